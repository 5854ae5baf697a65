"""The selective scan and the causal conv of the Mamba mixer, with their optional CUDA kernels.

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t        (per channel d, state n)
    y_t = <h_t, C_t> + D * u_t,  then gated: y_t * silu(z_t)

`selective_scan`, `ssd_scan` and `causal_conv` are the entry points; which kernel runs is decided in them, from what
`load_kernels` found installed. On CUDA tensors:

    Mamba scan, from zero or from a cached state  mamba-ssm's CUDA `selective_scan_fn` (from a state: plus the exact
                                                  correction `initial_state_correction`, so no token is stepped in
                                                  Python); without it, samba-hf's own Triton scan
                                                  (`triton_scan_samba.py`: torch and Triton only)
    Mamba one-token step                         mamba-ssm's Triton `selective_state_update`; without it, samba-hf's
                                                  Triton scan
    Mamba-2 one-token step                       mamba-ssm's Triton `selective_state_update`; without it,
                                                  samba-hf's Triton scan over heads
    Mamba-2 (SSD) scan                           mamba-ssm's Triton `mamba_chunk_scan_combined` (takes a state);
                                                  without it, samba-hf's Triton scan over heads
    causal conv                                  causal-conv1d's `causal_conv1d_fn` / `causal_conv1d_update`;
                                                  without it, samba-hf's own Triton conv (`triton_conv_samba.py`),
                                                  outside torch.compile (a plain `nn.Conv1d` only: an
                                                  adapter-wrapped conv runs as a module)

Each fallback to PyTorch on a CUDA tensor is logged once, naming what runs instead and what to install. Under
torch.compile the scans are samba-hf's Triton operators whatever else is installed (mamba-ssm's kernels are not torch
operators, and a compiled decoding step must be one graph to run in CUDA graphs). mamba-ssm's
Triton ops are imported without running the package's `__init__` (which needs its compiled extension and the
Mamba-3 modules), so an install made without compiling (`MAMBA_SKIP_CUDA_BUILD=TRUE`) still gives them.

Testing switch: with `TRITON_INTERPRET=1` and `SAMBA_HF_INTERPRET_KERNELS=1` in the environment, CPU tensors take the
CUDA paths above, so that Triton's interpreter runs the installed Triton kernels on the CPU (tests/test_kernels.py;
slow: tiny shapes only). It also steps around three CUDA-only calls in the packages' Python wrappers
(`_interpreter_shims`). Without `TRITON_INTERPRET=1` it is ignored, with a warning.

On CPU tensors the scan runs the compiled C scan of `cpu_kernels_samba.py` (`selective_scan_cpu`, with its
backward; under `torch.compile` the operator `torch.ops.samba_hf.selective_scan_cpu`). Where it cannot be built, or
with `SAMBA_HF_SCAN=pytorch`, the PyTorch scan runs instead (the same recurrence, stepped per token in Python). On
CPU a plain `nn.Conv1d` runs as K shifted multiply-adds (`depthwise_causal_conv`).

Everything is computed in float32 whatever the input dtype; `y` comes back in the dtype of `u`, the final state
in float32.

Part of the remote code of a saved model: imports only torch, transformers and its siblings (the kernel packages
lazily).
"""

import importlib
import importlib.util
import os
import sys
import typing
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

from .cpu_kernels_samba import cpu_scan_available, selective_scan_cpu, selective_scan_cpu_states
from .kernels_samba import KERNEL_IMPLEMENTATIONS, exporting, resolve_kernel_implementation, wants_gradient

logger = logging.get_logger(__name__)

# Tokens whose discretised A and B*u are materialised at once: bounds the scan's extra memory to
# O(batch * _BLOCK * d_inner * d_state) whatever the sequence length.
_BLOCK = 64


def _interpret_kernels() -> bool:
    """The testing switch (see the module docstring), read once at import."""
    if os.environ.get("SAMBA_HF_INTERPRET_KERNELS", "") not in ("", "0"):
        if os.environ.get("TRITON_INTERPRET") == "1":
            return True
        logger.warning(
            "samba-hf: SAMBA_HF_INTERPRET_KERNELS is set without TRITON_INTERPRET=1; ignored (it sends CPU "
            "tensors to the CUDA kernels, which only Triton's interpreter can run on a CPU)"
        )
    return False


INTERPRET_KERNELS = _interpret_kernels()


class Kernels(typing.NamedTuple):
    """The installed kernels samba-hf can call (None where absent), and why each absent one is."""

    selective_scan_triton: Callable | None  # samba-hf's own (triton_scan_samba.py): needs only Triton
    ssd_scan_triton: Callable | None  # the same kernel over Mamba-2's heads
    ssd_chunked_triton: Callable | None  # samba-hf's chunked SSD: Mamba-2 inference in half precision
    causal_conv_triton: Callable | None  # samba-hf's own (triton_conv_samba.py): needs only Triton
    selective_scan_fn: Callable | None  # mamba-ssm, compiled CUDA (its extension `selective_scan_cuda`)
    selective_state_update: Callable | None  # mamba-ssm, Triton: one token, Mamba-1 and Mamba-2
    mamba_chunk_scan_combined: Callable | None  # mamba-ssm, Triton: Mamba-2's SSD
    causal_conv1d_fn: Callable | None  # causal-conv1d, compiled CUDA
    causal_conv1d_update: Callable | None
    missing: dict  # name -> the reason it is None


