"""The Mamba layers' depthwise causal conv in Triton: forward and backward, from a cached left context, on any CUDA GPU
that torch runs on (torch's CUDA wheels bring Triton; causal-conv1d has no wheel). Without it a GPU runs the conv as
`nn.Conv1d`, which takes many times what reading and writing its tensors takes.

    out[b, d, i] = bias[d] + sum_k w[d, k] * x[b, d, T - L + i - (K - 1) + k]      (x = 0 before position 0)

x is the window (batch, d_inner, T): the cached left context, if any, then the L new inputs; out holds the last L
positions. The window comes as the mixers make it, a transposed (batch, T, d_inner) tensor, and the output is
returned in that layout too (a transposed (batch, L, d_inner) tensor), so that the mixer's transpose back costs no
copy. One program per (sequence, block of BLOCK_T positions, block of BLOCK_D channels) reads its K shifted
(BLOCK_T, BLOCK_D) tiles, contiguous along the channels, and accumulates in float32.

The backward: the window's gradient is the same sum with the taps reversed (one program per block of window
positions); the weight's and the bias's are sums over the batch and the positions, which each program makes over
its own block of outputs and writes apart (no atomics: the same numbers every run), and torch adds up. The plain
reference is `ssm_samba.depthwise_causal_conv` (and `nn.Conv1d`); tests/test_kernels.py checks this against both and
a float64 conv under Triton's interpreter. `ssm_samba.causal_conv` calls it on CUDA where causal-conv1d is not
installed, outside torch.compile (which compiles the `nn.Conv1d` path itself). Imported only on CUDA (or under the
interpreter): this file needs Triton.
"""

import torch

try:  # (transformers' remote-code loader reads imports outside try blocks as requirements: a CPU needs no Triton)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - ssm_samba imports this file only where Triton is
    triton = tl = None

BLOCK_T = 32  # positions a program
BLOCK_D = 64  # channels a program


