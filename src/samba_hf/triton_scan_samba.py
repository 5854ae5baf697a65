"""The selective scan of Mamba and Mamba-2 in Triton: forward and backward, from a given state, on any CUDA GPU that
torch runs on (torch's CUDA wheels bring Triton: nothing to compile, nothing else to install).

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t        (per channel d and state n; A < 0)
    y_t = (<h_t, C_t> + D * u_t) * silu(z_t)

Mamba: every channel has its own dt and its own row of A; B and C are shared by all channels. Mamba-2 (SSD) is the
same recurrence over heads * head_dim channels where a head's channels share one dt, one A (for every state) and
one D, and a group of heads shares B and C (`ssd_scan_triton`; no z, the mixer gates in its norm).
For Mamba-2 inference in half precision `ssd_chunked_triton` takes the SSD in its chunked matrix form instead, its
products on the tensor cores (`_ssd_chunked_forward`; forward only).

One program per (sequence, block of BLOCK_D channels) walks the sequence in order, holding its channels' states
(BLOCK_D x d_state, float32) in registers: no (tokens x channels x states) tensor is ever built, and the inputs are
read in the mixers' (batch, seq, channels) layout. It takes TILE tokens a step: their inputs loaded at once, their
states found by an associative scan over the tile (two steps h -> a h + b compose into one), so that the walk waits
on memory once a tile rather than once a token (a token a step leaves it waiting far longer than moving its tensors
takes). A zero step (dt = 0, padding) leaves the state as it was. The same kernel with one token is the decoding
step.

With few sequences and channel blocks that leaves most of a GPU waiting on one long walk, so a long sequence is
cut into segments scanned at once from zero, then joined exactly: `_join_segments` finds each segment's true
starting state from the ends of those before it (the recurrence is linear in the state), and `_correct_segments`
adds what that state contributes to the segment's outputs.

For the backward the forward also keeps the state before every CHUNK-th token (`checkpoints`, batch x
tokens/CHUNK x channels x d_state: 1/CHUNK of what a naive backward keeps; segments are then whole chunks, and
`_correct_segments` makes their checkpoints whole too). The backward walks a segment's chunks from the last: it
recomputes a chunk's states from its checkpoint into a scratch of CHUNK + 1 states per program (bounded, whatever
the length), then goes back through them a tile at a time, each tile's tokens read from its last, so that the
gradient of the state (carry_t = grad_t C_t + exp(dt_{t+1} A) carry_{t+1}) is the same associative scan as the
forward's (no reversed scan: Triton's `reverse=True` has had wrong results reported). The segments are walked back
at once: only that gradient runs across them, and it is linear too, so `_carry_segments` finds what each
segment's outputs give it from zero and `_join_segments` carries it from the last segment to the first, before
the walk. The gradients of B and C, sums over channels, are added across programs atomically (float32).

Under torch.compile the scan is the operator `torch.ops.samba_hf.scan_triton` (`_operator`), so a compiled decoding
step stays one graph (CUDA graphs). `ssm_samba.selective_scan` / `ssd_scan` call these on CUDA where mamba-ssm's
kernels are not installed, and always under torch.compile. Their
references are `ssm_samba.selective_scan_pytorch` and `ssd_scan_pytorch`; tests/test_kernels.py checks all of them
against float64 recurrences under Triton's interpreter. Imported only on CUDA (or under the interpreter): this file
needs Triton.
"""

import typing

import torch

try:  # (transformers' remote-code loader reads imports outside try blocks as requirements: a CPU needs no Triton)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - ssm_samba imports this file only where Triton is
    triton = tl = None

from .kernels_samba import run_kernel

CHUNK = 64  # tokens between the forward's checkpoints, and the backward's recompute length
# The forward's launch: channels per program at most (the state block, BLOCK_D x BLOCK_N floats, stays at most 2048
# in registers), and warps per program. Set by the compiler's resources and kept by a GPU's timings:
# benchmarks/gpu.py's `scan_configs` times the alternatives (fewer channels, 1 / 2 / 8 warps: each slower).
BLOCK_D_MAX = 32
NUM_WARPS = 4
# Tokens a step of the forward: at most TILE_MAX (1: a token a step), with the step's tile (tokens x channels x
# states, float32) at most TILE_ELEMENTS, so that it stays in registers without spilling (16 tokens of 32 channels
# spill): 4 tokens for Samba's layers and 1 for Mamba-2's 128 states. Chosen by the compiler's resources and kept by
# a GPU's timings (`scan_configs`: a token a step and 8 or 16 tokens a step were slower).
TILE_MAX = 16
TILE_ELEMENTS = 2048


