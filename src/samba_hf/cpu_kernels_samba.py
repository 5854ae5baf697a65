"""The CPU kernels in C: the selective scan with its backward, and the matrix-vector product of decoding. Each is
built once per machine by one loader and called through ctypes.

The scan (`selective_scan_cpu`: the arguments and results of `ssm_samba.selective_scan_pytorch`, differentiable) is
one pass over time that holds each channel's state in registers: no (time, channel, state) tensor, no Python per
token. Its backward recomputes the states from the ones the forward keeps every `_CPU_SCAN_SEGMENT` steps.
`ssm_samba.selective_scan` calls it on CPU tensors; where it cannot be built, or with `SAMBA_HF_SCAN=pytorch`, the
PyTorch scan runs instead.

The matrix-vector product (`gemv_cpu`, which `linear_samba.SambaLinear` calls on 1 to `MAX_TOKENS` tokens: a
decoding step, or the check of a few drafted tokens): such a product reads each weight once for a few tokens, so its
speed is the speed at which the weights stream from memory, which PyTorch's CPU matrix product of so few rows falls
short of. The kernel walks the weight's rows in storage order (W is (out, in), row-major: a row is one output's dot
products) with AVX-512 FMAs (float32) or AVX512-BF16 dot products (bfloat16 weights; converted to float32 on AVX-512
CPUs without them), accumulating in float32. The rows are split over `torch.get_num_threads()` threads of PyTorch's
own OpenMP pool: the library is built with -fopenmp, so it binds to the libgomp that torch has already loaded (one
pool, no second set of threads competing with torch's spinning ones); where it was built without OpenMP, or bound
to another OpenMP runtime than torch's, it runs on the calling thread alone (a single thread streams far less
than a CPU's bandwidth on many server CPUs). Each row is one thread's, so the numbers do not depend on the thread
count. Without AVX-512 it is not used (PyTorch's product is as good as plain C there); `SAMBA_HF_GEMV=pytorch` turns
it off.

`load_c_library` / `build_c_library` compile a source with the system's C compiler (`cc`, or `$CC`) into
`~/.cache/samba_hf` (`$SAMBA_HF_CACHE`) and load it. Under `torch.compile` the kernels are the operators
`torch.ops.samba_hf.selective_scan_cpu` (with its backward) and `torch.ops.samba_hf.gemv_cpu` (inference only),
which dynamo keeps as one call each (it cannot trace into ctypes). Their names and schemas stay as they are: saved
model folders carry older copies of this code, which register or find the same operators.

Part of the remote code of a saved model: imports only torch, transformers and the standard library.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import typing

import torch
from transformers.utils import logging

from .kernels_samba import run_kernel

logger = logging.get_logger(__name__)

_CPU_SCAN_SEGMENT = 64  # SEGMENT in the scan's source below: the forward keeps the state every this many steps
MAX_TOKENS = 16  # MAXM in the product's source below: the kernel keeps this many running sums per output row
_CPU_SCAN = None  # the loaded scan library, or False once building or loading it failed
_CPU_GEMV = None  # the loaded product library, or False once building or loading it failed


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
    float *states; /* states (batch, T, D, N), or NULL: the state after every step */
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
        if (a->states)
            for (int n = 0; n < N; n++)
                for (int c = 0; c < W; c++) a->states[(row * D + d0 + c) * N + n] = h[n * CH + c];
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

/* The forward, also writing the state after every step into states (batch, T, D, N): what a recording forward (a
   check of drafted tokens) keeps to go back to any of them. Each step's numbers are those of a scan of that token
   alone from the previous state. */
int samba_scan_forward_states(int threads, int batch, int T, int D, int N, const float *u, const float *dt,
                              const float *A, const float *B, const float *C, const float *Dskip, const float *z,
                              float *h, float *y, float *states) {
    Task t = {batch, T, D, N, u, dt, A, B, C, Dskip, z, NULL, NULL, h, y, NULL};
    t.states = states;
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

_CPU_GEMV_SOURCE = r"""
/* y (M, out) = x (M, in) W^T (+ bias): W (out, in) row-major, float32, bfloat16 (uint16 storage) or int8 with a
   float32 scale per row (W = scale * q: int8 weight-only quantization); x, bias, y float32, C-contiguous; M <= 16.
   The weight is read once: rows go in blocks of ROWS, and each block's rows are multiplied by the tokens in groups
   of at most GROUP while they are in cache, so that each chunk of x loaded is used for ROWS rows (ROWS x GROUP
   running sums in registers). The rows are split over `threads` threads of the
   OpenMP runtime PyTorch runs on (where built with -fopenmp). Every output's dot product is summed in the same order
   whatever M, the block and the thread count: the numbers of a one-token product. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#define MAXM 16
#define ROWS 3
#define GROUP 8
#define MIN_PARALLEL (1L << 16) /* weights (out x in) below this are multiplied on the calling thread */

