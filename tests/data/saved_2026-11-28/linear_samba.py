"""`SambaLinear`: `nn.Linear`, with a C matrix-vector kernel for decoding on CPU.

A decoding step multiplies every weight matrix by one token's activations: it reads each weight once, so its speed
is the speed at which the weights stream from memory. PyTorch's CPU matrix product reads a (1, in) x (in, out)
product's weights at about 20 GB/s on the machines here, where a reduction reads 50-80 GB/s. The kernel below
walks the weight's rows in storage order (W is (out, in), row-major: a row is one output's dot product) with
AVX-512 FMAs (float32) or AVX512-BF16 dot products (bfloat16 weights; converted to float32 on AVX-512 CPUs without
them), accumulating in float32, on the calling thread: one core streams the weights at 40+ GB/s here, and a second
thread of ours would compete with PyTorch's OpenMP threads, which spin for a while after each of its operations
(measured: slower). It runs when: a CPU with AVX-512, inference (no gradient wanted), 1 to `MAX_TOKENS` tokens, float32 or bfloat16
weights and input of the same dtype, the C library built (as the scan's, `ssm_samba.load_c_library`). Everything
else, and `SAMBA_HF_GEMV=pytorch`, calls `nn.Linear.forward`. Under `torch.compile` it is the operator
`torch.ops.samba_hf.gemv_cpu` (inference only), which dynamo keeps as one call.

Part of the remote code of a saved model: imports only torch, transformers and its siblings.
"""

import ctypes

import torch
from torch import nn
from transformers.utils import logging

from .ssm_samba import load_c_library

logger = logging.get_logger(__name__)

MAX_TOKENS = 8  # the kernel keeps this many running sums per output row

_CPU_GEMV_SOURCE = r"""
/* y (M, out) = x (M, in) W^T (+ bias): W (out, in) row-major, float32 or bfloat16 (uint16 storage); x, bias, y
   float32, C-contiguous; M <= 8. Each output row's M dot products read the row once. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAXM 8

static inline float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

typedef struct {
    const void *W;
    const float *x, *bias;
    float *y;
    int M, in, out, o_begin, o_end, bf16;
} Task;

static void rows(const Task *t) {
    const int M = t->M, in = t->in;
    for (int o = t->o_begin; o < t->o_end; o++) {
        float sum[MAXM];
#if defined(__AVX512F__)
        __m512 acc[MAXM];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
#endif
        int i = 0;
        if (t->bf16) {
            const uint16_t *w = (const uint16_t *)t->W + (size_t)o * in;
#if defined(__AVX512BF16__)
            for (; i + 32 <= in; i += 32) {
                __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i);
                for (int m = 0; m < M; m++) {
                    const float *x = t->x + (size_t)m * in + i;
                    __m512bh xv = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
                    acc[m] = _mm512_dpbf16_ps(acc[m], wv, xv);
                }
            }
#elif defined(__AVX512F__)
            for (; i + 16 <= in; i += 16) {
                __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + i))), 16);
                __m512 wv = _mm512_castsi512_ps(wide);
                for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(t->x + (size_t)m * in + i), acc[m]);
            }
#endif
            for (int m = 0; m < M; m++) {
#if defined(__AVX512F__)
                sum[m] = _mm512_reduce_add_ps(acc[m]);
#else
                sum[m] = 0.0f;
#endif
                const float *x = t->x + (size_t)m * in;
                for (int j = i; j < in; j++) sum[m] += bf16_to_float(w[j]) * x[j];
            }
        } else {
            const float *w = (const float *)t->W + (size_t)o * in;
#if defined(__AVX512F__)
            for (; i + 16 <= in; i += 16) {
                __m512 wv = _mm512_loadu_ps(w + i);
                for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(t->x + (size_t)m * in + i), acc[m]);
            }
#endif
            for (int m = 0; m < M; m++) {
#if defined(__AVX512F__)
                sum[m] = _mm512_reduce_add_ps(acc[m]);
#else
                sum[m] = 0.0f;
#endif
                const float *x = t->x + (size_t)m * in;
                for (int j = i; j < in; j++) sum[m] += w[j] * x[j];
            }
        }
        for (int m = 0; m < M; m++) t->y[(size_t)m * t->out + o] = sum[m] + (t->bias ? t->bias[o] : 0.0f);
    }
}

int samba_gemv_has_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

int samba_gemv(int bf16, int M, int in, int out, const void *W, const float *x, const float *bias, float *y) {
    if (M < 1 || M > MAXM) return 1;
    Task task = {W, x, bias, y, M, in, out, 0, out, bf16};
    rows(&task);
    return 0;
}
"""

_CPU_GEMV = None  # the loaded library, or False once building or loading it failed


def _gemv_library():
    """The C kernel (a ctypes library), built on first use; None where it cannot be (nn.Linear runs instead)."""
    global _CPU_GEMV
    if _CPU_GEMV is None:
        _CPU_GEMV = False
        library = load_c_library(_CPU_GEMV_SOURCE, "gemv", "SAMBA_HF_GEMV", "the CPU matrix-vector kernel",
                                 "nn.Linear")
        if library is None:
            return None
        if not library.samba_gemv_has_avx512():  # PyTorch's product is as good as plain C there
            return None
        library.samba_gemv.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 4
        library.samba_gemv.restype = ctypes.c_int
        _CPU_GEMV = library
    return _CPU_GEMV or None


@torch.compiler.assume_constant_result  # under torch.compile: asked once while tracing, not traced into
def gemv_available() -> bool:
    return _gemv_library() is not None


def gemv_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) with at most MAX_TOKENS rows, weight (out, in) float32 or bfloat16: F.linear(x, weight, bias)."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features).float().contiguous()
    weight = weight.contiguous()
    bias = None if bias is None else bias.float().contiguous()
    y = rows.new_empty(rows.shape[0], out_features)
    failed = _gemv_library().samba_gemv(
        int(weight.dtype == torch.bfloat16), rows.shape[0], in_features, out_features,
        ctypes.c_void_p(weight.data_ptr()), ctypes.c_void_p(rows.data_ptr()),
        None if bias is None else ctypes.c_void_p(bias.data_ptr()), ctypes.c_void_p(y.data_ptr()),
    )
    if failed:
        raise RuntimeError("samba-hf: the CPU matrix-vector kernel refused its arguments")
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


def _gemv_operator():
    """`gemv_cpu` as the operator `torch.ops.samba_hf.gemv_cpu`, registered once per process (a saved model's copy
    of this file finds it registered and uses it)."""
    namespace = torch.ops.samba_hf
    if hasattr(namespace, "gemv_cpu"):
        return namespace.gemv_cpu

    @torch.library.custom_op("samba_hf::gemv_cpu", mutates_args=(), device_types="cpu")
    def operator(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gemv_cpu(x, weight, bias)

    @operator.register_fake
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    return operator


_GEMV_OPERATOR = _gemv_operator()


class SambaLinear(nn.Linear):
    """`nn.Linear` (same parameters, state dict and behaviour; adapters wrap it as they wrap nn.Linear) whose
    inference on at most `MAX_TOKENS` tokens on CPU runs the C kernel above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            x.device.type == "cpu"
            and x.dtype == weight.dtype
            and weight.dtype in (torch.float32, torch.bfloat16)
            and 0 < x.numel() <= MAX_TOKENS * self.in_features
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and gemv_available()
        ):
            if torch.compiler.is_compiling():
                return _GEMV_OPERATOR(x, weight, self.bias)
            return gemv_cpu(x, weight, self.bias)
        return super().forward(x)
