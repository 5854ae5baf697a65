"""Samba against transformers' Llama (GQA), Mistral (SWA 2048) and Mamba of about the same size, in one run.

    python benchmarks/run_benchmarks.py [--prefill 1024,2048,4096,8192,16384,32768]
                                        [--decode 1024,4096,16384,32768,65536]
                                        [--dtypes float32,bfloat16] [--repeats 3] [--out benchmarks/results]

Measures, on this machine, batch 1 (CPU by default; --device cuda on a GPU), in each of `--dtypes` (default: float32,
plus bfloat16 where this CPU multiplies it natively and faster, as `samba-hf generate --dtype auto` decides):
- prefill: seconds for one forward over a random prompt of each length (`logits_to_keep=1`, as generate does);
- decode: tokens/s of the one-token step at each context length. The context is put into the cache directly
  (random keys/values/states of the right shapes: a decode step's cost depends on the cache's size, not on its
  values), so a 64K context costs no 64K prefill; each step then runs exactly as inside `generate`;
- memory: peak resident memory of a process that holds the model and a cache at that context and decodes
  (each (model, context) in a fresh subprocess, so the peaks do not mix);
- the memory-bandwidth floor of a decode step: parameter bytes read per token / measured read bandwidth;
- the embedded default model's tokens/s through `samba-hf generate` (greedy, 200 tokens), against a transformers
  Llama of the same shape through `generate`.
Every timing is interleaved: each repetition (prefill) or step (decode) runs every model, and every context, in
turn, and the median is kept, so that a machine that drifts over minutes moves all of them alike.
Writes `results.json` and PNG plots (prefill and decode vs length, like the paper's Figures 2 and 6).
"""

import argparse
import gc
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time

import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, WINDOW = 768, 12, 12, 4, 64, 2048, 32000, 2048