static inline float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

enum { FLOAT32 = 0, BFLOAT16 = 1, INT8 = 2 }; /* the weight's storage */

typedef struct {
    const void *W;
    const float *x, *bias, *scale; /* scale: int8 weights' per row, else NULL */
    const uint16_t *xb; /* x rounded to bfloat16 (AVX512-BF16's dot products take both operands so), or NULL */
    float *y;
    int M, in, out, kind;
} Task;

#if defined(__AVX512F__)
/* 16 weights from W at `at`, as float32: KIND is a constant where it is called */
static inline __attribute__((always_inline)) __m512 weights16(const void *W, size_t at, const int KIND) {
    if (KIND == INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)W + at))));
    if (KIND == BFLOAT16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)W + at))), 16));
    return _mm512_loadu_ps((const float *)W + at);
}
#endif

static inline __attribute__((always_inline)) float weight_at(const void *W, size_t at, const int KIND) {
    if (KIND == INT8) return (float)((const int8_t *)W)[at];
    if (KIND == BFLOAT16) return bf16_to_float(((const uint16_t *)W)[at]);
    return ((const float *)W)[at];
}

/* R rows from o, tokens m0 .. m0 + G - 1: R, G and KIND are constants where it is called, so the sums stay in
   registers and the weights' load is chosen at compile time */
static inline __attribute__((always_inline)) void block(const Task *t, int o, int m0, const int R, const int G,
                                                        const int KIND) {
    const int in = t->in;
    const size_t row = (size_t)o * in;
    float sum[ROWS][GROUP];
    int i = 0;
#if defined(__AVX512F__)
    __m512 acc[ROWS][GROUP];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();
#endif
#if defined(__AVX512BF16__)
    if (KIND == BFLOAT16) { /* bf16 dot products of 32 values, x rounded to bf16 once (t->xb) */
        const uint16_t *w = (const uint16_t *)t->W + row;
        for (; i + 32 <= in; i += 32) {
            __m512bh wv[ROWS];
            for (int r = 0; r < R; r++) wv[r] = (__m512bh)_mm512_loadu_si512(w + (size_t)r * in + i);
            for (int g = 0; g < G; g++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(t->xb + (size_t)(m0 + g) * in + i);
                for (int r = 0; r < R; r++) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], wv[r], xv);
            }
        }
    } else
#endif
    {
#if defined(__AVX512F__)
        for (; i + 16 <= in; i += 16) {
            __m512 wv[ROWS];
            for (int r = 0; r < R; r++) wv[r] = weights16(t->W, row + (size_t)r * in + i, KIND);
            for (int g = 0; g < G; g++) {
                __m512 xv = _mm512_loadu_ps(t->x + (size_t)(m0 + g) * in + i);
                for (int r = 0; r < R; r++) acc[r][g] = _mm512_fmadd_ps(wv[r], xv, acc[r][g]);
            }
        }
#endif
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
#if defined(__AVX512F__)
            sum[r][g] = _mm512_reduce_add_ps(acc[r][g]);
#else
            sum[r][g] = 0.0f;
#endif
            const float *x = t->x + (size_t)(m0 + g) * in;
            for (int j = i; j < in; j++) sum[r][g] += weight_at(t->W, row + (size_t)r * in + j, KIND) * x[j];
            if (KIND == INT8) sum[r][g] *= t->scale[o + r];
        }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++)
            t->y[(size_t)(m0 + g) * t->out + o + r] = sum[r][g] + (t->bias ? t->bias[o + r] : 0.0f);
}