@triton.jit
def _load_rows(ptr, b, t, t_ok, d, d_ok, stride_b, stride_t, HEAD_DIM: tl.constexpr):
    """(TILE, BLOCK_D) values of tokens t for the block's channels (zero where not t_ok), from a (batch, seq,
    channels / HEAD_DIM) tensor."""
    offsets = b * stride_b + t[:, None] * stride_t + (d // HEAD_DIM)[None, :]
    return tl.load(ptr + offsets, mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _load_state_rows(ptr, b, t, t_ok, group, n, d_ok, n_ok, stride_b, stride_t, stride_g, ONE_GROUP: tl.constexpr):
    """B or C of tokens t for the block's channels: (TILE, 1, BLOCK_N) when they share a group, else
    (TILE, BLOCK_D, BLOCK_N)."""
    rows = ptr + b * stride_b + t[:, None, None] * stride_t
    if ONE_GROUP:
        values = tl.load(
            rows + group * stride_g + n[None, None, :], mask=t_ok[:, None, None] & n_ok[None, None, :], other=0.0
        ).to(tl.float32)
    else:
        values = tl.load(
            rows + group[None, :, None] * stride_g + n[None, None, :],
            mask=t_ok[:, None, None] & (d_ok[:, None] & n_ok[None, :])[None, :, :],
            other=0.0,
        ).to(tl.float32)
    return values


@triton.jit
def _decays(dt, A, A_PER_HEAD: tl.constexpr):
    """exp(dt A) of a tile: (TILE, BLOCK_D, 1) when A is one number per channel, else (TILE, BLOCK_D, BLOCK_N)."""
    if A_PER_HEAD:
        decay = tl.exp(dt * A[None, :])[:, :, None]
    else:
        decay = tl.exp(dt[:, :, None] * A[None, :, :])
    return decay


@triton.jit
def _first_order(decay_1, state_1, decay_2, state_2):
    """Two steps of h -> decay * h + state, the first then the second, as one (the associative scan's combine)."""
    return decay_1 * decay_2, decay_2 * state_1 + state_2


@triton.jit
def _scan_tile(decay, step, before, TILE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """h after each of a tile's steps h -> decay * h + step, from h = before: (TILE, BLOCK_D, BLOCK_N). decay may be
    (TILE, BLOCK_D, 1) (Mamba-2's heads); the steps are composed by an associative scan over the tile."""
    decay = decay + tl.zeros((TILE, BLOCK_D, BLOCK_N), dtype=tl.float32)  # (the scan takes equal shapes)
    decays, states = tl.associative_scan((decay, step), axis=0, combine_fn=_first_order)
    return states + decays * before[None, :, :]


@triton.jit
def _carry_tile(
    grad,
    C,
    dt,
    dt_after,
    A,
    carry,
    A_PER_HEAD: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The backward's step over a tile read from its last token (row i: token last - i): the gradient of the state
    after each token, carry_t = grad_t C_t + exp(dt_{t+1} A) carry_{t+1}, from `carry` coming in after the tile
    (dt_after: each token's next one's step, 0 after the tile's last, whose carry comes in whole); the tile's decays
    exp(dt A); and the gradient of the state before its first token. grad: the output's gradient before the gate."""
    carries = _scan_tile(_decays(dt_after, A, A_PER_HEAD), grad[:, :, None] * C, carry, TILE, BLOCK_D, BLOCK_N)
    decay = _decays(dt, A, A_PER_HEAD)
    return carries, decay, _last(carries * decay, TILE)


@triton.jit
def _last(values, TILE: tl.constexpr):
    """values[TILE - 1] of a (TILE, ...) tile."""
    return tl.sum(tl.where((tl.arange(0, TILE) == TILE - 1)[:, None, None], values, 0.0), axis=0)


@triton.jit
def _group(block, d, channels_per_group, BLOCK_D: tl.constexpr, ONE_GROUP: tl.constexpr):
    """The group (of B and C) of the block's channels: one number when they share it, else one per channel."""
    if ONE_GROUP:
        group = (block * BLOCK_D) // channels_per_group
    else:
        group = d // channels_per_group
    return group


@triton.jit
def _load_A(A_ptr, d, dn, d_ok, dn_ok, HEAD_DIM: tl.constexpr, A_PER_HEAD: tl.constexpr):
    """The block's decay rates: one per channel (its head's) when A_PER_HEAD, else a (BLOCK_D, BLOCK_N) row each."""
    if A_PER_HEAD:
        A = tl.load(A_ptr + d // HEAD_DIM, mask=d_ok, other=0.0).to(tl.float32)
    else:
        A = tl.load(A_ptr + dn, mask=dn_ok, other=0.0).to(tl.float32)
    return A


@triton.jit
def _decay(dt, A, A_PER_HEAD: tl.constexpr):
    """exp(dt A): (BLOCK_D, 1) when A is one number per channel (Mamba-2's heads), else (BLOCK_D, BLOCK_N)."""
    if A_PER_HEAD:
        decay = tl.exp(dt * A)[:, None]
    else:
        decay = tl.exp(dt[:, None] * A)
    return decay


@triton.jit
def _scan_forward(
    u_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    z_ptr,
    h0_ptr,
    y_ptr,
    h_ptr,
    checkpoints_ptr,
    elapsed_ptr,
    seq_len,
    d_inner,
    d_state,
    channels_per_group,
    segment_len,
    stride_u_b,
    stride_u_t,
    stride_dt_b,
    stride_dt_t,
    stride_B_b,
    stride_B_t,
    stride_B_g,
    stride_C_b,
    stride_C_t,
    stride_C_g,
    stride_z_b,
    stride_z_t,
    stride_y_b,
    stride_y_t,
    HEAD_DIM: tl.constexpr,
    A_PER_HEAD: tl.constexpr,
    ONE_GROUP: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_H0: tl.constexpr,
    KEEP_CHECKPOINTS: tl.constexpr,
    SEGMENTED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE: tl.constexpr,
):
    """Program (sequence b, channel block, segment s) scans tokens [s * segment_len, (s + 1) * segment_len), from h0
    in the first segment and from zero in the others (`_join_segments` and `_correct_segments` then add what the
    true starting state contributes), and leaves its last state in h[b, s] (h: (batch, segments, channels,
    d_state)) and, SEGMENTED, the sum of its steps in elapsed[b, s] ((batch, segments, channels)). KEEP_CHECKPOINTS:
    the state before each chunk of CHUNK tokens too, into checkpoints (batch, chunks, channels, d_state); segments
    are then whole chunks."""
    b = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: a batch of long sequences passes 2**31 elements
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    segment = tl.program_id(2)
    n = tl.arange(0, BLOCK_N)
    d_ok, n_ok = d < d_inner, n < d_state
    dn_ok = d_ok[:, None] & n_ok[None, :]
    dn = d[:, None] * d_state + n[None, :]  # offsets in a (channels, d_state) matrix
    group = _group(tl.program_id(1), d, channels_per_group, BLOCK_D, ONE_GROUP)
    A = _load_A(A_ptr, d, dn, d_ok, dn_ok, HEAD_DIM, A_PER_HEAD)
    if HAS_D:
        D = tl.load(D_ptr + d // HEAD_DIM, mask=d_ok, other=0.0).to(tl.float32)
    h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    if HAS_H0:  # (batch, channels, d_state); only the first segment starts from it
        if segment == 0:
            h = tl.load(h0_ptr + b * d_inner * d_state + dn, mask=dn_ok, other=0.0).to(tl.float32)
    elapsed = tl.zeros((BLOCK_D,), dtype=tl.float32)
    start = segment.to(tl.int64) * segment_len
    end = tl.minimum(start + segment_len, seq_len)
    for c in range(0, tl.cdiv(end - start, CHUNK)):
        if KEEP_CHECKPOINTS:  # (after a segment's start, its share: `_correct_segments` adds the rest)
            chunk = start // CHUNK + c
            tl.store(checkpoints_ptr + (b * tl.cdiv(seq_len, CHUNK) + chunk) * d_inner * d_state + dn, h, mask=dn_ok)
        chunk_end = tl.minimum(start + c * CHUNK + CHUNK, end)
        for first in range(start + c * CHUNK, chunk_end, TILE):
            # TILE tokens a step: their inputs loaded at once, their states by an associative scan over the tile
            # (a token past the end has dt = 0, u = 0: it leaves the state as it was)
            t = first + tl.arange(0, TILE)
            t_ok = t < chunk_end
            u = _load_rows(u_ptr, b, t, t_ok, d, d_ok, stride_u_b, stride_u_t, 1)  # (TILE, BLOCK_D)
            dt = _load_rows(dt_ptr, b, t, t_ok, d, d_ok, stride_dt_b, stride_dt_t, HEAD_DIM)
            B = _load_state_rows(
                B_ptr, b, t, t_ok, group, n, d_ok, n_ok, stride_B_b, stride_B_t, stride_B_g, ONE_GROUP
            )  # (TILE, 1 or BLOCK_D, BLOCK_N)
            C = _load_state_rows(
                C_ptr, b, t, t_ok, group, n, d_ok, n_ok, stride_C_b, stride_C_t, stride_C_g, ONE_GROUP
            )
            states = _scan_tile(_decays(dt, A, A_PER_HEAD), (dt * u)[:, :, None] * B, h, TILE, BLOCK_D, BLOCK_N)
            h = _last(states, TILE)
            if SEGMENTED:
                elapsed += tl.sum(dt, axis=0)
            y = tl.sum(states * C, axis=2)
            if HAS_D:
                y += D[None, :] * u
            if HAS_Z:
                z = _load_rows(z_ptr, b, t, t_ok, d, d_ok, stride_z_b, stride_z_t, 1)
                y *= z * tl.sigmoid(z)
            tl.store(
                y_ptr + b * stride_y_b + t[:, None] * stride_y_t + d[None, :],
                y.to(y_ptr.dtype.element_ty),
                mask=t_ok[:, None] & d_ok[None, :],
            )
    segments = tl.num_programs(2)
    tl.store(h_ptr + (b * segments + segment) * d_inner * d_state + dn, h, mask=dn_ok)
    if SEGMENTED:
        tl.store(elapsed_ptr + (b * segments + segment) * d_inner + d, elapsed, mask=d_ok)


@triton.jit
def _join_segments(
    A_ptr,
    ends_ptr,
    elapsed_ptr,
    starts_ptr,
    h_ptr,
    segments,
    d_inner,
    d_state,
    HEAD_DIM: tl.constexpr,
    A_PER_HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The true state at each segment's start, in order: start[s] = exp(A elapsed[s-1]) start[s-1] + end[s-1] (the
    recurrence is linear in the state), into starts (batch, segments, channels, d_state); the last state into h."""
    b = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: a batch of long sequences passes 2**31 elements
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_ok, n_ok = d < d_inner, n < d_state
    dn_ok = d_ok[:, None] & n_ok[None, :]
    dn = d[:, None] * d_state + n[None, :]
    A = _load_A(A_ptr, d, dn, d_ok, dn_ok, HEAD_DIM, A_PER_HEAD)
    state = tl.load(ends_ptr + b * segments * d_inner * d_state + dn, mask=dn_ok, other=0.0)
    for s in range(1, segments):
        tl.store(starts_ptr + (b * segments + s) * d_inner * d_state + dn, state, mask=dn_ok)
        elapsed = tl.load(elapsed_ptr + (b * segments + s) * d_inner + d, mask=d_ok, other=0.0)
        local_end = tl.load(ends_ptr + (b * segments + s) * d_inner * d_state + dn, mask=dn_ok, other=0.0)
        state = _decay(elapsed, A, A_PER_HEAD) * state + local_end
    tl.store(h_ptr + b * d_inner * d_state + dn, state, mask=dn_ok)


@triton.jit
def _correct_segments(
    dt_ptr,
    A_ptr,
    C_ptr,
    z_ptr,
    starts_ptr,
    y_ptr,
    checkpoints_ptr,
    seq_len,
    d_inner,
    d_state,
    channels_per_group,
    segment_len,
    stride_dt_b,
    stride_dt_t,
    stride_C_b,
    stride_C_t,
    stride_C_g,
    stride_z_b,
    stride_z_t,
    stride_y_b,
    stride_y_t,
    HEAD_DIM: tl.constexpr,
    A_PER_HEAD: tl.constexpr,
    ONE_GROUP: tl.constexpr,
    HAS_Z: tl.constexpr,
    KEEP_CHECKPOINTS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE: tl.constexpr,
):
    """y_t += <g_t, C_t> (gated) over segment s + 1, where g starts at the segment's true starting state and decays
    as the state does (g_t = exp(dt_t A) g_{t-1}): what that state adds to the zero-start scan of `_scan_forward`.
    KEEP_CHECKPOINTS: g is added to the state kept before each of the segment's chunks too."""
    b = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: a batch of long sequences passes 2**31 elements
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    segment = tl.program_id(2) + 1
    n = tl.arange(0, BLOCK_N)
    d_ok, n_ok = d < d_inner, n < d_state
    dn_ok = d_ok[:, None] & n_ok[None, :]
    dn = d[:, None] * d_state + n[None, :]
    group = _group(tl.program_id(1), d, channels_per_group, BLOCK_D, ONE_GROUP)
    A = _load_A(A_ptr, d, dn, d_ok, dn_ok, HEAD_DIM, A_PER_HEAD)
    segments = tl.num_programs(2) + 1
    g = tl.load(starts_ptr + (b * segments + segment) * d_inner * d_state + dn, mask=dn_ok, other=0.0)
    start = segment.to(tl.int64) * segment_len
    end = tl.minimum(start + segment_len, seq_len)
    for first in range(start, end, TILE):
        if KEEP_CHECKPOINTS:  # a chunk starts here (segments are whole chunks, and a tile divides a chunk)
            if (first - start) % CHUNK == 0:
                at = checkpoints_ptr + (b * tl.cdiv(seq_len, CHUNK) + first // CHUNK) * d_inner * d_state + dn
                tl.store(at, tl.load(at, mask=dn_ok, other=0.0) + g, mask=dn_ok)
        t = first + tl.arange(0, TILE)
        t_ok = t < end
        dt = _load_rows(dt_ptr, b, t, t_ok, d, d_ok, stride_dt_b, stride_dt_t, HEAD_DIM)  # (TILE, BLOCK_D)
        C = _load_state_rows(C_ptr, b, t, t_ok, group, n, d_ok, n_ok, stride_C_b, stride_C_t, stride_C_g, ONE_GROUP)
        # g after each token of the tile: exp(A * (dt summed up to it)) g (exp(a) exp(b) = exp(a + b))
        decays = _decays(tl.cumsum(dt, axis=0), A, A_PER_HEAD) * g[None, :, :]  # (TILE, BLOCK_D, BLOCK_N)
        g = _last(decays, TILE)
        correction = tl.sum(decays * C, axis=2)
        if HAS_Z:
            z = _load_rows(z_ptr, b, t, t_ok, d, d_ok, stride_z_b, stride_z_t, 1)
            correction *= z * tl.sigmoid(z)
        y_at = y_ptr + b * stride_y_b + t[:, None] * stride_y_t + d[None, :]
        y_ok = t_ok[:, None] & d_ok[None, :]
        y = tl.load(y_at, mask=y_ok, other=0.0).to(tl.float32) + correction
        tl.store(y_at, y.to(y_ptr.dtype.element_ty), mask=y_ok)


@triton.jit
def _scan_backward(
    u_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    z_ptr,
    checkpoints_ptr,
    scratch_ptr,
    grad_y_ptr,
    carry_in_ptr,
    grad_u_ptr,
    grad_dt_ptr,
    grad_A_ptr,
    grad_B_ptr,
    grad_C_ptr,
    grad_D_ptr,
    grad_z_ptr,
    grad_h0_ptr,
    seq_len,
    d_inner,
    d_state,
    channels_per_group,
    groups,
    segment_len,
    stride_u_b,
    stride_u_t,
    stride_dt_b,
    stride_dt_t,
    stride_B_b,
    stride_B_t,
    stride_B_g,
    stride_C_b,
    stride_C_t,
    stride_C_g,
    stride_z_b,
    stride_z_t,
    stride_gy_b,
    stride_gy_t,
    stride_g_b,
    stride_g_t,
    HEAD_DIM: tl.constexpr,
    A_PER_HEAD: tl.constexpr,
    ONE_GROUP: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE: tl.constexpr,
):
    """Gradients, per program (sequence b, channel block, segment s of segment_len tokens, whole chunks), from the
    gradient of the state after the segment's last token, carry_in[b, s] ((batch, segments, channels, d_state):
    `_carry_segments` and `_join_segments` find it for all but the last): u, dt (per channel), z: its own entries;
    h0: the first segment's; A, D: per sequence, segment and channel, (batch, segments, channels, d_state or 1) and
    (batch, segments, channels), summed by the caller; B, C: added atomically into (batch, seq, groups, d_state)."""
    b = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: a batch of long sequences passes 2**31 elements
    block = tl.program_id(1)
    segment = tl.program_id(2)
    segments = tl.num_programs(2)
    d = block * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_ok, n_ok = d < d_inner, n < d_state
    dn_ok = d_ok[:, None] & n_ok[None, :]
    dn = d[:, None] * d_state + n[None, :]
    local = tl.arange(0, BLOCK_D)[:, None] * BLOCK_N + n[None, :]  # offsets in this program's scratch states
    group = _group(block, d, channels_per_group, BLOCK_D, ONE_GROUP)
    A = _load_A(A_ptr, d, dn, d_ok, dn_ok, HEAD_DIM, A_PER_HEAD)
    if A_PER_HEAD:  # (a ternary on a constexpr is avoided: plain branches compile on every Triton release)
        grad_A = tl.zeros((BLOCK_D,), dtype=tl.float32)
    else:
        grad_A = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + d // HEAD_DIM, mask=d_ok, other=0.0).to(tl.float32)
    program = (b * tl.num_programs(1) + block) * segments + segment
    scratch = scratch_ptr + program * (CHUNK + 1) * BLOCK_D * BLOCK_N
    carry = tl.load(carry_in_ptr + (b * segments + segment) * d_inner * d_state + dn, mask=dn_ok, other=0.0)
    grad_D = tl.zeros((BLOCK_D,), dtype=tl.float32)
    chunks = tl.cdiv(seq_len, CHUNK)
    first_chunk = segment * (segment_len // CHUNK)
    last_chunk = tl.minimum(first_chunk + segment_len // CHUNK, chunks) - 1
    for reverse in range(0, last_chunk - first_chunk + 1):
        c = last_chunk - reverse
        start = c.to(tl.int64) * CHUNK
        end = tl.minimum(start + CHUNK, seq_len)
        # the chunk's states, recomputed from its checkpoint a tile at a time: scratch[k] = the state before token
        # start + k
        h = tl.load(checkpoints_ptr + (b * chunks + c) * d_inner * d_state + dn, mask=dn_ok, other=0.0)
        tl.store(scratch + local, h)
        for first in range(start, end, TILE):
            t = first + tl.arange(0, TILE)
            t_ok = t < end
            u = _load_rows(u_ptr, b, t, t_ok, d, d_ok, stride_u_b, stride_u_t, 1)
            dt = _load_rows(dt_ptr, b, t, t_ok, d, d_ok, stride_dt_b, stride_dt_t, HEAD_DIM)
            B = _load_state_rows(
                B_ptr, b, t, t_ok, group, n, d_ok, n_ok, stride_B_b, stride_B_t, stride_B_g, ONE_GROUP
            )
            states = _scan_tile(_decays(dt, A, A_PER_HEAD), (dt * u)[:, :, None] * B, h, TILE, BLOCK_D, BLOCK_N)
            h = _last(states, TILE)
            tl.store(
                scratch + (t - start + 1)[:, None, None] * BLOCK_D * BLOCK_N + local[None, :, :],
                states,
                mask=t_ok[:, None, None],
            )
        tl.debug_barrier()
        # then back through the chunk a tile at a time, each tile's tokens from its last (row i: token last - i),
        # so that the gradient of the state, carry_t = grad_y_t C_t + exp(dt_{t+1} A) carry_{t+1}, is an
        # associative scan in the same order as the forward's
        tiles = tl.cdiv(end - start, TILE)
        for k in range(0, tiles):
            last = start + (tiles - 1 - k) * TILE + TILE - 1
            t = last - tl.arange(0, TILE)
            t_ok = t < end
            u = _load_rows(u_ptr, b, t, t_ok, d, d_ok, stride_u_b, stride_u_t, 1)  # (TILE, BLOCK_D)
            dt = _load_rows(dt_ptr, b, t, t_ok, d, d_ok, stride_dt_b, stride_dt_t, HEAD_DIM)
            B = _load_state_rows(
                B_ptr, b, t, t_ok, group, n, d_ok, n_ok, stride_B_b, stride_B_t, stride_B_g, ONE_GROUP
            )
            C = _load_state_rows(
                C_ptr, b, t, t_ok, group, n, d_ok, n_ok, stride_C_b, stride_C_t, stride_C_g, ONE_GROUP
            )
            grad = _load_rows(grad_y_ptr, b, t, t_ok, d, d_ok, stride_gy_b, stride_gy_t, 1)
            rows = (t - start)[:, None, None] * BLOCK_D * BLOCK_N + local[None, :, :]
            h_before = tl.load(
                scratch + rows, mask=t_ok[:, None, None], other=0.0
            )  # h_{t-1}: (TILE, BLOCK_D, BLOCK_N)
            h_after = tl.load(scratch + rows + BLOCK_D * BLOCK_N, mask=t_ok[:, None, None], other=0.0)  # h_t
            if HAS_Z:  # y = s * silu(z), s the output before the gate
                z = _load_rows(z_ptr, b, t, t_ok, d, d_ok, stride_z_b, stride_z_t, 1)
                s = tl.sum(h_after * C, axis=2)
                if HAS_D:
                    s += D[None, :] * u
                sig = tl.sigmoid(z)
                tl.store(
                    grad_z_ptr + b * stride_g_b + t[:, None] * stride_g_t + d[None, :],
                    grad * s * sig * (1.0 + z * (1.0 - sig)),
                    mask=t_ok[:, None] & d_ok[None, :],
                )
                grad = grad * z * sig  # the gradient of s
            if HAS_D:
                grad_D += tl.sum(grad * u, axis=0)
            _add_tile_over_channels(
                grad_C_ptr,
                h_after * grad[:, :, None],
                b,
                t,
                t_ok,
                group,
                n,
                d_ok,
                n_ok,
                seq_len,
                groups,
                d_state,
                ONE_GROUP,
            )
            # the decay of the token after each (1 after the tile's last: the carry from there comes in whole)
            after = t + 1
            dt_after = _load_rows(
                dt_ptr, b, after, (after <= last) & (after < end), d, d_ok, stride_dt_b, stride_dt_t, HEAD_DIM
            )
            # carries: the gradient of h_t; carry: of the state before the tile's first token
            carries, decay, carry = _carry_tile(grad, C, dt, dt_after, A, carry, A_PER_HEAD, TILE, BLOCK_D, BLOCK_N)
            from_decay = tl.where(dn_ok[None, :, :], carries * decay * h_before, 0.0)  # d/d(dt A) of decay h_{t-1}
            into_state = tl.where(dn_ok[None, :, :], carries * B, 0.0)
            if A_PER_HEAD:
                grad_A += tl.sum(tl.sum(from_decay, axis=2) * dt, axis=0)
                grad_dt = tl.sum(from_decay, axis=2) * A[None, :] + tl.sum(into_state, axis=2) * u
            else:
                grad_A += tl.sum(from_decay * dt[:, :, None], axis=0)
                grad_dt = tl.sum(from_decay * A[None, :, :] + into_state * u[:, :, None], axis=2)
            grad_u = tl.sum(into_state, axis=2) * dt
            if HAS_D:
                grad_u += grad * D[None, :]
            rows_ok = t_ok[:, None] & d_ok[None, :]
            tl.store(grad_u_ptr + b * stride_g_b + t[:, None] * stride_g_t + d[None, :], grad_u, mask=rows_ok)
            tl.store(grad_dt_ptr + b * stride_g_b + t[:, None] * stride_g_t + d[None, :], grad_dt, mask=rows_ok)
            _add_tile_over_channels(
                grad_B_ptr,
                carries * (dt * u)[:, :, None],
                b,
                t,
                t_ok,
                group,
                n,
                d_ok,
                n_ok,
                seq_len,
                groups,
                d_state,
                ONE_GROUP,
            )
        tl.debug_barrier()
    if segment == 0:
        tl.store(grad_h0_ptr + b * d_inner * d_state + dn, carry, mask=dn_ok)
    if A_PER_HEAD:
        tl.store(grad_A_ptr + (b * segments + segment) * d_inner + d, grad_A, mask=d_ok)
    else:
        tl.store(grad_A_ptr + (b * segments + segment) * d_inner * d_state + dn, grad_A, mask=dn_ok)
    if HAS_D:
        tl.store(grad_D_ptr + (b * segments + segment) * d_inner + d, grad_D, mask=d_ok)


@triton.jit
def _carry_segments(
    dt_ptr,
    A_ptr,
    C_ptr,
    z_ptr,
    grad_y_ptr,
    ends_ptr,
    elapsed_ptr,
    seq_len,
    d_inner,
    d_state,
    channels_per_group,
    segment_len,
    stride_dt_b,
    stride_dt_t,
    stride_C_b,
    stride_C_t,
    stride_C_g,
    stride_z_b,
    stride_z_t,
    stride_gy_b,
    stride_gy_t,
    HEAD_DIM: tl.constexpr,
    A_PER_HEAD: tl.constexpr,
    ONE_GROUP: tl.constexpr,
    HAS_Z: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE: tl.constexpr,
):
    """For a segmented backward, program (sequence b, channel block, segment s = 1, 2, ...): the gradient of the
    state before the segment's first token that its own outputs give, from zero after its last token (the adjoint
    recurrence carry_t = grad_t C_t + exp(dt_{t+1} A) carry_{t+1}, read only from dt, C, z and the output's
    gradient: no state is needed), and the sum of its steps. Stored in reversed order, at slot segments - s of ends
    (batch, segments, channels, d_state) and elapsed (batch, segments, channels), so that `_join_segments`, walking
    its slots up, carries the gradient from the last segment down to the first."""
    b = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: a batch of long sequences passes 2**31 elements
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    segment = tl.program_id(2) + 1
    segments = tl.num_programs(2) + 1
    n = tl.arange(0, BLOCK_N)
    d_ok, n_ok = d < d_inner, n < d_state
    dn_ok = d_ok[:, None] & n_ok[None, :]
    dn = d[:, None] * d_state + n[None, :]
    group = _group(tl.program_id(1), d, channels_per_group, BLOCK_D, ONE_GROUP)
    A = _load_A(A_ptr, d, dn, d_ok, dn_ok, HEAD_DIM, A_PER_HEAD)
    start = segment.to(tl.int64) * segment_len
    end = tl.minimum(start + segment_len, seq_len)
    tiles = tl.cdiv(end - start, TILE)
    carry = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    elapsed = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in range(0, tiles):  # a tile at a time from the last, each from its last token, as `_scan_backward` goes
        last = start + (tiles - 1 - k) * TILE + TILE - 1
        t = last - tl.arange(0, TILE)
        t_ok = t < end
        dt = _load_rows(dt_ptr, b, t, t_ok, d, d_ok, stride_dt_b, stride_dt_t, HEAD_DIM)  # (TILE, BLOCK_D)
        C = _load_state_rows(C_ptr, b, t, t_ok, group, n, d_ok, n_ok, stride_C_b, stride_C_t, stride_C_g, ONE_GROUP)
        grad = _load_rows(grad_y_ptr, b, t, t_ok, d, d_ok, stride_gy_b, stride_gy_t, 1)
        if HAS_Z:
            z = _load_rows(z_ptr, b, t, t_ok, d, d_ok, stride_z_b, stride_z_t, 1)
            grad = grad * z * tl.sigmoid(z)  # the gradient of the output before the gate
        after = t + 1
        dt_after = _load_rows(
            dt_ptr, b, after, (after <= last) & (after < end), d, d_ok, stride_dt_b, stride_dt_t, HEAD_DIM
        )
        _, _, carry = _carry_tile(grad, C, dt, dt_after, A, carry, A_PER_HEAD, TILE, BLOCK_D, BLOCK_N)
        elapsed += tl.sum(dt, axis=0)
    slot = segments - segment
    tl.store(ends_ptr + (b * segments + slot) * d_inner * d_state + dn, carry, mask=dn_ok)
    tl.store(elapsed_ptr + (b * segments + slot) * d_inner + d, elapsed, mask=d_ok)


@triton.jit
def _add_tile_over_channels(
    grad_ptr, values, b, t, t_ok, group, n, d_ok, n_ok, seq_len, groups, d_state, ONE_GROUP: tl.constexpr
):
    """grad[b, t, group(channel), :] += values[t, channel, :] for tokens t (where t_ok) and the block's channels
    (grad: (batch, seq, groups, d_state), float32; atomically, as other programs add theirs)."""
    rows = grad_ptr + ((b * seq_len + t) * groups) * d_state  # (TILE,)
    if ONE_GROUP:
        tl.atomic_add(
            rows[:, None] + group * d_state + n[None, :],
            tl.sum(tl.where(d_ok[None, :, None], values, 0.0), axis=1),
            mask=t_ok[:, None] & n_ok[None, :],
        )
    else:
        tl.atomic_add(
            rows[:, None, None] + group[None, :, None] * d_state + n[None, None, :],
            values,
            mask=t_ok[:, None, None] & (d_ok[:, None] & n_ok[None, :])[None, :, :],
        )


@triton.jit
def _ssd_chunked_forward(
    x_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    h0_ptr,
    y_ptr,
    h_ptr,
    seq_len,
    heads,
    head_dim,
    d_state,
    heads_per_group,
    stride_x_b,
    stride_x_t,
    stride_x_h,
    stride_dt_b,
    stride_dt_t,
    stride_B_b,
    stride_B_t,
    stride_B_g,
    stride_C_b,
    stride_C_t,
    stride_C_g,
    stride_y_b,
    stride_y_t,
    stride_y_h,
    HAS_D: tl.constexpr,
    HAS_H0: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Mamba-2's SSD for inference in its chunked matrix form (`ssm_samba.ssd_scan_pytorch`'s), the products on
    the tensor cores. Program (sequence b, head h, block of BLOCK_P of its channels) walks the chunks of CHUNK tokens
    in order, holding the state S (BLOCK_P x d_state, float32); with cum_i = dt_1 A + ... + dt_i A in a chunk:

        y_i = sum_{j <= i} exp(cum_i - cum_j) dt_j (C_i . B_j) x_j + exp(cum_i) S C_i + D x_i
        S  <- exp(cum_last) S + sum_j exp(cum_last - cum_j) dt_j x_j B_j^T

    every exponent <= 0. x, B and C in bf16 or fp16: the products take them so (the weights and the state rounded
    to it too, as mamba-ssm's SSD does), accumulating in float32."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    i = tl.arange(0, CHUNK)
    p_ok, n_ok = p < head_dim, n < d_state
    pn = (head * head_dim + p)[:, None] * d_state + n[None, :]  # offsets in a (heads x head_dim, d_state) state
    pn_ok = p_ok[:, None] & n_ok[None, :]
    group = head // heads_per_group
    A = tl.load(A_ptr + head).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + head).to(tl.float32)
    S = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    if HAS_H0:
        S = tl.load(h0_ptr + b * heads * head_dim * d_state + pn, mask=pn_ok, other=0.0).to(tl.float32)
    dot_dtype = x_ptr.dtype.element_ty
    causal = i[:, None] >= i[None, :]
    for start in range(0, seq_len, CHUNK):
        t = start + i
        t_ok = t < seq_len
        x = tl.load(
            x_ptr + b * stride_x_b + t[:, None] * stride_x_t + head * stride_x_h + p[None, :],
            mask=t_ok[:, None] & p_ok[None, :],
            other=0.0,
        )  # (CHUNK, BLOCK_P)
        dt = tl.load(dt_ptr + b * stride_dt_b + t * stride_dt_t + head, mask=t_ok, other=0.0).to(tl.float32)
        state_rows = t_ok[:, None] & n_ok[None, :]
        B = tl.load(
            B_ptr + b * stride_B_b + t[:, None] * stride_B_t + group * stride_B_g + n[None, :],
            mask=state_rows,
            other=0.0,
        ).to(dot_dtype)  # (CHUNK, BLOCK_N)
        C = tl.load(
            C_ptr + b * stride_C_b + t[:, None] * stride_C_t + group * stride_C_g + n[None, :],
            mask=state_rows,
            other=0.0,
        ).to(dot_dtype)
        cum = tl.cumsum(dt * A, axis=0)  # (CHUNK,); a token past the end adds 0
        cum_last = tl.sum(tl.where(i == CHUNK - 1, cum, 0.0), axis=0)
        # within the chunk: (C B^T, masked to j <= i and decayed) x
        scores = tl.dot(C, tl.trans(B))  # (CHUNK, CHUNK)
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        weights = (scores * decay * dt[None, :]).to(dot_dtype)
        y = tl.dot(weights, x)  # (CHUNK, BLOCK_P)
        # from the state the chunk starts in
        y += tl.dot(C, tl.trans(S.to(dot_dtype))) * tl.exp(cum)[:, None]
        if HAS_D:
            y += D * x.to(tl.float32)
        tl.store(
            y_ptr + b * stride_y_b + t[:, None] * stride_y_t + head * stride_y_h + p[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=t_ok[:, None] & p_ok[None, :],
        )
        # the state after the chunk
        inputs = (x.to(tl.float32) * (tl.exp(cum_last - cum) * dt)[:, None]).to(dot_dtype)  # (CHUNK, BLOCK_P)
        S = S * tl.exp(cum_last) + tl.dot(tl.trans(inputs), B)
    tl.store(h_ptr + b * heads * head_dim * d_state + pn, S, mask=pn_ok)


class _Layout:
    """How channels map onto heads and groups: Mamba (head_dim 1: every channel its own dt and A row; one group)
    or Mamba-2 (heads of head_dim channels sharing dt, A and D; groups of heads sharing B and C)."""

    def __init__(self, d_inner, d_state, head_dim, groups, a_per_head):
        self.d_inner, self.d_state, self.head_dim, self.groups = d_inner, d_state, head_dim, groups
        self.a_per_head = a_per_head
        self.channels_per_group = d_inner // groups
        self.block_n = triton.next_power_of_2(d_state)
        # channels per program: the state block (block_d x block_n) stays at most 2048 floats in registers
        self.block_d = max(1, min(BLOCK_D_MAX, 2048 // self.block_n, triton.next_power_of_2(d_inner)))
        self.one_group = groups == 1 or self.channels_per_group % self.block_d == 0
        self.blocks = triton.cdiv(d_inner, self.block_d)
        # tokens a step of the forward (a power of two, dividing CHUNK)
        self.tile = max(1, min(TILE_MAX, CHUNK, TILE_ELEMENTS // (self.block_d * self.block_n)))

    def tile_for(self, seq_len: int) -> int:
        """Tokens a step for seq_len tokens: no more than there are (the decoding step takes one a step)."""
        return min(self.tile, triton.next_power_of_2(seq_len))

    def constants(self):
        return dict(
            HEAD_DIM=self.head_dim,
            A_PER_HEAD=self.a_per_head,
            ONE_GROUP=self.one_group,
            CHUNK=CHUNK,
            BLOCK_D=self.block_d,
            BLOCK_N=self.block_n,
        )


def _strides(x, n):
    return x.stride()[:n] if x is not None else (0,) * n


# Segments: a long sequence is cut into segments scanned at once from zero, then joined (the time parallelism a
# sequential scan lacks: with few sequences and channel blocks, most of the GPU would wait), and walked back at once
# in the backward. Each segment at least MIN_SEGMENT tokens (whole chunks where there is a backward); about
# PROGRAMS_PER_SM programs per multiprocessor in all. Chosen by a GPU's timings (benchmarks/gpu.py's `scan_configs`,
# docs/speed.md): of 64 / 128 / 256 / 512 tokens, the smallest segments and the most programs were the fastest,
# forward and backward.
MIN_SEGMENT = 64
PROGRAMS_PER_SM = 32


def _segments(layout, batch: int, seq_len: int, device: torch.device) -> int:
    if seq_len < 2 * MIN_SEGMENT:
        return 1
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-PROGRAMS_PER_SM * processors // (batch * layout.blocks))
    return max(1, min(wanted, seq_len // MIN_SEGMENT))


def _segment_len(layout, batch: int, seq_len: int, device: torch.device, whole_chunks: bool) -> int:
    """Tokens a segment (`_segments`); whole_chunks: a multiple of CHUNK (the checkpoints' spacing)."""
    length = -(-seq_len // _segments(layout, batch, seq_len, device))
    return CHUNK * -(-length // CHUNK) if whole_chunks else length


def _forward(layout, u, dt, A, B, C, D, z, h0, keep_checkpoints: bool):
    """y (u's dtype), the last state and the checkpoints (float32; None unless keep_checkpoints). u, z (batch, seq,
    channels); dt (batch, seq, channels / head_dim); B, C (batch, seq, groups, d_state)."""
    batch, seq_len, d_inner = u.shape
    d_state = layout.d_state
    segment_len = _segment_len(layout, batch, seq_len, u.device, whole_chunks=keep_checkpoints)
    segments = max(1, -(-seq_len // segment_len))
    # segments: y in float32 until the correction is added, so that a half-precision y is rounded once
    y = torch.empty_like(u, dtype=torch.float32 if segments > 1 else u.dtype)
    ends = u.new_empty(batch, segments, d_inner, d_state, dtype=torch.float32)
    elapsed = u.new_empty(batch, segments, d_inner, dtype=torch.float32) if segments > 1 else None
    checkpoints = (
        u.new_empty(batch, triton.cdiv(seq_len, CHUNK), d_inner, d_state, dtype=torch.float32)
        if keep_checkpoints
        else None
    )
    _scan_forward[(batch, layout.blocks, segments)](
        u,
        dt,
        A,
        B,
        C,
        D,
        z,
        h0,
        y,
        ends,
        checkpoints,
        elapsed,
        seq_len,
        d_inner,
        d_state,
        layout.channels_per_group,
        segment_len,
        *_strides(u, 2),
        *_strides(dt, 2),
        *_strides(B, 3),
        *_strides(C, 3),
        *_strides(z, 2),
        *_strides(y, 2),
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_H0=h0 is not None,
        KEEP_CHECKPOINTS=keep_checkpoints,
        SEGMENTED=segments > 1,
        **layout.constants(),
        TILE=layout.tile_for(min(segment_len, seq_len)),
        num_warps=NUM_WARPS,
    )
    if segments == 1:
        return y, ends[:, 0], checkpoints
    h = u.new_empty(batch, d_inner, d_state, dtype=torch.float32)
    starts = torch.empty_like(ends)
    constants = dict(
        HEAD_DIM=layout.head_dim, A_PER_HEAD=layout.a_per_head, BLOCK_D=layout.block_d, BLOCK_N=layout.block_n
    )
    _join_segments[(batch, layout.blocks)](A, ends, elapsed, starts, h, segments, d_inner, d_state, **constants)
    _correct_segments[(batch, layout.blocks, segments - 1)](
        dt,
        A,
        C,
        z,
        starts,
        y,
        checkpoints,
        seq_len,
        d_inner,
        d_state,
        layout.channels_per_group,
        segment_len,
        *_strides(dt, 2),
        *_strides(C, 3),
        *_strides(z, 2),
        *_strides(y, 2),
        ONE_GROUP=layout.one_group,
        HAS_Z=z is not None,
        KEEP_CHECKPOINTS=keep_checkpoints,
        CHUNK=CHUNK,
        TILE=layout.tile_for(min(segment_len, seq_len)),
        **constants,
        num_warps=NUM_WARPS,
    )
    return y.to(u.dtype), h, checkpoints


def _backward_carries(layout, dt, A, C, z, grad_y, grad_h, segments: int, segment_len: int) -> torch.Tensor:
    """The gradient of the state after each segment's last token, (batch, segments, channels, d_state): grad_h
    (or zero) after the last; before that, what the later segments' outputs give (`_carry_segments`), carried back
    through their decays (`_join_segments`, the forward's join, on the segments in reversed order)."""
    batch, seq_len, d_inner = grad_y.shape
    f32 = dict(dtype=torch.float32, device=grad_y.device)
    ends = torch.empty(batch, segments, d_inner, layout.d_state, **f32)  # slot 0: grad_h; slot k: segment S - k's
    ends[:, 0] = 0.0 if grad_h is None else grad_h
    if segments == 1:
        return ends
    elapsed = torch.empty(batch, segments, d_inner, **f32)
    constants = dict(
        HEAD_DIM=layout.head_dim, A_PER_HEAD=layout.a_per_head, BLOCK_D=layout.block_d, BLOCK_N=layout.block_n
    )
    _carry_segments[(batch, layout.blocks, segments - 1)](
        dt,
        A,
        C,
        z,
        grad_y,
        ends,
        elapsed,
        seq_len,
        d_inner,
        layout.d_state,
        layout.channels_per_group,
        segment_len,
        *_strides(dt, 2),
        *_strides(C, 3),
        *_strides(z, 2),
        *_strides(grad_y, 2),
        ONE_GROUP=layout.one_group,
        HAS_Z=z is not None,
        TILE=layout.tile_for(min(segment_len, seq_len)),
        **constants,
        num_warps=NUM_WARPS,
    )
    starts, first = torch.empty_like(ends), torch.empty(batch, d_inner, layout.d_state, **f32)
    _join_segments[(batch, layout.blocks)](
        A, ends, elapsed, starts, first, segments, d_inner, layout.d_state, **constants
    )
    # slot k of starts holds what flows into segment S - k; the first segment's is the join's last state
    return torch.cat([first[:, None], starts[:, 1:].flip(1)], dim=1)


def _backward(layout, u, dt, A, B, C, D, z, checkpoints, grad_y, grad_h):
    """The gradients of (u, dt, A, B, C, D, z, h0); those of D and z are None where they were not given. A long
    sequence is cut into segments of whole chunks, walked back at once, each from the gradient of the state after
    it (`_backward_carries`): the checkpoints give every chunk's starting state, so only that gradient runs across
    segments, and it is linear."""
    (batch, seq_len, d_inner), d_state = u.shape, layout.d_state
    grad_y = grad_y.contiguous()  # autograd may hand an expanded (stride-0) gradient
    grad_h = None if grad_h is None else grad_h.float()
    segment_len = _segment_len(layout, batch, seq_len, u.device, whole_chunks=True)  # the forward's segments
    segments = -(-seq_len // segment_len)
    carry_in = _backward_carries(layout, dt, A, C, z, grad_y, grad_h, segments, segment_len)
    f32 = dict(dtype=torch.float32, device=u.device)
    grad_u, grad_dt = torch.empty(u.shape, **f32), torch.empty(u.shape, **f32)  # grad_dt per channel
    grad_z = torch.empty(u.shape, **f32) if z is not None else None
    grad_A = torch.empty(batch, segments, d_inner, *(() if layout.a_per_head else (d_state,)), **f32)
    grad_D = torch.empty(batch, segments, d_inner, **f32) if D is not None else None
    grad_B = torch.zeros(batch, seq_len, layout.groups, d_state, **f32)
    grad_C = torch.zeros(batch, seq_len, layout.groups, d_state, **f32)
    grad_h0 = torch.empty(batch, d_inner, d_state, **f32)
    scratch = torch.empty(batch * layout.blocks * segments * (CHUNK + 1) * layout.block_d * layout.block_n, **f32)
    _scan_backward[(batch, layout.blocks, segments)](
        u,
        dt,
        A,
        B,
        C,
        D,
        z,
        checkpoints,
        scratch,
        grad_y,
        carry_in,
        grad_u,
        grad_dt,
        grad_A,
        grad_B,
        grad_C,
        grad_D,
        grad_z,
        grad_h0,
        seq_len,
        d_inner,
        d_state,
        layout.channels_per_group,
        layout.groups,
        segment_len,
        *_strides(u, 2),
        *_strides(dt, 2),
        *_strides(B, 3),
        *_strides(C, 3),
        *_strides(z, 2),
        *_strides(grad_y, 2),
        *_strides(grad_u, 2),  # grad_u, grad_dt and grad_z: contiguous (batch, seq, channels)
        HAS_D=D is not None,
        HAS_Z=z is not None,
        **layout.constants(),
        TILE=layout.tile_for(min(segment_len, seq_len)),
        num_warps=NUM_WARPS,
    )
    heads = d_inner // layout.head_dim
    grad_A, grad_D = grad_A.sum((0, 1)), None if D is None else grad_D.sum((0, 1))
    return (
        grad_u.to(u.dtype),
        grad_dt.view(batch, seq_len, heads, layout.head_dim).sum(-1).to(dt.dtype),  # a head's channels share its dt
        grad_A.view(heads, -1).sum(-1) if layout.a_per_head else grad_A,
        grad_B.view(B.shape).to(B.dtype),
        grad_C.view(C.shape).to(C.dtype),
        None if D is None else grad_D.view(heads, layout.head_dim).sum(-1),
        None if z is None else grad_z.to(z.dtype),
        grad_h0,
    )


class _TritonScan(torch.autograd.Function):
    """The Triton scan with its backward, in eager mode. Inputs contiguous in their last dimension; A, D, h0
    float32; D, z and h0 may be None. Returns y and the last state (batch, channels, d_state)."""

    @staticmethod
    def forward(ctx, layout, u, dt, A, B, C, D, z, h0):
        y, h, checkpoints = _forward(layout, u, dt, A, B, C, D, z, h0, keep_checkpoints=True)
        ctx.layout = layout
        ctx.save_for_backward(u, dt, A, B, C, D, z, checkpoints)
        return y, h

    @staticmethod
    def backward(ctx, grad_y, grad_h):
        grads = _backward(ctx.layout, *ctx.saved_tensors, grad_y, grad_h)
        return (None, *(grad if need else None for grad, need in zip(grads, ctx.needs_input_grad[1:])))


def _operator():
    """The scan as a torch operator, `torch.ops.samba_hf.scan_triton`, with a backward, which `torch.compile` keeps
    as one call (and CUDA graphs capture): the decoding step compiled with transformers' static cache runs it.
    Registered once per process: a second copy of this file (a saved model's remote code) finds it registered and
    uses it. Returns (y, last state, checkpoints); the checkpoints are empty unless `keep_checkpoints`."""
    namespace = torch.ops.samba_hf
    if hasattr(namespace, "scan_triton"):
        return namespace.scan_triton
    Tensor, OptionalTensor = torch.Tensor, typing.Optional[torch.Tensor]

    @torch.library.custom_op("samba_hf::scan_triton", mutates_args=())
    def scan(
        u: Tensor,
        dt: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        D: OptionalTensor,
        z: OptionalTensor,
        h0: OptionalTensor,
        head_dim: int,
        groups: int,
        a_per_head: bool,
        keep_checkpoints: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        layout = _Layout(u.shape[-1], B.shape[-1], head_dim, groups, a_per_head)
        y, h, checkpoints = _forward(layout, u, dt, A, B, C, D, z, h0, keep_checkpoints)
        return y, h.clone() if h._base is not None else h, checkpoints if keep_checkpoints else u.new_empty(0)

    @scan.register_fake
    def _(u, dt, A, B, C, D, z, h0, head_dim, groups, a_per_head, keep_checkpoints):
        batch, seq_len, d_inner = u.shape
        d_state = B.shape[-1]
        checkpoints = (batch, -(-seq_len // CHUNK), d_inner, d_state) if keep_checkpoints else (0,)
        return (
            u.new_empty(u.shape),
            u.new_empty(batch, d_inner, d_state, dtype=torch.float32),
            u.new_empty(checkpoints, dtype=torch.float32),
        )

    @torch.library.custom_op("samba_hf::scan_triton_backward", mutates_args=())
    def scan_backward(
        u: Tensor,
        dt: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        D: OptionalTensor,
        z: OptionalTensor,
        checkpoints: Tensor,
        grad_y: Tensor,
        grad_h: OptionalTensor,
        head_dim: int,
        groups: int,
        a_per_head: bool,
    ) -> list[Tensor]:
        layout = _Layout(u.shape[-1], B.shape[-1], head_dim, groups, a_per_head)
        if checkpoints.numel() == 0:  # the forward kept none (reading them would read past the empty tensor)
            raise RuntimeError(
                "samba_hf::scan_triton was run with keep_checkpoints=False: nothing to differentiate; "
                "call it with keep_checkpoints=True where gradients are needed"
            )
        grads = _backward(layout, u, dt, A, B, C, D, z, checkpoints, grad_y, grad_h)
        return [u.new_empty(0) if grad is None else grad for grad in grads]  # an operator returns no None

    @scan_backward.register_fake
    def _(u, dt, A, B, C, D, z, checkpoints, grad_y, grad_h, head_dim, groups, a_per_head):
        absent = u.new_empty(0)
        return [
            u.new_empty(u.shape),
            dt.new_empty(dt.shape),
            A.new_empty(A.shape),
            B.new_empty(B.shape),
            C.new_empty(C.shape),
            absent if D is None else D.new_empty(D.shape),
            absent if z is None else z.new_empty(z.shape),
            u.new_empty(u.shape[0], u.shape[-1], B.shape[-1], dtype=torch.float32),
        ]

    def setup_context(ctx, inputs, output):
        u, dt, A, B, C, D, z, h0, head_dim, groups, a_per_head, _ = inputs
        ctx.save_for_backward(u, dt, A, B, C, D, z, output[2])
        ctx.layout_args = (head_dim, groups, a_per_head)
        ctx.absent = (False,) * 5 + (D is None, z is None, h0 is None)

    def backward(ctx, grad_y, grad_h, _):
        grads = scan_backward(*ctx.saved_tensors, grad_y, grad_h, *ctx.layout_args)
        return *(None if absent else grad for grad, absent in zip(grads, ctx.absent)), None, None, None, None

    scan.register_autograd(backward, setup_context=setup_context)
    return scan


_OPERATOR = _operator()


def _run(layout, u, dt, A, B, C, D, z, h0):
    def rows(x):  # contiguous along the last dimension, as the kernels read it
        return None if x is None else (x if x.stride(-1) == 1 else x.contiguous())

    u, dt, B, C, z = map(rows, (u, dt, B, C, z))
    A = A.float().contiguous()
    D = None if D is None else D.float().contiguous()
    h0 = None if h0 is None else h0.float().contiguous()
    inputs = (u, dt, A, B, C, D, z, h0)
    return run_kernel(
        inputs,
        lambda: _forward(layout, *inputs, keep_checkpoints=False)[:2],
        operator=lambda: _OPERATOR(
            *inputs, layout.head_dim, layout.groups, layout.a_per_head, torch.is_grad_enabled()
        )[:2],
        autograd=lambda: _TritonScan.apply(layout, *inputs),
    )


def selective_scan_triton(u, dt, A, B, C, D=None, z=None, h0=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba's scan on a CUDA tensor (the arguments and results of `ssm_samba.selective_scan_pytorch`): u, dt, z
    (batch, seq, d_inner); A (d_inner, d_state), <= 0; B, C (batch, seq, d_state); D (d_inner,); h0
    (batch, d_inner, d_state). y comes back in u's dtype, the last state in float32; differentiable."""
    d_inner, d_state = A.shape
    layout = _Layout(d_inner, d_state, head_dim=1, groups=1, a_per_head=False)
    return _run(layout, u, dt, A, B[:, :, None], C[:, :, None], D, z, h0)


# The chunked SSD's launch (`ssd_chunked_triton`): SSD_CHUNK tokens a chunk, SSD_BLOCK_P channels of a head a program.
# Chunks of 32 (64 spill registers, and were no faster); a whole head of 64 channels a program, with 8 warps: by a
# GPU's timings (`scan_configs`, docs/speed.md) twice as fast at 32K tokens as 32 channels, with the same output (a
# head's B and C are read once, not by two programs). Which Mamba-2 calls take it is decided in `ssm_samba.ssd_scan`.
SSD_CHUNK = 32
SSD_BLOCK_P = 64
SSD_NUM_WARPS = 8


def _ssd_blocks(head_dim: int, d_state: int) -> tuple[int, int]:
    """The chunked SSD's (BLOCK_P, BLOCK_N): a program's channels of a head, and the states padded to a power of two
    (at least 16: the products' smallest side)."""
    return min(SSD_BLOCK_P, max(16, triton.next_power_of_2(head_dim))), max(16, triton.next_power_of_2(d_state))


def ssd_chunked_variant(x, B, D, h0) -> tuple:
    """What a call's compiled chunked SSD depends on: the dtype and device, the chunk, block sizes and warps, whether
    D and h0 come."""
    return (
        x.dtype,
        x.device,
        SSD_CHUNK,
        *_ssd_blocks(x.shape[3], B.shape[3]),
        SSD_NUM_WARPS,
        D is not None,
        h0 is not None,
    )


def ssd_chunked_triton(x, dt, A, B, C, D=None, h0=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's scan for inference on a bf16 / fp16 CUDA tensor, in chunks (`_ssd_chunked_forward`): the arguments
    and results of `ssd_scan_triton`, no gradient. Products in x's dtype, accumulated in float32."""
    batch, seq_len, heads, head_dim = x.shape
    groups, d_state = B.shape[2:]
    x, dt, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, dt, B, C))
    y = torch.empty_like(x)
    h = x.new_empty(batch, heads, head_dim, d_state, dtype=torch.float32)
    block_p, block_n = _ssd_blocks(head_dim, d_state)
    _ssd_chunked_forward[(batch, heads, triton.cdiv(head_dim, block_p))](
        x,
        dt,
        A.float().contiguous(),
        B,
        C,
        None if D is None else D.float().contiguous(),
        None if h0 is None else h0.float().contiguous(),
        y,
        h,
        seq_len,
        heads,
        head_dim,
        d_state,
        heads // groups,
        *x.stride()[:3],
        *dt.stride()[:2],
        *B.stride()[:3],
        *C.stride()[:3],
        *y.stride()[:3],
        HAS_D=D is not None,
        HAS_H0=h0 is not None,
        CHUNK=SSD_CHUNK,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        num_warps=SSD_NUM_WARPS,
    )
    return y, h


def ssd_scan_triton(x, dt, A, B, C, D=None, h0=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's scan on a CUDA tensor (the arguments and results of `ssm_samba.ssd_scan_pytorch`, less the chunk
    size), as the selective scan over heads x head_dim channels: x (batch, seq, heads, head_dim); dt (batch, seq,
    heads); A, D (heads,); B, C (batch, seq, groups, d_state); h0 (batch, heads, head_dim, d_state). y in x's dtype,
    the last state in float32; differentiable."""
    batch, seq_len, heads, head_dim = x.shape
    groups, d_state = B.shape[2:]
    layout = _Layout(heads * head_dim, d_state, head_dim=head_dim, groups=groups, a_per_head=True)
    h0 = None if h0 is None else h0.reshape(batch, heads * head_dim, d_state)
    y, h = _run(layout, x.reshape(batch, seq_len, heads * head_dim), dt, A, B, C, D, None, h0)
    return y.view(x.shape), h.view(batch, heads, head_dim, d_state)
