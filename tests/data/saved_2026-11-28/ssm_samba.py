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

On CPU tensors the scan runs a compiled C scan (`_CPU_SCAN_SOURCE` below, with its backward): one pass over time that
holds each channel's state in registers, with no (time, channel, state) tensor and no Python per token. It is built
once per machine with the system's C compiler (`cc`, or `$CC`) into `~/.cache/samba_hf` (`$SAMBA_HF_CACHE`) and
loaded with ctypes. Under `torch.compile` it is the operator `torch.ops.samba_hf.selective_scan_cpu` (with its
backward), which dynamo keeps as one call. Where there is no compiler, or with `SAMBA_HF_SCAN=pytorch`, the PyTorch
scan runs instead (the same recurrence, stepped per token in Python). On CPU a plain `nn.Conv1d` runs as K shifted
multiply-adds (`depthwise_causal_conv`).

Everything is computed in float32 whatever the input dtype; `y` comes back in the dtype of `u`, the final state
in float32.

Part of the remote code of a saved model: imports only torch and transformers (the kernel packages lazily).
"""

import ctypes
import hashlib
import importlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import typing
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Tokens whose discretised A and B*u are materialised at once: bounds the scan's extra memory to
# O(batch * _BLOCK * d_inner * d_state) whatever the sequence length. 64 measured fastest here (32-128 within 10%).
_BLOCK = 64


def _interpret_kernels() -> bool:
    """The testing switch (see the module docstring), read once at import."""
    if os.environ.get("SAMBA_HF_INTERPRET_KERNELS", "") not in ("", "0"):
        if os.environ.get("TRITON_INTERPRET") == "1":
            return True
        logger.warning("samba-hf: SAMBA_HF_INTERPRET_KERNELS is set without TRITON_INTERPRET=1; ignored (it sends CPU "
                       "tensors to the CUDA kernels, which only Triton's interpreter can run on a CPU)")
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

_INSTALL_MAMBA = ("install mamba-ssm with its CUDA extension (MAMBA_FORCE_BUILD=TRUE pip install mamba-ssm "
                  "--no-build-isolation; from its main branch also MAMBA_KEEP_CUDA_BUILD=TRUE)")
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
    attempt(["selective_state_update"],
            lambda: (_import_mamba_ssm("ops.triton.selective_state_update").selective_state_update,))
    attempt(["mamba_chunk_scan_combined"],
            lambda: (_import_mamba_ssm("ops.triton.ssd_combined").mamba_chunk_scan_combined,))
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

    x, B, C = ((rand(*shape) - 0.5).to(dtype) for shape in ((batch, length, heads, head_dim),
                                                             (batch, length, groups, d_state),
                                                             (batch, length, groups, d_state)))
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


def _kernel_device(tensor: torch.Tensor) -> bool:
    """Whether a tensor takes the CUDA kernel paths: a CUDA tensor, or any CPU tensor under the testing switch."""
    return tensor.is_cuda or (INTERPRET_KERNELS and tensor.device.type == "cpu")


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the recurrence over a sequence, starting from state `h0` (zeros when None).

    Shapes: u, dt, z (batch, seq, d_inner); A (d_inner, d_state); B, C (batch, seq, d_state); D (d_inner,);
    h0 (batch, d_inner, d_state). `dt` is the step size after softplus (a zero step leaves the state untouched,
    which is how padded positions are skipped). Returns y (batch, seq, d_inner) and the last state.
    """
    if _kernel_device(u):
        kernels = load_kernels()
        # mamba-ssm's kernels are not torch operators: under torch.compile (a decoding step in CUDA graphs) the graph
        # would break around them, so it takes samba-hf's Triton scan, which is one (`torch.ops.samba_hf.scan_triton`)
        if h0 is not None and u.shape[1] == 1 and kernels.selective_state_update is not None and not compiling():
            return _step_with_kernel(kernels.selective_state_update, u, dt, A, B, C, D, z, h0)
        if kernels.selective_scan_fn is not None and not compiling():
            return _scan_with_kernel(kernels.selective_scan_fn, u, dt, A, B, C, D, z, h0)
        if kernels.selective_scan_triton is not None:
            if not compiling():
                logger.info_once("samba-hf: the Mamba scan runs samba-hf's Triton kernel (mamba-ssm's CUDA scan: "
                                 f"{kernels.missing.get('selective_scan_fn')}; to use that one, {_INSTALL_MAMBA})")
            return kernels.selective_scan_triton(u, dt, A, B, C, D, z, h0)
        _fallback("selective_scan_triton", "the Mamba scan runs in PyTorch, a Python step per token (slow on a GPU)",
                  _INSTALL_TRITON)
    elif u.device.type == "cpu" and cpu_scan_available():
        return selective_scan_cpu(u, dt, A, B, C, D, z, h0)
    return selective_scan_pytorch(u, dt, A, B, C, D, z, h0)


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


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    h0: torch.Tensor | None = None,
    chunk_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's state space recurrence (SSD), per head h of group g = h // (heads / groups):

        S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T        (S: head_dim x d_state)
        y_t = S_t C_t + D_h * x_t

    Shapes: x (batch, seq, heads, head_dim); dt (batch, seq, heads), after softplus (a zero step skips a padded
    position); A, D (heads,); B, C (batch, seq, groups, d_state); h0 (batch, heads, head_dim, d_state) or None.
    Returns y (batch, seq, heads, head_dim) in x's dtype and the last state in float32. On CUDA with mamba-ssm:
    `mamba_chunk_scan_combined` (any length, from h0 too) and `selective_state_update` (one token from h0); with
    Triton alone samba-hf's chunked SSD for inference on a half-precision prompt (`_takes_chunked_ssd`), its scan
    over heads otherwise; elsewhere `ssd_scan_pytorch`.
    """
    if _kernel_device(x):
        kernels = load_kernels()
        if x.shape[1] == 1 and h0 is not None and kernels.selective_state_update is not None and not compiling():
            return _ssd_step_with_kernel(kernels.selective_state_update, x, dt, A, B, C, D, h0)
        if kernels.mamba_chunk_scan_combined is not None and not compiling():  # (see selective_scan)
            # dt stays float32 (the kernels read it so; a bf16 copy would round every step)
            y, last = kernels.mamba_chunk_scan_combined(
                x, dt.float(), A.float(), B.to(x.dtype), C.to(x.dtype), chunk_size,
                D=None if D is None else D.float(), initial_states=None if h0 is None else h0.float(),
                dt_softplus=False, return_final_states=True,
            )
            return y.to(x.dtype), last.float()
        if kernels.ssd_scan_triton is not None:
            if kernels.ssd_chunked_triton is not None and _takes_chunked_ssd(x, dt, A, B, C, D, h0):
                results = _chunked_ssd(kernels, x, dt, A, B, C, D, h0)
                if results is not None:
                    return results
            return kernels.ssd_scan_triton(x, dt, A, B, C, D, h0)
        _fallback("ssd_scan_triton", "the Mamba-2 scan runs in PyTorch, a chunk at a time",
                  _INSTALL_TRITON)
    return ssd_scan_pytorch(x, dt, A, B, C, D, h0, chunk_size)


# Mamba-2 inference in bf16 / fp16 on at least SSD_MIN_TOKENS tokens takes samba-hf's chunked SSD; the decoding step,
# a gradient, float32 (its products would be TF32, or spill: ptxas, 6-38 KB a thread) and torch.compile the scan.
SSD_MIN_TOKENS = 16
_CHUNKED_SSD_CHECKED: set = set()  # the compiled variants that passed `_check_chunked_ssd`, in this process
_CHUNKED_SSD_FAILED: set = set()  # the dtypes the chunked SSD failed in (the scan serves them, said once)


def _takes_chunked_ssd(x, dt, A, B, C, D, h0) -> bool:
    """Whether a Mamba-2 scan on CUDA takes samba-hf's chunked SSD (see SSD_MIN_TOKENS); asked only where it loaded."""
    from .triton_scan_samba import _wants_gradient

    return (x.shape[1] >= SSD_MIN_TOKENS and x.dtype in (torch.bfloat16, torch.float16)
            and not _wants_gradient(x, dt, A, B, C, D, h0) and x.dtype not in _CHUNKED_SSD_FAILED and not compiling())


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
            "same numbers)")
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


