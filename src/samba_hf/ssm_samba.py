"""The selective scan and the causal conv of the Mamba mixer, with their optional CUDA kernels.

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t        (per channel d, state n)
    y_t = <h_t, C_t> + D * u_t,  then gated: y_t * silu(z_t)

`selective_scan` is the one entry point. On CUDA tensors it uses mamba-ssm's kernels when the package is
installed (`selective_scan_fn` for a sequence that starts from a zero state, `selective_state_update` for a
one-token step from a cached state); everywhere else, and for a multi-token input that continues from a cached
state (which `selective_scan_fn` cannot take), the PyTorch scan below. The first fallback on a CUDA tensor is
logged once.

Everything is computed in float32 whatever the input dtype; `y` comes back in the dtype of `u`, the final state
in float32.

`causal_conv` runs the mixer's depthwise conv over [cached window, new inputs]. On CUDA, with causal-conv1d
installed and the conv a plain `nn.Conv1d` (not wrapped by an adapter), it uses `causal_conv1d_update` for a
one-token step and `causal_conv1d_fn` otherwise; everywhere else it calls the module itself, so adapters apply.

Part of the remote code of a saved model: imports only torch and transformers.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Tokens whose discretised A and B*u are materialised at once: bounds the scan's extra memory to
# O(batch * _BLOCK * d_inner * d_state) whatever the sequence length. 64 measured fastest here (32-128 within 10%).
_BLOCK = 64

_KERNELS = None
_CONV_KERNELS = None


def _mamba_kernels():
    """(selective_scan_fn, selective_state_update) from mamba-ssm, or (None, None) when it is not installed."""
    global _KERNELS
    if _KERNELS is None:
        try:
            from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update

            _KERNELS = (selective_scan_fn, selective_state_update)
        except Exception:  # not installed, or built for another CUDA/torch
            _KERNELS = (None, None)
    return _KERNELS


def _conv_kernels():
    """(causal_conv1d_fn, causal_conv1d_update) from causal-conv1d, or (None, None) when it is not installed."""
    global _CONV_KERNELS
    if _CONV_KERNELS is None:
        try:
            from causal_conv1d import causal_conv1d_fn, causal_conv1d_update

            _CONV_KERNELS = (causal_conv1d_fn, causal_conv1d_update)
        except Exception:
            _CONV_KERNELS = (None, None)
    return _CONV_KERNELS


def _kernel_device(tensor: torch.Tensor) -> bool:
    """mamba-ssm's kernels run on CUDA tensors only."""
    return tensor.is_cuda


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
        scan_fn, state_update_fn = _mamba_kernels()
        if h0 is None and scan_fn is not None:
            return _scan_with_kernel(scan_fn, u, dt, A, B, C, D, z)
        if h0 is not None and u.shape[1] == 1 and state_update_fn is not None:
            return _step_with_kernel(state_update_fn, u, dt, A, B, C, D, z, h0)
        if scan_fn is None:
            logger.warning_once("samba-hf: mamba-ssm is not installed; the Mamba scan runs in PyTorch (slower on GPU)")
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


def _scan_with_kernel(scan_fn, u, dt, A, B, C, D, z):
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
    return y.transpose(1, 2).to(u.dtype), last_state.float()


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
        dt_bias=None,
        dt_softplus=False,
    )
    return y[:, None].to(u.dtype), state


def causal_conv(conv1d: nn.Conv1d, window: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The depthwise causal conv's outputs at the last `seq_len` positions of `window` (batch, d_inner, T), which
    holds the cached left context (if any) followed by the new inputs. Returns (batch, d_inner, seq_len)."""
    if _kernel_device(window) and type(conv1d) is nn.Conv1d:  # an adapter-wrapped conv must run as a module
        conv_fn, update_fn = _conv_kernels()
        weight = conv1d.weight[:, 0, :]  # (d_inner, kernel_size)
        if seq_len == 1 and window.shape[-1] >= conv1d.kernel_size[0] and update_fn is not None:
            state = window[..., :-1].contiguous()  # the previous inputs; the kernel shifts it in place (a copy)
            return update_fn(window[..., -1], state, weight, conv1d.bias, activation=None)[..., None]
        if conv_fn is not None:
            return conv_fn(window.contiguous(), weight, conv1d.bias, activation=None)[..., -seq_len:]
        logger.warning_once("samba-hf: causal-conv1d is not installed; the Mamba conv runs as a PyTorch Conv1d")
    return conv1d(window)[..., : window.shape[-1]][..., -seq_len:]
