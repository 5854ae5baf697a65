"""Phi-4-mini-flash-reasoning's architecture (SambaY) at full size, random weights, against a same-size Llama.

    python benchmarks/sambay_full_size.py [--release-config tests/data/sambay/config.json]
                                          [--prefill 1024,8192] [--decode 1024,32768] [--steps 4]
                                          [--prefill-dtype auto|bfloat16|float32] [--out benchmarks/results]

Each model runs in its own process, one after the other (so the memory peaks do not mix), batch 1, on this machine:
- the model: SambaY built from the released config.json (3,852,562,944 parameters) and a transformers Llama with
  the same width, depth, heads, key/value heads, head size and vocabulary, its MLP widened to 11008 so that it has
  as many parameters (3,846,801,920); random weights in bfloat16 (float32 A_log and lambdas in SambaY, as
  released), written with `save_pretrained` to a temporary folder that the run removes;
- load: seconds of `from_pretrained(folder, dtype=bfloat16)` (the folder was just written: warm page cache; the
  safetensors file is mapped, not read), then until every weight has been read once, and the peak resident memory;
- decode: tokens/s of the one-token step (median of `--steps` after 2 warm-up steps) at each context length, in
  bfloat16. The context is put into the cache directly (random keys/values/states of the shapes a prompt of that
  length leaves: a step's cost depends on the cache's size, not its values), so a 32K context costs no 32K prefill;
- cache bytes at each decode context, summed over the tensors the cache holds;
- prefill: seconds of one forward over a random prompt (`logits_to_keep=1`, as generate does; for SambaY also with
  the cross-decoder on every position, the release's prefill, through `logits_to_keep=tensor([last])`), in
  `--prefill-dtype`: auto takes what `samba-hf generate --dtype auto` takes, decided from the instruction set (bfloat16
  where the CPU multiplies it natively, else float32; `samba_hf.cli.auto_dtype`), never from a timing; float32 means
  the model is loaded again from the folder in that dtype; the JSON says which and why;
- peak resident memory of each phase (Linux: VmHWM, reset between phases). It counts the pages of the mapped
  safetensors file, once per mapping: after the prefill-dtype reload the file is mapped twice, so the prefill
  phase's figure (in the JSON) overstates what the process needs and the table leaves it out.
Writes `sambay_full_size.json` into --out and prints a markdown table.
"""

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from run_benchmarks import peak_rss_mib  # this folder is on sys.path when the script runs

HERE = Path(__file__).resolve().parent
RELEASE_CONFIG = HERE.parent / "tests" / "data" / "sambay" / "config.json"  # the release's, kept for the tests
LLAMA_MLP = 11008  # 3,846,801,920 parameters against SambaY's 3,852,562,944


def configs(release_config: Path) -> dict:
    from transformers import LlamaConfig

    from samba_hf import SambaYConfig

    sambay = SambaYConfig.from_dict(json.loads(release_config.read_text()))
    llama = LlamaConfig(
        vocab_size=sambay.vocab_size,
        hidden_size=sambay.hidden_size,
        intermediate_size=LLAMA_MLP,
        num_hidden_layers=sambay.num_hidden_layers,
        num_attention_heads=sambay.num_attention_heads,
        num_key_value_heads=sambay.num_key_value_heads,
        head_dim=sambay.head_dim,
        tie_word_embeddings=True,
        max_position_embeddings=262144,
    )
    return {"sambay": sambay, "llama": llama}


def reset_peak():
    try:  # Linux: "5" resets the peak resident set size (VmHWM) to the current one
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def bf16_matmul_speed() -> dict:
    """GFLOP/s of a (256 x 2560) @ (2560 x 2560) product in each dtype, best of 3 (a second at most each)."""
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(256, 2560, dtype=dtype), torch.randn(2560, 2560, dtype=dtype)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
            if best > 1.0:
                break
        result[str(dtype).removeprefix("torch.")] = 2 * 256 * 2560 * 2560 / best / 1e9
    return result


def synthetic_cache(model, name: str, context: int):
    """The cache a `context`-token prompt leaves, with random contents: per layer what it keeps (Mamba conv and SSM
    states; the window's keys/values in sliding layers; every position in full-attention layers; nothing in
    SambaY's cross-decoder)."""
    from transformers import DynamicCache

    config = model.config
    cache = DynamicCache(config=config)
    dtype = model.dtype
    kinds = config.block_types if name == "sambay" else ["full_attention"] * config.num_hidden_layers
    for idx, kind in enumerate(kinds):
        if kind in ("mamba", "memory"):
            cache.update_conv_state(
                torch.randn(1, config.mamba_d_inner, config.mamba_d_conv, dtype=dtype),
                idx,
                conv_kernel_size=config.mamba_d_conv,
            )
            cache.update_recurrent_state(torch.randn(1, config.mamba_d_inner, config.mamba_d_state), idx)
        elif kind in ("sliding_attention", "full_attention"):
            kept = min(context, config.sliding_window - 1) if kind == "sliding_attention" else context
            keys = torch.randn(1, config.num_key_value_heads, kept, config.head_dim, dtype=dtype)
            cache.update(keys, keys.clone(), idx)
            layer = cache.layers[idx]
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = context
    return cache


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            value = getattr(layer, name, None)
            tensors = value.values() if isinstance(value, dict) else [value]
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def time_decode(model, name: str, context: int, steps: int) -> tuple[float, int]:
    cache = synthetic_cache(model, name, context)
    size = cache_bytes(cache)
    token = torch.randint(0, model.config.vocab_size, (1, 1))
    times = []
    with torch.inference_mode():
        for step in range(steps + 2):
            start = time.perf_counter()
            model(
                token,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                position_ids=torch.tensor([[context + step]]),
            )
            times.append(time.perf_counter() - start)
    times = sorted(times[2:])
    return 1.0 / times[len(times) // 2], size


def time_prefill(model, length: int, keep) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids, logits_to_keep=keep, use_cache=True)
        return time.perf_counter() - start