_CPU_SCAN_SOURCE = r"""
/* The selective scan on CPU: one pass over time, CHANNELS channels at a time, their state held in a small local
   array (laid out state-major, so the loops over channels vectorise), no (time, channel, state) tensor anywhere.
   Arrays are float32 and C-contiguous: u, dt, z, y (batch, T, D); B, C (batch, T, N); A (D, N); Dskip (D);
   h (batch, D, N). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define CH 16         /* channels per block */
#define SEGMENT 64    /* the forward keeps the state every SEGMENT steps; the backward recomputes from there */

/* exp(x) for x <= 0 (x = dt * A), within 2 ulp: 2^k exp(r), r = x - k ln2 in [-ln2/2, ln2/2], degree-7 Taylor.
   Below -86 (a decay under 5e-38, which has wiped the state) it returns exp(-86), so 2^k stays a normal float. */
static inline float exp_nonpositive(float x) {
    x = x < -86.0f ? -86.0f : x;
    float kf = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* x / ln2 rounded to nearest */
    float r = x - kf * 0.693145751953125f - kf * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, 4);
    bits += ((int32_t)kf) << 23;
    memcpy(&p, &bits, 4);
    return p;
}

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

typedef struct {
    int batch, T, D, N;
    const float *u, *dt, *A, *B, *C, *Dskip, *z, *grad_y, *grad_h_last;
    float *h, *y, *checkpoints; /* checkpoints (batch, segments, D, N): the state before steps 0, SEGMENT, ... */
    float *grad_u, *grad_dt, *grad_A, *grad_B, *grad_C, *grad_D, *grad_z, *grad_h0;
    int d_begin, d_end, failed;
} Task;

/* one block's inputs at step t, zero past the last channel (dt = 0 leaves a padded lane's state at 0) */
static inline void load(const float *src, size_t offset, int width, float *out) {
    for (int c = 0; c < CH; c++) out[c] = c < width ? src[offset + c] : 0.0f;
}

/* h (N, CH) <- exp(dt A) h + dt u B, for one step */
static inline void step(int N, const float *At, const float *dtv, const float *du, const float *Bt, float *h) {
    for (int n = 0; n < N; n++) {
        const float Bn = Bt[n];
        float *hn = h + n * CH;
        const float *An = At + n * CH;
#pragma omp simd
        for (int c = 0; c < CH; c++) hn[c] = exp_nonpositive(dtv[c] * An[c]) * hn[c] + du[c] * Bn;
    }
}

/* h (N, CH) <- exp(dt A) h_prev + dt u B, keeping the decays exp(dt A) (N, CH) */
static inline void step_keeping_decays(int N, const float *At, const float *dtv, const float *du, const float *Bt,
                                       const float *h_prev, float *h, float *decay) {
    for (int n = 0; n < N; n++) {
        const float Bn = Bt[n];
#pragma omp simd
        for (int c = 0; c < CH; c++) {
            decay[n * CH + c] = exp_nonpositive(dtv[c] * At[n * CH + c]);
            h[n * CH + c] = decay[n * CH + c] * h_prev[n * CH + c] + du[c] * Bn;
        }
    }
}

static void forward_block(const Task *a, int b, int d0, float *At, float *h) {
    const int T = a->T, D = a->D, N = a->N, W = a->d_end - d0 < CH ? a->d_end - d0 : CH;
    const int segments = (T + SEGMENT - 1) / SEGMENT;
    for (int n = 0; n < N; n++)
        for (int c = 0; c < CH; c++) {
            At[n * CH + c] = c < W ? a->A[(size_t)(d0 + c) * N + n] : 0.0f;
            h[n * CH + c] = c < W ? a->h[((size_t)b * D + d0 + c) * N + n] : 0.0f;
        }
    float dtv[CH], uv[CH], du[CH], acc[CH];
    for (int t = 0; t < T; t++) {
        const size_t row = (size_t)b * T + t, at = row * D + d0;
        if (a->checkpoints && t % SEGMENT == 0)
            for (int n = 0; n < N; n++)
                for (int c = 0; c < W; c++)
                    a->checkpoints[(((size_t)b * segments + t / SEGMENT) * D + d0 + c) * N + n] = h[n * CH + c];
        load(a->dt, at, W, dtv);
        load(a->u, at, W, uv);
        for (int c = 0; c < CH; c++) du[c] = dtv[c] * uv[c];
        step(N, At, dtv, du, a->B + row * N, h);
        const float *Ct = a->C + row * N;
        for (int c = 0; c < CH; c++) acc[c] = 0.0f;
        for (int n = 0; n < N; n++) {
            const float Cn = Ct[n];
#pragma omp simd
            for (int c = 0; c < CH; c++) acc[c] += h[n * CH + c] * Cn;
        }
        for (int c = 0; c < W; c++) {
            float y = acc[c] + (a->Dskip ? a->Dskip[d0 + c] * uv[c] : 0.0f);
            if (a->z) y *= a->z[at + c] * sigmoid(a->z[at + c]);
            a->y[at + c] = y;
        }
    }
    for (int n = 0; n < N; n++)
        for (int c = 0; c < W; c++) a->h[((size_t)b * D + d0 + c) * N + n] = h[n * CH + c];
}

static void backward_block(Task *a, int b, int d0, float *At, float *work) {
    const int T = a->T, D = a->D, N = a->N, W = a->d_end - d0 < CH ? a->d_end - d0 : CH;
    const int segments = (T + SEGMENT - 1) / SEGMENT;
    const size_t width = (size_t)N * CH;
    float *gh = work, *gA = work + width;
    /* one segment at a time: its first state (a checkpoint), then each step's state and decays, as in the forward */
    float *start = malloc(sizeof(float) * width * (1 + 2 * SEGMENT));
    if (!start) { a->failed = 1; return; }
    float *states = start + width, *decays = states + width * SEGMENT;
    for (int n = 0; n < N; n++)
        for (int c = 0; c < CH; c++) {
            const size_t i = ((size_t)b * D + d0 + c) * N + n;
            At[n * CH + c] = c < W ? a->A[(size_t)(d0 + c) * N + n] : 0.0f;
            gh[n * CH + c] = c < W && a->grad_h_last ? a->grad_h_last[i] : 0.0f;
            gA[n * CH + c] = 0.0f;
        }
    float dtv[CH], uv[CH], du[CH], gy[CH], gu[CH], gdt[CH];
    for (int s = segments - 1; s >= 0; s--) {
        const int t0 = s * SEGMENT, t1 = (s + 1) * SEGMENT < T ? (s + 1) * SEGMENT : T;
        for (int n = 0; n < N; n++)
            for (int c = 0; c < CH; c++)
                start[n * CH + c] = c < W ? a->checkpoints[(((size_t)b * segments + s) * D + d0 + c) * N + n] : 0.0f;
        for (int t = t0; t < t1; t++) { /* states[t - t0] = the state after step t */
            const size_t row = (size_t)b * T + t;
            load(a->dt, row * D + d0, W, dtv);
            load(a->u, row * D + d0, W, uv);
            for (int c = 0; c < CH; c++) du[c] = dtv[c] * uv[c];
            step_keeping_decays(N, At, dtv, du, a->B + row * N, t == t0 ? start : states + (t - t0 - 1) * width,
                                states + (t - t0) * width, decays + (t - t0) * width);
        }
        for (int t = t1 - 1; t >= t0; t--) {
            const size_t row = (size_t)b * T + t, at = row * D + d0;
            const float *Bt = a->B + row * N, *Ct = a->C + row * N;
            float *gBt = a->grad_B + row * N, *gCt = a->grad_C + row * N;
            const float *prev = t == t0 ? start : states + (size_t)(t - t0 - 1) * width;
            const float *cur = states + (size_t)(t - t0) * width, *decay_t = decays + (size_t)(t - t0) * width;
            load(a->dt, at, W, dtv);
            load(a->u, at, W, uv);
            load(a->grad_y, at, W, gy);
            if (a->z) { /* y = (h C + D u) silu(z): recompute the ungated y for dz */
                for (int c = 0; c < W; c++) {
                    float y = a->Dskip ? a->Dskip[d0 + c] * uv[c] : 0.0f;
                    for (int n = 0; n < N; n++) y += cur[n * CH + c] * Ct[n];
                    const float zv = a->z[at + c], sg = sigmoid(zv);
                    a->grad_z[at + c] = gy[c] * y * sg * (1.0f + zv * (1.0f - sg));
                    gy[c] *= zv * sg;
                }
            }
            for (int c = 0; c < CH; c++) {
                gu[c] = a->Dskip && c < W ? gy[c] * a->Dskip[d0 + c] : 0.0f;
                gdt[c] = 0.0f;
            }
            if (a->Dskip)
                for (int c = 0; c < W; c++) a->grad_D[d0 + c] += gy[c] * uv[c];
            for (int n = 0; n < N; n++) {
                const float Bn = Bt[n], Cn = Ct[n];
                const float *An = At + n * CH, *pn = prev + n * CH, *cn = cur + n * CH, *dn = decay_t + n * CH;
                float *ghn = gh + n * CH, *gAn = gA + n * CH;
                float gB = 0.0f, gC = 0.0f;
#pragma omp simd reduction(+ : gB, gC)
                for (int c = 0; c < CH; c++) {
                    const float decay = dn[c];
                    const float g = ghn[c] + gy[c] * Cn; /* dL/dh_t */
                    gC += gy[c] * cn[c];
                    gdt[c] += g * (An[c] * decay * pn[c] + uv[c] * Bn);
                    gu[c] += g * dtv[c] * Bn;
                    gB += g * dtv[c] * uv[c];
                    gAn[c] += g * dtv[c] * decay * pn[c];
                    ghn[c] = g * decay; /* dL/dh_{t-1} */
                }
                gBt[n] += gB;
                gCt[n] += gC;
            }
            for (int c = 0; c < W; c++) {
                a->grad_u[at + c] = gu[c];
                a->grad_dt[at + c] = gdt[c];
            }
        }
    }
    for (int n = 0; n < N; n++)
        for (int c = 0; c < W; c++) {
            a->grad_h0[((size_t)b * D + d0 + c) * N + n] = gh[n * CH + c];
            a->grad_A[(size_t)(d0 + c) * N + n] += gA[n * CH + c];
        }
    free(start);
}

static void *run_task(void *arg) {
    Task *a = (Task *)arg;
    float *scratch = malloc(sizeof(float) * 3 * (size_t)a->N * CH);
    if (!scratch) { a->failed = 1; return NULL; }
    for (int b = 0; b < a->batch && !a->failed; b++)
        for (int d0 = a->d_begin; d0 < a->d_end && !a->failed; d0 += CH) {
            if (a->grad_y) backward_block(a, b, d0, scratch, scratch + (size_t)a->N * CH);
            else forward_block(a, b, d0, scratch, scratch + (size_t)a->N * CH);
        }
    free(scratch);
    return NULL;
}

/* Whole blocks of channels split evenly over up to `threads` tasks; the first runs on the calling thread.
   A task owns its channels' rows of y, h, grad_A, grad_D; grad_B and grad_C get one (batch, T, N) slice each. */
static int run(int threads, Task *proto) {
    enum { MAX_THREADS = 64 };
    Task tasks[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0}, failed = 0;
    const int blocks = (proto->D + CH - 1) / CH;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads > blocks ? blocks : threads;
    for (int k = threads - 1; k >= 0; k--) {
        tasks[k] = *proto;
        tasks[k].d_begin = (int)((long)blocks * k / threads) * CH;
        tasks[k].d_end = (int)((long)blocks * (k + 1) / threads) * CH;
        if (tasks[k].d_end > proto->D) tasks[k].d_end = proto->D;
        if (proto->grad_B) {
            const size_t slice = (size_t)proto->batch * proto->T * proto->N * k;
            tasks[k].grad_B = proto->grad_B + slice;
            tasks[k].grad_C = proto->grad_C + slice;
        }
        if (k > 0) started[k] = pthread_create(&ids[k], NULL, run_task, &tasks[k]) == 0;
        if (k == 0 || !started[k]) run_task(&tasks[k]);
    }
    for (int k = 0; k < threads; k++) {
        if (started[k]) pthread_join(ids[k], NULL);
        failed |= tasks[k].failed;
    }
    return failed;
}

/* h: the initial state in, the final state out. checkpoints (batch, ceil(T / SEGMENT), D, N), or NULL: for the
   backward. Returns nonzero when memory ran out. */
int samba_scan_forward(int threads, int batch, int T, int D, int N, const float *u, const float *dt, const float *A,
                       const float *B, const float *C, const float *Dskip, const float *z, float *h, float *y,
                       float *checkpoints) {
    Task t = {batch, T, D, N, u, dt, A, B, C, Dskip, z, NULL, NULL, h, y, checkpoints};
    return run(threads, &t);
}

/* checkpoints: as the forward wrote them. grad_A, grad_D, grad_B, grad_C must come zeroed; grad_B and grad_C are
   (threads, batch, T, N), to be summed over the first dimension. grad_h_last may be NULL. Returns nonzero when
   memory ran out. */
int samba_scan_backward(int threads, int batch, int T, int D, int N, const float *u, const float *dt, const float *A,
                        const float *B, const float *C, const float *Dskip, const float *z, float *checkpoints,
                        const float *grad_y, const float *grad_h_last, float *grad_u, float *grad_dt, float *grad_A,
                        float *grad_B, float *grad_C, float *grad_D, float *grad_z, float *grad_h0) {
    Task t = {batch, T, D, N, u, dt, A, B, C, Dskip, z, grad_y, grad_h_last, NULL, NULL, checkpoints,
              grad_u, grad_dt, grad_A, grad_B, grad_C, grad_D, grad_z, grad_h0};
    return run(threads, &t);
}
"""

