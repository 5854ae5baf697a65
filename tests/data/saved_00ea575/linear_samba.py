"""`SambaLinear`: `nn.Linear`, with a C matrix-vector kernel for decoding on CPU (`cpu_kernels_samba.gemv_cpu`).

A decoding step multiplies every weight matrix by one token's activations, so its speed is the speed at which the
weights stream from memory; the kernel streams them faster than PyTorch's CPU matrix product does for so few rows. It
runs when: a CPU with AVX-512, inference (no gradient wanted), 1 to `MAX_TOKENS` tokens, float32 or bfloat16 weights
and input of the same dtype, the C library built. Everything else, and `SAMBA_HF_GEMV=pytorch`, calls
`nn.Linear.forward`. Under `torch.compile` it is the operator `torch.ops.samba_hf.gemv_cpu` (inference only), which
dynamo keeps as one call.

Part of the remote code of a saved model: imports only torch and its siblings.
"""

import torch
from torch import nn

from .cpu_kernels_samba import _GEMV_OPERATOR, MAX_TOKENS, gemv_available, gemv_cpu


class SambaLinear(nn.Linear):
    """`nn.Linear` (same parameters, state dict and behaviour; adapters wrap it as they wrap nn.Linear) whose
    inference on at most `MAX_TOKENS` tokens on CPU runs the C kernel (`cpu_kernels_samba.gemv_cpu`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            x.device.type == "cpu"
            and x.dtype == weight.dtype
            and weight.dtype in (torch.float32, torch.bfloat16)
            and 0 < x.numel() <= MAX_TOKENS * self.in_features
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and gemv_available()
        ):
            if torch.compiler.is_compiling():
                return _GEMV_OPERATOR(x, weight, self.bias)
            return gemv_cpu(x, weight, self.bias)
        return super().forward(x)
