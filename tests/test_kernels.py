"""samba-hf's CUDA kernel paths with the real kernel packages, on the CPU under Triton's interpreter.

CI runs this file in its own environment (triton, numpy, and mamba-ssm 2.3.2.post1 and causal-conv1d installed from
their PyPI sdists without compiling; see .ci/run):

    TRITON_INTERPRET=1 SAMBA_HF_INTERPRET_KERNELS=1 python -m pytest -q tests/test_kernels.py

mamba-ssm's Triton kernels (`selective_state_update`, `mamba_chunk_scan_combined`, forward and backward) run as
released. Its CUDA scan and causal-conv1d are compiled CUDA, which the interpreter cannot run: for those two only the
compiled extension is stood in (`kernel_extensions.py`, built from each package's own reference function), under
the packages' real Python wrappers. Everything is checked against samba-hf's PyTorch path and a float64 reference,
and the tests count which kernels ran. Skipped outside that environment."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from samba_hf import ssm_samba

# Under the switch every test runs: a package missing from that environment fails them rather than skipping them.
pytestmark = pytest.mark.skipif(
    not ssm_samba.INTERPRET_KERNELS, reason="needs TRITON_INTERPRET=1 SAMBA_HF_INTERPRET_KERNELS=1 (see the docstring)"
)

if ssm_samba.INTERPRET_KERNELS:
    import kernel_extensions

    kernel_extensions.install()

from conftest import counted_chunked_ssd, returned_cache, tiny_model  # noqa: E402
from test_mamba2 import float64_ssd, ssd_inputs, tiny_mamba2  # noqa: E402
from test_reference_models import float64_recurrence  # noqa: E402

KERNEL_NAMES = ssm_samba.Kernels._fields[:-1]


PACKAGES = (
    "selective_scan_fn",
    "selective_state_update",
    "mamba_chunk_scan_combined",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)  # mamba-ssm's and causal-conv1d's


def only(monkeypatch, names) -> dict:
    """From here on only the kernels `names` are there (the others as if not installed), each wrapped to count its
    calls; the PyTorch scans fail the test if they run. Returns the counts."""
    monkeypatch.setattr(ssm_samba, "_KERNELS", None)
    loaded = ssm_samba.load_kernels()
    assert not loaded.missing, loaded.missing
    calls = dict.fromkeys(KERNEL_NAMES, 0)

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    chosen = {name: counting(name, getattr(loaded, name)) if name in names else None for name in KERNEL_NAMES}
    missing = {name: "left out by the test" for name in KERNEL_NAMES if name not in names}
    monkeypatch.setattr(ssm_samba, "_KERNELS", ssm_samba.Kernels(**chosen, missing=missing))
    forbid_pytorch_scans(monkeypatch)
    return calls


@pytest.fixture
def kernels(monkeypatch):
    """mamba-ssm's and causal-conv1d's kernels, counted (samba-hf's Triton scan left out)."""
    return only(monkeypatch, PACKAGES)


TRITON_ONLY = ("selective_scan_triton", "ssd_scan_triton", "ssd_chunked_triton", "causal_conv_triton")  # samba-hf's


@pytest.fixture
def triton_only(monkeypatch):
    """What `pip install samba-hf` gives on a GPU: samba-hf's Triton scans and conv, no kernel package."""
    return only(monkeypatch, TRITON_ONLY)


ORIGINAL = {
    name: getattr(ssm_samba, name) for name in ("selective_scan_pytorch", "selective_scan_cpu", "ssd_scan_pytorch")
}


def forbid_pytorch_scans(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a PyTorch scan ran where a kernel should have")

    for name in ("selective_scan_pytorch", "selective_scan_cpu", "ssd_scan_pytorch"):
        monkeypatch.setattr(ssm_samba, name, refuse)


def pytorch_path(monkeypatch):
    """From here on in the test, CPU tensors take the CPU paths (the reference)."""
    monkeypatch.undo()
    monkeypatch.setattr(ssm_samba, "INTERPRET_KERNELS", False)


def scan_inputs(batch=2, length=11, d=40, n=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    u, z = (torch.randn(batch, length, d, generator=g).to(dtype) for _ in range(2))
    dt = torch.exp(torch.empty(batch, length, d).uniform_(-6, 0, generator=g))  # 2.5e-3 .. 1
    A = -torch.exp(torch.empty(d, n).uniform_(-1, 2.5, generator=g))
    B, C = (torch.randn(batch, length, n, generator=g) for _ in range(2))
    D = torch.randn(d, generator=g)
    h0 = torch.randn(batch, d, n, generator=g)
    return u, dt, A, B, C, D, z, h0


def assert_close(actual, expected, tol):
    expected = expected.double()
    assert (actual.double() - expected).abs().max() <= tol * max(1.0, expected.abs().max().item())


# ---- the kernels, one by one ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mamba_decoding_step_runs_mamba_ssms_triton_kernel(kernels, dtype):
    """mamba-ssm's selective_state_update raised inside its own launch when given dt_bias=None (the H200 crash of
    every decode); samba-hf now passes a zero bias. Checked against the float64 recurrence."""
    u, dt, A, B, C, D, z, h0 = scan_inputs(length=1, dtype=dtype)
    y, h = ssm_samba.selective_scan(u, dt, A, B, C, D, z, h0)
    y_ref, h_ref = float64_recurrence(u, dt, A, B, C, D, z, h0)
    assert kernels["selective_state_update"] == 1 and y.dtype == dtype and h.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close(y, y_ref, tol)
    assert_close(h, h_ref, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mamba2_decoding_step_runs_mamba_ssms_triton_kernel(kernels, dtype):
    """The same kernel for Mamba-2's one-token step (dt, A and dt_bias per head, as stride-0 views over head_dim)."""
    x, dt, A, B, C, D, h0 = ssd_inputs(length=1)
    y, h = ssm_samba.ssd_scan(x.to(dtype), dt, A, B.to(dtype), C.to(dtype), D, h0)
    y_ref, h_ref = float64_ssd(x.to(dtype), dt, A, B.to(dtype), C.to(dtype), D, h0)
    assert kernels["selective_state_update"] == 1 and y.dtype == dtype
    assert_close(y, y_ref, 1e-5 if dtype == torch.float32 else 1e-2)
    assert_close(h, h_ref, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("from_state", [False, True])
def test_the_mamba_scan_runs_selective_scan_fn_from_any_state(kernels, monkeypatch, dtype, from_state):
    """selective_scan_fn takes no initial state: from a cached state samba-hf adds the exact correction (linear in the
    state), so a continuation never steps per token in Python. Values, last state and gradients."""
    u, dt, A, B, C, D, z, h0 = scan_inputs(dtype=dtype)
    h0 = h0 if from_state else None
    leaves = [t.clone().requires_grad_() for t in (u, dt, B, C)]
    y, h = ssm_samba.selective_scan(leaves[0], leaves[1], A, leaves[2], leaves[3], D, z, h0)
    assert kernels["selective_scan_fn"] == 1
    start = torch.zeros(2, 40, 5) if h0 is None else h0
    # selective_scan_fn reads dt, B and C in u's dtype (its CUDA code checks it)
    y_ref, h_ref = float64_recurrence(u, dt.to(dtype), A, B.to(dtype), C.to(dtype), D, z, start)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert y.dtype == dtype and h.dtype == torch.float32
    assert_close(y, y_ref, tol)
    assert_close(h, h_ref, 1e-5)
    if dtype != torch.float32:
        return
    grads = torch.autograd.grad(y.float().pow(2).sum(), leaves)
    pytorch_path(monkeypatch)
    reference = [t.clone().requires_grad_() for t in (u, dt, B, C)]
    y_p, _ = ssm_samba.selective_scan_pytorch(reference[0], reference[1], A, reference[2], reference[3], D, z, h0)
    for grad, ref in zip(grads, torch.autograd.grad(y_p.pow(2).sum(), reference)):
        assert_close(grad, ref, 1e-4)


@pytest.mark.parametrize("length", [1, 11, 64, 150])  # one token; within, at and across the 64-token chunks
@pytest.mark.parametrize("from_state", [False, True])
def test_samba_hfs_triton_scan_equals_float64_with_its_gradients(triton_only, length, from_state):
    u, dt, A, B, C, D, z, h0 = scan_inputs(length=length)
    h0 = h0 if from_state else None
    leaves = [t.clone().requires_grad_() for t in (u, dt, A, B, C, D, z)] + (
        [h0.clone().requires_grad_()] if from_state else []
    )
    y, h = ssm_samba.selective_scan(*leaves[:7], leaves[7] if from_state else None)
    assert triton_only["selective_scan_triton"] == 1 and y.dtype == torch.float32 and h.dtype == torch.float32
    weights = torch.randn_like(y), torch.randn_like(h)
    grads = torch.autograd.grad((y * weights[0]).sum() + (h * weights[1]).sum(), leaves)
    reference = [t.detach().double().requires_grad_() for t in leaves]
    y_ref, h_ref = float64_recurrence(*reference[:7], reference[7] if from_state else torch.zeros(2, 40, 5).double())
    expected = torch.autograd.grad((y_ref * weights[0]).sum() + (h_ref * weights[1]).sum(), reference)
    assert_close(y, y_ref, 1e-5)
    assert_close(h, h_ref, 1e-5)
    for name, grad, want in zip(("u", "dt", "A", "B", "C", "D", "z", "h0"), grads, expected):
        assert grad.shape == want.shape, name
        assert_close(grad, want, 1e-4)


@pytest.mark.parametrize("length", [1, 21, 70])
@pytest.mark.parametrize("from_state", [False, True])
@pytest.mark.parametrize(
    "shape",
    [
        dict(heads=6, head_dim=4, groups=3, d_state=5),  # a block of channels spans several groups
        dict(heads=4, head_dim=16, groups=1, d_state=16),  # every block inside one group
    ],
)
def test_samba_hfs_triton_ssd_equals_float64_with_its_gradients(triton_only, length, from_state, shape):
    x, dt, A, B, C, D, h0 = ssd_inputs(length=length, **shape)
    h0 = h0 if from_state else None
    leaves = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D)] + (
        [h0.clone().requires_grad_()] if from_state else []
    )
    y, h = ssm_samba.ssd_scan(*leaves[:6], leaves[6] if from_state else None)
    assert triton_only["ssd_scan_triton"] == 1 and y.shape == x.shape and h.dtype == torch.float32
    weights = torch.randn_like(y), torch.randn_like(h)
    grads = torch.autograd.grad((y * weights[0]).sum() + (h * weights[1]).sum(), leaves)
    reference = [t.detach().double().requires_grad_() for t in leaves]
    y_ref, h_ref = float64_ssd(*reference[:6], reference[6] if from_state else torch.zeros(h.shape).double())
    expected = torch.autograd.grad((y_ref * weights[0]).sum() + (h_ref * weights[1]).sum(), reference)
    assert_close(y, y_ref, 1e-5)
    assert_close(h, h_ref, 1e-5)
    for name, grad, want in zip(("x", "dt", "A", "B", "C", "D", "h0"), grads, expected):
        assert grad.shape == want.shape, name
        assert_close(grad, want, 1e-4)


# The interpreter's tl.dot gives wrong numbers for bfloat16 operands (Triton 3.9: a 16 x 16 product off by 3e10,
# float16 right), so CI checks the chunked SSD in float16, the same kernel; tests/test_gpu.py checks bf16 on a GPU.
@pytest.mark.parametrize("length", [16, 37, 100])  # one chunk of 32 cut short, two and a part, four and a part
@pytest.mark.parametrize("from_state", [False, True])
@pytest.mark.parametrize(
    "shape",
    [
        dict(heads=6, head_dim=4, groups=3, d_state=5),  # groups of two heads
        dict(heads=2, head_dim=40, groups=2, d_state=20),  # a head's channels in two programs of 32, the second cut
    ],
)
def test_the_chunked_ssd_equals_float64(triton_only, monkeypatch, length, from_state, shape):
    """Mamba-2 inference on a half-precision prompt: the chunked SSD (products in x's dtype, accumulated in float32)
    against the float64 recurrence on the same rounded inputs, y and the last state."""
    calls = counted_chunked_ssd(monkeypatch)
    x, dt, A, B, C, D, h0 = ssd_inputs(length=length, **shape)
    x, B, C = x.half(), B.half(), C.half()
    h0 = h0 if from_state else None
    with torch.no_grad():
        y, h = ssm_samba.ssd_scan(x, dt, A, B, C, D, h0)
    y_ref, h_ref = float64_ssd(x, dt, A, B, C, D, torch.zeros(h.shape) if h0 is None else h0)
    assert calls == [length] and triton_only["ssd_chunked_triton"] == 1 and triton_only["ssd_scan_triton"] == 0
    assert y.dtype == torch.float16 and h.dtype == torch.float32
    assert (y.double() - y_ref).abs().max() <= 2e-3 * y_ref.abs().max()
    assert (h.double() - h_ref).abs().max() <= 2e-3 * h_ref.abs().max()


def test_only_half_precision_inference_on_a_prompt_takes_the_chunked_ssd(triton_only, monkeypatch):
    """The chunked SSD serves inference on 16 tokens or more in bf16 / fp16; the decoding step, a gradient, float32
    (TF32 products, or spills) and torch.compile take the scan (all of them checked against float64 above)."""
    calls = counted_chunked_ssd(monkeypatch)
    x, dt, A, B, C, D, h0 = ssd_inputs(length=16)
    with torch.no_grad():
        ssm_samba.ssd_scan(x, dt, A, B, C, D, h0)  # float32
        ssm_samba.ssd_scan(x[:, :15].half(), dt[:, :15], A, B[:, :15].half(), C[:, :15].half(), D, h0)
    assert calls == []
    leaves = [t.half().requires_grad_() for t in (x, B, C)]
    ssm_samba.ssd_scan(leaves[0], dt, A, leaves[1], leaves[2], D, h0)[0].float().sum().backward()
    assert calls == [] and leaves[0].grad is not None
    with torch.no_grad():
        ssm_samba.ssd_scan(x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), D, h0)
        ssm_samba.ssd_scan(x.half(), dt, A, B.half(), C.half(), D, h0)
    assert calls == [16, 16]


def test_a_chunked_ssd_that_fails_leaves_the_prompt_to_the_scan_said_once(triton_only, monkeypatch, caplog):
    """Where the chunked SSD does not compile (bf16 products on a GPU before sm_80, say), the scan serves the prompt,
    with the same numbers, and that is said once."""

    def refuse(*args, **kwargs):
        raise RuntimeError("no bf16 products on this GPU")

    monkeypatch.setattr(ssm_samba, "_CHUNKED_SSD_FAILED", set())
    monkeypatch.setattr(ssm_samba, "_KERNELS", ssm_samba.load_kernels()._replace(ssd_chunked_triton=refuse))
    x, dt, A, B, C, D, h0 = ssd_inputs(length=20)
    x, B, C = x.half(), B.half(), C.half()
    with caplog.at_level(logging.WARNING), torch.no_grad():
        results = [ssm_samba.ssd_scan(x, dt, A, B, C, D, h0) for _ in range(2)]
    said = [r.getMessage() for r in caplog.records if "chunked SSD does not run" in r.getMessage()]
    assert len(said) == 1 and "no bf16 products on this GPU" in said[0] and "Triton scan instead" in said[0]
    y_ref, h_ref = float64_ssd(x, dt, A, B, C, D, h0)
    for y, h in results:
        assert (y.double() - y_ref).abs().max() <= 2e-3 * y_ref.abs().max()
        assert_close(h, h_ref, 1e-5)


def test_the_chunked_ssd_is_checked_once_per_variant_and_left_out_where_it_is_wrong(triton_only, monkeypatch, caplog):
    """Before its first prompt in a compiled variant (dtype, device, block sizes, D and a starting state or not) the
    chunked SSD runs a small problem of the caller's head size against the scan, once: a correct one (float16, under
    the interpreter) passes and serves; one that gives other numbers (a GPU or Triton release compiling it wrongly:
    here its results scaled) is left out, said once, and the scan serves with its numbers."""
    from samba_hf import triton_scan_samba

    x, dt, A, B, C, D, h0 = ssd_inputs(length=20)
    x, B, C = x.half(), B.half(), C.half()
    y_ref, h_ref = float64_ssd(x, dt, A, B, C, D, h0)
    y_zero, _ = float64_ssd(x, dt, A, B, C, torch.zeros_like(D), torch.zeros(h0.shape))  # no D, from zero
    monkeypatch.setattr(ssm_samba, "_CHUNKED_SSD_CHECKED", set())
    monkeypatch.setattr(ssm_samba, "_CHUNKED_SSD_FAILED", set())
    check = 2 * triton_scan_samba.SSD_CHUNK + 5
    calls = counted_chunked_ssd(monkeypatch, skip_check=False)
    for first, (d, state, want) in ((True, (D, h0, y_ref)), (False, (D, h0, y_ref)), (True, (None, None, y_zero))):
        before = len(calls)
        with torch.no_grad():
            y, h = ssm_samba.ssd_scan(x, dt, A, B, C, d, state)
        assert calls[before:] == ([check, 20] if first else [20]), calls  # the check before a variant's first prompt
        assert (y.double() - want).abs().max() <= 2e-3 * want.abs().max()
    checked = ssm_samba._CHUNKED_SSD_CHECKED
    assert len(checked) == 2 and {key[-2:] for key in checked} == {(True, True), (False, False)}, checked
    assert not ssm_samba._CHUNKED_SSD_FAILED

    kernels = ssm_samba.load_kernels()
    real = kernels.ssd_chunked_triton
    monkeypatch.setattr(
        ssm_samba, "_KERNELS", kernels._replace(ssd_chunked_triton=lambda *args: tuple(t * 1.5 for t in real(*args)))
    )
    monkeypatch.setattr(ssm_samba, "_CHUNKED_SSD_CHECKED", set())
    with caplog.at_level(logging.WARNING), torch.no_grad():
        results = [ssm_samba.ssd_scan(x, dt, A, B, C, D, h0) for _ in range(2)]
    said = [r.getMessage() for r in caplog.records if "chunked SSD does not run" in r.getMessage()]
    assert len(said) == 1 and "other numbers than the scan" in said[0], said
    assert ssm_samba._CHUNKED_SSD_FAILED == {torch.float16}
    for y, h in results:  # the scan's numbers, not the wrong kernel's
        assert (y.double() - y_ref).abs().max() <= 2e-3 * y_ref.abs().max()
        assert_close(h, h_ref, 1e-5)


def test_a_float16_mamba2_model_prefills_through_the_chunked_ssd(triton_only, monkeypatch):
    """A half-precision Mamba-2 model's prompt through the chunked SSD: the logits of the scan's path, and greedy
    tokens decoded on from the state it leaves in the cache equal to the scan's."""
    calls = counted_chunked_ssd(monkeypatch)
    model = tiny_mamba2(seed=4).half()
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(4))
    results = []
    for minimum in (16, 10**9):  # the chunked SSD, then the scan alone
        monkeypatch.setattr(ssm_samba, "SSD_MIN_TOKENS", minimum)
        with torch.no_grad():
            logits = model(ids).logits.float()
            tokens = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=4,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        results.append((logits, tokens))
    assert calls and set(calls) == {40}
    (logits, tokens), (scan_logits, scan_tokens) = results
    assert (logits - scan_logits).abs().max() <= 2e-2 * scan_logits.abs().max()
    assert torch.equal(tokens, scan_tokens)


@pytest.mark.parametrize("length", [40, 101])
@pytest.mark.parametrize("from_state", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_inference_scan_runs_in_segments_joined_exactly(triton_only, monkeypatch, length, from_state, dtype):
    """Inference on a long sequence: segments scanned at once from zero, then joined (the starting state of each
    from the ends of those before, its contribution added): the same as one pass, for Mamba and Mamba-2."""
    from samba_hf import triton_scan_samba

    monkeypatch.setattr(triton_scan_samba, "MIN_SEGMENT", 8)  # tiny segments, so that tiny inputs have several
    monkeypatch.setattr(triton_scan_samba, "PROGRAMS_PER_SM", 64)
    monkeypatch.setattr(ssm_samba, "SSD_MIN_TOKENS", 10**9)  # Mamba-2's bf16 prompts: the scan, not chunks
    segments = []
    real = triton_scan_samba._segments
    monkeypatch.setattr(triton_scan_samba, "_segments", lambda *a: segments.append(real(*a)) or segments[-1])
    u, dt, A, B, C, D, z, h0 = scan_inputs(length=length, dtype=dtype)
    h0 = h0 if from_state else None
    with torch.no_grad():
        y, h = ssm_samba.selective_scan(u, dt, A, B, C, D, z, h0)
    y_ref, h_ref = float64_recurrence(u, dt, A, B, C, D, z, torch.zeros(2, 40, 5) if h0 is None else h0)
    assert_close(y, y_ref, 1e-5 if dtype == torch.float32 else 1e-2)
    assert_close(h, h_ref, 1e-5)
    x, dt, A, B, C, D, h0 = ssd_inputs(length=length)
    h0 = h0 if from_state else None
    with torch.no_grad():
        y, h = ssm_samba.ssd_scan(x.to(dtype), dt, A, B, C, D, h0)
    y_ref, h_ref = float64_ssd(x.to(dtype), dt, A, B, C, D, torch.zeros(h.shape) if h0 is None else h0)
    assert_close(y, y_ref, 1e-5 if dtype == torch.float32 else 1e-2)
    assert_close(h, h_ref, 1e-5)
    assert len(segments) == 2 and min(segments) >= 4, segments


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_a_long_training_scan_is_walked_back_in_segments_exactly(triton_only, monkeypatch, kind):
    """A long sequence with a gradient to come: the forward scans segments of whole chunks at once and joins them,
    the state kept before each chunk made whole too; the backward walks the segments back at once, each from the
    gradient of the state after it (what the later segments' outputs give, `_carry_segments`, joined from the last
    segment to the first). Every value and gradient equals float64's, for Mamba and Mamba-2, from a state, with the
    last state's gradient, the last segment and its chunk cut short."""
    from samba_hf import triton_scan_samba

    monkeypatch.setattr(triton_scan_samba, "CHUNK", 8)  # tiny chunks and segments, so that 50 tokens have several
    monkeypatch.setattr(triton_scan_samba, "TILE_MAX", 2)  # and several tiles in a chunk
    monkeypatch.setattr(triton_scan_samba, "MIN_SEGMENT", 8)
    monkeypatch.setattr(triton_scan_samba, "PROGRAMS_PER_SM", 64)
    lengths, segments = [], []
    real_length, real_carries = triton_scan_samba._segment_len, triton_scan_samba._backward_carries
    monkeypatch.setattr(
        triton_scan_samba, "_segment_len", lambda *a, **k: lengths.append(real_length(*a, **k)) or lengths[-1]
    )
    monkeypatch.setattr(triton_scan_samba, "_backward_carries", lambda *a: segments.append(a[-2:]) or real_carries(*a))
    if kind == "mamba":
        names, inputs = ("u", "dt", "A", "B", "C", "D", "z", "h0"), scan_inputs(length=50)
        scan, reference_scan = ssm_samba.selective_scan, float64_recurrence
    else:
        names = ("x", "dt", "A", "B", "C", "D", "h0")
        x, dt, A, B, C, D, h0 = ssd_inputs(length=50, heads=6, head_dim=4, groups=3, d_state=5)  # blocks across groups
        inputs = x, dt, A / 16, B, C, D, h0  # decays that carry over a segment of 16 tokens (A in [-1, -1/16])
        scan, reference_scan = ssm_samba.ssd_scan, float64_ssd
    leaves = [t.clone().requires_grad_() for t in inputs]
    y, h = scan(*leaves)
    weights = torch.randn_like(y), torch.randn_like(h)
    grads = torch.autograd.grad((y * weights[0]).sum() + (h * weights[1]).sum(), leaves)
    reference = [t.detach().double().requires_grad_() for t in leaves]
    y_ref, h_ref = reference_scan(*reference)
    expected = torch.autograd.grad((y_ref * weights[0]).sum() + (h_ref * weights[1]).sum(), reference)
    assert lengths == [16, 16] and segments == [(4, 16)], (lengths, segments)  # 4 of 16 (2 chunks), the last 2
    assert_close(y, y_ref, 1e-5)
    assert_close(h, h_ref, 1e-5)
    for name, grad, want in zip(names, grads, expected):
        assert grad.shape == want.shape, name
        assert_close(grad, want, 1e-4)


@pytest.mark.parametrize("tile_max", [1, 2, 16])
def test_any_number_of_tokens_a_step_gives_the_float64_scan(triton_only, monkeypatch, tile_max):
    """The forward takes TILE tokens a step (an associative scan over them; 1: a token a step, the kernel the H100 run
    measured, and the decoding step's; the backward too): whatever the tile, whole or cut by the end of a chunk or a
    segment, the same numbers and gradients, for Mamba and Mamba-2, from a state, joined from segments."""
    from samba_hf import triton_scan_samba

    monkeypatch.setattr(triton_scan_samba, "TILE_MAX", tile_max)
    monkeypatch.setattr(triton_scan_samba, "TILE_ELEMENTS", 4096)
    monkeypatch.setattr(triton_scan_samba, "MIN_SEGMENT", 8)
    monkeypatch.setattr(triton_scan_samba, "PROGRAMS_PER_SM", 64)
    tiles = []
    real = triton_scan_samba._Layout.tile_for
    monkeypatch.setattr(
        triton_scan_samba._Layout, "tile_for", lambda self, n: tiles.append(real(self, n)) or tiles[-1]
    )
    u, dt, A, B, C, D, z, h0 = scan_inputs(length=37)
    with torch.no_grad():
        y, h = ssm_samba.selective_scan(u, dt, A, B, C, D, z, h0)  # segments of 10 tokens (the last 7)
    y_ref, h_ref = float64_recurrence(u, dt, A, B, C, D, z, h0)
    assert_close(y, y_ref, 1e-5)
    assert_close(h, h_ref, 1e-5)
    leaves = [t.clone().requires_grad_() for t in (u, dt, A, B, C, D, z, h0)]
    y, h = ssm_samba.selective_scan(*leaves)  # one segment, checkpoints every 64 tokens; the backward in tiles too
    assert_close(y, y_ref, 1e-5)
    weights = torch.randn_like(y), torch.randn_like(h)
    grads = torch.autograd.grad((y * weights[0]).sum() + (h * weights[1]).sum(), leaves)
    reference = [t.detach().double().requires_grad_() for t in leaves]
    y_ref64, h_ref64 = float64_recurrence(*reference)
    expected = torch.autograd.grad((y_ref64 * weights[0]).sum() + (h_ref64 * weights[1]).sum(), reference)
    for name, grad, want in zip(("u", "dt", "A", "B", "C", "D", "z", "h0"), grads, expected):
        assert_close(grad, want, 1e-4)
    x, dt, A, B, C, D, h0 = ssd_inputs(length=37, heads=4, head_dim=16, groups=1, d_state=16)
    with torch.no_grad():
        y, h = ssm_samba.ssd_scan(x, dt, A, B, C, D, h0)
    y_ref, h_ref = float64_ssd(x, dt, A, B, C, D, h0)
    assert_close(y, y_ref, 1e-5)
    assert_close(h, h_ref, 1e-5)
    # the tiny Mamba layout: 32 channels of 8 states a program; the Mamba-2 one 32 of 16 (forward and join of the
    # segments, the forward and backward of the training scan, the Mamba-2 forward and join)
    expected = [min(tile_max, 16)] * 4 + [min(tile_max, 8)] * 2
    assert tiles == expected, tiles


def test_the_gpu_benchmarks_scan_configs_run_each_launch_with_the_defaults_numbers(triton_only, monkeypatch):
    """benchmarks/gpu.py's `scan_configs` times each launch of samba-hf's Triton scan on the next GPU run (what the
    defaults of triton_scan_samba.py should be; GPU time is too short to find a bug in it there): on the smoke sizes,
    under the interpreter, its launches run, give the default's numbers, and Samba's is timed with its backward.
    Three of the launches, each timed once (the interpreter takes minutes for them all; every tile's numbers are
    checked above)."""
    import importlib.util
    import time
    from types import SimpleNamespace

    from samba_hf import triton_scan_samba

    spec = importlib.util.spec_from_file_location("gpu_benchmark", Path(__file__).parents[1] / "benchmarks" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    chosen = ("default", "a token a step (the H100 run's kernel)", "16 tokens of 16 channels a step, 8 warps")
    monkeypatch.setattr(gpu, "SCAN_CONFIGS", [config for config in gpu.SCAN_CONFIGS if config[0] in chosen])
    assert [name for name, _ in gpu.SCAN_CONFIGS] == list(chosen)

    def timed_once(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    monkeypatch.setattr(gpu, "timed", timed_once)
    defaults = {key: getattr(triton_scan_samba, key) for _, values in gpu.SCAN_CONFIGS for key in values}
    args = SimpleNamespace(smoke=True, prefill="24", time_limit=3600, cap=3600)
    rows = gpu.scan_configs(args, torch.device("cpu"), torch.float32)
    assert list(rows) == [24] and "error" not in rows[24], rows
    assert len(rows[24]) == 2 * len(gpu.SCAN_CONFIGS)
    for name, row in rows[24].items():
        assert row["seconds"] > 0 and row["difference"] <= 1e-5, (name, row)
        assert ("train_seconds" in row) == name.startswith("samba"), (name, row)
    assert {key: getattr(triton_scan_samba, key) for key in defaults} == defaults  # each launch's constants put back


def test_samba_hfs_triton_scan_in_bfloat16_and_over_padding(triton_only):
    """bf16 inputs (float32 state, y in bf16); a zero step leaves the state as it was (padding)."""
    u, dt, A, B, C, D, z, h0 = scan_inputs(length=20, dtype=torch.bfloat16)
    y, h = ssm_samba.selective_scan(u, dt, A, B, C, D, z, h0)
    y_ref, h_ref = float64_recurrence(u, dt, A, B, C, D, z, h0)
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    assert_close(y, y_ref, 1e-2)
    assert_close(h, h_ref, 1e-5)
    gap = dt.clone()
    gap[:, 5:9] = 0  # four padded positions
    keep = [t for t in range(20) if not 5 <= t < 9]
    _, with_gap = ssm_samba.selective_scan(u, gap, A, B, C, D, z, h0)
    _, without = ssm_samba.selective_scan(u[:, keep], dt[:, keep], A, B[:, keep], C[:, keep], D, z[:, keep], h0)
    assert_close(with_gap, without, 1e-6)


def test_packed_documents_train_through_samba_hfs_triton_scan(triton_only, monkeypatch):
    """A packed batch (position_ids restarting at each document): each document's loss and gradients as if alone."""
    from transformers import DataCollatorWithFlattening

    model = tiny_model(seed=6)
    documents = [
        torch.randint(3, 97, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        for length in (9, 5, 13)
    ]
    batch = DataCollatorWithFlattening()([{"input_ids": d} for d in documents])
    model.train()
    loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]).loss
    grads = torch.autograd.grad(loss, [model.model.layers[0].mamba.A_log, model.model.layers[0].mamba.in_proj.weight])
    assert triton_only["selective_scan_triton"] > 0
    pytorch_path(monkeypatch)
    model.zero_grad()
    reference = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]).loss
    expected = torch.autograd.grad(
        reference, [model.model.layers[0].mamba.A_log, model.model.layers[0].mamba.in_proj.weight]
    )
    assert_close(loss, reference, 1e-5)
    for grad, want in zip(grads, expected):
        assert_close(grad, want, 1e-4)


def test_a_saved_folder_runs_the_triton_scan_from_its_own_code(triton_only, tmp_path):
    """save_pretrained copies triton_scan_samba.py and triton_conv_samba.py beside the other remote-code files; loaded
    with trust_remote_code where samba_hf cannot be imported, the folder's own Triton scan and conv give the same
    logits."""
    from test_save_load import assert_loads_without_the_package

    model = tiny_model(seed=8)
    model.save_pretrained(tmp_path)
    for name in ("triton_scan_samba.py", "triton_conv_samba.py"):
        assert (tmp_path / name).read_bytes() == Path(ssm_samba.__file__).with_name(name).read_bytes()
    ids = torch.randint(3, 97, (1, 20))
    with torch.no_grad():
        torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "expected.pt")
    assert triton_only["selective_scan_triton"] == 2 and triton_only["causal_conv_triton"] == 2  # two Mamba layers
    assert_loads_without_the_package(tmp_path)


