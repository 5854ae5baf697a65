"""Serving on CPU: N concurrent requests to vLLM's OpenAI-compatible server on the embedded default Samba (through
samba-hf-vllm), against samba-hf's batched `generate` of the same N prompts, and against vLLM serving a Llama of the
same size (the default model's shape with an MLP 797 wide: 5,904,128 parameters, as Samba; random weights), compiled
as vLLM runs it by default and with `--enforce-eager` (the plugin's classes always run eagerly).

    python benchmarks/vllm_serving.py --vllm-python .venv-vllm/bin/python --out benchmarks/results/vllm_serving.json

Run from samba-hf's environment (it builds the Llama folder and runs `generate`); the servers run in the plugin's
(`--vllm-python`, see docs/serving.md). Every request: a prompt of `--prompt-len` random token ids,
`--new-tokens` greedy tokens (EOS ignored), float32. Reported per engine, median over `--rounds` rounds (each engine
once per round, in turn): output tokens/s over the whole batch (all requests sent at once) and time to first token
(server: per request, from sending to the first streamed token, median and max over the requests; `generate`: the
batch's prefill and first step, `max_new_tokens=1`).
"""

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_MLP = 797  # with this MLP width a Llama of the default model's shape has exactly its parameter count


def run_record() -> dict:
    """What a benchmark's JSON begins with: the machine, torch and its threads, the command as run, the date."""
    import torch

    return {
        "machine": machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
    }


def write_json(path: Path, result: dict):
    """A benchmark's JSON, written whole or not at all (a `.partial` file beside it, renamed)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=1) + "\n")
    partial.replace(path)


def machine() -> str:
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} cores, {', '.join(isa)}"


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(count)]


# ---------------------------------------------------------------- in the vLLM environment: one server, N clients


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_one(url: str, model: str, prompt: list[int], new_tokens: int, result: dict):
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and "ttft" not in result:
                result["ttft"] = time.perf_counter() - start
            if chunk.get("usage"):
                result["tokens"] = chunk["usage"]["completion_tokens"]


def serve_and_measure(folder: str, batch: list[list[int]], new_tokens: int, eager: bool) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            folder,
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            str(len(batch)),
            *(["--enforce-eager"] if eager else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"the vLLM server on {folder} exited with {server.returncode}")
                time.sleep(1)
        stream_one(url, folder, [5] * 16, 4, {})  # warm-up, on a prompt that shares no block with the batch
        results = [{} for _ in batch]
        threads = [
            threading.Thread(target=stream_one, args=(url, folder, p, new_tokens, r)) for p, r in zip(batch, results)
        ]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=120)
    ttft = [r["ttft"] for r in results]
    return {
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_median_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
    }


# ---------------------------------------------------------------- in samba-hf's environment


def samba_hf_generate(batch: list[list[int]], new_tokens: int) -> dict:
    import torch

    from samba_hf import SambaForCausalLM
    from samba_hf.cli import default_model_path

    model = SambaForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    ids = torch.tensor(batch)
    options = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, **options)  # warm-up (builds the compiled scan once)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **options)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **options)
        wall = time.perf_counter() - start
    return {
        "tokens_per_s": (out.shape[1] - ids.shape[1]) * len(batch) / wall,
        "ttft_median_s": ttft,
        "ttft_max_s": ttft,
    }


def llama_folder(folder: Path) -> Path:
    """The default model's shape as a transformers Llama (random weights), with its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from samba_hf.cli import default_model_path

    torch.manual_seed(0)
    c = AutoConfig.from_pretrained(default_model_path())
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=LLAMA_MLP,
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
        )
    )
    llama.save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(folder)
    return folder


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="the plugin environment's python (runs the servers)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # child: a folder to serve, prints one JSON line
    parser.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)  # child: --enforce-eager
    args = parser.parse_args()
    if args.serve:
        batch = prompts(args.requests, args.prompt_len, 4096)
        print(json.dumps(serve_and_measure(args.serve, batch, args.new_tokens, args.eager)))
        return
    if not args.vllm_python:
        parser.error("--vllm-python is required (the environment where samba-hf-vllm is installed)")
    if not (os.path.isfile(args.vllm_python) and os.access(args.vllm_python, os.X_OK)):
        parser.error(
            f"--vllm-python {args.vllm_python}: no such program; give the plugin environment's python, "
            "e.g. .venv-vllm/bin/python"
        )
    for name in ("requests", "prompt_len", "new_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.out is not None and not args.out.parent.is_dir():
        parser.error(f"--out {args.out}: the folder {args.out.parent} does not exist")

    from samba_hf.cli import default_model_path

    batch = prompts(args.requests, args.prompt_len, 4096)
    work = Path(tempfile.mkdtemp(prefix="vllm_serving_"))
    try:
        llama = str(llama_folder(work / "llama"))
        # (folder, eager): vLLM compiles the Llama on CPU by default; the plugin's classes always run eagerly
        servers = {
            "vllm: samba (plugin)": (default_model_path(), False),
            "vllm: llama, same size": (llama, False),
            "vllm: llama, same size, --enforce-eager": (llama, True),
        }
        runs = {name: [] for name in ["samba-hf generate (batched)", *servers]}
        for _ in range(args.rounds):
            runs["samba-hf generate (batched)"].append(samba_hf_generate(batch, args.new_tokens))
            for name, (folder, eager) in servers.items():
                child = [
                    args.vllm_python,
                    __file__,
                    "--serve",
                    folder,
                    "--requests",
                    str(args.requests),
                    "--prompt-len",
                    str(args.prompt_len),
                    "--new-tokens",
                    str(args.new_tokens),
                    *(["--eager"] if eager else []),
                ]
                out = subprocess.run(child, capture_output=True, text=True, check=True)
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(work)
    table = {
        name: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]} for name, rounds in runs.items()
    }
    report = {
        "command": " ".join(["python", "benchmarks/vllm_serving.py", *sys.argv[1:]]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": {
            "requests": args.requests,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
            "dtype": "float32",
        },
        "results": table,
        "rounds": runs,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
