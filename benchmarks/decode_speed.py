"""Decoding speed, third round (#21): eager against compiled, transformers' window against the in-place one.

    python benchmarks/decode_speed.py --out benchmarks/results/decode_speed.json [--dtypes float32,bfloat16]
                                      [--contexts 1024,16384] [--steps 20] [--repeats 3] [--skip-default-model]

1. The ~113M Samba and Llama of `run_benchmarks.py` (random weights, batch 1): the median one-token step at each
   context, every (model, cache, context) stepped in turn after 3 warm-up steps (the compiled ones compile there).
   The context is put into the cache directly (random contents of the right shapes and bookkeeping), as in
   `run_benchmarks.py`. Caches: samba-hf's default (`DynamicCache` with `SambaSlidingWindowLayer`, eager),
   transformers' `DynamicSlidingWindowLayer` (eager), and transformers' `StaticCache` with the step compiled
   (`model.get_compiled_call(CompileConfig(fullgraph=True))`, what `generate(cache_implementation="static",
   compile_config=...)` runs). The floor: parameter bytes a step reads / the read bandwidth measured in the run.
2. The embedded default model through `samba-hf generate` (200 greedy tokens, the figure it prints), eager and
   with `--compile`, against a transformers Llama of the same shape and parameter count through `generate`, eager
   and compiled by the same switches; each a fresh process, alternated `--repeats` times, medians.
Dtypes: float32, plus bfloat16 where this CPU multiplies it natively (the rule of `--dtype auto`).
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run_benchmarks import (  # noqa: E402
    HEAD_DIM, KV_HEADS, LLAMA_GENERATE, WINDOW, build, decode_bytes_per_token, default_dtypes, measure_bandwidth_gbs,
    synthetic_cache,
)
from vllm_serving import machine  # noqa: E402


def dynamic_cache(model, name: str, context: int, in_place: bool):
    """`run_benchmarks.synthetic_cache`, its sliding layers samba-hf's in-place ones when `in_place`."""
    from transformers import DynamicCache

    from samba_hf.modeling_samba import SambaModel

    if not in_place:
        return synthetic_cache(model, name, context, "cpu")
    original = DynamicCache.__init__

    def init_in_place(self, *args, **kwargs):  # the layers samba-hf's forward puts into a fresh cache
        original(self, *args, **kwargs)
        SambaModel._write_windows_in_place(self)

    DynamicCache.__init__ = init_in_place
    try:
        return synthetic_cache(model, name, context, "cpu")
    finally:
        DynamicCache.__init__ = original


def static_cache(model, context: int, room: int):
    """transformers' `StaticCache` as it stands after `context` tokens, with `room` more positions."""
    from transformers import StaticCache
    from transformers.cache_utils import LinearAttentionLayer, StaticSlidingWindowLayer

    config, dtype = model.config, model.dtype
    cache = StaticCache(config=config, max_cache_len=context + room)
    g = torch.Generator().manual_seed(0)
    for idx, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionLayer):
            cache.update_conv_state(torch.randn(1, config.mamba_d_inner, config.mamba_d_conv, generator=g).to(dtype),
                                    idx, conv_kernel_size=config.mamba_d_conv)
            cache.update_recurrent_state(torch.randn(1, config.mamba_d_inner, config.mamba_d_state, generator=g), idx)
            continue
        probe = torch.zeros(1, KV_HEADS, 1, HEAD_DIM, dtype=dtype)
        layer.lazy_initialization(probe, probe)
        filled = min(context, layer.max_cache_len)
        layer.keys[:, :, :filled].normal_(generator=g)
        layer.values[:, :, :filled].normal_(generator=g)
        layer.cumulative_length.fill_(context)
        if isinstance(layer, StaticSlidingWindowLayer):
            layer.cumulative_length_int = context
    return cache