/* block() for R rows and a KIND, the token count G (1 .. GROUP) made a constant */
#define GROUPS(R, KIND)                                                                                             \
    static void block_##R##_##KIND(const Task *t, int o, int m0, int G) {                                         \
        switch (G) {                                                                                                \
        case 1: block(t, o, m0, R, 1, KIND); break;                                                                 \
        case 2: block(t, o, m0, R, 2, KIND); break;                                                                 \
        case 3: block(t, o, m0, R, 3, KIND); break;                                                                 \
        case 4: block(t, o, m0, R, 4, KIND); break;                                                                 \
        case 5: block(t, o, m0, R, 5, KIND); break;                                                                 \
        case 6: block(t, o, m0, R, 6, KIND); break;                                                                 \
        case 7: block(t, o, m0, R, 7, KIND); break;                                                                 \
        default: block(t, o, m0, R, 8, KIND); break;                                                                \
        }                                                                                                           \
    }
#define KINDS(KIND) GROUPS(1, KIND) GROUPS(2, KIND) GROUPS(3, KIND)
KINDS(FLOAT32)
KINDS(BFLOAT16)
KINDS(INT8)

typedef void (*Block)(const Task *, int, int, int);
static const Block BLOCKS[3][ROWS] = { /* [kind][rows - 1] */
    {block_1_FLOAT32, block_2_FLOAT32, block_3_FLOAT32},
    {block_1_BFLOAT16, block_2_BFLOAT16, block_3_BFLOAT16},
    {block_1_INT8, block_2_INT8, block_3_INT8},
};

/* rows o_begin .. o_end - 1, every token */
static void rows(const Task *t, int o_begin, int o_end) {
    for (int o = o_begin; o < o_end; o += ROWS) {
        const int R = o_end - o < ROWS ? o_end - o : ROWS;
        for (int m0 = 0; m0 < t->M; m0 += GROUP)
            BLOCKS[t->kind][R - 1](t, o, m0, t->M - m0 < GROUP ? t->M - m0 : GROUP);
    }
}

int samba_gemv_has_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