def build(name: str, device: str, dtype: torch.dtype = torch.float32):
    """The four models, all about 100-115M parameters, random weights, in `dtype` (Samba's A_log and D float32, as
    `from_pretrained` keeps them)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MambaConfig,
        MambaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    import samba_hf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    )
    torch.manual_seed(0)
    if name == "samba":
        model = samba_hf.SambaForCausalLM(samba_hf.SambaConfig(sliding_window=WINDOW, **common))
    elif name == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif name == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=WINDOW, **common))
    elif name == "mamba":
        model = MambaForCausalLM(
            MambaConfig(
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                num_hidden_layers=24,
                state_size=16,
                expand=2,
                conv_kernel=4,
                tie_word_embeddings=True,
            )
        )
    else:
        raise ValueError(name)
    model.config._attn_implementation = "sdpa" if name != "mamba" else None
    model = model.to(device=device, dtype=dtype).eval()
    if name == "samba":
        for layer in model.model.layers:
            if hasattr(layer, "mamba"):
                layer.mamba.A_log.data, layer.mamba.D.data = layer.mamba.A_log.float(), layer.mamba.D.float()
    return model


def synthetic_cache(model, name: str, context: int, device: str):
    """A cache as it stands after `context` tokens: random contents, real shapes and bookkeeping."""
    from transformers import DynamicCache

    config, dtype = model.config, model.dtype
    cache = DynamicCache(config=config)
    generator = torch.Generator().manual_seed(0)
    for idx in range(config.num_hidden_layers):
        kind = config.layer_types[idx] if getattr(config, "layer_types", None) else "full_attention"
        if name == "mamba" or kind == "linear_attention":
            d_inner = config.intermediate_size if name == "mamba" else config.mamba_d_inner
            d_state = config.state_size if name == "mamba" else config.mamba_d_state
            d_conv = config.conv_kernel if name == "mamba" else config.mamba_d_conv
            cache.update_conv_state(
                torch.randn(1, d_inner, d_conv, generator=generator).to(device, dtype), idx, conv_kernel_size=d_conv
            )
            state = torch.randn(
                1, d_inner, d_state, generator=generator
            )  # float32 in Samba, the model's dtype in Mamba
            cache.update_recurrent_state(state.to(device, dtype if name == "mamba" else torch.float32), idx)
        else:
            # keep only what the layer would keep; fill in slices to avoid a huge temporary
            kept = min(context, WINDOW - 1) if kind == "sliding_attention" or name == "mistral" else context
            keys = torch.randn(1, KV_HEADS, kept, HEAD_DIM, generator=generator).to(device, dtype)
            cache.update(keys, keys.clone(), idx)
            layer = cache.layers[idx]
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = context
    return cache


def time_prefill(model, length: int, device: str) -> float:
    ids = torch.randint(0, VOCAB, (1, length))
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids.to(device), logits_to_keep=1, use_cache=False)
        if device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - start


def time_decode_interleaved(models: dict, contexts: list[int], device: str, steps: int) -> dict:
    """{name: {context: tokens/s}}: the median one-token step, every (model, context) stepped in turn, `steps` times
    after 2 warm-up rounds. All caches are held at once."""
    caches = {(name, c): synthetic_cache(model, name, c, device) for name, model in models.items() for c in contexts}
    token = torch.randint(0, VOCAB, (1, 1), device=device)
    times = {key: [] for key in caches}
    with torch.inference_mode():
        for step in range(steps + 2):
            for (name, context), cache in caches.items():
                model = models[name]
                start = time.perf_counter()
                if name == "mamba":
                    model(token, cache_params=cache, use_cache=True)
                else:
                    model(
                        token,
                        past_key_values=cache,
                        use_cache=True,
                        position_ids=torch.tensor([[context + step]], device=device),
                    )
                if device != "cpu":
                    torch.cuda.synchronize()
                if step >= 2:
                    times[(name, context)].append(time.perf_counter() - start)
    return {name: {c: 1.0 / statistics.median(times[(name, c)]) for c in contexts} for name in models}


def time_prefill_interleaved(models: dict, lengths: list[int], device: str, repeats: int, limits: dict) -> dict:
    """{name: {length: seconds}}: the median over `repeats` rounds, each round timing every model in turn. A model
    with a limit in `limits` is timed up to that length only."""
    out = {name: {} for name in models}
    for length in lengths:
        names = [n for n in models if length <= limits.get(n, length)]
        times = {n: [] for n in names}
        for _ in range(repeats if length <= 8192 else 1):  # a long prefill takes minutes: one round
            for name in names:
                times[name].append(time_prefill(models[name], length, device))
                gc.collect()
        for name in names:
            out[name][length] = statistics.median(times[name])
            print(f"  prefill {length:>6} {name:>8}: {out[name][length]:8.2f} s", flush=True)
    return out


def peak_rss_mib() -> float:
    """This process's peak resident memory. Linux: VmHWM (getrusage's ru_maxrss survives exec and would report the
    parent's peak); elsewhere getrusage."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def measure_bandwidth_gbs(device: str) -> tuple[float, float]:
    """(copy bandwidth counting read + write, read bandwidth of a reduction) over a 1 GiB tensor, best of 5 each.
    A decode step mostly reads weights, so the read figure sets its floor."""
    src = torch.empty(2**28, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)

    def best_of(fn):
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            fn()
            if device != "cpu":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    copy = 2 * src.nbytes / best_of(lambda: dst.copy_(src)) / 1e9
    read = src.nbytes / best_of(lambda: src.sum()) / 1e9
    return copy, read


def decode_bytes_per_token(model) -> int:
    """Parameter bytes a decode step reads: everything but the embedding rows it does not look up (the tied
    embedding matrix is read once, by lm_head)."""
    seen, total = set(), 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total


def child(args):
    """One (model, context) in its own process: peak RSS while holding the model and the cache and decoding."""
    dtype = getattr(torch, args.child_dtype)
    model = build(args.child_model, args.device, dtype)
    rate = time_decode_interleaved({args.child_model: model}, [args.child_context], args.device, 4)
    print(json.dumps({"tokens_per_s": rate[args.child_model][args.child_context], "peak_rss_mib": peak_rss_mib()}))


