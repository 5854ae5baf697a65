"""The Mamba-1 selective scan in Triton: forward and backward, from a given state, on any CUDA GPU that torch runs
on (torch's CUDA wheels bring Triton: nothing to compile, nothing else to install).

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t        (per channel d, state n; A < 0)
    y_t = (<h_t, C_t> + D * u_t) * silu(z_t)

One program per (sequence, block of BLOCK_D channels) walks the sequence in order, holding its channels' states
(BLOCK_D x d_state, float32) in registers: no (tokens x channels x states) tensor is ever built, and the inputs are
read in their (batch, seq, channels) layout, a contiguous run of BLOCK_D channels per token. A zero step (dt = 0,
padding) leaves the state as it was. The same kernel with one token is the decoding step.

For the backward the forward also keeps the state before every CHUNK-th token (`checkpoints`, batch x
tokens/CHUNK x d_inner x d_state: 1/CHUNK of what a naive backward keeps). The backward walks the chunks from the
last: it recomputes a chunk's states from its checkpoint into a scratch buffer of CHUNK + 1 states per program
(bounded, whatever the length), then steps back through them, carrying the gradient of the state.

`selective_scan_triton` is the entry point (differentiable); `ssm_samba.selective_scan` calls it on CUDA where
mamba-ssm's CUDA scan is not installed. Its reference is `ssm_samba.selective_scan_pytorch` (the same recurrence,
stepped per token in PyTorch); tests/test_kernels.py checks both against a float64 recurrence under Triton's
interpreter. Imported only on CUDA (or under the interpreter): this file needs Triton.
"""

import torch

try:  # (transformers' remote-code loader reads imports outside try blocks as requirements: a CPU needs no Triton)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - ssm_samba imports this file only where Triton is
    triton = tl = None

CHUNK = 64  # tokens between the forward's checkpoints, and the backward's recompute length
BLOCK_D = 32  # channels per program


@triton.jit
def _scan_forward(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, h0_ptr, y_ptr, h_ptr, checkpoints_ptr,
    seq_len, d_inner, d_state,
    stride_u_b, stride_u_t, stride_dt_b, stride_dt_t, stride_B_b, stride_B_t, stride_C_b, stride_C_t,
    stride_z_b, stride_z_t, stride_y_b, stride_y_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_H0: tl.constexpr, KEEP_CHECKPOINTS: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_ok, n_ok = d < d_inner, n < d_state
    dn_ok = d_ok[:, None] & n_ok[None, :]
    dn = d[:, None] * d_state + n[None, :]  # offsets in a (d_inner, d_state) matrix
    A = tl.load(A_ptr + dn, mask=dn_ok, other=0.0).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    state_offset = b * d_inner * d_state + dn  # (batch, d_inner, d_state) tensors
    if HAS_H0:
        h = tl.load(h0_ptr + state_offset, mask=dn_ok, other=0.0).to(tl.float32)
    else:
        h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    chunks = tl.cdiv(seq_len, CHUNK)
    for c in range(0, chunks):
        if KEEP_CHECKPOINTS:
            tl.store(checkpoints_ptr + (b * chunks + c) * d_inner * d_state + dn, h, mask=dn_ok)
        for t in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, seq_len)):
            u = tl.load(u_ptr + b * stride_u_b + t * stride_u_t + d, mask=d_ok, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + b * stride_dt_b + t * stride_dt_t + d, mask=d_ok, other=0.0).to(tl.float32)
            B = tl.load(B_ptr + b * stride_B_b + t * stride_B_t + n, mask=n_ok, other=0.0).to(tl.float32)
            C = tl.load(C_ptr + b * stride_C_b + t * stride_C_t + n, mask=n_ok, other=0.0).to(tl.float32)
            h = tl.exp(dt[:, None] * A) * h + (dt * u)[:, None] * B[None, :]
            y = tl.sum(h * C[None, :], axis=1)
            if HAS_D:
                y += D * u
            if HAS_Z:
                z = tl.load(z_ptr + b * stride_z_b + t * stride_z_t + d, mask=d_ok, other=0.0).to(tl.float32)
                y *= z * tl.sigmoid(z)
            tl.store(y_ptr + b * stride_y_b + t * stride_y_t + d, y.to(y_ptr.dtype.element_ty), mask=d_ok)
    tl.store(h_ptr + state_offset, h, mask=dn_ok)