def worker(args) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    import samba_hf  # noqa: F401  (registers phi4flash)

    logging.disable_progress_bar()
    name = args.worker
    config = configs(Path(args.release_config))[name]
    result = {"model": name}
    folder = Path(tempfile.mkdtemp(prefix=f"samba-hf-bench-{name}-"))
    try:
        torch.manual_seed(0)
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        result["parameters"] = sum(p.numel() for p in model.parameters())
        result["build_s"] = time.perf_counter() - start
        model.save_pretrained(folder)
        del model
        gc.collect()
        reset_peak()
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        result["load_s"] = time.perf_counter() - start
        for param in model.parameters():  # safetensors maps the file: read every weight once
            int(param.detach().view(torch.uint8).max())
        result["load_and_read_s"] = time.perf_counter() - start
        result["peak_gib_after_load"] = peak_rss_mib() / 1024
        model.config._attn_implementation = "sdpa"
        print(
            f"[{name}] {result['parameters']:,} parameters, loaded in {result['load_s']:.1f} s, read in "
            f"{result['load_and_read_s']:.1f} s",
            file=sys.stderr,
        )
        decode(model, name, args, result)
        if args.prefill_dtype != "bfloat16":  # a fresh copy in that dtype (no bf16 file mapping left beside it)
            del model
            gc.collect()
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.prefill_dtype)).eval()
            model.config._attn_implementation = "sdpa"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    prefill(model, name, args, result)
    return result


def decode(model, name, args, result):
    result["decode_tokens_per_s"], result["cache_bytes"], result["peak_gib_decode"] = {}, {}, {}
    for context in args.decode:
        reset_peak()
        rate, size = time_decode(model, name, context, args.steps)
        result["decode_tokens_per_s"][context], result["cache_bytes"][context] = rate, size
        result["peak_gib_decode"][context] = peak_rss_mib() / 1024
        print(f"[{name}] decode at {context}: {rate:.3f} tokens/s, cache {size / 2**20:.1f} MiB", file=sys.stderr)
        gc.collect()
    if name == "sambay":
        result["cache_nbytes_formula"] = {c: model.cache_nbytes(1, c) for c in args.decode}


def prefill(model, name, args, result):
    result["prefill_dtype"] = args.prefill_dtype
    time_prefill(model, 64, 1)  # warm-up
    result["prefill_s"], result["peak_gib_prefill"] = {}, {}
    if name == "sambay":
        result["prefill_s_whole_cross_decoder"] = {}
    for length in args.prefill:
        reset_peak()
        result["prefill_s"][length] = time_prefill(model, length, 1)
        result["peak_gib_prefill"][length] = peak_rss_mib() / 1024
        print(f"[{name}] prefill {length}: {result['prefill_s'][length]:.1f} s", file=sys.stderr)
        if name == "sambay" and length in args.whole_cross_decoder_at:
            # the same logits, but the cross-decoder runs on every position (as the release's prefill does)
            seconds = time_prefill(model, length, torch.tensor([length - 1]))
            result["prefill_s_whole_cross_decoder"][length] = seconds
            print(f"[{name}] prefill {length}, cross-decoder on every position: {seconds:.1f} s", file=sys.stderr)