LLAMA_GENERATE = """
import sys, time, torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM
from samba_hf.cli import default_model_path
torch.manual_seed(0)
c = AutoConfig.from_pretrained(default_model_path())
llama = LlamaForCausalLM(LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size={mlp},
    num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, tie_word_embeddings=True)).eval()
ids = torch.randint(4, c.vocab_size, (1, 5))
with torch.inference_mode():
    start = time.perf_counter()
    out = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens={tokens}, min_new_tokens={tokens},
                         do_sample=False, pad_token_id=0)
    print((out.shape[1] - 5) / (time.perf_counter() - start))
"""


def default_model_speed(repeats: int, tokens: int = 200) -> dict:
    """tokens/s of the embedded default through `samba-hf generate` (greedy, float32, as a user runs it: the figure
    it prints), and of a same-shape transformers Llama (random weights, its MLP 797 wide: as many parameters)
    through `generate`, each in a fresh process, alternated `repeats` times; medians."""
    import re

    cli = [
        sys.executable,
        "-c",
        "import sys; from samba_hf_cli import main; sys.exit(main())",
        "generate",
        "The history of",
        "--max-new-tokens",
        str(tokens),
        "--dtype",
        "float32",
    ]
    llama = [sys.executable, "-c", LLAMA_GENERATE.format(mlp=797, tokens=tokens)]  # 5,904,128 parameters, as Samba
    rates = {"samba-hf generate (embedded default)": [], "llama, same shape, generate": []}
    for _ in range(repeats):
        out = subprocess.run(cli, capture_output=True, text=True, check=True)
        rates["samba-hf generate (embedded default)"].append(float(re.search(r"\(([0-9.]+) tokens/s", out.stderr)[1]))
        out = subprocess.run(llama, capture_output=True, text=True, check=True)
        rates["llama, same shape, generate"].append(float(out.stdout.strip().splitlines()[-1]))
    return {name: statistics.median(values) for name, values in rates.items()}


