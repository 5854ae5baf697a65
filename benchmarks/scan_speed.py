"""The Mamba scan alone: samba-hf's compiled CPU scan and its PyTorch fallback (blocked) against a per-token loop laid
out as transformers' Mamba does it, with the max abs difference against a float64 recurrence; forward, and forward
plus backward.

    python benchmarks/scan_speed.py [--lengths 2048,8192] [--d-inner 1536]
"""

import argparse
import time

import torch
import torch.nn.functional as F

from samba_hf.cpu_kernels_samba import selective_scan_cpu
from samba_hf.ssm_samba import selective_scan_pytorch


def per_token_loop(u, dt, A, B, C):
    """transformers' slow path in outline: (batch, d, seq, n) tensors, one step and one matmul per token."""
    dA = torch.exp(A[None, :, None, :] * dt.transpose(1, 2)[..., None])
    dBu = dt.transpose(1, 2)[..., None] * B[:, None] * u.transpose(1, 2)[..., None]
    h = torch.zeros(u.shape[0], u.shape[2], A.shape[1])
    ys = []
    for i in range(u.shape[1]):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append(torch.matmul(h, C[:, i, :, None])[..., 0])
    return torch.stack(ys, dim=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--d-inner", type=int, default=1536)
    args = parser.parse_args()
    torch.manual_seed(0)
    d, n = args.d_inner, 16
    A = -torch.arange(1, n + 1, dtype=torch.float32).expand(d, n).contiguous()
    for length in (int(x) for x in args.lengths.split(",")):
        u, B, C = torch.randn(1, length, d), torch.randn(1, length, n), torch.randn(1, length, n)
        dt = F.softplus(torch.randn(1, length, d) - 3)
        ref = per_token_loop(u.double(), dt.double(), A.double(), B.double(), C.double()) if length <= 2048 else None
        line = [f"L={length}:"]
        for name, scan in (
            ("compiled", selective_scan_cpu),
            ("pytorch", selective_scan_pytorch),
            ("per-token loop", lambda *x: (per_token_loop(*x), None)),
        ):
            with torch.inference_mode():
                start = time.perf_counter()
                y, _ = scan(u, dt, A, B, C)
                forward = time.perf_counter() - start
            err = "" if ref is None else f", error {(y.double() - ref).abs().max().item():.1e}"
            backward = ""
            if name != "per-token loop":
                inputs = [x.clone().requires_grad_() for x in (u, dt, B, C)]
                start = time.perf_counter()
                y, _ = scan(inputs[0], inputs[1], A, inputs[2], inputs[3])
                y.sum().backward()
                backward = f", with backward {time.perf_counter() - start:.3f} s"
            line.append(f"{name} {forward:.3f} s{backward}{err};")
        print(" ".join(line))


if __name__ == "__main__":
    main()