# Half precision as float16: Triton 3.9's interpreter multiplies bfloat16 matrices wrongly (tl.dot of two 16 x 16
# bfloat16 blocks is off by 1e10 on the CPU), which this kernel's chunks are made of; on a GPU bfloat16 is what runs.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("from_state", [False, True])
def test_the_mamba2_scan_runs_mamba_chunk_scan_combined(kernels, monkeypatch, dtype, from_state):
    x, dt, A, B, C, D, h0 = ssd_inputs(length=21)
    h0 = h0 if from_state else None
    x, B, C = x.to(dtype), B.to(dtype), C.to(dtype)
    leaves = [t.clone().requires_grad_() for t in (x, dt, B, C)]
    y, last = ssm_samba.ssd_scan(*leaves[:2], A, *leaves[2:], D, h0, chunk_size=8)
    assert kernels["mamba_chunk_scan_combined"] == 1
    y_ref, last_ref = float64_ssd(x, dt, A, B, C, D, torch.zeros(2, 6, 4, 5) if h0 is None else h0)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert y.dtype == dtype
    assert_close(y, y_ref, tol)
    assert_close(last, last_ref, tol)
    if dtype != torch.float32:
        return
    grads = torch.autograd.grad(y.pow(2).sum(), leaves)
    pytorch_path(monkeypatch)
    reference = [t.clone().requires_grad_() for t in (x, dt, B, C)]
    y_p, _ = ssm_samba.ssd_scan_pytorch(*reference[:2], A, *reference[2:], D, h0, chunk_size=8)
    for grad, ref in zip(grads, torch.autograd.grad(y_p.pow(2).sum(), reference)):
        assert_close(grad, ref, 1e-3)


