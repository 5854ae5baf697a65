"""The kernel switch: which code runs the scan, the causal conv and the linear layers, as `attn_implementation`
chooses attention.

`config.kernel_implementation` (set with `from_pretrained(..., kernel_implementation=...)` or
`model.set_kernel_implementation(...)`) is one of `KERNEL_IMPLEMENTATIONS` for every part, or a dict choosing per
part (`{"scan": "pytorch"}`; parts left out are "auto"):

    part     "auto" (the default)                "pytorch"          "samba"                     "mamba_ssm"
    scan     CUDA: mamba-ssm, else samba-hf's    ssm_samba's        samba-hf's: the C scan on   mamba-ssm's (CUDA)
             Triton scan; CPU: the C scan        PyTorch scans      CPU, Triton scans on CUDA
    conv     CUDA: causal-conv1d, else samba-    nn.Conv1d          samba-hf's: multiply-adds   causal-conv1d's (CUDA)
             hf's Triton conv; CPU: multiply-                       on CPU, Triton on CUDA
             adds
    linear   CPU decoding steps: the C matrix-   nn.Linear          as "auto" (said once where  nn.Linear
             vector kernel (AVX-512); else                          the C kernel cannot run)
             nn.Linear

"auto" takes the fastest path installed, falling back (said once) where a kernel is missing. Any other choice of
scan or conv runs exactly that path, and one that cannot run here is one ValueError naming the choices
(`ssm_samba.require`, which knows what is installed): when the model is built or loaded, for its device, and at
the call for a tensor elsewhere. Which path runs is decided in `ssm_samba.selective_scan`, `ssd_scan` and
`causal_conv`, and in `SambaLinear.forward`, from the choice the model hands its layers. samba-hf's
own linear kernel serves CPU decoding steps only, so "samba" there is "auto" said out loud. Under torch.compile the
scans of "auto", "samba" and "mamba_ssm" are samba-hf's operators, which a graph can hold; "pytorch" traces the
PyTorch paths.

The choice between a kernel's compiled operator, its autograd function and its plain forward is made once, in
`run_kernel`, for every kernel samba-hf has.

While torch.export traces (`exporting`), every part runs its PyTorch path whatever the choice: an exported program
holds core ATen operators only, which ExecuTorch and ONNX lower, and its scans run at any length (`ssm_samba`).

Part of the remote code of a saved model: imports only torch.
"""

from collections.abc import Callable

import torch

KERNEL_IMPLEMENTATIONS = ("auto", "pytorch", "samba", "mamba_ssm")
KERNEL_PARTS = ("scan", "conv", "linear")


def resolve_kernel_implementation(value) -> dict[str, str]:
    """The choice of each part, from a config's `kernel_implementation` (None, one of `KERNEL_IMPLEMENTATIONS`, or a
    dict of parts); a ValueError naming the choices for anything else."""
    if value is None:
        return dict.fromkeys(KERNEL_PARTS, "auto")
    one = isinstance(value, str)
    if one:
        value = dict.fromkeys(KERNEL_PARTS, value)
    if not isinstance(value, dict):
        raise ValueError(
            f"kernel_implementation must be one of {', '.join(map(repr, KERNEL_IMPLEMENTATIONS))} or a dict of "
            f"parts ({', '.join(map(repr, KERNEL_PARTS))}) to those, got {value!r} ({type(value).__name__})."
        )
    unknown_parts = sorted(map(str, set(value) - set(KERNEL_PARTS)))
    if unknown_parts:
        raise ValueError(
            f"kernel_implementation has no part {', '.join(map(repr, unknown_parts))}: the parts are "
            f"{', '.join(map(repr, KERNEL_PARTS))}, e.g. {{'scan': 'pytorch'}}."
        )
    for part, choice in value.items():
        if choice not in KERNEL_IMPLEMENTATIONS:
            raise ValueError(
                f"kernel_implementation{'' if one else f'[{part!r}]'} is {choice!r}, "
                f"which is none of {', '.join(map(repr, KERNEL_IMPLEMENTATIONS))} (see docs/model.md, 'Choosing the "
                "kernels')."
            )
    return {part: value.get(part, "auto") for part in KERNEL_PARTS}


def exporting() -> bool:
    """Whether torch.export is tracing this call (transformers' exporters, ExecuTorch, ONNX): every part then runs
    its PyTorch path (module docstring)."""
    return torch.compiler.is_exporting()


def wants_gradient(*tensors) -> bool:
    """Whether autograd will want gradients of any of these tensors (None: an absent input)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def run_kernel(inputs: tuple, plain: Callable, operator: Callable | None = None, autograd: Callable | None = None):
    """A kernel called the one way its context allows: `operator()` (a torch operator, which torch.compile keeps as
    one call) while compiling, `autograd()` (its autograd.Function) where a gradient of `inputs` is wanted, else
    `plain()`, its forward alone. A kernel without one of them is never asked for it by its caller."""
    if operator is not None and torch.compiler.is_compiling():
        return operator()
    if autograd is not None and wants_gradient(*inputs):
        return autograd()
    return plain()