_CPU_SCAN_SEGMENT = 64  # SEGMENT in the source above
_CPU_SCAN = None  # the loaded library, or False once building or loading it failed


def _cpu_scan_library():
    """The compiled CPU scan (a ctypes library), built on first use; None where it cannot be (the caller falls back)."""
    global _CPU_SCAN
    if _CPU_SCAN is None:
        _CPU_SCAN = False
        library = load_c_library(_CPU_SCAN_SOURCE, "selective_scan", "SAMBA_HF_SCAN", "the compiled CPU scan",
                                 "the PyTorch scan")
        if library is None:
            return None
        sizes = [ctypes.c_int] * 5  # threads, batch, seq_len, d_inner, d_state
        library.samba_scan_forward.argtypes = sizes + [ctypes.c_void_p] * 10  # u dt A B C D z h y checkpoints
        # u..z, checkpoints, grad_y, grad_h, then the 8 gradients
        library.samba_scan_backward.argtypes = sizes + [ctypes.c_void_p] * 18
        library.samba_scan_forward.restype = library.samba_scan_backward.restype = ctypes.c_int
        _CPU_SCAN = library
    return _CPU_SCAN or None


@torch.compiler.assume_constant_result  # under torch.compile: asked once while tracing, not traced into
def cpu_scan_available() -> bool:
    return _cpu_scan_library() is not None