def table(results: dict) -> str:
    sambay, llama = results["models"]["sambay"], results["models"]["llama"]
    rows = [
        ("parameters", f"{sambay['parameters']:,}", f"{llama['parameters']:,}", ""),
        (
            "load (bf16): `from_pretrained`, then every weight read once",
            f"{sambay['load_s']:.1f} s, {sambay['load_and_read_s']:.1f} s",
            f"{llama['load_s']:.1f} s, {llama['load_and_read_s']:.1f} s",
            f"{llama['load_and_read_s'] / sambay['load_and_read_s']:.2f}x",
        ),
        (
            "peak memory after load",
            f"{sambay['peak_gib_after_load']:.2f} GiB",
            f"{llama['peak_gib_after_load']:.2f} GiB",
            "",
        ),
    ]
    dtype = sambay["prefill_dtype"]
    for length in sambay["prefill_s"]:
        s, llama_s = sambay["prefill_s"][length], llama["prefill_s"][length]
        rows.append(
            (f"prefill {int(length) // 1024}K ({dtype})", f"{s:.1f} s", f"{llama_s:.1f} s", f"{llama_s / s:.2f}x")
        )
        if length in sambay.get("prefill_s_whole_cross_decoder", {}):
            whole = sambay["prefill_s_whole_cross_decoder"][length]
            rows.append(
                (
                    f"prefill {int(length) // 1024}K, SambaY's cross-decoder on every position (as released)",
                    f"{whole:.1f} s",
                    "",
                    f"YOCO saving: {whole / s:.2f}x",
                )
            )
    for context in sambay["decode_tokens_per_s"]:
        s, llama_rate = sambay["decode_tokens_per_s"][context], llama["decode_tokens_per_s"][context]
        rows.append(
            (
                f"decode at {int(context) // 1024}K context (bf16), peak memory",
                f"{s:.2f} tokens/s, {sambay['peak_gib_decode'][context]:.1f} GiB",
                f"{llama_rate:.2f} tokens/s, {llama['peak_gib_decode'][context]:.1f} GiB",
                f"{s / llama_rate:.2f}x",
            )
        )
    for context in sambay["cache_bytes"]:
        s, llama_bytes = sambay["cache_bytes"][context], llama["cache_bytes"][context]
        rows.append(
            (
                f"cache at {int(context) // 1024}K context (bf16)",
                f"{s / 2**20:.0f} MiB",
                f"{llama_bytes / 2**20:.0f} MiB",
                f"{llama_bytes / s:.1f}x",
            )
        )
    lines = ["| | SambaY | Llama | SambaY's speed / Llama's (cache: Llama's size / SambaY's) |", "|---|---|---|---|"]
    return "\n".join(lines + [f"| {' | '.join(row)} |" for row in rows])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release-config", default=str(RELEASE_CONFIG))
    parser.add_argument("--prefill", default="1024,8192")
    parser.add_argument(
        "--whole-cross-decoder-at",
        default="1024",
        help="prefill lengths also timed with SambaY's cross-decoder on every position",
    )
    parser.add_argument("--decode", default="1024,32768")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prefill-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--models", default="sambay,llama")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--report", metavar="JSON", help="print the table of a saved run and stop")
    args = parser.parse_args()
    if args.report:
        return report(args.report)
    unknown = [name for name in args.models.split(",") if name not in ("sambay", "llama")]
    if unknown:
        parser.error(f"--models {args.models}: {unknown[0]!r} is not one of sambay, llama")
    if not os.path.isfile(args.release_config):
        parser.error(
            f"--release-config {args.release_config}: no such file (the released config.json of "
            "microsoft/Phi-4-mini-flash-reasoning)"
        )
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    for field in ("prefill", "decode", "whole_cross_decoder_at"):
        option, text = "--" + field.replace("_", "-"), getattr(args, field)
        if not all(x.isdigit() and int(x) > 0 for x in text.split(",") if x):
            parser.error(f"{option}: give token counts of at least 1, separated by commas, got {text!r}")
        setattr(args, field, [int(x) for x in text.split(",") if x])
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    speed = bf16_matmul_speed()  # recorded with the machine, to compare runs; it decides nothing
    why = "given on the command line"
    if args.prefill_dtype == "auto":
        from samba_hf.cli import auto_dtype

        dtype, why = auto_dtype(torch.device("cpu"))
        args.prefill_dtype = str(dtype).removeprefix("torch.")
    results = {
        "command": " ".join(["python", "benchmarks/sambay_full_size.py"] + sys.argv[1:]),
        "machine": {
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "matmul_gflops": speed,
            "cpu": cpu_name(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "prefill_dtype": args.prefill_dtype,
        "prefill_dtype_why": why,
        "models": {},
    }
    print(f"matmul GFLOP/s: {speed}; prefill in {args.prefill_dtype} ({why})", file=sys.stderr)
    for name in args.models.split(","):
        command = [
            sys.executable,
            __file__,
            "--worker",
            name,
            "--release-config",
            args.release_config,
            "--prefill",
            ",".join(map(str, args.prefill)),
            "--decode",
            ",".join(map(str, args.decode)),
            "--whole-cross-decoder-at",
            ",".join(map(str, args.whole_cross_decoder_at)),
            "--steps",
            str(args.steps),
            "--prefill-dtype",
            args.prefill_dtype,
        ]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
        results["models"][name] = json.loads(done.stdout.strip().splitlines()[-1])
    os.makedirs(args.out, exist_ok=True)
    path = Path(args.out) / "sambay_full_size.json"
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(results, indent=2))
    partial.replace(path)
    if {"sambay", "llama"} <= set(results["models"]):
        print(table(json.loads(path.read_text())))  # JSON keys: the lengths as strings
    return 0


def report(path: str) -> int:
    """`--report JSON`: the table of a saved run."""
    print(table(json.loads(Path(path).read_text())))
    return 0


def cpu_name() -> str:
    """The CPU model and the instruction-set flags that decide its float32 / bf16 speed, as /proc/cpuinfo says."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
    return f"{model} ({', '.join(f for f in isa if f in flags) or 'none of ' + ', '.join(isa)})"


if __name__ == "__main__":
    sys.exit(main())
