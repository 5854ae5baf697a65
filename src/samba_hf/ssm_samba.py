"""The selective scan of the Mamba mixer, in plain PyTorch.

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t        (per channel d, state n)
    y_t = <h_t, C_t> + D * u_t,  then gated: y_t * silu(z_t)

Everything is computed in float32 whatever the input dtype; `y` comes back in the dtype of `u`, the final state
in float32. Part of the remote code of a saved model: imports only torch.
"""

import torch
import torch.nn.functional as F

# Tokens whose discretised A and B*u are materialised at once: bounds the scan's extra memory to
# O(batch * _BLOCK * d_inner * d_state) whatever the sequence length.
_BLOCK = 64


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
    batch, seq_len, d_inner = u.shape
    A = A.float()
    h = torch.zeros(batch, d_inner, A.shape[-1], device=u.device, dtype=torch.float32) if h0 is None else h0.float()
    ys = []
    for start in range(0, seq_len, _BLOCK):
        u_blk = u[:, start : start + _BLOCK].float()
        dt_blk = dt[:, start : start + _BLOCK].float()
        decay = torch.exp(dt_blk[..., None] * A)  # (b, t, d, n)
        inject = (dt_blk * u_blk)[..., None] * B[:, start : start + _BLOCK, None, :].float()  # (b, t, d, n)
        states = []
        for t in range(u_blk.shape[1]):
            h = decay[:, t] * h + inject[:, t]
            states.append(h)
        states = torch.stack(states, dim=1)  # (b, t, d, n)
        ys.append(torch.einsum("btdn,btn->btd", states, C[:, start : start + _BLOCK].float()))
    y = torch.cat(ys, dim=1) if ys else u.new_zeros(batch, 0, d_inner, dtype=torch.float32)
    if D is not None:
        y = y + u.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(u.dtype), h