def default_dtypes(device: str) -> list[str]:
    if device != "cpu":
        return ["float32", "bfloat16"]
    from samba_hf.cli import cpu_native_bfloat16

    return ["float32", "bfloat16"] if cpu_native_bfloat16() else ["float32"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--decode", default="1024,2048,4096,16384,32768,65536")
    parser.add_argument("--models", default="samba,llama,mistral,mamba")
    parser.add_argument(
        "--dtypes",
        default=None,
        help="comma-separated; default: float32, plus bfloat16 where this "
        "CPU computes it natively and faster (always on a GPU); empty: the embedded default only",
    )
    parser.add_argument(
        "--bf16-prefill-max",
        type=int,
        default=None,
        help="longest prefill timed in bfloat16 (default: all of --prefill)",
    )
    parser.add_argument(
        "--prefill-limits",
        default="",
        help="longest prefill per model, e.g. mistral=8192,mamba=8192 (default: every length)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds per prefill length up to 8K")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per (model, context)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-process peak-memory measurements")
    parser.add_argument("--no-default-model", action="store_true", help="skip the embedded default's tokens/s")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--report", metavar="RESULTS_JSON", help="only re-evaluate targets and plots of a saved run")
    parser.add_argument("--child-model")
    parser.add_argument("--child-context", type=int)
    parser.add_argument("--child-dtype", default="float32")
    args = parser.parse_args()
    if args.child_model:
        return child(args)
    if args.report:
        with open(args.report) as f:
            results = load_results(f)
        results["targets"] = evaluate_targets(results)
        print("\n".join(results["targets"]))
        with open(args.report, "w") as f:
            json.dump(results, f, indent=2)
        return plot(results, os.path.dirname(os.path.abspath(args.report)))

    names = args.models.split(",")
    prefill_lengths = [int(x) for x in args.prefill.split(",") if x]
    decode_contexts = [int(x) for x in args.decode.split(",") if x]
    try:
        limits = {k: int(v) for k, v in (item.split("=") for item in args.prefill_limits.split(",") if item)}
    except ValueError:
        parser.error(
            f"--prefill-limits {args.prefill_limits!r}: give MODEL=TOKENS pairs, e.g. mistral=8192,mamba=8192"
        )
    if unknown := [n for n in names + list(limits) if n not in ("samba", "llama", "mistral", "mamba")]:
        parser.error(f"unknown model {unknown[0]!r}: the models are samba, llama, mistral and mamba")
    known_dtypes = ("", "float32", "bfloat16", "float16")
    if args.dtypes is not None and (unknown := [d for d in args.dtypes.split(",") if d not in known_dtypes]):
        parser.error(f"--dtypes: {', '.join(unknown)} is not float32, bfloat16 or float16")
    # --dtypes "" measures no model (only the embedded default's tokens/s)
    dtypes = [d for d in args.dtypes.split(",") if d] if args.dtypes is not None else default_dtypes(args.device)
    results = {
        "machine": {"threads": torch.get_num_threads(), "device": args.device, "torch": torch.__version__},
        "command": shlex.join(["python", "benchmarks/run_benchmarks.py", *sys.argv[1:]]),
        "runs": {},
    }
    copy_bandwidth, bandwidth = measure_bandwidth_gbs(args.device)
    results["machine"]["copy_bandwidth_gbs"] = copy_bandwidth
    results["machine"]["read_bandwidth_gbs"] = bandwidth
    print(
        f"bandwidth: copy {copy_bandwidth:.1f} GB/s (read+write), read {bandwidth:.1f} GB/s; "
        f"threads {torch.get_num_threads()}; dtypes {dtypes}",
        flush=True,
    )

    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        models = {name: build(name, args.device, dtype) for name in names}
        run = {}
        for name, model in models.items():
            run[name] = {
                "parameters": sum(p.numel() for p in model.parameters()),
                "prefill_s": {},
                "decode_tokens_per_s": {},
                "peak_rss_mib": {},
                "decode_floor_ms": decode_bytes_per_token(model) / (bandwidth * 1e9) * 1e3,
            }
            print(
                f"\n{dtype_name} {name}: {run[name]['parameters'] / 1e6:.1f}M parameters, decode floor "
                f"{run[name]['decode_floor_ms']:.1f} ms/token",
                flush=True,
            )
            time_prefill(model, 256, args.device)  # warm-up
        lengths = prefill_lengths
        if dtype == torch.bfloat16 and args.bf16_prefill_max is not None:
            lengths = [n for n in lengths if n <= args.bf16_prefill_max]
        for name, times in time_prefill_interleaved(models, lengths, args.device, args.repeats, limits).items():
            run[name]["prefill_s"] = times
        for name, rates in time_decode_interleaved(models, decode_contexts, args.device, args.steps).items():
            run[name]["decode_tokens_per_s"] = rates
            print(
                f"  decode {dtype_name} {name}: " + ", ".join(f"{c}: {r:.2f}/s" for c, r in rates.items()), flush=True
            )
        del models
        gc.collect()
        for name in [] if args.no_memory else names:
            for context in decode_contexts:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child-model",
                        name,
                        "--child-context",
                        str(context),
                        "--child-dtype",
                        dtype_name,
                        "--device",
                        args.device,
                    ],
                    capture_output=True,
                    text=True,
                )
                if out.returncode != 0:
                    print(f"  memory {name} {context}: failed\n{out.stderr[-2000:]}", flush=True)
                    continue
                run[name]["peak_rss_mib"][context] = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mib"]
            print(f"  peak RSS {dtype_name} {name}: {run[name]['peak_rss_mib']}", flush=True)
        results["runs"][dtype_name] = run

    if not args.no_default_model and args.device == "cpu":
        results["default_model_tokens_per_s"] = default_model_speed(args.repeats)
        print(f"\nembedded default: {results['default_model_tokens_per_s']}", flush=True)
    results["targets"] = evaluate_targets(results)
    for line in results["targets"]:
        print(line)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    plot(results, args.out)
    print(f"\nwrote {args.out}/results.json and plots")


def load_results(f) -> dict:
    results = json.load(f)
    for run in results["runs"].values():  # JSON turned the lengths into strings
        for entry in run.values():
            for key in ("prefill_s", "decode_tokens_per_s", "peak_rss_mib"):
                entry[key] = {int(k): v for k, v in entry[key].items()}
    return results