_KERNELS: Kernels | None = None

_INSTALL_MAMBA = (
    "install mamba-ssm with its CUDA extension (MAMBA_FORCE_BUILD=TRUE pip install mamba-ssm "
    "--no-build-isolation; from its main branch also MAMBA_KEEP_CUDA_BUILD=TRUE)"
)
_INSTALL_TRITON = "install triton (torch's CUDA wheels bring it)"
_INSTALL_CONV = "install causal-conv1d (CAUSAL_CONV1D_FORCE_BUILD=TRUE pip install causal-conv1d --no-build-isolation)"


def _import_mamba_ssm(module: str):
    """`mamba_ssm.<module>`, without running mamba_ssm/__init__.py (it imports the compiled scan and the Mamba-3
    modules, which the Triton ops need neither of): the package is set up from its spec, unexecuted, for the import,
    and taken out of sys.modules again, so that a later `import mamba_ssm` runs the real one."""
    if "mamba_ssm" in sys.modules:
        return importlib.import_module(f"mamba_ssm.{module}")
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None:
        raise ImportError("mamba-ssm is not installed")
    package = importlib.util.module_from_spec(spec)  # __path__ set, __init__ not run
    sys.modules["mamba_ssm"] = package
    try:
        return importlib.import_module(f"mamba_ssm.{module}")
    finally:
        if sys.modules.get("mamba_ssm") is package:
            del sys.modules["mamba_ssm"]