def test_mamba_ssms_float32_ssd_with_tf32_products_stays_within_test_gpus_tolerance(kernels, monkeypatch):
    """On a GPU mamba-ssm's float32 `tl.dot`s run on tensor cores as TF32 (Triton's default precision); the
    interpreter multiplies in full float32. With TF32 emulated the worse way (the 13 low mantissa bits of each operand
    dropped, as an mma reads a float32 register unless the compiler rounds it first), the Mamba-2 scan must stay
    within the bound test_gpu.py holds it to (output and last state, from a state and from zero), with a margin of 2
    for other inputs; and the emulation must show (the error at least 10x that of full float32)."""
    import numpy as np
    from test_gpu import SSD_FLOAT32_TOLERANCE
    from triton.runtime import interpreter

    g = torch.Generator().manual_seed(0)
    b, L, h, p, groups, n = 1, 200, 4, 16, 2, 32  # test_gpu's case, smaller
    x = torch.randn(b, L, h, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, L, h, generator=g) - 2)
    A = -torch.exp(torch.randn(h, generator=g))
    B, C = (torch.randn(b, L, groups, n, generator=g) for _ in range(2))
    D, h0 = torch.randn(h, generator=g), torch.randn(b, h, p, n, generator=g)

    def relative_error():  # of the output and of the last state, from h0 and from zero
        errors = []
        for start in (h0, torch.zeros_like(h0)):
            y, last = ssm_samba.ssd_scan(x, dt, A, B, C, D, start, chunk_size=64)
            y_ref, last_ref = float64_ssd(x, dt, A, B, C, D, start)
            errors += [
                ((got.double() - ref).abs().max() / ref.abs().max()).item()
                for got, ref in ((y, y_ref), (last, last_ref))
            ]
        return max(errors)

    full_float32 = relative_error()
    ieee_dot = interpreter.InterpreterBuilder.create_dot

    def tf32(handle):
        bits = np.ascontiguousarray(handle.data).view(np.uint32) & np.uint32(0xFFFFE000)
        return interpreter.TensorHandle(bits.view(np.float32), handle.dtype.scalar)

    def tf32_dot(self, a, b, d, *args):
        if a.data.dtype == np.float32 and b.data.dtype == np.float32:
            a, b = tf32(a), tf32(b)
        return ieee_dot(self, a, b, d, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", tf32_dot)
    with_tf32 = relative_error()
    assert kernels["mamba_chunk_scan_combined"] == 4
    assert 10 * full_float32 < with_tf32 <= SSD_FLOAT32_TOLERANCE / 2, (full_float32, with_tf32)


def test_the_causal_conv_runs_causal_conv1d(kernels):
    conv = torch.nn.Conv1d(24, 24, kernel_size=4, groups=24, padding=3)
    window = torch.randn(2, 24, 13)
    with torch.no_grad():
        reference = conv(window)[..., :13]
        for seq_len in (13, 5, 1):  # prompt, continuation after a cached window, one-token step
            out = ssm_samba.causal_conv(conv, window, seq_len)
            assert (out - reference[..., -seq_len:]).abs().max() <= 1e-5
    assert kernels["causal_conv1d_fn"] == 2 and kernels["causal_conv1d_update"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_bias", [True, False])
def test_samba_hfs_triton_conv_equals_a_float64_conv_with_gradients(triton_only, dtype, has_bias):
    """samba-hf's Triton conv against a float64 depthwise conv: a prompt, a continuation after a cached window (the
    window's head is cached context) and the one-token step, on the mixers' transposed (batch, seq, d_inner) layout
    and on a contiguous window; the gradients of the window, the weight and the bias. 70 channels and 45 positions:
    more than one block of each (64 and 32), neither a multiple."""
    from samba_hf.triton_conv_samba import causal_conv_triton

    g = torch.Generator().manual_seed(3)
    d, length, taps = 70, 45, 4
    weight = torch.randn(d, taps, generator=g)
    bias = torch.randn(d, generator=g) if has_bias else None
    for layout in ("transposed", "contiguous"):
        x = torch.randn(2, length, d, generator=g)
        window = x.transpose(1, 2) if layout == "transposed" else x.transpose(1, 2).contiguous()
        for seq_len in (length, 13, 1):
            leaves = [
                t.to(dtype, copy=True).requires_grad_() for t in (window, weight) + ((bias,) if has_bias else ())
            ]
            out = causal_conv_triton(leaves[0], leaves[1], leaves[2] if has_bias else None, seq_len)
            grad = torch.randn(out.shape, generator=g)
            out.float().backward(grad)
            exact = [t.detach().double().requires_grad_() for t in leaves]
            full = torch.nn.functional.conv1d(
                exact[0], exact[1][:, None], exact[2] if has_bias else None, padding=taps - 1, groups=d
            )[..., :length]
            want = full[..., length - seq_len :]
            want.backward(grad.double())
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert out.shape == (2, d, seq_len) and out.dtype == dtype
            assert_close(out, want, tol)
            for got, expected in zip(leaves, exact):
                assert_close(got.grad, expected.grad, tol)


def test_the_causal_conv_runs_samba_hfs_triton_conv_without_causal_conv1d(triton_only):
    conv = torch.nn.Conv1d(24, 24, kernel_size=4, groups=24, padding=3)
    window = torch.randn(2, 13, 24).transpose(1, 2)  # as the mixers make it
    with torch.no_grad():
        reference = conv(window)[..., :13]
        for seq_len in (13, 5, 1):  # prompt, continuation after a cached window, one-token step
            out = ssm_samba.causal_conv(conv, window, seq_len)
            assert (out - reference[..., -seq_len:]).abs().max() <= 1e-5
            assert out.transpose(1, 2).is_contiguous()  # the mixer's transpose back is free
    assert triton_only["causal_conv_triton"] == 3


def test_every_kernel_variant_compiles_for_a_cuda_gpu():
    """Triton's real compiler, down to a cubin for sm_80 and sm_90, with no GPU: what the interpreter cannot check
    (the first H200 run found every variant refused by Triton 3.6's compiler). In its own process, without
    TRITON_INTERPRET (tests/triton_compile_check.py)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("triton_compile_check.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    failing = [line for line in result.stdout.splitlines() if ": ok (" not in line]
    assert result.returncode == 0 and failing == ["failures 0"], (failing[:5], result.stderr[-2000:])
    assert result.stdout.count(": ok (") >= 100


# ---- whole models ---------------------------------------------------------------------------------------------------


def run_everything(model, ids, prefix):
    """Logits of one forward; the gradients of a training step; greedy tokens from a cached prompt (one-token steps);
    the logits of a multi-token continuation from the cache, and of a prompt cut into 4-token inference chunks."""
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(
            ids[:, :prefix],
            attention_mask=torch.ones_like(ids[:, :prefix]),
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        cache = returned_cache(model(ids[:, :prefix], use_cache=True))
        continued = model(ids[:, prefix:], cache=cache, use_cache=True).logits
        model.config.inference_chunk_size = 4
        chunked = model(ids).logits
        model.config.inference_chunk_size = 0
    model.zero_grad()
    model.train()
    model(ids, labels=ids).loss.backward()
    model.eval()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits, grads, tokens, continued, chunked


@pytest.mark.parametrize(
    "kind, installed, expected",
    [
        (
            "samba",
            "packages",
            {"selective_scan_fn", "selective_state_update", "causal_conv1d_fn", "causal_conv1d_update"},
        ),
        ("samba", "triton only", {"selective_scan_triton", "causal_conv_triton"}),
        (
            "mamba2",
            "packages",
            {"mamba_chunk_scan_combined", "selective_state_update", "causal_conv1d_fn", "causal_conv1d_update"},
        ),
        ("mamba2", "triton only", {"ssd_scan_triton", "causal_conv_triton"}),
    ],
)
def test_a_model_runs_every_kernel_and_equals_the_pytorch_path(monkeypatch, kind, installed, expected):
    calls = only(monkeypatch, PACKAGES if installed == "packages" else TRITON_ONLY)
    model = tiny_model(seed=3) if kind == "samba" else tiny_mamba2("megatron", seed=5)
    ids = torch.randint(3, 97, (2, 14), generator=torch.Generator().manual_seed(1))
    with_kernels = run_everything(model, ids, prefix=9)
    assert {name for name, count in calls.items() if count} == expected, calls
    pytorch_path(monkeypatch)
    reference = run_everything(model, ids, prefix=9)
    for got, want in zip(with_kernels[:1] + with_kernels[3:], reference[:1] + reference[3:]):
        assert_close(got, want, 1e-4)
    assert torch.equal(with_kernels[2], reference[2])
    assert with_kernels[1].keys() == reference[1].keys()
    for name in reference[1]:
        assert_close(with_kernels[1][name], reference[1][name], 1e-3)


def prompt_then_steps(model, ids, prefix):
    """Logits of a prompt and of one-token steps from its cache, and the gradients of a training step: the scan and
    the conv of a prompt, of a decoding step and of a backward."""
    with torch.no_grad():
        out = model(ids[:, :prefix], use_cache=True)
        cache, logits = returned_cache(out), [out.logits]
        for t in range(prefix, ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    model.zero_grad()
    model.train()
    model(ids, labels=ids).loss.backward()
    model.eval()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logits, dim=1), grads


@pytest.mark.parametrize("kind", ["samba", "mamba2"])
@pytest.mark.parametrize("choice", ["samba", "mamba_ssm", "pytorch"])
def test_the_kernel_switch_runs_only_the_chosen_kernels_with_everything_installed(monkeypatch, kind, choice):
    """kernel_implementation with every kernel installed: "samba" runs samba-hf's Triton scan and conv alone,
    "mamba_ssm" mamba-ssm's and causal-conv1d's alone (where "auto" prefers them too), "pytorch" no kernel; each
    equal to the PyTorch path (a prompt, decoding steps, the gradients of a training step)."""
    calls = only(monkeypatch, PACKAGES + TRITON_ONLY)
    model = tiny_model(seed=3) if kind == "samba" else tiny_mamba2("megatron", seed=5)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    if choice == "pytorch":  # the PyTorch scans may run now
        for name in ("selective_scan_pytorch", "selective_scan_cpu", "ssd_scan_pytorch"):
            monkeypatch.setattr(ssm_samba, name, ORIGINAL[name])
    model.set_kernel_implementation(choice)
    logits, grads = prompt_then_steps(model, ids, prefix=10)
    scan = {"samba": "selective_scan_triton", "mamba2": "ssd_scan_triton"}[kind]
    expected = {
        "samba": {scan, "causal_conv_triton"},
        "mamba_ssm": {
            "selective_scan_fn" if kind == "samba" else "mamba_chunk_scan_combined",
            "selective_state_update",
            "causal_conv1d_fn",
            "causal_conv1d_update",
        },
        "pytorch": set(),
    }[choice]
    assert {name for name, count in calls.items() if count} == expected, calls
    pytorch_path(monkeypatch)
    model.set_kernel_implementation("auto")
    reference_logits, reference_grads = prompt_then_steps(model, ids, prefix=10)
    assert_close(logits, reference_logits, 1e-4)
    assert grads.keys() == reference_grads.keys()
    for name in reference_grads:
        assert_close(grads[name], reference_grads[name], 1e-3)


@pytest.mark.parametrize(
    "installed, choice, message",
    [
        (TRITON_ONLY, "mamba_ssm", "selective_scan_fn is not installed"),
        (PACKAGES, "samba", "samba-hf's Triton scan is unavailable"),
        (PACKAGES[:3], {"conv": "samba"}, "samba-hf's Triton conv is unavailable"),
    ],
)
def test_a_chosen_kernel_that_is_not_installed_is_one_error(monkeypatch, installed, choice, message):
    only(monkeypatch, installed)
    model = tiny_model(seed=3)
    with pytest.raises(ValueError, match=f"{message}.*'auto', 'pytorch', 'samba', 'mamba_ssm'"):
        model.set_kernel_implementation(choice)
    assert model.config.kernel_implementation == "auto"


@pytest.mark.parametrize("kind", ["samba", "mamba2"])
@pytest.mark.parametrize("installed", ["triton only", "packages too"])
def test_the_compiled_decoding_step_runs_the_triton_scan_as_one_operator(monkeypatch, kind, installed):
    """transformers' static cache and compile_config (fullgraph: one graph per step, CUDA graphs on a GPU): the scan
    in the graph is the operator torch.ops.samba_hf.scan_triton, even where mamba-ssm is installed (its kernels are
    no operators), and the tokens equal eager decoding's."""
    from test_generation import compiled_generate_equals_eager

    monkeypatch.setattr(ssm_samba, "_KERNELS", None)
    loaded = ssm_samba.load_kernels()
    if installed == "triton only":
        monkeypatch.setattr(ssm_samba, "_KERNELS", loaded._replace(**{name: None for name in PACKAGES}))
    forbid_pytorch_scans(monkeypatch)
    model = tiny_model(seed=11) if kind == "samba" else tiny_mamba2("megatron", seed=11)
    with torch.profiler.profile() as profile:
        compiled_generate_equals_eager(model, vocab=97)
    ran = {event.key: event.count for event in profile.key_averages()}
    assert ran.get("samba_hf::scan_triton", 0) > 0, sorted(ran)[:40]


@pytest.mark.parametrize("keep_checkpoints", [False, True])
def test_the_triton_scan_operator_passes_opcheck(keep_checkpoints):
    """The operator's schema, its fake (shapes for tracing) and its autograd registration, by torch's own check."""
    from samba_hf import triton_scan_samba  # noqa: F401  (registers the operator)

    u, dt, A, B, C, D, z, h0 = scan_inputs(length=9)
    B, C = B[:, :, None].contiguous(), C[:, :, None].contiguous()  # (batch, seq, groups, d_state)
    if keep_checkpoints:  # what a gradient needs
        u, dt, B, h0 = (t.requires_grad_() for t in (u, dt, B, h0))
    args = (u, dt, A, B, C, D, z, h0, 1, 1, False, keep_checkpoints)
    torch.library.opcheck(torch.ops.samba_hf.scan_triton.default, args)


def test_a_bfloat16_model_decodes_with_the_kernels(kernels, monkeypatch):
    model = tiny_model(seed=3).to(torch.bfloat16)
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        step = model(ids[:, -1:], cache=returned_cache(out), use_cache=True).logits
    assert kernels["selective_state_update"] == 2 and torch.isfinite(step).all()


@pytest.mark.parametrize("target", ["in_proj", "x_proj", "dt_proj", "out_proj"])
def test_adapters_on_the_mamba_projections_reach_the_kernel_path(kernels, monkeypatch, target):
    from test_peft import IDS, adapted, decode_logits, differs

    model = adapted(target).eval()
    with torch.no_grad():
        with_kernels = model(input_ids=IDS).logits
        decoded = decode_logits(model, IDS)
        with model.disable_adapter():
            base = model(input_ids=IDS).logits
    assert (
        kernels["selective_scan_fn"] > 0 and kernels["selective_state_update"] > 0 and kernels["causal_conv1d_fn"] > 0
    )
    pytorch_path(monkeypatch)
    with torch.no_grad():
        pytorch = model(input_ids=IDS).logits
    assert differs(with_kernels, base)
    assert_close(with_kernels, pytorch, 1e-4)
    assert_close(decoded, pytorch[:, -3:], 1e-4)


def test_an_adapter_wrapped_conv_runs_as_its_module(kernels):
    class WrappedConv(torch.nn.Conv1d):  # what an adapter library's wrapper looks like to the dispatch
        def forward(self, x):
            return super().forward(x) + 1.0

    model = tiny_model(seed=5)
    ids = torch.randint(3, 97, (1, 12))
    with torch.no_grad():
        base = model(ids).logits
        for layer in model.model.layers:
            if layer.layer_type == "linear_attention":
                plain = layer.mamba.conv1d
                wrapped = WrappedConv(
                    plain.in_channels,
                    plain.out_channels,
                    plain.kernel_size[0],
                    groups=plain.groups,
                    padding=plain.padding[0],
                )
                wrapped.load_state_dict(plain.state_dict())
                layer.mamba.conv1d = wrapped
        conv_calls = kernels["causal_conv1d_fn"]
        wrapped_out = model(ids).logits
    assert kernels["causal_conv1d_fn"] == conv_calls  # the module ran, not the kernel
    assert not torch.allclose(base, wrapped_out)


# ---- loading, and what happens without a kernel ---------------------------------------------------------------------


def test_the_triton_ops_load_without_mamba_ssms_init_or_its_cuda_extension():
    """An install without the compiled scan (MAMBA_SKIP_CUDA_BUILD=TRUE, as here) still gives the Triton kernels;
    mamba_ssm/__init__.py (which imports the compiled scan and Mamba-3) never runs, and a later `import mamba_ssm`
    finds no half-made package in its way. In a fresh process: nothing of this test's stand-ins there."""
    script = (
        "import sys\n"
        "from samba_hf import ssm_samba\n"
        "k = ssm_samba.load_kernels()\n"
        "assert k.selective_state_update is not None and k.mamba_chunk_scan_combined is not None, k.missing\n"
        "assert k.selective_scan_fn is None and 'selective_scan_cuda' in k.missing['selective_scan_fn'], k.missing\n"
        "assert k.causal_conv1d_fn is None and 'causal_conv1d_cuda' in k.missing['causal_conv1d_fn'], k.missing\n"
        "assert 'mamba_ssm' not in sys.modules and 'mamba_ssm.modules.mamba3' not in sys.modules\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


def test_mamba_ssms_main_branch_without_its_extension_runs_samba_hfs_triton_scan(monkeypatch, caplog):
    """mamba-ssm's main branch imports without its CUDA scan (selective_scan_cuda = None) and raises only when
    selective_scan_fn is called: samba-hf looks at the extension, and scans with its own Triton kernel."""
    interface = ssm_samba._import_mamba_ssm("ops.selective_scan_interface")
    monkeypatch.setattr(interface, "selective_scan_cuda", None)
    monkeypatch.setattr(ssm_samba, "_KERNELS", None)
    loaded = ssm_samba.load_kernels()
    assert loaded.selective_scan_fn is None and "selective_scan_cuda" in loaded.missing["selective_scan_fn"]
    forbid_pytorch_scans(monkeypatch)
    u, dt, A, B, C, D, z, h0 = scan_inputs()
    y, _ = ssm_samba.selective_scan(u, dt, A, B, C, D, z, h0)
    assert_close(y, float64_recurrence(u, dt, A, B, C, D, z, h0)[0], 1e-5)


def test_a_triton_scan_that_fails_its_check_is_left_out(monkeypatch, caplog):
    """load_kernels runs samba-hf's Triton scan once on a few numbers against the PyTorch scan: one that answers
    otherwise (a GPU or Triton release it compiles wrongly for) is left out with the reason, and the fallback says
    it."""
    from samba_hf import triton_scan_samba

    real = triton_scan_samba.selective_scan_triton
    monkeypatch.setattr(triton_scan_samba, "selective_scan_triton", lambda *a: tuple(t * 1.01 for t in real(*a)))
    monkeypatch.setattr(ssm_samba, "_KERNELS", None)
    loaded = ssm_samba.load_kernels()
    assert loaded.selective_scan_triton is None and loaded.ssd_scan_triton is None
    assert "other numbers than the PyTorch scan on cpu" in loaded.missing["selective_scan_triton"]
    monkeypatch.setattr(ssm_samba, "_KERNELS", loaded._replace(**{name: None for name in PACKAGES}))
    logging.Logger.warning_once.cache_clear()
    u, dt, A, B, C, D, z, h0 = scan_inputs()
    with caplog.at_level(logging.WARNING):
        y, _ = ssm_samba.selective_scan(u, dt, A, B, C, D, z, h0)
    assert any("other numbers" in r.getMessage() for r in caplog.records)
    assert_close(y, float64_recurrence(u, dt, A, B, C, D, z, h0)[0], 1e-5)


def test_without_any_kernel_the_fallback_is_said_once(monkeypatch, caplog):
    """No Triton scan either (no triton): one warning that names what runs and what to install, then PyTorch."""
    monkeypatch.setattr(
        ssm_samba,
        "_KERNELS",
        ssm_samba.Kernels(*[None] * len(KERNEL_NAMES), missing={"selective_scan_triton": "ImportError: no triton"}),
    )
    logging.Logger.warning_once.cache_clear()
    u, dt, A, B, C, D, z, h0 = scan_inputs()
    with caplog.at_level(logging.WARNING):
        y1, _ = ssm_samba.selective_scan(u, dt, A, B, C, D, z, h0)
        ssm_samba.selective_scan(u, dt, A, B, C, D, z, h0)
    lines = [r.getMessage() for r in caplog.records if "samba-hf" in r.getMessage()]
    assert len(lines) == 1 and "selective_scan_triton is unavailable (ImportError: no triton)" in lines[0]
    assert "runs in PyTorch" in lines[0] and "install triton" in lines[0]
    assert_close(y1, float64_recurrence(u, dt, A, B, C, D, z, h0)[0], 1e-5)


@pytest.mark.parametrize("kind", ["samba", "mamba2"])
@pytest.mark.parametrize("installed", ["packages", "triton only"])
def test_a_verified_draft_is_taken_back_on_every_kernel_path(monkeypatch, kind, installed):
    """Assisted generation's rollback through the kernels (mamba-ssm's and causal-conv1d's, or samba-hf's Triton
    ones): a recording cache verifies a prompt with a draft, then a 4-token draft, and is taken back by 1 and 3
    tokens; the next logits equal those of a forward over the kept tokens alone. Greedy prompt lookup gives plain
    greedy decoding's tokens."""
    from samba_hf import cache_samba

    only(monkeypatch, PACKAGES if installed == "packages" else TRITON_ONLY)
    model = tiny_model(seed=3) if kind == "samba" else tiny_mamba2("megatron", seed=5)
    ids = torch.randint(3, 97, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for back in (1, 3):
            cache = cache_samba.DynamicCache(config=model.config)
            cache.activate_past_recording()
            model(ids[:, :14], cache=cache, use_cache=True, logits_to_keep=3)  # the prompt and a 2-token draft
            cache.crop(-1)
            model(ids[:, 13:18], cache=cache, use_cache=True, logits_to_keep=5)  # the next token and a 4-token draft
            cache.crop(-back)
            got = model(ids[:, 18:20], cache=cache, use_cache=True).logits
            reference = model(torch.cat([ids[:, : 18 - back], ids[:, 18:20]], 1)).logits[:, -2:]
            assert_close(got, reference, 1e-4)
        prompt = torch.cat([ids[:, :8]] * 2, 1)
        plain = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
        assert torch.equal(
            model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, prompt_lookup_num_tokens=3),
            plain,
        )