@triton.jit
def _scan_backward(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, checkpoints_ptr, scratch_ptr, grad_y_ptr, grad_h_ptr,
    grad_u_ptr, grad_dt_ptr, grad_A_ptr, grad_B_ptr, grad_C_ptr, grad_D_ptr, grad_z_ptr, grad_h0_ptr,
    batch, seq_len, d_inner, d_state,
    stride_u_b, stride_u_t, stride_dt_b, stride_dt_t, stride_B_b, stride_B_t, stride_C_b, stride_C_t,
    stride_z_b, stride_z_t, stride_gy_b, stride_gy_t, stride_g_b, stride_g_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_GRAD_H: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Gradients, per program (sequence b, channel block): u, dt, z, h0 its own entries; A, D partial sums per
    sequence, (batch, d_inner, d_state) and (batch, d_inner); B, C partial sums per channel block, (blocks, batch,
    seq, d_state). The caller sums the partials."""
    b = tl.program_id(0)
    block = tl.program_id(1)
    d = block * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_ok, n_ok = d < d_inner, n < d_state
    dn_ok = d_ok[:, None] & n_ok[None, :]
    dn = d[:, None] * d_state + n[None, :]
    local = tl.arange(0, BLOCK_D)[:, None] * BLOCK_N + n[None, :]  # offsets in this program's scratch states
    A = tl.load(A_ptr + dn, mask=dn_ok, other=0.0).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    state_offset = b * d_inner * d_state + dn
    programs = tl.num_programs(1)
    scratch = scratch_ptr + (b * programs + block) * (CHUNK + 1) * BLOCK_D * BLOCK_N
    partial_BC = (block * batch + b) * seq_len * d_state  # this program's rows of grad_B / grad_C
    if HAS_GRAD_H:
        carry = tl.load(grad_h_ptr + state_offset, mask=dn_ok, other=0.0).to(tl.float32)
    else:
        carry = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    grad_A = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    grad_D = tl.zeros((BLOCK_D,), dtype=tl.float32)
    chunks = tl.cdiv(seq_len, CHUNK)
    for reverse in range(0, chunks):
        c = chunks - 1 - reverse
        start = c * CHUNK
        end = tl.minimum(start + CHUNK, seq_len)
        # the chunk's states, recomputed from its checkpoint: scratch[k] = the state before token start + k
        h = tl.load(checkpoints_ptr + (b * chunks + c) * d_inner * d_state + dn, mask=dn_ok, other=0.0)
        tl.store(scratch + local, h)
        for t in range(start, end):
            u = tl.load(u_ptr + b * stride_u_b + t * stride_u_t + d, mask=d_ok, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + b * stride_dt_b + t * stride_dt_t + d, mask=d_ok, other=0.0).to(tl.float32)
            B = tl.load(B_ptr + b * stride_B_b + t * stride_B_t + n, mask=n_ok, other=0.0).to(tl.float32)
            h = tl.exp(dt[:, None] * A) * h + (dt * u)[:, None] * B[None, :]
            tl.store(scratch + (t - start + 1) * BLOCK_D * BLOCK_N + local, h)
        tl.debug_barrier()
        for k in range(0, end - start):
            t = end - 1 - k
            u = tl.load(u_ptr + b * stride_u_b + t * stride_u_t + d, mask=d_ok, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + b * stride_dt_b + t * stride_dt_t + d, mask=d_ok, other=0.0).to(tl.float32)
            B = tl.load(B_ptr + b * stride_B_b + t * stride_B_t + n, mask=n_ok, other=0.0).to(tl.float32)
            C = tl.load(C_ptr + b * stride_C_b + t * stride_C_t + n, mask=n_ok, other=0.0).to(tl.float32)
            grad = tl.load(grad_y_ptr + b * stride_gy_b + t * stride_gy_t + d, mask=d_ok, other=0.0).to(tl.float32)
            h = tl.load(scratch + (t - start + 1) * BLOCK_D * BLOCK_N + local)  # h_t
            h_before = tl.load(scratch + (t - start) * BLOCK_D * BLOCK_N + local)  # h_{t-1}
            if HAS_Z:  # y = s * silu(z), s the output before the gate
                z = tl.load(z_ptr + b * stride_z_b + t * stride_z_t + d, mask=d_ok, other=0.0).to(tl.float32)
                s = tl.sum(h * C[None, :], axis=1)
                if HAS_D:
                    s += D * u
                sig = tl.sigmoid(z)
                tl.store(grad_z_ptr + b * stride_g_b + t * stride_g_t + d,
                         grad * s * sig * (1.0 + z * (1.0 - sig)), mask=d_ok)
                grad = grad * z * sig  # the gradient of s
            if HAS_D:
                grad_D += grad * u
            tl.store(grad_C_ptr + partial_BC + t * d_state + n,
                     tl.sum(tl.where(dn_ok, h * grad[:, None], 0.0), axis=0), mask=n_ok)
            carry += grad[:, None] * C[None, :]  # the gradient of h_t
            decay = tl.exp(dt[:, None] * A)
            from_decay = tl.where(dn_ok, carry * decay * h_before, 0.0)  # d/d(dt A) of decay * h_{t-1}
            grad_A += from_decay * dt[:, None]
            grad_u = tl.sum(tl.where(dn_ok, carry * B[None, :], 0.0), axis=1) * dt
            grad_dt = tl.sum(from_decay * A + tl.where(dn_ok, carry * B[None, :], 0.0) * u[:, None], axis=1)
            if HAS_D:
                grad_u += grad * D
            tl.store(grad_u_ptr + b * stride_g_b + t * stride_g_t + d, grad_u, mask=d_ok)
            tl.store(grad_dt_ptr + b * stride_g_b + t * stride_g_t + d, grad_dt, mask=d_ok)
            tl.store(grad_B_ptr + partial_BC + t * d_state + n,
                     tl.sum(tl.where(dn_ok, carry * (dt * u)[:, None], 0.0), axis=0), mask=n_ok)
            carry = carry * decay
        tl.debug_barrier()
    tl.store(grad_h0_ptr + state_offset, carry, mask=dn_ok)
    tl.store(grad_A_ptr + b * d_inner * d_state + dn, grad_A, mask=dn_ok)
    if HAS_D:
        tl.store(grad_D_ptr + b * d_inner + d, grad_D, mask=d_ok)


def _forward(u, dt, A, B, C, D, z, h0, keep_checkpoints: bool):
    """y (u's dtype), the last state and the checkpoints (float32; None unless keep_checkpoints)."""
    batch, seq_len, d_inner = u.shape
    d_state = A.shape[1]
    y = torch.empty_like(u)
    h = u.new_empty(batch, d_inner, d_state, dtype=torch.float32)
    chunks = triton.cdiv(seq_len, CHUNK)
    checkpoints = u.new_empty(batch, chunks, d_inner, d_state, dtype=torch.float32) if keep_checkpoints else None
    grid = (batch, triton.cdiv(d_inner, BLOCK_D))
    _scan_forward[grid](
        u, dt, A, B, C, D, z, h0, y, h, checkpoints, seq_len, d_inner, d_state,
        u.stride(0), u.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        *(z.stride()[:2] if z is not None else (0, 0)), y.stride(0), y.stride(1),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_H0=h0 is not None, KEEP_CHECKPOINTS=keep_checkpoints,
        CHUNK=CHUNK, BLOCK_D=BLOCK_D, BLOCK_N=triton.next_power_of_2(d_state),
    )
    return y, h, checkpoints


class _TritonScan(torch.autograd.Function):
    """The Triton scan with its backward. Inputs contiguous in their last dimension; A, D, h0 float32; D, z and h0
    may be None."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C, D, z, h0):
        y, h, checkpoints = _forward(u, dt, A, B, C, D, z, h0, keep_checkpoints=True)
        ctx.save_for_backward(u, dt, A, B, C, D, z, checkpoints)
        return y, h

    @staticmethod
    def backward(ctx, grad_y, grad_h):
        u, dt, A, B, C, D, z, checkpoints = ctx.saved_tensors
        (batch, seq_len, d_inner), d_state = u.shape, A.shape[1]
        blocks = triton.cdiv(d_inner, BLOCK_D)
        block_n = triton.next_power_of_2(d_state)
        grad_y = grad_y.contiguous()
        f32 = dict(dtype=torch.float32, device=u.device)
        grad_u, grad_dt = torch.empty(u.shape, **f32), torch.empty(u.shape, **f32)
        grad_z = torch.empty(u.shape, **f32) if z is not None else None
        grad_A = torch.empty(batch, d_inner, d_state, **f32)
        grad_D = torch.empty(batch, d_inner, **f32) if D is not None else None
        grad_B = torch.empty(blocks, batch, seq_len, d_state, **f32)
        grad_C = torch.empty(blocks, batch, seq_len, d_state, **f32)
        grad_h0 = torch.empty(batch, d_inner, d_state, **f32)
        scratch = torch.empty(batch * blocks * (CHUNK + 1) * BLOCK_D * block_n, **f32)
        _scan_backward[(batch, blocks)](
            u, dt, A, B, C, D, z, checkpoints, scratch, grad_y, grad_h if grad_h is not None else None,
            grad_u, grad_dt, grad_A, grad_B, grad_C, grad_D, grad_z, grad_h0,
            batch, seq_len, d_inner, d_state,
            u.stride(0), u.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
            *(z.stride()[:2] if z is not None else (0, 0)), grad_y.stride(0), grad_y.stride(1),
            grad_u.stride(0), grad_u.stride(1),  # grad_u, grad_dt and grad_z: contiguous, (batch, seq, d_inner)
            HAS_D=D is not None, HAS_Z=z is not None, HAS_GRAD_H=grad_h is not None,
            CHUNK=CHUNK, BLOCK_D=BLOCK_D, BLOCK_N=block_n,
        )
        grads = (grad_u.to(u.dtype), grad_dt.to(dt.dtype), grad_A.sum(0), grad_B.sum(0).to(B.dtype),
                 grad_C.sum(0).to(C.dtype), None if D is None else grad_D.sum(0),
                 None if z is None else grad_z.to(z.dtype), grad_h0)
        return tuple(grad if need else None for grad, need in zip(grads, ctx.needs_input_grad))


def selective_scan_triton(u, dt, A, B, C, D=None, z=None, h0=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan on a CUDA tensor (same arguments and results as `ssm_samba.selective_scan_pytorch`): u, dt, z
    (batch, seq, d_inner); A (d_inner, d_state), <= 0; B, C (batch, seq, d_state); D (d_inner,); h0
    (batch, d_inner, d_state). y comes back in u's dtype, the last state in float32; differentiable."""

    def rows(x):  # contiguous along the last dimension, as the kernels read it
        return None if x is None else (x if x.stride(-1) == 1 else x.contiguous())

    u, dt, B, C, z = map(rows, (u, dt, B, C, z))
    A = A.float().contiguous()
    D = None if D is None else D.float().contiguous()
    h0 = None if h0 is None else h0.float().contiguous()
    inputs = (u, dt, A, B, C, D, z, h0)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        return _TritonScan.apply(*inputs)
    y, h, _ = _forward(*inputs, keep_checkpoints=False)
    return y, h