def load_kernels() -> Kernels:
    """What is installed, found once per process (`_KERNELS`; tests reset it to None to look again)."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    if INTERPRET_KERNELS:
        _interpreter_shims()
    found, missing = {}, {}

    def attempt(names, load):
        try:
            found.update(zip(names, load()))
        except Exception as error:  # not installed, built for another CUDA / torch, or without its extension
            missing.update(dict.fromkeys(names, f"{type(error).__name__}: {error}".splitlines()[0]))

    def cuda_scan():
        interface = _import_mamba_ssm("ops.selective_scan_interface")
        if getattr(interface, "selective_scan_cuda", None) is None:  # mamba-ssm's main branch: opt-in extension
            raise ImportError("mamba-ssm was installed without its CUDA extension selective_scan_cuda")
        return (interface.selective_scan_fn,)

    def conv():
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update

        return causal_conv1d_fn, causal_conv1d_update

    def triton_scans():
        from .triton_scan_samba import selective_scan_triton, ssd_chunked_triton, ssd_scan_triton

        if INTERPRET_KERNELS or torch.cuda.is_available():
            _check_scan(selective_scan_triton, "cpu" if INTERPRET_KERNELS else "cuda")
        return selective_scan_triton, ssd_scan_triton, ssd_chunked_triton

    def triton_conv():
        from .triton_conv_samba import causal_conv_triton

        if INTERPRET_KERNELS or torch.cuda.is_available():
            _check_conv(causal_conv_triton, "cpu" if INTERPRET_KERNELS else "cuda")
        return (causal_conv_triton,)

    attempt(["selective_scan_triton", "ssd_scan_triton", "ssd_chunked_triton"], triton_scans)
    attempt(["causal_conv_triton"], triton_conv)
    attempt(["selective_scan_fn"], cuda_scan)
    attempt(
        ["selective_state_update"],
        lambda: (_import_mamba_ssm("ops.triton.selective_state_update").selective_state_update,),
    )
    attempt(
        ["mamba_chunk_scan_combined"],
        lambda: (_import_mamba_ssm("ops.triton.ssd_combined").mamba_chunk_scan_combined,),
    )
    attempt(["causal_conv1d_fn", "causal_conv1d_update"], conv)
    _KERNELS = Kernels(**{name: found.get(name) for name in Kernels._fields[:-1]}, missing=missing)
    return _KERNELS


def _check_scan(scan, device: str):
    """Run samba-hf's Triton scan once on a few numbers against the PyTorch scan: on a GPU (or Triton release) it
    cannot compile for, or compiles wrongly for, it is then left out (and the fallback said once) instead of failing
    or answering wrongly. Raises a RuntimeError saying which."""
    g = torch.Generator(device=device).manual_seed(0)
    u, dt, B, C = (torch.rand(1, 3, 4, device=device, generator=g) for _ in range(4))
    A, h0 = -torch.rand(4, 4, device=device, generator=g), torch.rand(1, 4, 4, device=device, generator=g)
    results = zip(scan(u, dt, A, B, C, None, None, h0), selective_scan_pytorch(u, dt, A, B, C, None, None, h0))
    _require_agreement(results, 1e-4, "the PyTorch scan", u.device, floor=1.0)


def _check_conv(conv, device: str):
    """Run samba-hf's Triton conv once on a few numbers against `depthwise_causal_conv`, from a cached left context:
    where it cannot compile, or compiles wrongly, it is then left out (said once). Raises a RuntimeError saying so."""
    g = torch.Generator(device=device).manual_seed(0)
    window, weight, bias = (torch.rand(*shape, device=device, generator=g) for shape in ((1, 5, 7), (5, 4), (5,)))
    results = [(conv(window, weight, bias, 4), depthwise_causal_conv(weight, bias, window, 4))]
    _require_agreement(results, 1e-5, "the PyTorch conv", window.device, floor=1.0)


def _check_chunked_ssd(kernels: Kernels, x, B, D, h0):
    """Before the chunked SSD's first prompt in a compiled variant (`triton_scan_samba.ssd_chunked_variant`): a
    small problem of the caller's dtype, device, head size and states, with D and a starting state where the caller
    has them (two chunks and a part, two groups of two heads), through it and through samba-hf's Triton scan, which
    multiplies no matrices. Raises a RuntimeError where it gives other numbers (a GPU or Triton release compiling it
    wrongly)."""
    from .triton_scan_samba import SSD_CHUNK

    dtype, device, head_dim, d_state = x.dtype, x.device, x.shape[3], B.shape[3]
    g = torch.Generator(device=device).manual_seed(0)
    batch, length, heads, groups = 1, 2 * SSD_CHUNK + 5, 4, 2

    def rand(*shape):
        return torch.rand(*shape, device=device, generator=g)

    x, B, C = (
        (rand(*shape) - 0.5).to(dtype)
        for shape in (
            (batch, length, heads, head_dim),
            (batch, length, groups, d_state),
            (batch, length, groups, d_state),
        )
    )
    dt, A = rand(batch, length, heads) * 0.5, -rand(heads) - 0.1
    D = None if D is None else rand(heads)
    h0 = None if h0 is None else rand(batch, heads, head_dim, d_state)
    results = zip(kernels.ssd_chunked_triton(x, dt, A, B, C, D, h0), kernels.ssd_scan_triton(x, dt, A, B, C, D, h0))
    # products of 8 / 11 bits, relative to each result's size (y and the last state are well below 1 here); a
    # wrong kernel is off by far more
    _require_agreement(results, 6e-2 if dtype == torch.bfloat16 else 1e-2, "the scan", device, floor=0.0)


def _require_agreement(results, tolerance: float, reference: str, device: torch.device, floor: float):
    """For the load-time checks: every (got, want) pair within `tolerance` of the larger of `floor` and want's
    largest value, or a RuntimeError naming the reference and the device."""
    for got, want in results:
        got, want = got.float(), want.float()
        if not (got - want).abs().max() <= tolerance * want.abs().max().clamp(min=floor):
            where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            raise RuntimeError(f"it gives other numbers than {reference} on {where}")


def _fallback(kernel: str, runs: str, install: str):
    """Say once that `kernel` is not there, what runs instead, and what to install (not while torch.compile traces:
    the eager call before it has said it)."""
    if compiling():
        return
    reason = load_kernels().missing.get(kernel, "not installed")
    logger.warning_once(f"samba-hf: {kernel} is unavailable ({reason}); {runs}. For the fast path, {install}.")


def compiling() -> bool:
    """Whether torch.compile is tracing this call (its graphs take only torch operators, and no logging)."""
    return torch.compiler.is_compiling()


def kernel_device(device: torch.device) -> bool:
    """Whether tensors on `device` take the CUDA kernel paths: CUDA, or the CPU under the testing switch."""
    return device.type == "cuda" or (INTERPRET_KERNELS and device.type == "cpu")


def unavailable(part: str, choice: str, device: torch.device, mamba_version: int = 1) -> str | None:
    """Why `choice` cannot run `part` on `device` (None where it can): what is missing, and what to install."""
    if choice in ("auto", "pytorch") or part == "linear":  # linear: the C kernel where the CPU has one
        return None
    on_kernel_device = kernel_device(device)
    if choice == "mamba_ssm" and not on_kernel_device:
        return f"mamba-ssm's and causal-conv1d's kernels run on CUDA tensors only, and this one is on {device.type}"
    kernels = load_kernels()
    if choice == "mamba_ssm":
        needed = {
            "scan": "selective_scan_fn" if mamba_version == 1 else "mamba_chunk_scan_combined",
            "conv": "causal_conv1d_fn",
        }[part]
        if getattr(kernels, needed) is None:
            return f"{needed} is not installed ({kernels.missing.get(needed, 'not found')})"
        return None
    # "samba"
    if part == "scan":
        if on_kernel_device:
            needed = "selective_scan_triton" if mamba_version == 1 else "ssd_scan_triton"
            if getattr(kernels, needed) is None:
                return f"samba-hf's Triton scan is unavailable ({kernels.missing.get(needed, 'not found')})"
        elif mamba_version == 1 and not cpu_scan_available():
            return "samba-hf's C scan could not be built here (see the warning above; it needs a C compiler)"
        return None  # Mamba-2 on a CPU: its chunked PyTorch scan is samba-hf's only one
    if on_kernel_device and kernels.causal_conv_triton is None:  # the conv (on a CPU: multiply-adds, always there)
        return f"samba-hf's Triton conv is unavailable ({kernels.missing.get('causal_conv_triton', 'not found')})"
    return None


def require(part: str, choice: str, device: torch.device, mamba_version: int = 1):
    """A ValueError where `choice` cannot run `part` on `device`, naming what is missing and the choices."""
    why = unavailable(part, choice, device, mamba_version)
    if why is not None:
        raise ValueError(
            f"kernel_implementation asks for {choice!r} for the {part}, which cannot run here: {why}. Choose "
            f'another of {", ".join(map(repr, KERNEL_IMPLEMENTATIONS))} for it ("auto" takes what is installed).'
        )


def check_kernel_implementation(value, device: torch.device, mamba_version: int = 1) -> dict[str, str]:
    """`resolve_kernel_implementation`, and a ValueError for any part whose choice cannot run on `device`."""
    chosen = resolve_kernel_implementation(value)
    for part, choice in chosen.items():
        require(part, choice, device, mamba_version)
    return chosen


def _interpreter_shims():
    """Under the testing switch: what the packages' Python wrappers call that a CPU build of torch cannot answer, or
    that Triton's interpreter cannot do, answered for CPU tensors. `torch.cuda.device(None)` (a CPU tensor's device
    index) becomes a no-op; `torch.cuda.get_device_properties` of a CPU device reports one multiprocessor; and
    `triton.autotune` keeps the first of its pruned configs, since timing them needs a GPU driver. Set up once."""
    import contextlib
    import types

    from triton.runtime.autotuner import Autotuner

    if getattr(torch.cuda.device, "_samba_hf_shim", False):
        return
    cuda_device, properties, prune = torch.cuda.device, torch.cuda.get_device_properties, Autotuner.prune_configs

    def device_or_none(index):
        return contextlib.nullcontext() if index is None else cuda_device(index)

    def get_device_properties(device=None):
        if isinstance(device, torch.device) and device.type == "cpu":
            return types.SimpleNamespace(multi_processor_count=1, name="cpu (Triton interpreter)")
        return properties(device)

    device_or_none._samba_hf_shim = True
    torch.cuda.device, torch.cuda.get_device_properties = device_or_none, get_device_properties
    Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]


def selective_scan(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the recurrence over a sequence, starting from state `h0` (zeros when None).

    Shapes: u, dt, z (batch, seq, d_inner); A (d_inner, d_state); B, C (batch, seq, d_state); D (d_inner,);
    h0 (batch, d_inner, d_state). `dt` is the step size after softplus (a zero step leaves the state untouched,
    which is how padded positions are skipped). Returns y (batch, seq, d_inner) and the last state. `kernel`: the
    scan's choice of the kernel switch (`kernels_samba`), "auto" unless a model was told otherwise.
    """
    if exporting():
        return selective_scan_over_time(u, dt, A, B, C, D, z, h0)
    if kernel == "pytorch":
        return selective_scan_pytorch(u, dt, A, B, C, D, z, h0)
    if kernel != "auto" and not compiling():
        require("scan", kernel, u.device)
    if kernel_device(u.device):
        kernels = load_kernels()
        # mamba-ssm's kernels are not torch operators: under torch.compile (a decoding step in CUDA graphs) the graph
        # would break around them, so it takes samba-hf's Triton scan, which is one (`torch.ops.samba_hf.scan_triton`)
        if kernel != "samba" and not compiling():
            if h0 is not None and u.shape[1] == 1 and kernels.selective_state_update is not None:
                return _step_with_kernel(kernels.selective_state_update, u, dt, A, B, C, D, z, h0)
            if kernels.selective_scan_fn is not None:
                return _scan_with_kernel(kernels.selective_scan_fn, u, dt, A, B, C, D, z, h0)
        if kernels.selective_scan_triton is not None:
            if kernel == "auto" and not compiling():
                logger.info_once(
                    "samba-hf: the Mamba scan runs samba-hf's Triton kernel (mamba-ssm's CUDA scan: "
                    f"{kernels.missing.get('selective_scan_fn')}; to use that one, {_INSTALL_MAMBA})"
                )
            return kernels.selective_scan_triton(u, dt, A, B, C, D, z, h0)
        _fallback(
            "selective_scan_triton",
            "the Mamba scan runs in PyTorch, a Python step per token (slow on a GPU)",
            _INSTALL_TRITON,
        )
    elif _takes_cpu_scan(u, kernel):
        return selective_scan_cpu(u, dt, A, B, C, D, z, h0)
    return selective_scan_pytorch(u, dt, A, B, C, D, z, h0)


