"""`SambaLinear`: `nn.Linear`, with a C matrix-vector kernel for decoding on CPU (`cpu_kernels_samba.gemv_cpu`).

A decoding step multiplies every weight matrix by one token's activations, so its speed is the speed at which the
weights stream from memory; the kernel streams them faster than PyTorch's CPU matrix product does for so few rows. It
runs when: a CPU with AVX-512, inference (no gradient wanted), 1 to `KERNEL_TOKENS` tokens, plain float32 or bfloat16
weights (no tensor subclass) and input of the same dtype, the C library built, and the kernel switch's "linear"
choice (`kernel`, set by the model) is "auto" or "samba" (`kernels_samba`). torchao's int8 weight-only weights
(`Int8WeightOnlyConfig`: an `Int8Tensor` of int8 values and a float32 scale per row, no zero point) are read by the
kernel as int8 (a quarter of float32's bytes), outside torch.compile; any other tensor subclass goes through its
own product. Everything else, and `SAMBA_HF_GEMV=pytorch`, calls `nn.Linear.forward`. Under `torch.compile` it is
the operator `torch.ops.samba_hf.gemv_cpu` (inference only), which dynamo keeps as one call.

Part of the remote code of a saved model: imports only torch and its siblings.
"""

import torch
from torch import nn
from transformers.utils import logging

from .cpu_kernels_samba import GEMV_OPERATOR, MAX_TOKENS, gemv_available, gemv_cpu
from .kernels_samba import exporting, run_kernel, wants_gradient

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
        if exporting():  # an exported program holds nn.Linear's product (kernels_samba)
            return super().forward(x)
        int8 = _int8_rows(weight, x)
        if int8 is not None and self.kernel in ("auto", "samba") and gemv_available():
            return gemv_cpu(x, int8[0], self.bias, int8[1])
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


def _int8_rows(weight: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 values (out, in), scale (out,)) of a torchao weight-only int8 weight with one symmetric scale per row,
    where the kernel can take this product (inference on the CPU, float32 or bfloat16 input, few tokens, not
    compiling); else None. Read from torchao's `Int8Tensor` by its fields (`qdata`, `scale`, `zero_point`,
    `block_size`)."""
    if type(weight).__name__ != "Int8Tensor" or not type(weight).__module__.startswith("torchao"):
        return None
    qdata, scale, zero_point = (getattr(weight, name, None) for name in ("qdata", "scale", "zero_point"))
    if (
        x.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.bfloat16)
        or torch.compiler.is_compiling()
        or wants_gradient(x)
        or getattr(weight, "act_quant_kwargs", None) is not None
        or not isinstance(qdata, torch.Tensor)
        or qdata.dtype != torch.int8
        or qdata.dim() != 2
        or list(getattr(weight, "block_size", [])) != [1, qdata.shape[1]]
        or not isinstance(scale, torch.Tensor)
        or scale.numel() != qdata.shape[0]
        or not 0 < x.numel() <= MAX_TOKENS * qdata.shape[1]
        or (zero_point is not None and bool(zero_point.any()))
    ):
        return None
    return qdata, scale