int samba_gemv_has_openmp(void) {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

int samba_gemv(int kind, int M, int in, int out, const void *W, const float *x, const float *bias, float *y,
               int threads, const float *scale) {
    if (M < 1 || M > MAXM || kind < FLOAT32 || kind > INT8 || (kind == INT8 && !scale)) return 1;
    Task task = {W, x, bias, scale, NULL, y, M, in, out, kind};
    uint16_t *xb = NULL;
#if defined(__AVX512BF16__)
    if (kind == BFLOAT16) { /* x rounded to bfloat16 once, as each dot product would (to nearest, ties to even) */
        xb = (uint16_t *)malloc(sizeof(uint16_t) * ((size_t)M * in + 32));
        if (!xb) return 2;
        size_t n = (size_t)M * in, k = 0;
        for (; k + 32 <= n; k += 32)
            _mm512_storeu_si512(xb + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16),
                                                                     _mm512_loadu_ps(x + k)));
        for (; k < n; k++) {
            uint32_t bits;
            memcpy(&bits, x + k, 4);
            xb[k] = (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
        }
        task.xb = xb;
    }
#endif
#if defined(_OPENMP)
    if (threads > 1 && (long)out * in >= MIN_PARALLEL) {
        /* whole blocks of 16 rows (whole cache lines of y) split evenly, each row one thread's */
        const int blocks = (out + 15) / 16;
#pragma omp parallel num_threads(threads)
        {
            const int k = omp_get_thread_num(), n = omp_get_num_threads();
            const int begin = (int)((long)blocks * k / n) * 16, end = (int)((long)blocks * (k + 1) / n) * 16;
            rows(&task, begin, end < out ? end : out);
        }
        free(xb);
        return 0;
    }
#endif
    rows(&task, 0, out);
    free(xb);
    return 0;
}
"""


def load_c_library(source_text: str, name: str, variable: str, what: str, fallback: str, openmp: bool = False):
    """The ctypes library built from `source_text` (`build_c_library`), or None: where `$variable` is "pytorch",
    or where it cannot be built or loaded (said once: `what` is unavailable, using `fallback`)."""
    choice = os.environ.get(variable, "").lower()
    if choice == "pytorch":
        return None
    if choice not in ("", "compiled"):
        logger.warning_once(f"samba-hf: {variable}={choice!r} is not 'compiled' or 'pytorch'; using {what}")
    try:
        return ctypes.CDLL(build_c_library(source_text, name, openmp))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning_once(f"samba-hf: {what} is unavailable ({error}); using {fallback}")
        return None


def build_c_library(source_text: str, name: str, openmp: bool = False) -> str:
    """Compile a C source for this machine, once: the library's path in the cache. The name hashes the source,
    the compiler and the CPU, so a cache shared between machines never hands one a library built for another; the
    file is written under a temporary name and renamed, so concurrent builds never load a half-written one.
    openmp: with -fopenmp where the compiler takes it (else without)."""
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
        tries = [["-march=native", *base], base]  # a compiler without -march=native still gets a build
        if openmp:
            tries.insert(0, ["-march=native", "-fopenmp", *base])
        for flags in tries:
            result = subprocess.run(
                [compiler, *flags, source, "-o", os.path.join(build, f"{name}.so"), "-lpthread"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if result.returncode == 0:
                os.replace(os.path.join(build, f"{name}.so"), path)
                return path
            errors.append(result.stderr.strip().splitlines()[-1:] or [f"exit {result.returncode}"])
        raise RuntimeError(f"{compiler} failed: {errors[-1][0]}")


def _cpu_scan_library():
    """The compiled CPU scan (a ctypes library), built on first use; None where it cannot be (the caller falls
    back)."""
    global _CPU_SCAN
    if _CPU_SCAN is None:
        _CPU_SCAN = False
        library = load_c_library(
            _CPU_SCAN_SOURCE, "selective_scan", "SAMBA_HF_SCAN", "the compiled CPU scan", "the PyTorch scan"
        )
        if library is None:
            return None
        sizes = [ctypes.c_int] * 5  # threads, batch, seq_len, d_inner, d_state
        library.samba_scan_forward.argtypes = sizes + [ctypes.c_void_p] * 10  # u dt A B C D z h y checkpoints
        # u..z, checkpoints, grad_y, grad_h, then the 8 gradients
        library.samba_scan_backward.argtypes = sizes + [ctypes.c_void_p] * 18
        library.samba_scan_forward_states.argtypes = sizes + [ctypes.c_void_p] * 10  # u dt A B C D z h y states
        library.samba_scan_forward.restype = library.samba_scan_backward.restype = ctypes.c_int
        library.samba_scan_forward_states.restype = ctypes.c_int
        _CPU_SCAN = library
    return _CPU_SCAN or None


@torch.compiler.assume_constant_result  # under torch.compile: asked once while tracing, not traced into
def cpu_scan_available() -> bool:
    return _cpu_scan_library() is not None


def _pointer(tensor: torch.Tensor | None):
    return None if tensor is None else ctypes.c_void_p(tensor.data_ptr())


def _scan_threads(batch: int, seq_len: int, d_inner: int, d_state: int) -> int:
    # starting threads costs more than a small scan's work: below 2**18 state updates (a one-token decode step, for
    # one) the scan runs on the calling thread
    return 1 if batch * seq_len * d_inner * d_state < (1 << 18) else torch.get_num_threads()


def _cpu_scan_forward(u, dt, A, B, C, D, z, h0, keep_checkpoints=False, keep_states=False):
    """y, the last state, and either (keep_checkpoints) the state before every 64th step, for the backward, or
    (keep_states) the state after every step (batch, seq, d_inner, d_state)."""
    (batch, seq_len, d_inner), d_state = u.shape, A.shape[1]
    h = u.new_zeros(batch, d_inner, d_state) if h0 is None else h0.clone()
    y = torch.empty_like(u)
    library = _cpu_scan_library()
    if keep_states:
        forward, kept = library.samba_scan_forward_states, u.new_empty(batch, seq_len, d_inner, d_state)
    else:
        segments = -(-seq_len // _CPU_SCAN_SEGMENT)
        forward = library.samba_scan_forward
        kept = u.new_empty(batch, segments, d_inner, d_state) if keep_checkpoints else None
    failed = forward(
        _scan_threads(batch, seq_len, d_inner, d_state),
        batch,
        seq_len,
        d_inner,
        d_state,
        *map(_pointer, (u, dt, A, B, C, D, z, h, y, kept)),
    )
    if failed:
        raise MemoryError("samba-hf: out of memory in the CPU scan")
    return (y, h, kept) if keep_checkpoints or keep_states else (y, h)


def selective_scan_cpu_states(u, dt, A, B, C, D=None, z=None, h0=None):
    """The compiled scan, inference only, also giving the state after every token: y, the last state and the states
    (batch, seq, d_inner, d_state), each token's numbers those of a scan of that token alone from the state before
    (what a recording forward keeps for `crop`, in one call instead of one per token)."""
    inputs = (None if x is None else x.float().contiguous() for x in (u, dt, A, B, C, D, z, h0))
    return _cpu_scan_forward(*inputs, keep_states=True)


def _cpu_scan_backward(u, dt, A, B, C, D, z, checkpoints, grad_y, grad_h, D_given=True, z_given=True):
    """The gradients of (u, dt, A, B, C, D, z, h0); those of D and z are None where they were not given."""
    (batch, seq_len, d_inner), d_state = u.shape, A.shape[1]
    threads = _scan_threads(batch, seq_len, d_inner, d_state)
    grads = {
        "u": torch.empty_like(u),
        "dt": torch.empty_like(dt),
        "A": torch.zeros_like(A),
        "B": B.new_zeros(threads, *B.shape),
        "C": C.new_zeros(threads, *C.shape),
        "D": torch.zeros_like(D) if D_given else None,
        "z": torch.empty_like(z) if z_given else None,
        "h0": u.new_empty(batch, d_inner, d_state),
    }
    # named, so that they live until the call returns (a pointer does not keep its tensor alive)
    grad_y = grad_y.float().contiguous()
    grad_h = None if grad_h is None else grad_h.float().contiguous()
    failed = _cpu_scan_library().samba_scan_backward(
        threads,
        batch,
        seq_len,
        d_inner,
        d_state,
        *map(
            _pointer,
            (
                u,
                dt,
                A,
                B,
                C,
                D if D_given else None,
                z if z_given else None,
                checkpoints,
                grad_y,
                grad_h,
                *grads.values(),
            ),
        ),
    )
    if failed:
        raise MemoryError("samba-hf: out of memory in the CPU scan's backward")
    grads["B"], grads["C"] = grads["B"].sum(0), grads["C"].sum(0)
    return tuple(grads.values())


def _gemv_library():
    """The C kernel (a ctypes library), built on first use; None where it cannot be (nn.Linear runs instead)."""
    global _CPU_GEMV
    if _CPU_GEMV is None:
        _CPU_GEMV = False
        library = load_c_library(
            _CPU_GEMV_SOURCE, "gemv", "SAMBA_HF_GEMV", "the CPU matrix-vector kernel", "nn.Linear", openmp=True
        )
        if library is None:
            return None
        if not library.samba_gemv_has_avx512():  # PyTorch's product is as good as plain C there
            return None
        library.samba_gemv.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p]
        library.samba_gemv.restype = ctypes.c_int
        library.threaded = bool(library.samba_gemv_has_openmp()) and _shares_torchs_openmp(library)
        _CPU_GEMV = library
    return _CPU_GEMV or None


def _shares_torchs_openmp(library) -> bool:
    """Whether the kernel's library runs on the OpenMP runtime torch's own operators run on (the one its -fopenmp
    build binds to by name, where torch has loaded it first): an OpenMP function looked up from the library and from
    libtorch_cpu resolve to the same code. Other runtimes may be loaded too (sentencepiece's wheel carries its own
    libgomp under another name); what matters is that the kernel's threads are torch's. False where this cannot be
    told (no libtorch_cpu.so: not Linux), and the kernel stays on the calling thread."""
    try:
        torch_library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        ours = ctypes.cast(library.omp_get_max_threads, ctypes.c_void_p).value
        return ours is not None and ours == ctypes.cast(torch_library.omp_get_max_threads, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return False


def gemv_threads() -> int:
    """The threads the matrix-vector kernel splits its rows over: PyTorch's intra-op threads where the kernel shares
    their OpenMP pool, else 1."""
    library = _gemv_library()
    return torch.get_num_threads() if library is not None and library.threaded else 1


@torch.compiler.assume_constant_result  # under torch.compile: asked once while tracing, not traced into
def gemv_available() -> bool:
    return _gemv_library() is not None


def gemv_cpu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """x (..., in) with at most MAX_TOKENS rows, weight (out, in) float32 or bfloat16: F.linear(x, weight, bias).
    With `scale` (out,) float32, weight is int8 and stands for scale[:, None] * weight (weight-only int8)."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features).float().contiguous()
    weight = weight.contiguous()
    bias = None if bias is None else bias.float().contiguous()
    scale = None if scale is None else scale.float().reshape(out_features).contiguous()
    y = rows.new_empty(rows.shape[0], out_features)
    failed = _gemv_library().samba_gemv(
        2 if scale is not None else int(weight.dtype == torch.bfloat16),
        rows.shape[0],
        in_features,
        out_features,
        ctypes.c_void_p(weight.data_ptr()),
        ctypes.c_void_p(rows.data_ptr()),
        None if bias is None else ctypes.c_void_p(bias.data_ptr()),
        ctypes.c_void_p(y.data_ptr()),
        gemv_threads(),
        None if scale is None else ctypes.c_void_p(scale.data_ptr()),
    )
    if failed:
        raise RuntimeError("samba-hf: the CPU matrix-vector kernel refused its arguments")
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


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