def load_c_library(source_text: str, name: str, variable: str, what: str, fallback: str):
    """The ctypes library built from `source_text` (`build_c_library`), or None: where `$variable` is "pytorch",
    or where it cannot be built or loaded (said once: `what` is unavailable, using `fallback`)."""
    choice = os.environ.get(variable, "").lower()
    if choice == "pytorch":
        return None
    if choice not in ("", "compiled"):
        logger.warning_once(f"samba-hf: {variable}={choice!r} is not 'compiled' or 'pytorch'; using {what}")
    try:
        return ctypes.CDLL(build_c_library(source_text, name))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning_once(f"samba-hf: {what} is unavailable ({error}); using {fallback}")
        return None


def build_c_library(source_text: str, name: str) -> str:
    """Compile a C source for this machine, once: the library's path in the cache. The name hashes the source,
    the compiler and the CPU, so a cache shared between machines never hands one a library built for another; the
    file is written under a temporary name and renamed, so concurrent builds never load a half-written one."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    cpu = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu += "".join(line for line in info if line.startswith(("flags", "model name")))
    except OSError:
        pass
    key = hashlib.sha256("\0".join([source_text, compiler, cpu]).encode()).hexdigest()[:16]
    cache = os.environ.get("SAMBA_HF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "samba_hf"
    )
    path = os.path.join(cache, f"{name}_{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as build:
        source = os.path.join(build, f"{name}.c")
        with open(source, "w") as f:
            f.write(source_text)
        base = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd"]
        errors = []
        for flags in (["-march=native", *base], base):  # a compiler without -march=native still gets a build
            result = subprocess.run([compiler, *flags, source, "-o", os.path.join(build, f"{name}.so"), "-lpthread"],
                                    capture_output=True, text=True, timeout=300)
            if result.returncode == 0:
                os.replace(os.path.join(build, f"{name}.so"), path)
                return path
            errors.append(result.stderr.strip().splitlines()[-1:] or [f"exit {result.returncode}"])
        raise RuntimeError(f"{compiler} failed: {errors[-1][0]}")


def _pointer(tensor: torch.Tensor | None):
    return None if tensor is None else ctypes.c_void_p(tensor.data_ptr())


def _scan_threads(batch: int, seq_len: int, d_inner: int, d_state: int) -> int:
    # starting a thread costs about what 20K state updates do: a one-token decode step runs on the calling thread
    return 1 if batch * seq_len * d_inner * d_state < (1 << 18) else torch.get_num_threads()


class _CpuScan(torch.autograd.Function):
    """The compiled scan with its backward. All inputs float32 and contiguous; D, z and h0 may be None."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C, D, z, h0):
        y, h, checkpoints = _cpu_scan_forward(u, dt, A, B, C, D, z, h0, keep_checkpoints=True)
        ctx.save_for_backward(u, dt, A, B, C, D, z, checkpoints)
        return y, h

    @staticmethod
    def backward(ctx, grad_y, grad_h):
        saved = ctx.saved_tensors  # unpacked once (activation checkpointing allows no second unpacking)
        grads = _cpu_scan_backward(*saved, grad_y, grad_h, D_given=saved[5] is not None, z_given=saved[6] is not None)
        return tuple(grad if need else None for grad, need in zip(grads, ctx.needs_input_grad))