def _takes_cpu_scan(u: torch.Tensor, kernel: str) -> bool:
    """Whether `selective_scan` runs the compiled CPU scan for these inputs and choice of the kernel switch."""
    return kernel != "pytorch" and u.device.type == "cpu" and cpu_scan_available()


def selective_scan_pytorch(u, dt, A, B, C, D=None, z=None, h0=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference path: per block, exp(dt*A) and dt*B*u for all its tokens at once, then the recurrence token by
    token. Each step multiplies by a decay in (0, 1]: nothing overflows or underflows, at any length."""
    batch, seq_len, d_inner = u.shape
    A = A.float()
    h = torch.zeros(batch, d_inner, A.shape[-1], device=u.device, dtype=torch.float32) if h0 is None else h0.float()
    ys = []
    for start in range(0, seq_len, _BLOCK):
        u_blk = u[:, start : start + _BLOCK].float()
        dt_blk = dt[:, start : start + _BLOCK].float()
        decay = torch.exp(dt_blk[..., None] * A)  # (b, t, d, n)
        inject = (dt_blk * u_blk)[..., None] * B[:, start : start + _BLOCK, None, :].float()  # (b, t, d, n)
        if torch.is_grad_enabled() and (inject.requires_grad or h.requires_grad):
            # autograd cannot record out= writes. unbind, not inject[:, t]: the backward of each index would
            # allocate and zero a whole block (quadratic in the block length); unbind's backward is one stack.
            states = []
            for inject_t, decay_t in zip(inject.unbind(1), decay.unbind(1)):
                h = torch.addcmul(inject_t, decay_t, h)
                states.append(h)
            states = torch.stack(states, dim=1)
        else:
            states = torch.empty_like(inject)  # (b, t, d, n): h_t = decay_t * h_{t-1} + inject_t, in place
            for t in range(u_blk.shape[1]):
                h = torch.addcmul(inject[:, t], decay[:, t], h, out=states[:, t])
        ys.append(torch.einsum("btdn,btn->btd", states, C[:, start : start + _BLOCK].float()))
    y = torch.cat(ys, dim=1) if ys else u.new_zeros(batch, 0, d_inner, dtype=torch.float32)
    if D is not None:
        y = y + u.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(u.dtype), h


def selective_scan_over_time(u, dt, A, B, C, D=None, z=None, h0=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`selective_scan_pytorch`'s recurrence as one of torch's `scan` operators over the tokens: what an exported
    program holds (torch.export, ExecuTorch, ONNX), which runs at any length, where a Python loop would be unrolled
    at the traced one. Each token's decay and input are computed in its step, so memory does not grow with the
    length. The same numbers as `selective_scan_pytorch` but for the order of the sum over d_state."""
    from torch._higher_order_ops.scan import scan

    batch, _, d_inner = u.shape
    A = A.float()
    h = torch.zeros(batch, d_inner, A.shape[-1], device=u.device, dtype=torch.float32) if h0 is None else h0.float()

    def step(h, token):
        u_t, dt_t, B_t, C_t = token  # (b, d), (b, d), (b, n), (b, n)
        h = torch.addcmul((dt_t * u_t)[..., None] * B_t[:, None, :], torch.exp(dt_t[..., None] * A), h)
        return h, (h * C_t[:, None, :]).sum(-1)

    over_time = [t.float().transpose(0, 1) for t in (u, dt, B, C)]  # (seq, batch, ...)
    h, y = scan(step, h, over_time)
    y = y.transpose(0, 1)  # (b, t, d)
    if D is not None:
        y = y + u.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(u.dtype), h


def scan_keeping_states(scan: Callable, h0: torch.Tensor | None, per_token: dict, **fixed):
    """`scan` (`selective_scan` or `ssd_scan`) keeping the state after each token: what a recording forward (assisted
    generation's check of drafted tokens) hands its cache, to take the layer back to any of those tokens. Where
    `selective_scan` runs the compiled CPU scan, one call of it keeps them all (inference); elsewhere the scan runs one
    token at a time, as decoding steps run it. Either way each token gets the numbers of its one-token step, as plain
    decoding would. `per_token`: the arguments with a sequence dimension (dim 1; None for an absent one). Returns y
    (the tokens' outputs), the last state and the list of states."""
    if (
        scan is selective_scan
        and _takes_cpu_scan(per_token["u"], fixed.get("kernel", "auto"))
        and not compiling()
        and not wants_gradient(h0, *per_token.values(), *(v for v in fixed.values() if isinstance(v, torch.Tensor)))
    ):
        options = {name: value for name, value in fixed.items() if name != "kernel"}
        y, h, states = selective_scan_cpu_states(**per_token, **options, h0=h0)
        return y.to(per_token["u"].dtype), h, list(states.unbind(1))
    length = next(value for value in per_token.values() if value is not None).shape[1]
    outputs, states = [], []
    for t in range(length):
        step = {name: None if value is None else value[:, t : t + 1] for name, value in per_token.items()}
        y, h0 = scan(**step, **fixed, h0=h0)
        outputs.append(y)
        states.append(h0)
    return torch.cat(outputs, dim=1), h0, states


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    h0: torch.Tensor | None = None,
    chunk_size: int = 128,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's state space recurrence (SSD), per head h of group g = h // (heads / groups):

        S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T        (S: head_dim x d_state)
        y_t = S_t C_t + D_h * x_t

    Shapes: x (batch, seq, heads, head_dim); dt (batch, seq, heads), after softplus (a zero step skips a padded
    position); A, D (heads,); B, C (batch, seq, groups, d_state); h0 (batch, heads, head_dim, d_state) or None.
    Returns y (batch, seq, heads, head_dim) in x's dtype and the last state in float32. On CUDA with mamba-ssm:
    `mamba_chunk_scan_combined` (any length, from h0 too) and `selective_state_update` (one token from h0); with
    Triton alone samba-hf's chunked SSD for inference on a half-precision prompt (`_takes_chunked_ssd`), its scan
    over heads otherwise; elsewhere `ssd_scan_pytorch`. `kernel`: as `selective_scan`'s.
    """
    if exporting():
        return ssd_scan_over_time(x, dt, A, B, C, D, h0)
    if kernel == "pytorch":
        return ssd_scan_pytorch(x, dt, A, B, C, D, h0, chunk_size)
    if kernel != "auto" and not compiling():
        require("scan", kernel, x.device, mamba_version=2)
    if kernel_device(x.device):
        kernels = load_kernels()
        step = x.shape[1] == 1 and h0 is not None and kernels.selective_state_update is not None
        if step and kernel != "samba" and not compiling():
            return _ssd_step_with_kernel(kernels.selective_state_update, x, dt, A, B, C, D, h0)
        if kernels.mamba_chunk_scan_combined is not None and kernel != "samba" and not compiling():  # (see above)
            # dt stays float32 (the kernels read it so; a bf16 copy would round every step)
            y, last = kernels.mamba_chunk_scan_combined(
                x,
                dt.float(),
                A.float(),
                B.to(x.dtype),
                C.to(x.dtype),
                chunk_size,
                D=None if D is None else D.float(),
                initial_states=None if h0 is None else h0.float(),
                dt_softplus=False,
                return_final_states=True,
            )
            return y.to(x.dtype), last.float()
        if kernels.ssd_scan_triton is not None:
            if kernels.ssd_chunked_triton is not None and _takes_chunked_ssd(x, dt, A, B, C, D, h0):
                results = _chunked_ssd(kernels, x, dt, A, B, C, D, h0)
                if results is not None:
                    return results
            return kernels.ssd_scan_triton(x, dt, A, B, C, D, h0)
        _fallback("ssd_scan_triton", "the Mamba-2 scan runs in PyTorch, a chunk at a time", _INSTALL_TRITON)
    return ssd_scan_pytorch(x, dt, A, B, C, D, h0, chunk_size)


# Mamba-2 inference in bf16 / fp16 on at least SSD_MIN_TOKENS tokens takes samba-hf's chunked SSD; the decoding step,
# a gradient, float32 (its products would be TF32, or spill registers) and torch.compile the scan.
SSD_MIN_TOKENS = 16
_CHUNKED_SSD_CHECKED: set = set()  # the compiled variants that passed `_check_chunked_ssd`, in this process
_CHUNKED_SSD_FAILED: set = set()  # the dtypes the chunked SSD failed in (the scan serves them, said once)


def _takes_chunked_ssd(x, dt, A, B, C, D, h0) -> bool:
    """Whether a Mamba-2 scan on CUDA takes samba-hf's chunked SSD (see SSD_MIN_TOKENS); asked only where it loaded."""
    return (
        x.shape[1] >= SSD_MIN_TOKENS
        and x.dtype in (torch.bfloat16, torch.float16)
        and not wants_gradient(x, dt, A, B, C, D, h0)
        and x.dtype not in _CHUNKED_SSD_FAILED
        and not compiling()
    )


def _chunked_ssd(kernels: Kernels, x, dt, A, B, C, D, h0):
    """The chunked SSD's results, each compiled variant checked once before its first prompt (`_check_chunked_ssd`);
    None where it fails or differs: the scan then serves that dtype, said once."""
    from .triton_scan_samba import ssd_chunked_variant

    try:
        variant = ssd_chunked_variant(x, B, D, h0)
        if variant not in _CHUNKED_SSD_CHECKED:
            _check_chunked_ssd(kernels, x, B, D, h0)
            _CHUNKED_SSD_CHECKED.add(variant)
        return kernels.ssd_chunked_triton(x, dt, A, B, C, D, h0)
    except Exception as error:  # a GPU whose compiler takes no products in this dtype (bf16 before sm_80), or
        # compiles them wrongly
        _CHUNKED_SSD_FAILED.add(x.dtype)
        logger.warning_once(
            f"samba-hf: the chunked SSD does not run in {x.dtype} here ({type(error).__name__}: "
            f"{str(error).strip()[:300]}); Mamba-2 prompts in it take samba-hf's Triton scan instead (slower, the "
            "same numbers)"
        )
        return None


def ssd_scan_pytorch(x, dt, A, B, C, D=None, h0=None, chunk_size=128) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD in its chunked matrix form, in float32, one chunk of `chunk_size` tokens at a time (Python runs per chunk,
    never per token; the largest tensors are (batch, chunk, chunk, heads) and one state, whatever the length).
    Within a chunk, with a_t = dt_t * A (<= 0) and cum_i = a_1 + ... + a_i:

        y_i = sum_{j <= i} exp(cum_i - cum_j) dt_j (C_i . B_j) x_j  +  exp(cum_i) C_i S_0     (S_0: the incoming state)
        S   = exp(cum_last) S_0 + sum_j exp(cum_last - cum_j) dt_j x_j B_j^T

    Every exponent is <= 0, so nothing overflows at any length."""
    batch, seq_len, heads, head_dim = x.shape
    groups, d_state = B.shape[2:]
    per_group = heads // groups
    A = A.float()
    state = x.new_zeros(batch, heads, head_dim, d_state, dtype=torch.float32) if h0 is None else h0.float()
    # heads as (groups, heads per group): a head's B and C are its group's, without repeating them per head
    state = state.view(batch, groups, per_group, head_dim, d_state)
    y = x.new_empty(batch, seq_len, groups, per_group, head_dim, dtype=torch.float32)
    for start in range(0, seq_len, chunk_size):
        end = min(start + chunk_size, seq_len)
        xc = x[:, start:end].float().view(batch, -1, groups, per_group, head_dim)  # (b, q, g, r, p)
        dtc = dt[:, start:end].float().view(batch, -1, groups, per_group)  # (b, q, g, r)
        Bc, Cc = B[:, start:end].float(), C[:, start:end].float()  # (b, q, g, n)
        cum = torch.cumsum(dtc * A.view(groups, per_group), dim=1)  # (b, q, g, r)
        # decay from position j to position i (i >= j): exp(cum_i - cum_j), zero above the diagonal
        length = end - start
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        segment = (cum[:, :, None] - cum[:, None]).masked_fill(~causal[None, :, :, None, None], float("-inf"))
        scores = torch.einsum("bign,bjgn->bijg", Cc, Bc)[..., None] * segment.exp() * dtc[:, None]  # (b, i, j, g, r)
        from_state = torch.einsum("bign,bgrpn->bigrp", Cc, state) * cum.exp()[..., None]
        y[:, start:end] = torch.einsum("bijgr,bjgrp->bigrp", scores, xc) + from_state
        to_end = (cum[:, -1:] - cum).exp() * dtc  # (b, q, g, r)
        state = state * cum[:, -1].exp()[..., None, None] + torch.einsum(
            "bjgrp,bjgn->bgrpn", xc * to_end[..., None], Bc
        )
    y = y.view(batch, seq_len, heads, head_dim)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype), state.view(batch, heads, head_dim, d_state)


def ssd_scan_over_time(x, dt, A, B, C, D=None, h0=None) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD token by token (`ssd_scan`'s recurrence) as one of torch's `scan` operators over the tokens: what an
    exported program holds, at any length (`selective_scan_over_time`). Equal to `ssd_scan_pytorch` up to the
    order of its sums."""
    from torch._higher_order_ops.scan import scan

    batch, _, heads, head_dim = x.shape
    groups, d_state = B.shape[2:]
    per_group = heads // groups
    A = A.float().view(groups, per_group)
    state = x.new_zeros(batch, heads, head_dim, d_state, dtype=torch.float32) if h0 is None else h0.float()
    state = state.view(batch, groups, per_group, head_dim, d_state)  # a head's B and C are its group's

    def step(state, token):
        x_t, dt_t, B_t, C_t = token  # (b, g, r, p), (b, g, r), (b, g, n), (b, g, n)
        state = (
            state * torch.exp(dt_t * A)[..., None, None]
            + (x_t * dt_t[..., None])[..., None] * B_t[:, :, None, None, :]
        )
        return state, (state * C_t[:, :, None, None, :]).sum(-1)

    over_time = [
        x.float().view(batch, -1, groups, per_group, head_dim).transpose(0, 1),
        dt.float().view(batch, -1, groups, per_group).transpose(0, 1),
        B.float().transpose(0, 1),
        C.float().transpose(0, 1),
    ]
    state, y = scan(step, state, over_time)
    y = y.transpose(0, 1).reshape(x.shape)  # (b, t, heads, head_dim)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype), state.view(batch, heads, head_dim, d_state)


def _ssd_step_with_kernel(state_update_fn, x, dt, A, B, C, D, h0):
    # mamba-ssm's Mamba-2 step: per-channel arguments with the head's values repeated over head_dim (and d_state),
    # as stride-0 views: the kernel then reads one dt, A and dt_bias per head (its TIE_HDIM path)
    heads, head_dim, d_state = h0.shape[1:]
    state = h0.float().clone()  # updated in place by the kernel: (b, h, p, n)
    y = state_update_fn(
        state,
        x[:, 0],
        dt[:, 0, :, None].expand(-1, heads, head_dim).float(),
        A.float()[:, None, None].expand(heads, head_dim, d_state),
        B[:, 0].to(x.dtype),
        C[:, 0].to(x.dtype),
        D=None if D is None else D.float()[:, None].expand(heads, head_dim),
        # a zero bias, not None: mamba-ssm (2.3.2.post1 and main) reads dt_bias.stride in its launch whatever it is
        dt_bias=_zeros(heads, x.device)[:, None].expand(heads, head_dim),
        dt_softplus=False,
    )
    return y[:, None].to(x.dtype), state


def _zeros(size: int, device: torch.device) -> torch.Tensor:
    """A float32 zero vector, made once per size and device (a decoding step must not allocate one per layer)."""
    key = (size, device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(size, device=device)
    return _ZEROS[key]


_ZEROS: dict = {}


def _scan_with_kernel(scan_fn, u, dt, A, B, C, D, z, h0):
    """mamba-ssm's `selective_scan_fn`, which starts from a zero state; from `h0`, plus `initial_state_correction`."""

    # mamba-ssm wants channels before time, u, delta, z (b, d, l) and B, C (b, n, l), all in u's dtype; A and D
    # float32.
    def channels_first(x):
        return x.transpose(1, 2).to(u.dtype).contiguous()

    y, last_state = scan_fn(
        channels_first(u),
        channels_first(dt),
        A.float().contiguous(),
        channels_first(B),
        channels_first(C),
        None if D is None else D.float(),
        None if z is None else channels_first(z),
        delta_bias=None,
        delta_softplus=False,
        return_last_state=True,
    )
    y, last_state = y.transpose(1, 2), last_state.float()
    if h0 is None:
        return y.to(u.dtype), last_state
    # the kernel rounds dt to u's dtype: the correction reads the same steps
    from_state, carried = initial_state_correction(dt.to(u.dtype), A, C, h0)
    if z is not None:
        from_state = from_state * F.silu(z.float())  # the gate is linear in y
    return (y.float() + from_state).to(u.dtype), last_state + carried


def initial_state_correction(dt, A, C, h0) -> tuple[torch.Tensor, torch.Tensor]:
    """What starting from `h0` instead of zeros adds to the scan (it is linear in the state): with
    elapsed_t = dt_1 + ... + dt_t per channel,

        y_t  += sum_n C_t[n] exp(A[d, n] elapsed_t[d]) h0[d, n]       (before D and the gate)
        h_L  += exp(A[d, n] elapsed_L[d]) h0[d, n]

    Every exponent is <= 0 (A < 0, dt >= 0). dt (b, l, d); A (d, n); C (b, l, n); h0 (b, d, n). Returns
    (b, l, d) and (b, d, n), float32; a loop over the d_state states keeps the memory at O(b * l * d)."""
    elapsed = torch.cumsum(dt.float(), dim=1)  # (b, l, d)
    A, C, h0 = A.float(), C.float(), h0.float()
    from_state = torch.zeros_like(elapsed)
    for n in range(A.shape[1]):
        from_state += torch.exp(elapsed * A[:, n]) * h0[:, None, :, n] * C[:, :, n, None]
    return from_state, h0 * torch.exp(elapsed[:, -1, :, None] * A)


def _step_with_kernel(state_update_fn, u, dt, A, B, C, D, z, h0):
    state = h0.float().clone()  # updated in place by the kernel: (b, d, n)
    y = state_update_fn(
        state,
        u[:, 0],
        dt[:, 0],
        A.float(),
        B[:, 0],
        C[:, 0],
        D=None if D is None else D.float(),
        z=None if z is None else z[:, 0],
        # a zero bias, not None: mamba-ssm (2.3.2.post1 and main) unpacks dt_bias.stride() in its launch whatever it is
        dt_bias=_zeros(u.shape[-1], u.device),
        dt_softplus=False,
    )
    return y[:, None].to(u.dtype), state


def depthwise_causal_conv(weight: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor, seq_len: int):
    """What `nn.Conv1d(d, d, K, groups=d, padding=K-1)` gives at the last `seq_len` positions of `window`, as K
    shifted multiply-adds: out[t] = bias + sum_k weight[:, k] * x[t - (K - 1 - k)], zero before the window starts.
    weight (d_inner, K); window (batch, d_inner, T) with any strides. The elementwise ops keep the window's memory
    layout, so a window that is a transposed (batch, seq, d_inner) tensor gives an output whose transpose back is
    contiguous: no transposing copy on the way in or out (on CPU each one would cost more than the conv itself)."""
    kernel_size, length = weight.shape[-1], window.shape[-1]
    start = length - seq_len  # the first new position in the window
    # the tap on the current input; half precision accumulates in float32 (as a conv kernel does)
    last_tap = weight[:, kernel_size - 1, None]
    out = window[..., start:] * (last_tap.float() if last_tap.dtype in (torch.float16, torch.bfloat16) else last_tap)
    for k in range(kernel_size - 1):
        shift = kernel_size - 1 - k  # tap k reads the input `shift` positions back
        first = max(0, shift - start)  # outputs before `first` read zeros there
        if first < seq_len:
            out[..., first:].addcmul_(window[..., start + first - shift : length - shift], weight[:, k, None])
    if bias is not None:
        out = out + bias[:, None]
    return out.to(window.dtype)


def causal_conv(conv1d: nn.Conv1d, window: torch.Tensor, seq_len: int, kernel: str = "auto") -> torch.Tensor:
    """The depthwise causal conv's outputs at the last `seq_len` positions of `window` (batch, d_inner, T), which
    holds the cached left context (if any) followed by the new inputs. Returns (batch, d_inner, seq_len). `kernel`:
    the conv's choice of the kernel switch (`kernels_samba`); "pytorch" runs the Conv1d module."""
    plain = type(conv1d) is nn.Conv1d  # an adapter-wrapped conv must run as a module
    if exporting():
        kernel = "pytorch"
    if kernel != "auto" and plain and not compiling():
        require("conv", kernel, window.device)
    if kernel != "pytorch" and plain and kernel_device(window.device):
        kernels = load_kernels()
        weight = conv1d.weight[:, 0, :]  # (d_inner, kernel_size)
        if kernels.causal_conv1d_fn is not None and kernel != "samba":
            if seq_len == 1 and window.shape[-1] >= conv1d.kernel_size[0]:
                # causal_conv1d_update(x (b, d), conv_state (b, d, >= K - 1)): the state is shifted in place (a copy)
                state = window[..., :-1].contiguous()
                return kernels.causal_conv1d_update(window[..., -1], state, weight, conv1d.bias, activation=None)[
                    ..., None
                ]
            # causal_conv1d_fn(x (b, d, l), weight (d, K)): zero left padding, every position
            return kernels.causal_conv1d_fn(window.contiguous(), weight, conv1d.bias, activation=None)[..., -seq_len:]
        if kernels.causal_conv_triton is not None and not compiling():  # (compiled: the Conv1d below, by Inductor)
            return kernels.causal_conv_triton(window, weight, conv1d.bias, seq_len)
        if kernels.causal_conv_triton is None:
            _fallback(
                "causal_conv1d_fn",
                "the Mamba conv runs as a PyTorch Conv1d (samba-hf's Triton conv is "
                f"unavailable too: {kernels.missing.get('causal_conv_triton', 'not installed')})",
                _INSTALL_CONV,
            )
    elif kernel != "pytorch" and plain:
        return depthwise_causal_conv(conv1d.weight[:, 0, :], conv1d.bias, window, seq_len)
    return conv1d(window)[..., : window.shape[-1]][..., -seq_len:]