def selective_scan_cpu(u, dt, A, B, C, D=None, z=None, h0=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled CPU scan (the arguments and results of `ssm_samba.selective_scan_pytorch`), differentiable. A must
    be <= 0, as the model's A = -exp(A_log) is: each decay exp(dt * A) is then in (0, 1], and nothing overflows at
    any length.
    Under `torch.compile` it runs as the operator `torch.ops.samba_hf.selective_scan_cpu` (`_scan_operator`)."""
    inputs = tuple(None if x is None else x.float().contiguous() for x in (u, dt, A, B, C, D, z, h0))

    def plain():
        with torch.no_grad():
            return _cpu_scan_forward(*inputs)

    y, h = run_kernel(
        inputs,
        plain,
        operator=lambda: _SCAN_OPERATOR(*inputs, keep_checkpoints=torch.is_grad_enabled())[:2],
        autograd=lambda: _CpuScan.apply(*inputs),
    )
    return y.to(u.dtype), h


def _scan_operator():
    """The compiled scan as a torch operator, `torch.ops.samba_hf.selective_scan_cpu`, with a backward, so that
    `torch.compile` keeps it as one call: dynamo cannot trace into the C library, and the PyTorch scan it would trace
    instead unrolls a Python loop over tokens. Registered once per process: a second copy of this code (a saved
    model's remote code) finds the operator registered and uses it. Returns (y, last state, checkpoints); the
    checkpoints (for the backward) are empty unless `keep_checkpoints`."""
    namespace = torch.ops.samba_hf
    if hasattr(namespace, "selective_scan_cpu"):
        return namespace.selective_scan_cpu
    Tensor, OptionalTensor = torch.Tensor, typing.Optional[torch.Tensor]

    @torch.library.custom_op("samba_hf::selective_scan_cpu", mutates_args=(), device_types="cpu")
    def scan(
        u: Tensor,
        dt: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        D: OptionalTensor,
        z: OptionalTensor,
        h0: OptionalTensor,
        keep_checkpoints: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if keep_checkpoints:
            return _cpu_scan_forward(u, dt, A, B, C, D, z, h0, keep_checkpoints=True)
        y, h = _cpu_scan_forward(u, dt, A, B, C, D, z, h0)
        return y, h, u.new_empty(0)

    @scan.register_fake
    def _(u, dt, A, B, C, D, z, h0, keep_checkpoints):
        (batch, seq_len, d_inner), d_state = u.shape, A.shape[1]
        checkpoints = (batch, (seq_len + _CPU_SCAN_SEGMENT - 1) // _CPU_SCAN_SEGMENT, d_inner, d_state)
        return (
            u.new_empty(u.shape),
            u.new_empty(batch, d_inner, d_state),
            u.new_empty(checkpoints if keep_checkpoints else 0),
        )

    @torch.library.custom_op("samba_hf::selective_scan_cpu_backward", mutates_args=(), device_types="cpu")
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
    ) -> list[Tensor]:
        grads = _cpu_scan_backward(u, dt, A, B, C, D, z, checkpoints, grad_y, grad_h, D is not None, z is not None)
        return [u.new_empty(0) if grad is None else grad for grad in grads]  # an operator returns no None

    @scan_backward.register_fake
    def _(u, dt, A, B, C, D, z, checkpoints, grad_y, grad_h):
        absent = u.new_empty(0)
        return [
            u.new_empty(u.shape),
            dt.new_empty(dt.shape),
            A.new_empty(A.shape),
            B.new_empty(B.shape),
            C.new_empty(C.shape),
            absent if D is None else D.new_empty(D.shape),
            absent if z is None else z.new_empty(z.shape),
            u.new_empty(u.shape[0], *A.shape),
        ]

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


def _gemv_operator():
    """`gemv_cpu` as the operator `torch.ops.samba_hf.gemv_cpu`, registered once per process (a saved model's copy
    of this code finds it registered and uses it)."""
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


GEMV_OPERATOR = _gemv_operator()  # what `SambaLinear` calls while torch.compile traces
