"""The Mamba-2-Hybrid layout at full width and reduced depth: samba-hf against transformers' NemotronHForCausalLM (its
torch path: what runs without mamba-ssm) and a Llama of the same size, on this machine.

    python benchmarks/mamba2_hybrid.py                                   # CPU, float32, prefill 1K-16K, decode 1K-64K
    python benchmarks/mamba2_hybrid.py --prefill 1024,4096,8192,16384 --out benchmarks/results/mamba2_hybrid.json
    python benchmarks/mamba2_hybrid.py --models samba-hf,Llama --prefill 32768 --decode "" --profile-length 0 \
        --out benchmarks/results/mamba2_hybrid_32k.json            # NemotronH's torch path needs ~30 GiB at 32K

One model is in memory at a time. The slice is blocks 7-13 of the 8B's pattern, "M-M*-M-" (3 Mamba-2, 1 attention, 3
MLP blocks: 773M parameters at hidden 4096, Mamba-2 heads 128 x 64, 8 groups, state 128; GQA 32/8 heads of 128; GELU
MLP 16384), with a 32K vocabulary instead of 256K so that three models fit in memory at once. NemotronH gets the same
sizes (weights of its own: speed does not depend on them). The Llama has 3 layers of hidden 4096, GQA 32/8, SwiGLU
17408: 768M parameters besides the embeddings, as the hybrid's 773M.

Prefill: one forward over a random prompt, best of --repeat (of 1 from 16K tokens), with the process's peak RSS.
Decode: one-token steps from a cache holding --decode contexts (filled with random keys/values and states: a step's
time does not depend on them), best of --steps. Memory: each model's cache at each context (bytes of its tensors).
"Where the time goes": samba-hf's prefill at --profile-length under torch.profiler, grouped by operation. Prints a
table; --out writes the JSON.
"""

import argparse
import json
import os
import platform
import shlex
import time
from datetime import date

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, NemotronHConfig, NemotronHForCausalLM

from samba_hf import SambaConfig, SambaForCausalLM

PATTERN = "M-M*-M-"


def build(name: str, pattern: str, vocab: int):
    """One of the three models, random weights, float32."""
    samba_config = SambaConfig.from_preset("mamba2-hybrid-8b", hybrid_override_pattern=pattern, vocab_size=vocab)
    c = samba_config
    torch.manual_seed(0)
    if name == "samba-hf":
        return SambaForCausalLM(samba_config).eval()
    if name == "NemotronH":
        return NemotronHForCausalLM(
            NemotronHConfig(
                vocab_size=vocab,
                hidden_size=c.hidden_size,
                hybrid_override_pattern=pattern,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                intermediate_size=c.intermediate_size,
                mlp_hidden_act="gelu",
                ssm_state_size=c.mamba_d_state,
                mamba_num_heads=c.mamba2_num_heads,
                mamba_head_dim=c.mamba2_head_dim,
                n_groups=c.mamba2_n_groups,
                conv_kernel=4,
                chunk_size=128,
                layer_norm_epsilon=1e-5,
                tie_word_embeddings=False,
                use_bias=False,
                use_conv_bias=True,
                attention_bias=False,
                mlp_bias=False,
                residual_in_fp32=False,
            )
        ).eval()
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=c.hidden_size,
            intermediate_size=17408,
            num_hidden_layers=3,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
            max_position_embeddings=131072,
        )
    ).eval()


MODELS = ("samba-hf", "NemotronH", "Llama")


def parameters(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)


def filled_cache(name: str, model, context: int) -> DynamicCache:
    """A cache as after `context` tokens, with random contents."""
    config = model.config
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        kind = config.layer_types[i] if hasattr(config, "layer_types") and config.layer_types else "full_attention"
        if kind == "linear_attention":
            mixer = model.model.layers[i].mamba if name == "samba-hf" else model.model.layers[i].mixer
            conv_channels = mixer.conv1d.in_channels
            heads = getattr(mixer, "num_heads")
            head_dim = getattr(mixer, "head_dim")
            state = mixer.ssm_state_size
            cache.update_conv_state(torch.randn(1, conv_channels, 4), i, conv_kernel_size=4)
            cache.update_recurrent_state(torch.randn(1, heads, head_dim, state), i)
        elif kind in ("full_attention", "sliding_attention"):
            kv, head_dim = config.num_key_value_heads, config.head_dim
            cache.update(torch.randn(1, kv, context, head_dim), torch.randn(1, kv, context, head_dim), i)
    return cache


