"""The generation cache's size against the context length, from `SambaForCausalLM.cache_nbytes` on meta-device models
(no weights, seconds): Samba-421M and NVIDIA's Mamba-2-Hybrid 8B, each against the same model with every mixer turned
into full attention (a Llama-style cache of the same shapes). Batch 1, bfloat16 keys and values; Mamba states are
float32 in every dtype. `tests/test_generation.py::test_cache_nbytes_against_a_full_attention_layout` checks the
formula against the tensors a cache holds.

    python benchmarks/cache_size.py [--out benchmarks/results/cache_size]   # writes cache_size.json and .png there
"""

import argparse
import json
import os

import torch

from samba_hf import SambaConfig, SambaForCausalLM

CONTEXTS = [2**k for k in range(10, 21)]  # 1K ... 1M tokens


def full_attention(config: SambaConfig) -> SambaConfig:
    """The same model with every Mamba and sliding-window layer a full-attention layer ("mlp" blocks stay)."""
    layer_types = ["mlp" if kind == "mlp" else "full_attention" for kind in config.layer_types]
    return SambaConfig(**{**config.to_dict(), "layer_types": layer_types, "hybrid_override_pattern": None})


def sizes(config: SambaConfig) -> list[float]:
    with torch.device("meta"):
        model = SambaForCausalLM(config)
    return [model.cache_nbytes(1, seq_len=n, dtype=torch.bfloat16) / 2**20 for n in CONTEXTS]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cache_size", help="folder for cache_size.json and .png")
    args = parser.parse_args()
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out} is a file; give a folder")
    curves = {}
    for name, preset in (("Samba-421M", "samba-421m"), ("Mamba-2-Hybrid 8B", "mamba2-hybrid-8b")):
        config = SambaConfig.from_preset(preset)
        curves[name] = sizes(config)
        curves[f"{name}, all full attention"] = sizes(full_attention(config))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cache_size.json"), "w") as file:
        json.dump(
            {
                "contexts": CONTEXTS,
                "cache_MiB": curves,
                "batch": 1,
                "dtype": "bfloat16",
                "command": "python benchmarks/cache_size.py",
            },
            file,
            indent=1,
        )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for (name, values), color in zip(curves.items(), ["C0", "C0", "C1", "C1"]):
        axes.plot(
            CONTEXTS,
            values,
            marker="o",
            color=color,
            linestyle="--" if "all full attention" in name else "-",
            label=name,
        )
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("context (tokens)")
    axes.set_ylabel("cache (MiB, batch 1, bf16)")
    axes.set_title("generation cache size against context")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(os.path.join(args.out, "cache_size.png"), dpi=110)
    print(f"{'context':>9}" + "".join(f"{name[:30]:>32}" for name in curves))
    for i, n in enumerate(CONTEXTS):
        print(f"{n:>9}" + "".join(f"{values[i]:>29.1f} MiB" for values in curves.values()))


if __name__ == "__main__":
    main()
