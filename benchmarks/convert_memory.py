"""Peak memory of `samba-hf convert lit-gpt` on an official-size checkpoint (random weights, fp32 as pretrain.py
saves).

    python benchmarks/convert_memory.py                      # Samba_421M (a 1.7 GB checkpoint)
    python benchmarks/convert_memory.py --config Samba_1.3B --dtype bfloat16  # 5.3 GB, written as bf16

Writes the checkpoint into a temporary folder, runs the converter in a child process (no --verify) and samples the
child's /proc status every 20 ms: RssAnon is the memory the process owns (what must fit in RAM); RssFile is the
memory-mapped checkpoint pages the kernel may drop at any time. Prints one line of numbers.
"""

import argparse
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from samba_hf.conversion import lit_gpt


def status_kib(pid: int) -> dict[str, int]:
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                fields[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return fields


def run_and_sample(command: list[str]) -> tuple[float, int, int]:
    """Run `command`, sampling its /proc status every 20 ms: (seconds, peak RssAnon KiB, peak RssFile KiB)."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak_anon = peak_file = 0
    while child.poll() is None:
        fields = status_kib(child.pid)
        peak_anon = max(peak_anon, fields.get("RssAnon", 0))
        peak_file = max(peak_file, fields.get("RssFile", 0))
        time.sleep(0.02)
    if child.returncode:
        raise SystemExit(child.stderr.read())
    return time.perf_counter() - start, peak_anon, peak_file


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="Samba_421M", choices=sorted(lit_gpt.OFFICIAL_CONFIGS))
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    config = lit_gpt.config_from_name(args.config)
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        src = Path(tmp) / "iter-000001-ckpt.pth"
        shapes = lit_gpt.official_shapes(config)
        state = {name: torch.randn(shape) * 0.02 for name, shape in shapes.items() if name != "lm_head.weight"}
        state["lm_head.weight"] = state["transformer.wte.weight"]
        torch.save({"model": state, "iter_num": 1}, src)
        del state
        size = src.stat().st_size
        command = [
            sys.executable,
            "-m",
            "samba_hf_cli",
            "convert",
            "lit-gpt",
            str(src),
            str(Path(tmp) / "out"),
            "--config",
            args.config,
            "--no-verify",
        ] + (["--dtype", args.dtype] if args.dtype else [])
        elapsed, peak_anon, peak_file = run_and_sample(command)
        params = sum(math.prod(s) for n, s in shapes.items() if n != "lm_head.weight")
        print(
            f"{args.config}: {params:,} parameters, checkpoint {size / 2**30:.2f} GiB fp32, written as "
            f"{args.dtype or 'float32'}; convert took {elapsed:.1f} s; "
            f"peak RssAnon {peak_anon / 2**20:.2f} GiB, peak RssFile {peak_file / 2**20:.2f} GiB (memory-mapped, "
            "reclaimable)"
        )


if __name__ == "__main__":
    main()