def _cpu_scan_backward(u, dt, A, B, C, D, z, checkpoints, grad_y, grad_h, D_given=True, z_given=True):
    """The gradients of (u, dt, A, B, C, D, z, h0); those of D and z are None where they were not given."""
    (batch, seq_len, d_inner), d_state = u.shape, A.shape[1]
    threads = _scan_threads(batch, seq_len, d_inner, d_state)
    grads = {
        "u": torch.empty_like(u), "dt": torch.empty_like(dt), "A": torch.zeros_like(A),
        "B": B.new_zeros(threads, *B.shape), "C": C.new_zeros(threads, *C.shape),
        "D": torch.zeros_like(D) if D_given else None, "z": torch.empty_like(z) if z_given else None,
        "h0": u.new_empty(batch, d_inner, d_state),
    }
    # named, so that they live until the call returns (a pointer does not keep its tensor alive)
    grad_y = grad_y.float().contiguous()
    grad_h = None if grad_h is None else grad_h.float().contiguous()
    failed = _cpu_scan_library().samba_scan_backward(
        threads, batch, seq_len, d_inner, d_state,
        *map(_pointer, (u, dt, A, B, C, D if D_given else None, z if z_given else None, checkpoints, grad_y, grad_h,
                        *grads.values())),
    )
    if failed:
        raise MemoryError("samba-hf: out of memory in the CPU scan's backward")
    grads["B"], grads["C"] = grads["B"].sum(0), grads["C"].sum(0)
    return tuple(grads.values())


