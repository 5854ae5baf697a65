"""Peak memory of `samba-hf convert megatron` on a full-size NVIDIA Mamba-2-Hybrid 8B file (random weights, the
released key set, shapes and dtype: 8,654,517,248 bf16 parameters, a 17.3 GB model_optim_rng.pt).

    python benchmarks/megatron_convert_memory.py              # the hybrid; --pattern M*56 for the pure Mamba-2 8B

The checkpoint is built without holding it in memory: each tensor is a file-backed storage filled piece by piece,
then torch.save streams them into the Hub folder layout (tracker file, release/mp_rank_00/model_optim_rng.pt) with
the release's pickled args (a Namespace with its 2024 fields; no Mamba-2 sizes, so the converter assumes the release's
8 groups and state 128). The converter then runs in a child process (bf16 output, 5 GB shards, no --verify), sampled
as in convert_memory.py: RssAnon is what must fit in RAM, RssFile the memory-mapped source the kernel may drop.
Needs about 2.5x the checkpoint's size on disk (the backing file, the checkpoint, the output); prints one line.
"""

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from convert_memory import run_and_sample

from samba_hf import SambaConfig
from samba_hf.conversion import megatron


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pattern", default=SambaConfig.from_preset("mamba2-hybrid-8b").hybrid_pattern)
    parser.add_argument("--dir", default=".", help="where the temporary checkpoint and output go")
    args = parser.parse_args()
    preset = "mamba2-8b" if set(args.pattern) == {"M"} else "mamba2-hybrid-8b"
    config = SambaConfig.from_preset(preset, hybrid_override_pattern=args.pattern)
    shapes = megatron.megatron_shapes(config)
    params = sum(math.prod(shape) for shape in shapes.values())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp) / "mamba2-hybrid-8b-3t-4k"
        (folder / "release" / "mp_rank_00").mkdir(parents=True)
        (folder / megatron.TRACKER).write_text("release")
        backing = Path(tmp) / "backing"
        backing.mkdir()
        state, generator = {}, torch.Generator().manual_seed(0)
        start = time.perf_counter()
        for index, (name, shape) in enumerate(
            sorted(shapes.items(), key=lambda item: megatron.released_order(item[0]))
        ):
            count = math.prod(shape)
            # one file-backed storage per tensor, as torch.save writes one record per storage
            storage = torch.UntypedStorage.from_file(str(backing / str(index)), shared=True, nbytes=2 * count)
            tensor = torch.empty(0, dtype=torch.bfloat16).set_(storage, 0, (count,)).view(shape)
            flat = tensor.view(-1)
            for piece in range(0, count, 1 << 26):  # 128 MiB of bf16 at a time
                block = flat[piece : piece + (1 << 26)]
                block.copy_(torch.randn(block.numel(), generator=generator) * 0.02)
            if name.endswith("A_log"):
                tensor.copy_(torch.log(torch.linspace(1, 16, count)))
            state[name] = tensor
        pt = folder / "release" / "mp_rank_00" / "model_optim_rng.pt"
        pattern = config.hybrid_pattern
        release_args = megatron.megatron_args(config)
        for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads"):
            delattr(release_args, name)  # not in the 2024 args
        if pattern == SambaConfig.from_preset(preset).hybrid_pattern:  # the release: ratios, no override pattern
            del release_args.hybrid_override_pattern
            release_args.hybrid_attention_ratio = 0.08 if "*" in pattern else 0.0
            release_args.hybrid_mlp_ratio = 0.5 if "-" in pattern else 0.0
        torch.save({"model": state, "args": release_args, "checkpoint_version": 3.0, "iteration": 0}, pt)
        del state, storage, tensor, flat, block
        shutil.rmtree(backing)
        built = time.perf_counter() - start
        size = pt.stat().st_size
        command = [
            sys.executable,
            "-m",
            "samba_hf_cli",
            "convert",
            "megatron",
            str(folder),
            str(Path(tmp) / "out"),
            "--no-verify",
            "--dtype",
            "bfloat16",
        ]
        elapsed, peak_anon, peak_file = run_and_sample(command)
        written = sum(p.stat().st_size for p in (Path(tmp) / "out").glob("*.safetensors"))
        print(
            f"{preset} ({pattern.count('M')} Mamba-2, {pattern.count('*')} attention, {pattern.count('-')} MLP "
            f"blocks): {params:,} parameters, checkpoint {size / 1e9:.2f} GB bf16 (built in {built:.0f} s); convert "
            f"took {elapsed:.0f} s and wrote {written / 1e9:.2f} GB of bf16 safetensors in 5 GB shards; peak RssAnon "
            f"{peak_anon / 2**20:.2f} GiB, peak RssFile {peak_file / 2**20:.2f} GiB (memory-mapped, reclaimable)"
        )


if __name__ == "__main__":
    main()
