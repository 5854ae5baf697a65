"""Decoding speed, third round (#21): eager against compiled, transformers' window against the in-place one.

    python benchmarks/decode_speed.py --out benchmarks/results/decode_speed.json [--dtypes float32,bfloat16]
                                      [--contexts 1024,16384] [--steps 20] [--repeats 3]
                                      [--parts steps,default,kernels]

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
3. The matrix-vector kernel alone: every linear of the 113M Samba on one token, through the kernel and through
   nn.Linear; and one query's sdpa over 1023 keys in the dtype and in float32.
4. Checking drafts (`--parts checks`): on the 113M Samba (the kernel on every thread, on one thread, and PyTorch's
   products) and Llama, from a cache as after the first context, a recorded forward of k tokens (the current one
   and k - 1 drafts, recording as assisted generation has it) and the crop of the drafts, against a one-token step
   (`benchmarks/gpu.py`'s `verify`, medians of --steps), for k in 2, 9 and 16; in float32 also with torchao's int8
   weight-only weights where torchao is installed.
5. Where the embedded default's time goes (`--parts overhead`): it and the same-shape Llama of part 2, in one
   process, alternated `--repeats` times: ms a token of `generate` (200 greedy tokens, eager), of the forward alone
   (one-token steps on a cache), and of the linear layers' products inside that forward (timed around each call:
   samba-hf's kernel or nn.Linear), with the bytes of weights a step reads; the rest of the forward is the norms,
   mixers, attention and Python around them, and generate's loop is its time less the forward's.
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
    HEAD_DIM,
    KV_HEADS,
    WINDOW,
    build,
    decode_bytes_per_token,
    default_dtypes,
    measure_bandwidth_gbs,
    synthetic_cache,
)
from vllm_serving import machine, write_json  # noqa: E402


def dynamic_cache(model, name: str, context: int, in_place: bool):
    """`run_benchmarks.synthetic_cache`, its sliding layers samba-hf's in-place ones when `in_place`."""
    from transformers import DynamicCache

    from samba_hf.cache_samba import use_samba_layers

    if not in_place:
        return synthetic_cache(model, name, context, "cpu")
    original = DynamicCache.__init__

    def init_in_place(self, *args, **kwargs):  # the layers samba-hf's forward puts into a fresh cache
        original(self, *args, **kwargs)
        use_samba_layers(self)

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
            cache.update_conv_state(
                torch.randn(1, config.mamba_d_inner, config.mamba_d_conv, generator=g).to(dtype),
                idx,
                conv_kernel_size=config.mamba_d_conv,
            )
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
            models["samba"], "samba", context, in_place=True
        )
        runs[("samba", "transformers' window, eager", context)] = dynamic_cache(
            models["samba"], "samba", context, in_place=False
        )
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
                call(
                    input_ids=token,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                    position_ids=torch.tensor([[context + step]]),
                )
                if step >= 3:
                    times[key].append(time.perf_counter() - start)
    _, read_gbs = measure_bandwidth_gbs("cpu")
    floors = {name: decode_bytes_per_token(model) / (read_gbs * 1e9) * 1e3 for name, model in models.items()}
    return {
        "read_bandwidth_gbs": read_gbs,
        "floor_ms": floors,
        "step_ms": {
            f"{name} | {kind} | {context}": 1e3 * statistics.median(times[(name, kind, context)])
            for name, kind, context in runs
        },
    }


def kernels(dtype: torch.dtype, repeats: int = 7) -> dict:
    """ms: every linear of the 113M Samba on one token, one after another (the weights stream from memory as in a
    step), through the matrix-vector kernel and through nn.Linear, interleaved; and one query's sdpa over 1023 cached
    keys (12 heads, 4 key/value heads) in this dtype and in float32."""
    from samba_hf import cpu_kernels_samba
    from samba_hf.linear_samba import SambaLinear

    model = build("samba", "cpu", dtype)
    layers = [module for module in model.modules() if isinstance(module, SambaLinear)]
    inputs = [torch.randn(1, layer.in_features).to(dtype) for layer in layers]
    times = {"linears, kernel": [], "linears, nn.Linear": []}
    query = torch.randn(1, 12, 1, HEAD_DIM).to(dtype)
    keys, values = (
        torch.randn(1, KV_HEADS, 1023, HEAD_DIM).to(dtype),
        torch.randn(1, KV_HEADS, 1023, HEAD_DIM).to(dtype),
    )
    attend = torch.nn.functional.scaled_dot_product_attention
    with torch.inference_mode():
        for _ in range(repeats):
            for name in times:
                start = time.perf_counter()
                for layer, x in zip(layers, inputs):
                    layer(x) if name.endswith("kernel") else torch.nn.functional.linear(x, layer.weight, layer.bias)
                times[name].append(time.perf_counter() - start)
        for name, (q, k, v) in {
            f"sdpa, one query, {str(dtype)[6:]}": (query, keys, values),
            "sdpa, one query, float32": (query.float(), keys.float(), values.float()),
        }.items():
            times[name] = []
            for _ in range(50):
                start = time.perf_counter()
                attend(q, k, v, enable_gqa=True)
                times[name].append(time.perf_counter() - start)
    result = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    result["kernel available"] = cpu_kernels_samba.gemv_available()
    return result