@triton.jit
def _conv_forward(
    x_ptr, w_ptr, bias_ptr, out_ptr, window_len, seq_len, d_inner,
    stride_x_b, stride_x_d, stride_x_t, stride_o_b, stride_o_d, stride_o_t,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (sequence b, block of outputs i, block of channels d): out[b, d, i] for its block."""
    b = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: a batch of long windows passes 2**31 elements
    i = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    i_ok, d_ok = i < seq_len, d < d_inner
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
        position = window_len - seq_len + i - (K - 1) + k  # the window position tap k reads for output i
        ok = (i_ok & (position >= 0))[:, None] & d_ok[None, :]
        x = tl.load(x_ptr + b * stride_x_b + position[:, None] * stride_x_t + d[None, :] * stride_x_d, mask=ok,
                    other=0.0)
        w = tl.load(w_ptr + d * K + k, mask=d_ok, other=0.0)
        acc += x.to(tl.float32) * w.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + b * stride_o_b + i[:, None] * stride_o_t + d[None, :] * stride_o_d,
             acc.to(out_ptr.dtype.element_ty), mask=i_ok[:, None] & d_ok[None, :])


@triton.jit
def _conv_backward(
    x_ptr, w_ptr, grad_ptr, grad_x_ptr, grad_w_ptr, grad_bias_ptr, window_len, seq_len, d_inner, blocks,
    stride_x_b, stride_x_d, stride_x_t, stride_g_b, stride_g_d, stride_g_t, stride_gx_b, stride_gx_d, stride_gx_t,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (sequence b, block j, block of channels d): the window's gradient at positions p of block j, and the
    weight's and the bias's sums over the outputs i of block j, into grad_w[b, j] (K, d_inner) and grad_bias[b, j]."""
    b = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    p = block * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < d_inner
    # the window's gradient: position p feeds output i = p - (T - L) + (K - 1) - k through tap k
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
        i = p - (window_len - seq_len) + (K - 1) - k
        ok = ((i >= 0) & (i < seq_len) & (p < window_len))[:, None] & d_ok[None, :]
        g = tl.load(grad_ptr + b * stride_g_b + i[:, None] * stride_g_t + d[None, :] * stride_g_d, mask=ok, other=0.0)
        w = tl.load(w_ptr + d * K + k, mask=d_ok, other=0.0)
        acc += g.to(tl.float32) * w.to(tl.float32)[None, :]
    tl.store(grad_x_ptr + b * stride_gx_b + p[:, None] * stride_gx_t + d[None, :] * stride_gx_d,
             acc.to(grad_x_ptr.dtype.element_ty), mask=(p < window_len)[:, None] & d_ok[None, :])
    # the weight's and the bias's: over this block's outputs i (the same indices as p)
    i_ok = p < seq_len
    g = tl.load(grad_ptr + b * stride_g_b + p[:, None] * stride_g_t + d[None, :] * stride_g_d,
                mask=i_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    partial = (b * blocks + block) * K * d_inner  # grad_w: (batch, blocks, K, d_inner), float32
    for k in tl.static_range(K):
        position = window_len - seq_len + p - (K - 1) + k
        ok = (i_ok & (position >= 0))[:, None] & d_ok[None, :]
        x = tl.load(x_ptr + b * stride_x_b + position[:, None] * stride_x_t + d[None, :] * stride_x_d, mask=ok,
                    other=0.0)
        tl.store(grad_w_ptr + partial + k * d_inner + d, tl.sum(g * x.to(tl.float32), axis=0), mask=d_ok)
    if HAS_BIAS:
        tl.store(grad_bias_ptr + (b * blocks + block) * d_inner + d, tl.sum(g, axis=0), mask=d_ok)


def _forward(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seq_len: int) -> torch.Tensor:
    batch, d_inner, window_len = window.shape
    out = window.new_empty(batch, seq_len, d_inner).transpose(1, 2)  # (batch, d_inner, L), channels contiguous
    grid = (batch, triton.cdiv(seq_len, BLOCK_T), triton.cdiv(d_inner, BLOCK_D))
    _conv_forward[grid](
        window, weight, bias, out, window_len, seq_len, d_inner, *window.stride(), *out.stride(),
        K=weight.shape[1], HAS_BIAS=bias is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
    )
    return out


def _backward(window, weight, bias, grad, seq_len):
    batch, d_inner, window_len = window.shape
    kernel_size = weight.shape[1]
    blocks = triton.cdiv(window_len, BLOCK_T)
    grad_x = window.new_empty(batch, window_len, d_inner).transpose(1, 2)
    grad_w = window.new_empty(batch, blocks, kernel_size, d_inner, dtype=torch.float32)
    grad_bias = window.new_empty(batch, blocks, d_inner, dtype=torch.float32) if bias is not None else None
    _conv_backward[(batch, blocks, triton.cdiv(d_inner, BLOCK_D))](
        window, weight, grad, grad_x, grad_w, grad_bias, window_len, seq_len, d_inner, blocks,
        *window.stride(), *grad.stride(), *grad_x.stride(),
        K=kernel_size, HAS_BIAS=bias is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
    )
    grad_weight = grad_w.sum((0, 1)).t().to(weight.dtype)  # (d_inner, K)
    grad_b = grad_bias.sum((0, 1)).to(bias.dtype) if bias is not None else None
    return grad_x, grad_weight, grad_b


class _TritonCausalConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, window, weight, bias, seq_len):
        ctx.save_for_backward(window, weight, bias)
        ctx.seq_len = seq_len
        return _forward(window, weight, bias, seq_len)

    @staticmethod
    def backward(ctx, grad):
        window, weight, bias = ctx.saved_tensors
        grad_x, grad_weight, grad_bias = _backward(window, weight, bias, grad, ctx.seq_len)
        return grad_x, grad_weight, grad_bias, None


def causal_conv_triton(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       seq_len: int) -> torch.Tensor:
    """The depthwise causal conv at the last `seq_len` positions of `window` (batch, d_inner, T), any strides;
    weight (d_inner, K); bias (d_inner,) or None. Returns (batch, d_inner, seq_len) in the window's dtype, laid out
    as a transposed (batch, seq_len, d_inner) tensor. Differentiable in window, weight and bias."""
    weight = weight.contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (window, weight, bias)):
        return _TritonCausalConv.apply(window, weight, bias, seq_len)
    return _forward(window, weight, bias, seq_len)