def _cpu_scan_forward(u, dt, A, B, C, D, z, h0, keep_checkpoints=False):
    """y, the last state, and (keep_checkpoints) the state before every 64th step, for the backward."""
    (batch, seq_len, d_inner), d_state = u.shape, A.shape[1]
    h = u.new_zeros(batch, d_inner, d_state) if h0 is None else h0.clone()
    y = torch.empty_like(u)
    segments = -(-seq_len // _CPU_SCAN_SEGMENT)
    checkpoints = u.new_empty(batch, segments, d_inner, d_state) if keep_checkpoints else None
    failed = _cpu_scan_library().samba_scan_forward(
        _scan_threads(batch, seq_len, d_inner, d_state), batch, seq_len, d_inner, d_state,
        *map(_pointer, (u, dt, A, B, C, D, z, h, y, checkpoints)),
    )
    if failed:
        raise MemoryError("samba-hf: out of memory in the CPU scan")
    return (y, h, checkpoints) if keep_checkpoints else (y, h)


def selective_scan_cpu(u, dt, A, B, C, D=None, z=None, h0=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled CPU scan (same arguments and results as `selective_scan_pytorch`), differentiable. A must be <= 0,
    as the model's A = -exp(A_log) is: each decay exp(dt * A) is then in (0, 1], and nothing overflows at any length.
    Under `torch.compile` it runs as the operator `torch.ops.samba_hf.selective_scan_cpu` (`_scan_operator`)."""
    inputs = [None if x is None else x.float().contiguous() for x in (u, dt, A, B, C, D, z, h0)]
    if torch.compiler.is_compiling():
        y, h, _ = _SCAN_OPERATOR(*inputs, keep_checkpoints=torch.is_grad_enabled())
    elif torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        y, h = _CpuScan.apply(*inputs)
    else:
        with torch.no_grad():
            y, h = _cpu_scan_forward(*inputs)
    return y.to(u.dtype), h


def _scan_operator():
    """The compiled scan as a torch operator, `torch.ops.samba_hf.selective_scan_cpu`, with a backward, so that
    `torch.compile` keeps it as one call: dynamo cannot trace into the C library, and the PyTorch scan it would trace
    instead unrolls a Python loop over tokens. Registered once per process: a second copy of this file (a saved
    model's remote code) finds the operator registered and uses it. Returns (y, last state, checkpoints); the
    checkpoints (for the backward) are empty unless `keep_checkpoints`."""
    namespace = torch.ops.samba_hf
    if hasattr(namespace, "selective_scan_cpu"):
        return namespace.selective_scan_cpu
    Tensor, OptionalTensor = torch.Tensor, typing.Optional[torch.Tensor]

    @torch.library.custom_op("samba_hf::selective_scan_cpu", mutates_args=(), device_types="cpu")
    def scan(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: OptionalTensor, z: OptionalTensor,
             h0: OptionalTensor, keep_checkpoints: bool) -> tuple[Tensor, Tensor, Tensor]:
        if keep_checkpoints:
            return _cpu_scan_forward(u, dt, A, B, C, D, z, h0, keep_checkpoints=True)
        y, h = _cpu_scan_forward(u, dt, A, B, C, D, z, h0)
        return y, h, u.new_empty(0)

    @scan.register_fake
    def _(u, dt, A, B, C, D, z, h0, keep_checkpoints):
        (batch, seq_len, d_inner), d_state = u.shape, A.shape[1]
        checkpoints = (batch, (seq_len + _CPU_SCAN_SEGMENT - 1) // _CPU_SCAN_SEGMENT, d_inner, d_state)
        return u.new_empty(u.shape), u.new_empty(batch, d_inner, d_state), u.new_empty(checkpoints if keep_checkpoints else 0)

    @torch.library.custom_op("samba_hf::selective_scan_cpu_backward", mutates_args=(), device_types="cpu")
    def scan_backward(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: OptionalTensor, z: OptionalTensor,
                      checkpoints: Tensor, grad_y: Tensor, grad_h: OptionalTensor) -> list[Tensor]:
        grads = _cpu_scan_backward(u, dt, A, B, C, D, z, checkpoints, grad_y, grad_h, D is not None, z is not None)
        return [u.new_empty(0) if grad is None else grad for grad in grads]  # an operator returns no None

    @scan_backward.register_fake
    def _(u, dt, A, B, C, D, z, checkpoints, grad_y, grad_h):
        absent = u.new_empty(0)
        return [u.new_empty(u.shape), dt.new_empty(dt.shape), A.new_empty(A.shape), B.new_empty(B.shape),
                C.new_empty(C.shape), absent if D is None else D.new_empty(D.shape),
                absent if z is None else z.new_empty(z.shape), u.new_empty(u.shape[0], *A.shape)]

    def setup_context(ctx, inputs, output):
        u, dt, A, B, C, D, z, h0, _ = inputs
        ctx.save_for_backward(u, dt, A, B, C, D, z, output[2])
        ctx.absent = (False,) * 5 + (D is None, z is None, h0 is None)

    def backward(ctx, grad_y, grad_h, _):
        grads = scan_backward(*ctx.saved_tensors, grad_y, grad_h)
        return *(None if absent else grad for grad, absent in zip(grads, ctx.absent)), None

    scan.register_autograd(backward, setup_context=setup_context)
    return scan


_SCAN_OPERATOR = _scan_operator()


def _scan_with_kernel(scan_fn, u, dt, A, B, C, D, z, h0):
    """mamba-ssm's `selective_scan_fn`, which starts from a zero state; from `h0`, plus `initial_state_correction`."""
    # mamba-ssm wants channels before time, u, delta, z (b, d, l) and B, C (b, n, l), all in u's dtype; A and D float32.
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
    contiguous: no transposing copy on the way in or out (on CPU each one cost more than the conv itself)."""
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


def causal_conv(conv1d: nn.Conv1d, window: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The depthwise causal conv's outputs at the last `seq_len` positions of `window` (batch, d_inner, T), which
    holds the cached left context (if any) followed by the new inputs. Returns (batch, d_inner, seq_len)."""
    plain = type(conv1d) is nn.Conv1d  # an adapter-wrapped conv must run as a module
    if _kernel_device(window) and plain:
        kernels = load_kernels()
        weight = conv1d.weight[:, 0, :]  # (d_inner, kernel_size)
        if kernels.causal_conv1d_fn is not None:
            if seq_len == 1 and window.shape[-1] >= conv1d.kernel_size[0]:
                # causal_conv1d_update(x (b, d), conv_state (b, d, >= K - 1)): the state is shifted in place (a copy)
                state = window[..., :-1].contiguous()
                return kernels.causal_conv1d_update(window[..., -1], state, weight, conv1d.bias, activation=None)[..., None]
            # causal_conv1d_fn(x (b, d, l), weight (d, K)): zero left padding, every position
            return kernels.causal_conv1d_fn(window.contiguous(), weight, conv1d.bias, activation=None)[..., -seq_len:]
        if kernels.causal_conv_triton is not None and not compiling():  # (compiled: the Conv1d below, by Inductor)
            return kernels.causal_conv_triton(window, weight, conv1d.bias, seq_len)
        if kernels.causal_conv_triton is None:
            _fallback("causal_conv1d_fn", "the Mamba conv runs as a PyTorch Conv1d (samba-hf's Triton conv is "
                      f"unavailable too: {kernels.missing.get('causal_conv_triton', 'not installed')})", _INSTALL_CONV)
    elif plain:
        return depthwise_causal_conv(conv1d.weight[:, 0, :], conv1d.bias, window, seq_len)
    return conv1d(window)[..., : window.shape[-1]][..., -seq_len:]