def checks(dtype: torch.dtype, context: int, steps: int) -> dict:
    """ms of a one-token step and of checking k - 1 drafts (`gpu.verify`), each model and product path in turn."""
    from gpu import verify

    from samba_hf import cpu_kernels_samba

    library = cpu_kernels_samba._gemv_library()
    threaded = library is not None and library.threaded  # as the library decided when it loaded, put back after
    paths = {
        "kernel, every thread": ("auto", True),
        "kernel, one thread": ("auto", False),
        "pytorch": ("pytorch", True),
    }
    result = {"threads": torch.get_num_threads(), "kernel available": library is not None}
    for name in ("samba", "llama"):
        model = build(name, "cpu", dtype)
        for path, (linear, every_thread) in (paths if name == "samba" else {"": ("auto", True)}).items():
            if name == "samba":
                model.set_kernel_implementation({"scan": "auto", "conv": "auto", "linear": linear})
                if library is not None:
                    library.threaded = every_thread and threaded
            for tokens in (2, 9, 16):
                result[f"{name} {path} k={tokens}".replace("  ", " ")] = verify(model, context, tokens, steps)
        if library is not None:
            library.threaded = threaded
    try:  # int8 weights through torchao (the quantize extra), float32 activations
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        return result
    if dtype == torch.float32:
        model = build("samba", "cpu", dtype)
        quantize_(model, Int8WeightOnlyConfig())
        for tokens in (2, 9, 16):
            result[f"samba int8 (torchao) k={tokens}"] = verify(model, context, tokens, steps)
    return result


def overhead(dtype: torch.dtype, repeats: int, tokens: int = 200) -> dict:
    """ms a token: generate, the forward alone, the linears' products within it (part 5 of the docstring)."""
    from speculative import default_size_models
    from transformers import DynamicCache

    from samba_hf import linear_samba
    from samba_hf.cli import default_model_path

    models = default_size_models(default_model_path(), dtype)
    vocab = models["samba"].config.vocab_size
    spent, depth = [0.0], [0]
    originals = {cls: cls.forward for cls in (torch.nn.Linear, linear_samba.SambaLinear)}

    def timed(cls):
        def forward(module, x):  # the outermost linear call only (SambaLinear may hand on to nn.Linear's)
            depth[0] += 1
            start = time.perf_counter()
            try:
                return originals[cls](module, x)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[0] += time.perf_counter() - start

        return forward

    ids = torch.randint(4, vocab, (1, 5), generator=torch.Generator().manual_seed(0))
    options = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    times = {name: {"generate": [], "forward": [], "linears": []} for name in models}
    with torch.inference_mode():
        for model in models.values():
            model.generate(ids, **options)  # warm-up
        for _ in range(repeats):
            for name, model in models.items():
                start = time.perf_counter()
                model.generate(ids, **options)
                times[name]["generate"].append((time.perf_counter() - start) / tokens)
                cache = DynamicCache(config=model.config)
                model(ids, cache=cache, use_cache=True)
                token, steps = ids[:, :1], []
                for _ in range(tokens):
                    start = time.perf_counter()
                    model(token, cache=cache, use_cache=True, logits_to_keep=1)
                    steps.append(time.perf_counter() - start)
                times[name]["forward"].append(statistics.median(steps))
                cache = DynamicCache(config=model.config)
                model(ids, cache=cache, use_cache=True)
                for cls in originals:
                    cls.forward = timed(cls)
                try:
                    spent[0] = 0.0
                    for _ in range(tokens):
                        model(token, cache=cache, use_cache=True, logits_to_keep=1)
                    times[name]["linears"].append(spent[0] / tokens)
                finally:
                    for cls, forward in originals.items():
                        cls.forward = forward
    result = {}
    for name, model in models.items():
        ms = {part: 1e3 * statistics.median(values) for part, values in times[name].items()}
        result[name] = {
            "generate ms/token": ms["generate"],
            "forward ms": ms["forward"],
            "linears ms": ms["linears"],
            "rest of the forward ms": ms["forward"] - ms["linears"],
            "generate loop ms": ms["generate"] - ms["forward"],
            "weight MB a step reads": decode_bytes_per_token(model) / 1e6,
            "parameters": sum(p.numel() for p in model.parameters()),
        }
    return result


