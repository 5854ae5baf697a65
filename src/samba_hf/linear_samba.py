"""`SambaLinear`: `nn.Linear`, with a C matrix-vector kernel for decoding on CPU (`cpu_kernels_samba.gemv_cpu`).

A decoding step multiplies every weight matrix by one token's activations, so its speed is the speed at which the
weights stream from memory; the kernel streams them faster than PyTorch's CPU matrix product does for so few rows. It
runs when: a CPU with AVX-512, inference (no gradient wanted), 1 to `KERNEL_TOKENS` tokens, plain float32 or bfloat16
weights (no tensor subclass, such as a quantized weight) and input of the same dtype, the C library built, and the
kernel switch's "linear" choice (`kernel`, set by the model) is "auto" or "samba" (`kernels_samba`). Everything
else, and `SAMBA_HF_GEMV=pytorch`, calls `nn.Linear.forward`. Under `torch.compile` it is the operator
`torch.ops.samba_hf.gemv_cpu` (inference only), which dynamo keeps as one call.

Part of the remote code of a saved model: imports only torch and its siblings.
"""

import torch
from torch import nn
from transformers.utils import logging

from .cpu_kernels_samba import GEMV_OPERATOR, MAX_TOKENS, gemv_available, gemv_cpu
from .kernels_samba import run_kernel

logger = logging.get_logger(__name__)

# Tokens a product takes the kernel for, by the weight's dtype: up to MAX_TOKENS in float32, where it reads the
# weights faster than PyTorch's product at every count; up to 8 in bfloat16, past which oneDNN's bf16 product is as
# fast (docs/speed.md, "Checking drafts").
KERNEL_TOKENS = {torch.float32: MAX_TOKENS, torch.bfloat16: 8}


class SambaLinear(nn.Linear):
    """`nn.Linear` (same parameters, state dict and behaviour; adapters wrap it as they wrap nn.Linear) whose
    inference on at most `KERNEL_TOKENS` tokens on CPU runs the C kernel (`cpu_kernels_samba.gemv_cpu`)."""

    kernel = "auto"  # the kernel switch's choice for the linear layers (`choose_kernels`)

    def choose_kernels(self, chosen: dict[str, str]):
        self.kernel = chosen["linear"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            self.kernel in ("auto", "samba")
            and x.device.type == "cpu"
            and type(weight) in (nn.Parameter, torch.Tensor)  # a quantized weight is a subclass: never read as floats
            and x.dtype == weight.dtype
            and weight.dtype in KERNEL_TOKENS
            and 0 < x.numel() <= KERNEL_TOKENS[weight.dtype] * self.in_features
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            if gemv_available():  # inference only: no autograd function
                return run_kernel(
                    (), lambda: gemv_cpu(x, weight, self.bias), operator=lambda: GEMV_OPERATOR(x, weight, self.bias)
                )
            if self.kernel == "samba" and not torch.compiler.is_compiling():
                logger.warning_once(
                    'samba-hf: kernel_implementation "samba" asks for samba-hf\'s matrix-vector kernel, which this '
                    "CPU cannot run (it needs AVX-512 and a C compiler); the linear layers run nn.Linear"
                )
        return super().forward(x)