def cache_bytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        for tensors in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            total += sum(t.nbytes for t in tensors.values() if t is not None)
        for attr in ("keys", "values"):
            tensor = getattr(layer, attr, None)
            total += tensor.nbytes if isinstance(tensor, torch.Tensor) else 0
    return total


def where_the_time_goes(model, length: int) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, model.config.vocab_size, (1, length))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(ids, use_cache=False)
    rows = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    total = sum(t for _, t in rows)
    return [(key, t / total) for key, t in sorted(rows, key=lambda r: -r[1])[:8]]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefill", default="1024,4096,16384")
    parser.add_argument("--decode", default="1024,4096,16384,65536")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--profile-length", type=int, default=4096)
    parser.add_argument("--models", default=",".join(MODELS), help=f"a subset of {','.join(MODELS)}")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    result = {
        "command": "python benchmarks/mamba2_hybrid.py "
        + " ".join(f"--{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in vars(args).items() if v is not None),
        "date": date.today().isoformat(),
        "machine": machine(),
        "torch": torch.__version__,
        "pattern": PATTERN,
        "dtype": "float32",
        "parameters_without_embeddings": {},
        "prefill_seconds": {},
        "prefill_peak_gib": {},
        "decode_step_seconds": {},
        "cache_bytes": {},
    }
    if set(args.models.split(",")) - set(MODELS):
        parser.error(f"--models takes names from {','.join(MODELS)}, got {args.models!r}")
    for name in args.models.split(","):  # one model in memory at a time (three at 16K tokens do not fit in 24 GB)
        model = build(name, PATTERN, args.vocab)
        result["parameters_without_embeddings"][name] = parameters(model)
        for length in map(int, args.prefill.split(",")):
            ids = torch.randint(0, args.vocab, (1, length))
            best, peak = float("inf"), 0.0
            for _ in range(args.repeat if length < 16384 else 1):
                with PeakRss() as rss:
                    start = time.perf_counter()
                    model(ids, use_cache=False, logits_to_keep=1)
                    best = min(best, time.perf_counter() - start)
                peak = max(peak, rss.peak_gib)
            result["prefill_seconds"].setdefault(length, {})[name] = best
            result["prefill_peak_gib"].setdefault(length, {})[name] = peak
            print(f"{name:>9} prefill {length:>6}: {best:8.2f} s, peak RSS {peak:5.1f} GiB", flush=True)
        token = torch.randint(0, args.vocab, (1, 1))
        for context in [int(c) for c in args.decode.split(",") if c]:
            cache, best = filled_cache(name, model, context), float("inf")
            for _ in range(args.steps):
                start = time.perf_counter()
                model(token, past_key_values=cache, use_cache=True, position_ids=torch.tensor([[context]]))
                best = min(best, time.perf_counter() - start)
            result["decode_step_seconds"].setdefault(context, {})[name] = best
            result["cache_bytes"].setdefault(context, {})[name] = cache_bytes(cache)
            print(
                f"{name:>9} decode at {context:>6}: {1000 * best:7.1f} ms, "
                f"cache {cache_bytes(cache) / 2**20:7.1f} MiB",
                flush=True,
            )
            del cache
        if name == "samba-hf" and args.profile_length:
            result["samba_hf_prefill_profile"] = where_the_time_goes(model, args.profile_length)
            for key, share in result["samba_hf_prefill_profile"]:
                print(f"  samba-hf prefill {args.profile_length}: {100 * share:5.1f}% {key}")
        del model
        if args.out:  # after each model, so that a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)


class PeakRss:
    """The process's peak resident memory while the block runs (sampled every 20 ms), in GiB."""

    def __enter__(self):
        import threading

        self.peak_gib, self._running = self._rss(), True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._running = False
        self._thread.join()

    def _sample(self):
        while self._running:
            self.peak_gib = max(self.peak_gib, self._rss())
            time.sleep(0.02)

    @staticmethod
    def _rss() -> float:
        with open("/proc/self/status") as status:
            return int(status.read().split("VmRSS:")[1].split()[0]) / 2**20


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            lines = info.read().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags"))
        name += " (" + ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags) + ")"
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