LLAMA_STEPS = """
import statistics, sys, time, torch
from transformers import AutoConfig, CompileConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer
from samba_hf.cli import default_model_path
torch.manual_seed(0)
c = AutoConfig.from_pretrained(default_model_path())
llama = LlamaForCausalLM(LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=797,
    num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, tie_word_embeddings=True)).eval().to(torch.{dtype})
ids = torch.randint(4, c.vocab_size, (1, 5))
compiled = {compiled}
options = dict(attention_mask=torch.ones_like(ids), max_new_tokens={tokens}, min_new_tokens={tokens}, do_sample=False,
               pad_token_id=0)
if compiled:
    cc = CompileConfig(fullgraph=True); cc._compile_all_devices = True
    options.update(cache_implementation="static", compile_config=cc)

class Times(BaseStreamer):
    def __init__(self): self.times = []
    def put(self, value): self.times.append(time.perf_counter())
    def end(self): pass

with torch.inference_mode():
    times = Times()
    start = time.perf_counter()
    out = llama.generate(ids, streamer=times, **options)
    if compiled:  # as samba-hf generate --compile reports: the median step after compiling
        print(1 / statistics.median(b - a for a, b in zip(times.times[2:], times.times[3:])))
    else:  # as samba-hf generate reports: the whole call
        print((out.shape[1] - 5) / (time.perf_counter() - start))
"""


def default_model(dtype: str, repeats: int, tokens: int = 200) -> dict:
    """tokens/s: `samba-hf generate` as it prints them (the whole call; with --compile the median step after
    compiling) and a same-size Llama through `generate`, measured the same way, eager and compiled."""
    cli = [
        sys.executable,
        "-c",
        "import sys; from samba_hf_cli import main; sys.exit(main())",
        "generate",
        "The history of",
        "--max-new-tokens",
        str(tokens),
        "--dtype",
        dtype,
    ]
    commands = {
        "samba-hf generate": cli,
        "samba-hf generate --compile": cli + ["--compile"],
        "llama generate, eager": [
            sys.executable,
            "-c",
            LLAMA_STEPS.format(dtype=dtype, compiled=False, tokens=tokens),
        ],
        "llama generate, compiled (static cache)": [
            sys.executable,
            "-c",
            LLAMA_STEPS.format(dtype=dtype, compiled=True, tokens=tokens),
        ],
    }
    rates = {name: [] for name in commands}
    for _ in range(repeats):
        for name, command in commands.items():
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
    parser.add_argument(
        "--parts",
        default="steps,default,kernels",
        help="steps (the 113M models' decode step), "
        "default (the embedded default through samba-hf generate), kernels (the 113M Samba's linears "
        "through the kernel and nn.Linear; one query's sdpa), checks (checking drafts against a step), overhead "
        "(where the embedded default's step goes, against a same-shape Llama's)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.out is not None and not args.out.parent.is_dir():
        parser.error(f"--out: the folder {args.out.parent} does not exist")
    parts = args.parts.split(",")
    if not parts or set(parts) - {"steps", "default", "kernels", "checks", "overhead"}:
        parser.error(f"--parts: give some of steps, default, kernels, checks, overhead, got {args.parts!r}")
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")
    dtypes = args.dtypes.split(",") if args.dtypes else default_dtypes("cpu")
    for dtype in dtypes:
        if dtype not in ("float32", "bfloat16", "float16"):
            parser.error(f"--dtypes: {dtype} is not float32, bfloat16 or float16")
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        parser.error(f"--contexts: give token counts separated by commas, got {args.contexts!r}")
    if min(contexts) < 1:
        parser.error("--contexts must be at least 1 token each")
    report = {
        "command": " ".join(["python", "benchmarks/decode_speed.py", *sys.argv[1:]]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "window": WINDOW,
        "results": {},
    }
    for dtype in dtypes:
        result = decode_steps(getattr(torch, dtype), contexts, args.steps) if "steps" in parts else {}
        if "kernels" in parts:
            result["kernels_ms"] = kernels(getattr(torch, dtype))
        if "checks" in parts:
            result["checks"] = checks(getattr(torch, dtype), contexts[0], args.steps)
        if "default" in parts:
            result["default_model_tokens_per_s"] = default_model(dtype, args.repeats)
        if "overhead" in parts:
            result["default_model_overhead"] = overhead(getattr(torch, dtype), args.repeats)
        report["results"][dtype] = result
        print(json.dumps({dtype: result}, indent=1), flush=True)
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
