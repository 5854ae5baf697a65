"""The one-token decode step of the ~113M Samba of `run_benchmarks.py` (window 2048, float32) with transformers'
`DynamicSlidingWindowLayer` (which concatenates, i.e. copies, the whole window every step) and with samba-hf's
`SambaSlidingWindowLayer` (written in place), from caches as they stand after 1K and 16K tokens (random contents,
real shapes). The four (layer, context) pairs are stepped in turn; median of `--steps` steps after 2 warm-up rounds.

    python benchmarks/sliding_window_cache.py --out benchmarks/results/sliding_window_cache.json
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run_benchmarks import build, synthetic_cache  # noqa: E402
from vllm_serving import machine  # noqa: E402


def cache_for(model, context: int, in_place: bool):
    from transformers import DynamicCache

    from samba_hf.cache_samba import use_samba_layers

    if not in_place:  # transformers' layers, filled as they come
        return synthetic_cache(model, "samba", context, "cpu")
    original = DynamicCache.__init__

    def init_in_place(self, *args, **kwargs):  # the layers samba-hf's forward would put in a fresh cache
        original(self, *args, **kwargs)
        use_samba_layers(self)

    DynamicCache.__init__ = init_in_place
    try:
        return synthetic_cache(model, "samba", context, "cpu")
    finally:
        DynamicCache.__init__ = original


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,16384")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = build("samba", "cpu")
    contexts = [int(c) for c in args.contexts.split(",")]
    runs = {
        (layer, c): cache_for(model, c, layer == "in place")
        for layer in ("transformers", "in place")
        for c in contexts
    }
    kinds = {key: type(cache.layers[1]).__name__ for key, cache in runs.items()}
    token = torch.tensor([[7]])
    times = {key: [] for key in runs}
    with torch.inference_mode():
        for step in range(args.steps + 2):
            for key, cache in runs.items():
                start = time.perf_counter()
                model(token, past_key_values=cache, use_cache=True, logits_to_keep=1)
                if step >= 2:
                    times[key].append(time.perf_counter() - start)
    table = {
        f"{layer}, {c} tokens": {"step_ms": 1000 * statistics.median(times[(layer, c)]), "layer": kinds[(layer, c)]}
        for layer, c in runs
    }
    report = {
        "command": " ".join(["python", "benchmarks/sliding_window_cache.py", *sys.argv[1:]]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "steps": args.steps,
        "results": table,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
