"""Samba against transformers' Llama (GQA), Mistral (SWA 2048) and Mamba of about the same size, in one run.

    python benchmarks/run_benchmarks.py [--prefill 1024,2048,4096,8192,16384,32768] [--decode 1024,4096,16384,32768,65536]
                                        [--peer-prefill-max 32768] [--out benchmarks/results]

Measures, on this machine, float32, batch 1 (CPU by default; --device cuda on a GPU):
- prefill: seconds for one forward over a random prompt of each length (`logits_to_keep=1`, as generate does);
- decode: tokens/s of the one-token step at each context length. The context is put into the cache directly
  (random keys/values/states of the right shapes: a decode step's cost depends on the cache's size, not on its
  values), so a 64K context costs no 64K prefill; each step then runs exactly as inside `generate`;
- memory: peak resident memory of a process that holds the model and a cache at that context and decodes
  (each (model, context) in a fresh subprocess, so the peaks do not mix);
- the memory-bandwidth floor of a decode step: parameter bytes read per token / measured copy bandwidth.
Writes `results.json` and PNG plots (prefill and decode vs length, like the paper's Figures 2 and 6).
"""

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, WINDOW = 768, 12, 12, 4, 64, 2048, 32000, 2048


def build(name: str, device: str):
    """The four models, all about 100-115M parameters, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM, MistralConfig, MistralForCausalLM

    import samba_hf

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  tie_word_embeddings=True, max_position_embeddings=131072)
    torch.manual_seed(0)
    if name == "samba":
        model = samba_hf.SambaForCausalLM(samba_hf.SambaConfig(sliding_window=WINDOW, **common))
    elif name == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif name == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=WINDOW, **common))
    elif name == "mamba":
        model = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=24, state_size=16,
                                             expand=2, conv_kernel=4, tie_word_embeddings=True))
    else:
        raise ValueError(name)
    model.config._attn_implementation = "sdpa" if name != "mamba" else None
    return model.to(device).eval()


def synthetic_cache(model, name: str, context: int, device: str):
    """A cache as it stands after `context` tokens: random contents, real shapes and bookkeeping."""
    from transformers import DynamicCache

    config = model.config
    cache = DynamicCache(config=config)
    generator = torch.Generator().manual_seed(0)
    for idx in range(config.num_hidden_layers):
        kind = (config.layer_types[idx] if getattr(config, "layer_types", None) else "full_attention")
        if name == "mamba" or kind == "linear_attention":
            d_inner = config.intermediate_size if name == "mamba" else config.mamba_d_inner
            d_state = config.state_size if name == "mamba" else config.mamba_d_state
            d_conv = config.conv_kernel if name == "mamba" else config.mamba_d_conv
            cache.update_conv_state(torch.randn(1, d_inner, d_conv, generator=generator).to(device), idx,
                                    conv_kernel_size=d_conv)
            cache.update_recurrent_state(torch.randn(1, d_inner, d_state, generator=generator).to(device), idx)
        else:
            # keep only what the layer would keep; fill in slices to avoid a huge temporary
            kept = min(context, WINDOW - 1) if kind == "sliding_attention" or name == "mistral" else context
            keys = torch.randn(1, KV_HEADS, kept, HEAD_DIM, generator=generator).to(device)
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


def time_decode(model, name: str, context: int, device: str, steps: int) -> float:
    """Tokens/s of the one-token decode step at `context` (median over steps after 2 warm-up steps)."""
    cache = synthetic_cache(model, name, context, device)
    token = torch.randint(0, VOCAB, (1, 1), device=device)
    times = []
    with torch.inference_mode():
        for step in range(steps + 2):
            kwargs = {} if name == "mamba" else {"position_ids": torch.tensor([[context + step]], device=device)}
            start = time.perf_counter()
            if name == "mamba":
                model(token, cache_params=cache, use_cache=True)
            else:
                model(token, past_key_values=cache, use_cache=True, **kwargs)
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    times = sorted(times[2:])
    return 1.0 / times[len(times) // 2]


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
    """One (model, context) decode measurement in its own process: tokens/s and peak RSS."""
    model = build(args.child_model, args.device)
    rate = time_decode(model, args.child_model, args.child_context, args.device, args.steps)
    print(json.dumps({"tokens_per_s": rate, "peak_rss_mib": peak_rss_mib()}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--decode", default="1024,2048,4096,16384,32768,65536")
    parser.add_argument("--models", default="samba,llama,mistral,mamba")
    parser.add_argument("--peer-prefill-max", type=int, default=32768, help="longest prefill timed for the peers")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per context")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--report", metavar="RESULTS_JSON", help="only re-evaluate targets and plots of a saved run")
    parser.add_argument("--child-model")
    parser.add_argument("--child-context", type=int)
    args = parser.parse_args()
    if args.child_model:
        return child(args)
    if args.report:
        with open(args.report) as f:
            results = json.load(f)
        for entry in results["models"].values():  # JSON turned the lengths into strings
            for key in ("prefill_s", "decode_tokens_per_s", "peak_rss_mib"):
                entry[key] = {int(k): v for k, v in entry[key].items()}
        results["targets"] = evaluate_targets(results)
        print("\n".join(results["targets"]))
        with open(args.report, "w") as f:
            json.dump(results, f, indent=2)
        return plot(results, os.path.dirname(os.path.abspath(args.report)))

    models = args.models.split(",")
    prefill_lengths = [int(x) for x in args.prefill.split(",") if x]
    decode_contexts = [int(x) for x in args.decode.split(",") if x]
    results = {"machine": {"threads": torch.get_num_threads(), "device": args.device, "torch": torch.__version__},
               "command": " ".join(sys.argv), "models": {}}
    copy_bandwidth, bandwidth = measure_bandwidth_gbs(args.device)
    results["machine"]["copy_bandwidth_gbs"] = copy_bandwidth
    results["machine"]["read_bandwidth_gbs"] = bandwidth
    print(f"bandwidth: copy {copy_bandwidth:.1f} GB/s (read+write), read {bandwidth:.1f} GB/s; "
          f"threads {torch.get_num_threads()}", flush=True)

    for name in models:
        model = build(name, args.device)
        n_params = sum(p.numel() for p in model.parameters())
        entry = {"parameters": n_params, "prefill_s": {}, "decode_tokens_per_s": {}, "peak_rss_mib": {}}
        entry["decode_floor_ms"] = decode_bytes_per_token(model) / (bandwidth * 1e9) * 1e3
        print(f"\n{name}: {n_params / 1e6:.1f}M parameters, decode floor {entry['decode_floor_ms']:.1f} ms/token", flush=True)
        time_prefill(model, 256, args.device)  # warm-up
        for length in prefill_lengths:
            if name != "samba" and length > args.peer_prefill_max:
                continue
            seconds = time_prefill(model, length, args.device)
            entry["prefill_s"][length] = seconds
            print(f"  prefill {length:>6}: {seconds:8.2f} s", flush=True)
            gc.collect()
        del model
        gc.collect()
        for context in decode_contexts:
            out = subprocess.run([sys.executable, __file__, "--child-model", name, "--child-context", str(context),
                                  "--device", args.device, "--steps", str(args.steps)], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"  decode {context}: failed\n{out.stderr[-2000:]}", flush=True)
                continue
            measured = json.loads(out.stdout.strip().splitlines()[-1])
            entry["decode_tokens_per_s"][context] = measured["tokens_per_s"]
            entry["peak_rss_mib"][context] = measured["peak_rss_mib"]
            print(f"  decode at {context:>6}: {measured['tokens_per_s']:7.2f} tokens/s "
                  f"({1e3 / measured['tokens_per_s']:6.1f} ms), peak RSS {measured['peak_rss_mib']:7.0f} MiB", flush=True)
        results["models"][name] = entry

    results["targets"] = evaluate_targets(results)
    for line in results["targets"]:
        print(line)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    plot(results, args.out)
    print(f"\nwrote {args.out}/results.json and plots")


def evaluate_targets(results) -> list[str]:
    """The Speed issue's targets as ratios measured in this run; a target whose numbers are missing says so."""
    models = results["models"]

    def get(name, key, length):
        return models.get(name, {}).get(key, {}).get(length)

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

    check("decode tokens/s at 32K / at 1K (flat)",
          ratio(get("samba", "decode_tokens_per_s", 32768), get("samba", "decode_tokens_per_s", 1024)), 0.95)
    check("decode at 32K, Samba / Llama", ratio(get("samba", "decode_tokens_per_s", 32768),
                                               get("llama", "decode_tokens_per_s", 32768)), 3.0)
    check("prefill t(32K) / t(2K) (linear)", ratio(get("samba", "prefill_s", 32768), get("samba", "prefill_s", 2048)),
          18.0, higher_is_better=False)
    check("prefill at 32K, Llama time / Samba time", ratio(get("llama", "prefill_s", 32768), get("samba", "prefill_s", 32768)), 2.0)
    check("prefill at 32K, Mamba time / Samba time", ratio(get("mamba", "prefill_s", 32768), get("samba", "prefill_s", 32768)), 5.0)
    floor = models.get("samba", {}).get("decode_floor_ms")
    rate = get("samba", "decode_tokens_per_s", 1024)
    check("decode step / bandwidth floor", None if rate is None else (1e3 / rate) / floor, 1.5, higher_is_better=False)
    check("peak RSS decoding at 64K / at 2K", ratio(get("samba", "peak_rss_mib", 65536), get("samba", "peak_rss_mib", 2048)),
          1.05, higher_is_better=False)
    return lines


def plot(results, out_dir):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)")
        return
    for key, ylabel, filename in (("prefill_s", "prefill time (s)", "prefill.png"),
                                  ("decode_tokens_per_s", "decode tokens/s", "decode.png"),
                                  ("peak_rss_mib", "peak resident memory (MiB)", "memory.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, entry in results["models"].items():
            points = sorted((int(k), v) for k, v in entry[key].items())
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        if key == "prefill_s":
            ax.set_yscale("log")
        ax.set_xlabel("prompt length" if key == "prefill_s" else "context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, filename), dpi=100)
        plt.close(fig)


if __name__ == "__main__":
    main()