def evaluate_targets(results) -> list[str]:
    """The Speed issues' targets as ratios measured in this run, per dtype; a target whose numbers are missing says
    so."""
    lines = []

    def check(label, value, goal, higher_is_better=True):
        if value is None:
            lines.append(f"{label}: not measured in this run")
            return
        met = value >= goal if higher_is_better else value <= goal
        sign = ">=" if higher_is_better else "<="
        lines.append(f"{label}: {value:.3f} (target {sign} {goal}) {'MET' if met else 'MISSED'}")

    def ratio(a, b):
        return None if a is None or b is None else a / b

    for dtype, models in results["runs"].items():

        def get(name, key, length):
            return models.get(name, {}).get(key, {}).get(length)

        def prefill_speedup(length):  # Llama's time / Samba's
            return ratio(get("llama", "prefill_s", length), get("samba", "prefill_s", length))

        check(
            f"[{dtype}] prefill at 1K, Samba time / Llama time",
            ratio(get("samba", "prefill_s", 1024), get("llama", "prefill_s", 1024)),
            1.15,
            False,
        )
        for length in (4096, 8192, 16384):
            check(f"[{dtype}] prefill at {length // 1024}K, Llama time / Samba time", prefill_speedup(length), 1.0)
        check(f"[{dtype}] prefill at 32K, Llama time / Samba time", prefill_speedup(32768), 3.0)
        check(
            f"[{dtype}] prefill at 32K, Mamba time / Samba time",
            ratio(get("mamba", "prefill_s", 32768), get("samba", "prefill_s", 32768)),
            5.0,
        )
        check(
            f"[{dtype}] prefill t(32K) / t(2K) (linear)",
            ratio(get("samba", "prefill_s", 32768), get("samba", "prefill_s", 2048)),
            18.0,
            False,
        )
        floor = models.get("samba", {}).get("decode_floor_ms")
        rate = get("samba", "decode_tokens_per_s", 1024)
        check(
            f"[{dtype}] decode step at 1K / bandwidth floor",
            None if rate is None or floor is None else (1e3 / rate) / floor,
            1.5,
            False,
        )
        check(
            f"[{dtype}] decode at 16K, Samba / Llama",
            ratio(get("samba", "decode_tokens_per_s", 16384), get("llama", "decode_tokens_per_s", 16384)),
            3.0,
        )
        check(
            f"[{dtype}] decode tokens/s at 32K / at 1K (flat)",
            ratio(get("samba", "decode_tokens_per_s", 32768), get("samba", "decode_tokens_per_s", 1024)),
            0.95,
        )
        check(
            f"[{dtype}] peak RSS decoding at 64K / at 2K",
            ratio(get("samba", "peak_rss_mib", 65536), get("samba", "peak_rss_mib", 2048)),
            1.05,
            False,
        )
    default = results.get("default_model_tokens_per_s", {}).get("samba-hf generate (embedded default)")
    check("embedded default through samba-hf generate, tokens/s", default, 400)
    return lines


def plot(results, out_dir):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)")
        return
    for dtype, models in results["runs"].items():
        for key, ylabel, filename in (
            ("prefill_s", "prefill time (s)", "prefill"),
            ("decode_tokens_per_s", "decode tokens/s", "decode"),
            ("peak_rss_mib", "peak resident memory (MiB)", "memory"),
        ):
            fig, ax = plt.subplots(figsize=(6, 4))
            for name, entry in models.items():
                points = sorted((int(k), v) for k, v in entry[key].items())
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
            if not ax.lines:
                plt.close(fig)
                continue
            ax.set_xscale("log", base=2)
            if key == "prefill_s":
                ax.set_yscale("log")
            ax.set_xlabel("prompt length" if key == "prefill_s" else "context length (tokens)")
            ax.set_ylabel(ylabel)
            ax.set_title(dtype)
            ax.grid(True, alpha=0.3)
            ax.legend()
            fig.tight_layout()
            fig.savefig(os.path.join(out_dir, f"{filename}_{dtype}.png"), dpi=100)
            plt.close(fig)


if __name__ == "__main__":
    main()
