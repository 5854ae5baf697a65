"""Stream N tokens through `model.generate` and show that time per token and memory stay flat.

    python examples/stream_forever.py [--tokens 65536] [--every 4096] [--model PATH] [--batch-size 1]

Every `--every` tokens it prints: tokens so far, tokens/s over the last interval, the bytes held by the hybrid
cache (Mamba conv+SSM states and the rolling sliding-window KV buffer) and the process's resident memory.
Default model: the embedded default that ships with samba-hf (5.9M parameters, trained by examples/train_tiny.py).
"""

import argparse
import os
import resource
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.generation.streamers import BaseStreamer

import samba_hf  # noqa: F401
from samba_hf.cache_samba import CACHE_NAME  # generate's cache argument: `cache` (5.24), `past_key_values` (5.23)
from samba_hf.cli import default_model_path


def resident_mib() -> float:
    """Current resident set size (Linux /proc), else the peak from getrusage."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes of storage the cache's tensors hold (a view counts its whole storage, each storage once)."""
    storages = {}
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            tensors += list(states.values())
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


class Meter(BaseStreamer):
    """Receives each generated token from generate() and reports every `every` tokens."""

    def __init__(self, cache, every, batch_size):
        self.cache, self.every, self.batch_size = cache, every, batch_size
        self.count, self.prompt_seen = 0, False
        self.last_time, self.rows = time.perf_counter(), []

    def put(self, value):
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            self.last_time = time.perf_counter()
            return
        self.count += 1
        if self.count % self.every == 0:
            now = time.perf_counter()
            rate = self.every * self.batch_size / (now - self.last_time)
            self.last_time = now
            row = (self.count, rate, cache_bytes(self.cache), resident_mib())
            self.rows.append(row)
            print(
                f"{row[0]:>8} tokens  {row[1]:8.1f} tokens/s  cache {row[2] / 2**20:8.3f} MiB  RSS {row[3]:8.1f} MiB",
                flush=True,
            )

    def end(self):
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--every", type=int, default=4096)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    path = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # never stop early: we want exactly --tokens tokens
    print(
        f"model {path}: {sum(p.numel() for p in model.parameters()):,} parameters, window "
        f"{model.config.sliding_window}, layers {model.config.layer_types}; torch threads {torch.get_num_threads()}"
    )
    print(
        f"cache bound from SambaForCausalLM.cache_nbytes({args.batch_size}): "
        f"{model.cache_nbytes(args.batch_size) / 2**20:.3f} MiB"
    )

    ids = tokenizer(["Once upon a time"] * args.batch_size, return_tensors="pt").input_ids
    cache = DynamicCache(config=model.config)
    meter = Meter(cache, args.every, args.batch_size)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **{CACHE_NAME: cache},
            max_new_tokens=args.tokens,
            do_sample=True,
            top_k=50,
            streamer=meter,
            pad_token_id=tokenizer.pad_token_id,
        )
    total = time.perf_counter() - start
    print(f"{args.tokens} tokens in {total:.1f} s ({args.tokens * args.batch_size / total:.1f} tokens/s overall)")
    if len(meter.rows) >= 2:
        first, last = meter.rows[0], meter.rows[-1]
        print(
            f"last interval / first interval: speed x{last[1] / first[1]:.2f}, cache x{last[2] / first[2]:.2f}, "
            f"RSS {first[3]:.1f} -> {last[3]:.1f} MiB"
        )


if __name__ == "__main__":
    main()