def decode_steps(dtype: torch.dtype, contexts: list[int], steps: int) -> dict:
    from transformers import CompileConfig

    torch._dynamo.config.recompile_limit = 64  # one compiled function, several caches and contexts
    models = {name: build(name, "cpu", dtype) for name in ("samba", "llama")}
    compiled = {name: model.get_compiled_call(CompileConfig(fullgraph=True)) for name, model in models.items()}
    runs = {}
    for context in contexts:
        runs[("samba", "in-place window (samba-hf default), eager", context)] = dynamic_cache(
            models["samba"], "samba", context, in_place=True)
        runs[("samba", "transformers' window, eager", context)] = dynamic_cache(
            models["samba"], "samba", context, in_place=False)
        runs[("samba", "static cache, compiled", context)] = static_cache(models["samba"], context, steps + 8)
        runs[("llama", "dynamic cache, eager", context)] = dynamic_cache(models["llama"], "llama", context, False)
        runs[("llama", "static cache, compiled", context)] = static_cache(models["llama"], context, steps + 8)
    token = torch.tensor([[7]])
    times = {key: [] for key in runs}
    with torch.inference_mode():
        for step in range(steps + 3):
            for key, cache in runs.items():
                name, kind, context = key
                call = compiled[name] if "compiled" in kind else models[name]
                start = time.perf_counter()
                call(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1,
                     position_ids=torch.tensor([[context + step]]))
                if step >= 3:
                    times[key].append(time.perf_counter() - start)
    _, read_gbs = measure_bandwidth_gbs("cpu")
    floors = {name: decode_bytes_per_token(model) / (read_gbs * 1e9) * 1e3 for name, model in models.items()}
    return {
        "read_bandwidth_gbs": read_gbs,
        "floor_ms": floors,
        "step_ms": {f"{name} | {kind} | {context}": 1e3 * statistics.median(times[(name, kind, context)])
                    for name, kind, context in runs},
    }


def default_model(dtype: str, repeats: int, tokens: int = 200) -> dict:
    cli = [sys.executable, "-c", "import sys; from samba_hf_cli import main; sys.exit(main())", "generate",
           "The history of", "--max-new-tokens", str(tokens), "--dtype", dtype]
    compiled_llama = ("from transformers import CompileConfig\n"
                      "cc = CompileConfig(fullgraph=True); cc._compile_all_devices = True\n")
    llama = LLAMA_GENERATE.replace("llama = LlamaForCausalLM", "llama = LlamaForCausalLM").format(mlp=797, tokens=tokens)
    llama = llama.replace(").eval()", f").eval().to(torch.{dtype})")
    llama_compiled = llama.replace("with torch.inference_mode():", compiled_llama + "with torch.inference_mode():\n"
                                   "    llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, "
                                   "do_sample=False, pad_token_id=0, cache_implementation='static', compile_config=cc)")
    llama_compiled = llama_compiled.replace("do_sample=False, pad_token_id=0)",
                                            "do_sample=False, pad_token_id=0, cache_implementation='static', "
                                            "compile_config=cc)")
    rates = {"samba-hf generate": [], "samba-hf generate --compile": [], "llama generate, eager": [],
             "llama generate, compiled (static cache)": []}
    for _ in range(repeats):
        for name, command in (("samba-hf generate", cli), ("samba-hf generate --compile", cli + ["--compile"]),
                              ("llama generate, eager", [sys.executable, "-c", llama]),
                              ("llama generate, compiled (static cache)", [sys.executable, "-c", llama_compiled])):
            out = subprocess.run(command, capture_output=True, text=True, check=True)
            if name.startswith("samba"):
                rates[name].append(float(re.search(r"\(([0-9.]+) tokens/s", out.stderr)[1]))
            else:
                rates[name].append(float(out.stdout.strip().splitlines()[-1]))
    return {name: statistics.median(values) for name, values in rates.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default=None, help="default: float32, plus bfloat16 where native")
    parser.add_argument("--contexts", default="1024,16384")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-default-model", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.out is not None and not args.out.parent.is_dir():
        parser.error(f"--out: the folder {args.out.parent} does not exist")
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")
    dtypes = args.dtypes.split(",") if args.dtypes else default_dtypes("cpu")
    contexts = [int(c) for c in args.contexts.split(",")]
    report = {"command": " ".join(["python", "benchmarks/decode_speed.py", *sys.argv[1:]]), "machine": machine(),
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "window": WINDOW, "results": {}}
    for dtype in dtypes:
        result = decode_steps(getattr(torch, dtype), contexts, args.steps)
        if not args.skip_default_model:
            result["default_model_tokens_per_s"] = default_model(dtype, args.repeats)
        report["results"][dtype] = result
        print(json.dumps({dtype: result}, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
