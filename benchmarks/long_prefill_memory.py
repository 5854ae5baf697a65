"""Peak memory of one prefill forward over a very long prompt (default: 128K tokens, the Samba-421M preset).

    python benchmarks/long_prefill_memory.py [--preset samba-421m] [--tokens 131072] [--chunk 0]

Random weights, float32, batch 1, `logits_to_keep=1` (what generate asks for). `--chunk N` instead reads the
prompt N tokens at a time through the cache (generate's `prefill_chunk_size`). Prints the wall time and the peak
resident memory of the process (VmHWM).
"""

import argparse
import time

import torch
from transformers import DynamicCache

import samba_hf


def peak_rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="samba-421m")
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=0, help="0: one forward; N: N tokens at a time through the cache")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = samba_hf.SambaForCausalLM(samba_hf.SambaConfig.from_preset(args.preset)).eval()
    after_load = peak_rss_gib()
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens))
    start = time.perf_counter()
    with torch.inference_mode():
        if args.chunk:
            cache = DynamicCache(config=model.config)
            for pos in range(0, args.tokens, args.chunk):
                logits = model(
                    ids[:, pos : pos + args.chunk], past_key_values=cache, use_cache=True, logits_to_keep=1
                ).logits
        else:
            logits = model(ids, logits_to_keep=1).logits
    elapsed = time.perf_counter() - start
    assert torch.isfinite(logits).all()
    print(
        f"{args.preset}, {args.tokens} tokens, {'one forward' if not args.chunk else f'chunks of {args.chunk}'}: "
        f"{elapsed:.0f} s, peak RSS {peak_rss_gib():.2f} GiB (model alone {after_load:.2f} GiB)"
    )


if __name__ == "__main__":
    main()
