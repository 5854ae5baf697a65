"""Kernel paths against the PyTorch path, on a GPU. Skipped where there is none (CI has none: there
tests/test_kernels.py runs the same kernel paths under Triton's interpreter).

Run on a GPU machine with `python -m pytest -q tests/test_gpu.py`, with and without mamba-ssm / causal-conv1d /
flash-attn installed (benchmarks/gpu_run.sh does both); the cases of a package that is not there are skipped."""

import importlib.util

import pytest
import torch
from conftest import counted_chunked_ssd, returned_cache, tiny_model

from samba_hf import ssm_samba

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
KERNELS = ssm_samba.load_kernels()
needs_mamba_ssm = pytest.mark.skipif(
    KERNELS.selective_state_update is None or KERNELS.mamba_chunk_scan_combined is None,
    reason="needs mamba-ssm's Triton kernels",
)
needs_cuda_scan = pytest.mark.skipif(KERNELS.selective_scan_fn is None, reason="needs mamba-ssm's CUDA scan")
needs_causal_conv1d = pytest.mark.skipif(KERNELS.causal_conv1d_fn is None, reason="needs causal-conv1d")

# mamba-ssm's Mamba-2 kernels multiply float32 blocks with tl.dot at Triton's default precision, TF32 on a GPU's
# tensor cores (a 10-bit mantissa), while the PyTorch path multiplies in full float32. Under the interpreter, with
# TF32 emulated the worse way (the 13 low bits of each operand dropped), test_ssd_kernels_match_pytorch's inputs
# differ by 1.7e-3 of the output's size (6.2e-4 rounding to nearest, 3e-6 in full float32), over the 1e-3 this case
# failed with on the H200 (2026-11-26). tests/test_kernels.py checks the emulated error against this bound.
SSD_FLOAT32_TOLERANCE = 4e-3


@needs_causal_conv1d
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv_kernels_match_the_module(dtype):
    conv = torch.nn.Conv1d(64, 64, kernel_size=4, groups=64, padding=3).cuda().to(dtype)
    window = torch.randn(2, 64, 37, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref = conv(window)[..., :37]
        for seq_len in (37, 5, 1):  # prompt, continuation after a cached window, one-token step
            out = ssm_samba.causal_conv(conv, window, seq_len)
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            assert out.shape == (2, 64, seq_len)
            assert (out.float() - ref[..., -seq_len:].float()).abs().max() <= tol


@needs_cuda_scan
@needs_mamba_ssm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_scan_kernel_matches_pytorch(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    b, L, d, n = 2, 300, 64, 16
    u = torch.randn(b, L, d, device="cuda", generator=g).to(dtype)
    z = torch.randn(b, L, d, device="cuda", generator=g).to(dtype)
    dt = torch.nn.functional.softplus(torch.randn(b, L, d, device="cuda", generator=g) - 2)
    A = -torch.exp(torch.randn(d, n, device="cuda", generator=g))
    B, C = torch.randn(b, L, n, device="cuda", generator=g), torch.randn(b, L, n, device="cuda", generator=g)
    D = torch.randn(d, device="cuda", generator=g)
    y_k, h_k = ssm_samba.selective_scan(u, dt, A, B, C, D, z)
    y_p, h_p = ssm_samba.selective_scan_pytorch(u, dt, A, B, C, D, z)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    assert (y_k.float() - y_p.float()).abs().max() <= tol * max(1, y_p.abs().max().item())
    assert (h_k - h_p).abs().max() <= tol * max(1, h_p.abs().max().item())
    # a continuation from a state: selective_scan_fn plus the initial-state correction
    h0 = torch.randn(b, d, n, device="cuda", generator=g)
    y_k, h_k = ssm_samba.selective_scan(u, dt, A, B, C, D, z, h0)
    y_p, h_p = ssm_samba.selective_scan_pytorch(u, dt.to(dtype), A, B.to(dtype), C.to(dtype), D, z, h0)
    assert (y_k.float() - y_p.float()).abs().max() <= tol * max(1, y_p.abs().max().item())
    assert (h_k - h_p).abs().max() <= tol * max(1, h_p.abs().max().item())
    # one-token step from a state: selective_state_update
    y1_k, h1_k = ssm_samba.selective_scan(u[:, :1], dt[:, :1], A, B[:, :1], C[:, :1], D, z[:, :1], h_p)
    y1_p, h1_p = ssm_samba.selective_scan_pytorch(u[:, :1], dt[:, :1], A, B[:, :1], C[:, :1], D, z[:, :1], h_p)
    assert (y1_k.float() - y1_p.float()).abs().max() <= tol * max(1, y1_p.abs().max().item())
    assert (h1_k - h1_p).abs().max() <= tol * max(1, h1_p.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_samba_hfs_triton_conv_matches_the_module_with_gradients(triton_scans_only, dtype):
    """samba-hf's Triton conv (what runs without causal-conv1d) against nn.Conv1d on the GPU: a prompt, a continuation
    from a cached window and the one-token step, in the mixers' layout; the gradients of the window and the conv."""
    conv = torch.nn.Conv1d(200, 200, kernel_size=4, groups=200, padding=3).cuda().to(dtype)
    x = torch.randn(2, 300, 200, device="cuda", dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for seq_len in (300, 37, 1):
        window = x.transpose(1, 2).detach().requires_grad_()
        out = ssm_samba.causal_conv(conv, window, seq_len)
        grads = torch.autograd.grad(out.float().square().sum(), [window, conv.weight, conv.bias])
        ref_window = x.transpose(1, 2).detach().requires_grad_()
        ref = conv(ref_window)[..., :300][..., -seq_len:]
        ref_grads = torch.autograd.grad(ref.float().square().sum(), [ref_window, conv.weight, conv.bias])
        assert out.shape == ref.shape and out.transpose(1, 2).is_contiguous()
        for got, want in zip((out, *grads), (ref, *ref_grads)):
            assert (got.float() - want.float()).abs().max() <= tol * max(1.0, want.float().abs().max().item())


def _greedy(model, ids, steps):
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention", "flash_attention_2"])
def test_model_on_gpu_matches_cpu(attn):
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("needs flash-attn")
    shape = dict(head_dim=16, hidden_size=64) if attn == "flex_attention" else {}  # flex on CUDA: head_dim >= 16
    cpu = tiny_model(seed=4, **shape)
    gpu = tiny_model(seed=4, **shape).cuda()
    dtype = torch.bfloat16 if attn == "flash_attention_2" else torch.float32
    gpu = gpu.to(dtype)
    gpu.set_attn_implementation(attn)
    ids = torch.randint(3, 97, (2, 40))
    with torch.no_grad():
        ref = cpu(ids).logits
        out = gpu(ids.cuda()).logits.float().cpu()
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    assert (out - ref).abs().max() <= tol
    # chunked continuation from the cache (multi-token from a cached state) on the GPU
    if dtype == torch.float32:
        assert torch.equal(_greedy(gpu, ids[:, :10].cuda(), 20).cpu(), _greedy(cpu, ids[:, :10], 20))


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_sambay_on_gpu_matches_cpu_and_trains(attn):
    """SambaY: the Mamba kernels where installed, and flash-attention's one-head-size path for differential
    attention (each half of the paired values)."""
    from test_sambay import ids as sambay_ids
    from test_sambay import tiny_model as sambay_model

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("needs flash-attn")
    cpu, _ = sambay_model(seed=1)
    gpu, _ = sambay_model(seed=1)
    dtype = torch.bfloat16 if attn == "flash_attention_2" else torch.float32
    gpu = gpu.cuda().to(dtype)
    gpu.set_attn_implementation(attn)
    x = sambay_ids(2, 40)
    with torch.no_grad():
        ref = cpu(x).logits
        out = gpu(x.cuda()).logits.float().cpu()
    tol = 1e-4 if dtype == torch.float32 else 4e-2
    assert (out - ref).abs().max() <= tol * ref.abs().max()
    if dtype == torch.float32:
        assert torch.equal(_greedy(gpu, x[:, :3].cuda(), 12).cpu(), _greedy(cpu, x[:, :3], 12))
    gpu.train()
    gpu(x.cuda(), labels=x.cuda()).loss.backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in gpu.parameters())


@needs_mamba_ssm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ssd_kernels_match_pytorch(dtype):
    """mamba-ssm's Mamba-2 kernels (mamba_chunk_scan_combined from a zero and from a given state,
    selective_state_update for one token) against the PyTorch SSD."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, L, h, p, groups, n = 2, 300, 8, 16, 2, 32
    x = torch.randn(b, L, h, p, device="cuda", generator=g).to(dtype)
    dt = torch.nn.functional.softplus(torch.randn(b, L, h, device="cuda", generator=g) - 2)
    A = -torch.exp(torch.randn(h, device="cuda", generator=g))
    B, C = (torch.randn(b, L, groups, n, device="cuda", generator=g).to(dtype) for _ in range(2))
    D = torch.randn(h, device="cuda", generator=g)
    h0 = torch.randn(b, h, p, n, device="cuda", generator=g)
    tol = SSD_FLOAT32_TOLERANCE if dtype == torch.float32 else 5e-2
    for state in (None, h0):
        y_k, last_k = ssm_samba.ssd_scan(x, dt, A, B, C, D, state, chunk_size=64)
        y_p, last_p = ssm_samba.ssd_scan_pytorch(x, dt, A, B, C, D, state, chunk_size=64)
        assert (y_k.float() - y_p.float()).abs().max() <= tol * max(1, y_p.abs().max().item())
        assert (last_k - last_p).abs().max() <= tol * max(1, last_p.abs().max().item())
    y1_k, h1_k = ssm_samba.ssd_scan(x[:, :1], dt[:, :1], A, B[:, :1], C[:, :1], D, h0)
    y1_p, h1_p = ssm_samba.ssd_scan_pytorch(x[:, :1], dt[:, :1], A, B[:, :1], C[:, :1], D, h0)
    assert (y1_k.float() - y1_p.float()).abs().max() <= tol * max(1, y1_p.abs().max().item())
    assert (h1_k - h1_p).abs().max() <= tol * max(1, h1_p.abs().max().item())


@pytest.mark.parametrize("layout", ["megatron", "samba2"])
def test_mamba2_layouts_on_cuda_match_the_cpu(layout):
    from test_mamba2 import tiny_mamba2

    model = tiny_mamba2(layout, seed=7)
    ids = torch.randint(3, 97, (2, 40))
    with torch.no_grad():
        cpu = model(ids).logits
        cuda = model.cuda()(ids.cuda()).logits.cpu()
    assert (cuda - cpu).abs().max() <= 1e-3 * cpu.abs().max()
    assert torch.equal(_greedy(model, ids.cuda()[:, :10], 20).cpu(), _greedy(model.cpu(), ids[:, :10], 20))


@needs_cuda_scan
@needs_mamba_ssm
def test_a_cached_continuation_never_steps_per_token_in_python(monkeypatch):
    """With mamba-ssm, a prompt continued from the cache, and a prompt cut into inference chunks, run the kernels
    only: the PyTorch scan is made to fail."""
    model = tiny_model(seed=4).cuda()
    ids = torch.randint(3, 97, (2, 40), device="cuda")
    with torch.no_grad():
        reference = model(ids).logits
        monkeypatch.setattr(ssm_samba, "selective_scan_pytorch", not_on_cuda(ssm_samba.selective_scan_pytorch))
        cache = returned_cache(model(ids[:, :25], use_cache=True))
        continued = model(ids[:, 25:], cache=cache, use_cache=True).logits
        model.config.inference_chunk_size = 16
        from samba_hf import modeling_samba

        monkeypatch.setattr(modeling_samba, "CUDA_MIN_INFERENCE_CHUNK", 0)  # chunks of 16 on the GPU too
        chunked = model(ids).logits
    assert (continued - reference[:, 25:]).abs().max() <= 1e-3 * reference.abs().max()
    assert (chunked - reference).abs().max() <= 1e-3 * reference.abs().max()


@pytest.fixture
def triton_scans_only(monkeypatch):
    """What `pip install samba-hf` gives: samba-hf's Triton scans and conv, none of mamba-ssm's or causal-conv1d's
    kernels."""
    for name in ("selective_scan_triton", "causal_conv_triton"):
        if getattr(KERNELS, name) is None:
            pytest.skip(f"samba-hf's {name} does not load here: {KERNELS.missing.get(name)}")
    own = ("selective_scan_triton", "ssd_scan_triton", "ssd_chunked_triton", "causal_conv_triton")
    monkeypatch.setattr(
        ssm_samba,
        "_KERNELS",
        KERNELS._replace(**{name: None for name in ssm_samba.Kernels._fields[:-1] if name not in own}),
    )
    for name in ("selective_scan_pytorch", "ssd_scan_pytorch"):
        monkeypatch.setattr(ssm_samba, name, not_on_cuda(getattr(ssm_samba, name)))


def not_on_cuda(scan):
    """`scan` for CPU tensors (the reference models run there); a failed test if a CUDA tensor reaches it."""

    def guarded(x, *args, **kwargs):
        if x.is_cuda:
            pytest.fail(f"{scan.__name__} ran on CUDA tensors")
        return scan(x, *args, **kwargs)

    return guarded


PYTORCH_SCAN, PYTORCH_SSD = ssm_samba.selective_scan_pytorch, ssm_samba.ssd_scan_pytorch  # before any monkeypatch


def values_and_gradients(fn, inputs):
    """fn's outputs and the gradients of a fixed random weighting of them with respect to every tensor input."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    y, h = fn(*leaves)
    g = torch.Generator(device="cuda").manual_seed(1)
    weights = tuple(torch.rand(t.shape, device="cuda", generator=g) - 0.5 for t in (y, h))
    return (y, h, *torch.autograd.grad((y.float() * weights[0]).sum() + (h * weights[1]).sum(), leaves))


def assert_all_close(got, want, tol):
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a.float() - b.float()).abs().max() <= tol * max(1.0, b.float().abs().max().item()), i


def assert_a_training_step_matches(gpu, cpu, ids):
    """The same model on the GPU and on the CPU: one training step's gradients agree, parameter by parameter."""
    gpu.train()
    cpu.train()
    gpu(ids.cuda(), labels=ids.cuda()).loss.backward()
    cpu(ids, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(gpu.named_parameters(), cpu.named_parameters()):
        assert (a.grad.cpu() - b.grad).abs().max() <= 1e-3 * max(1.0, b.grad.abs().max().item()), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_samba_hfs_triton_scans_match_pytorch_with_gradients(triton_scans_only, dtype):
    """Mamba's and Mamba-2's scans across the backward's 64-token chunks, from a state: values and every gradient."""
    g = torch.Generator(device="cuda").manual_seed(0)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    b, L, d, n = 2, 300, 64, 16
    u, z = (torch.randn(b, L, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    dt = torch.nn.functional.softplus(torch.randn(b, L, d, device="cuda", generator=g) - 2)
    A = -torch.exp(torch.randn(d, n, device="cuda", generator=g))
    B, C = (torch.randn(b, L, n, device="cuda", generator=g) for _ in range(2))
    D, h0 = torch.randn(d, device="cuda", generator=g), torch.randn(b, d, n, device="cuda", generator=g)
    inputs = (u, dt, A, B, C, D, z, h0)
    assert_all_close(
        values_and_gradients(ssm_samba.selective_scan, inputs), values_and_gradients(PYTORCH_SCAN, inputs), tol
    )
    heads, head_dim, groups, n = 8, 16, 2, 32
    x = torch.randn(b, L, heads, head_dim, device="cuda", generator=g).to(dtype)
    dt = torch.nn.functional.softplus(torch.randn(b, L, heads, device="cuda", generator=g) - 2)
    A, D = -torch.exp(torch.randn(heads, device="cuda", generator=g)), torch.randn(heads, device="cuda", generator=g)
    B, C = (torch.randn(b, L, groups, n, device="cuda", generator=g).to(dtype) for _ in range(2))
    h0 = torch.randn(b, heads, head_dim, n, device="cuda", generator=g)
    inputs = (x, dt, A, B, C, D, h0)
    assert_all_close(values_and_gradients(ssm_samba.ssd_scan, inputs), values_and_gradients(PYTORCH_SSD, inputs), tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_samba_hfs_chunked_ssd_matches_float64_on_a_prompt(triton_scans_only, monkeypatch, dtype):
    """Mamba-2 inference on a half-precision prompt takes samba-hf's chunked SSD (its products on the tensor cores):
    against the float64 recurrence on the same rounded inputs, the 8B's head shape (64 x 128), several chunks and a
    part, from a state. (CI checks float16 under the interpreter, whose bf16 products are wrong.)"""
    from test_mamba2 import float64_ssd

    from samba_hf import triton_scan_samba

    calls = counted_chunked_ssd(monkeypatch, skip_check=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    b, L, heads, head_dim, groups, n = 2, 300, 4, 64, 2, 128
    x = torch.randn(b, L, heads, head_dim, device="cuda", generator=g).to(dtype)
    dt = torch.nn.functional.softplus(torch.randn(b, L, heads, device="cuda", generator=g) - 2)
    A, D = -torch.exp(torch.randn(heads, device="cuda", generator=g)), torch.randn(heads, device="cuda", generator=g)
    B, C = (torch.randn(b, L, groups, n, device="cuda", generator=g).to(dtype) / n**0.5 for _ in range(2))
    h0 = torch.randn(b, heads, head_dim, n, device="cuda", generator=g)
    with torch.no_grad():
        y, h = ssm_samba.ssd_scan(x, dt, A, B, C, D, h0)
    y_ref, h_ref = float64_ssd(*(t.cpu() for t in (x, dt, A, B, C, D, h0)))
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-2  # products of 8 and of 11 bits
    # (the first prompt in a dtype runs the load-time check first: a small problem through both paths)
    assert calls[-1] == L and y.dtype == dtype
    assert triton_scan_samba.ssd_chunked_variant(x, B, D, h0) in ssm_samba._CHUNKED_SSD_CHECKED
    assert (y.cpu().double() - y_ref).abs().max() <= tol * y_ref.abs().max()
    assert (h.cpu().double() - h_ref).abs().max() <= tol * h_ref.abs().max()


@pytest.mark.parametrize("kind", ["samba", "mamba2"])
def test_an_eager_decoding_step_neither_synchronises_nor_builds_cudnn_graphs(kind):
    """On an H100 (2026-11-26) samba-hf's eager decoding steps synchronised with the GPU once each (the input
    checks read the ids back) and attended through cuDNN, which builds a graph for every new key length: Samba-1.3B
    stepped in 62 ms at 1K of context, its window still growing, and 16 ms at 64K. Now a step reads nothing back
    and keeps sdpa off cuDNN over the cache; where torch itself would take cuDNN for these shapes, that is checked
    too. bf16, heads of 64 (cuDNN's sizes), the keys growing at every step; the tokens are the same either way."""
    from test_mamba2 import tiny_mamba2
    from torch.nn.functional import scaled_dot_product_attention
    from torch.profiler import ProfilerActivity, profile

    shapes = dict(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=64,
    )
    model = tiny_model(seed=6, **shapes) if kind == "samba" else tiny_mamba2("megatron", seed=6, **shapes)
    model = model.cuda().to(torch.bfloat16)
    ids = torch.randint(3, 97, (1, 12), device="cuda")

    def traced(fn):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
            out = fn()
        return out, [event.name for event in trace.events()]

    with torch.no_grad():
        cache = returned_cache(model(ids, use_cache=True))
        token = ids[:, -1:]
        for _ in range(2):  # first calls: the kernels' load-time checks
            token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)

        def steps():
            nonlocal token
            for _ in range(3):
                token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            return token

        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any call that waits for the GPU raises
        try:
            steps()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _, names = traced(steps)  # (the profiler synchronises on leaving: its trace is for cuDNN only)
        q = torch.randn(1, 4, 1, 64, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(1, 2, 17, 64, device="cuda", dtype=torch.bfloat16)
        _, alone = traced(lambda: scaled_dot_product_attention(q, kv, kv, enable_gqa=True))
    assert not [name for name in names if "cudnn_attention" in name], "cuDNN's attention ran over the cache"
    assert torch.backends.cuda.cudnn_sdp_enabled()  # left as it was
    print(f"torch alone takes cuDNN for a step's shapes: {any('cudnn_attention' in name for name in alone)}")


@pytest.mark.parametrize("kind", ["samba", "mamba2", "sambay"])
def test_decoding_in_cuda_graphs_gives_the_eager_tokens(kind):
    """generate with transformers' switches (a static cache, compile_config; its default mode on a GPU replays the
    compiled step as a CUDA graph, which needs the Mamba states and the window written in place): the eager tokens, in
    float32, with whichever kernels are installed. SambaY: Phi-4-mini-flash-reasoning's layout."""
    from test_generation import compiled_generate_equals_eager
    from test_mamba2 import tiny_mamba2
    from test_sambay import tiny_model as tiny_sambay

    models = {
        "samba": lambda: tiny_model(seed=11),
        "mamba2": lambda: tiny_mamba2("megatron", seed=7),
        "sambay": lambda: tiny_sambay(seed=5)[0],
    }
    model = models[kind]().cuda()
    compiled_generate_equals_eager(model, vocab=model.config.vocab_size)


@pytest.mark.parametrize("name", ["samba", "megatron", "sambay"])
def test_speculative_decoding_on_the_gpu_gives_the_greedy_tokens(name):
    """Prompt lookup and an assistant of the same family, on the GPU in float32 with whichever kernels are installed:
    plain greedy's tokens exactly (the recorded forward and `crop` run the GPU's scans and conv)."""
    from test_assisted_generation import greedy, layout, repetitive_prompt
    from test_sambay import tiny_model as tiny_sambay

    model = layout(name).cuda()
    ids = repetitive_prompt(model.config.vocab_size).cuda()
    expected = greedy(model, ids)
    assert torch.equal(greedy(model, ids, prompt_lookup_num_tokens=5), expected)
    assistant = tiny_model(seed=12, vocab_size=model.config.vocab_size) if name != "sambay" else tiny_sambay(seed=6)[0]
    assert torch.equal(greedy(model, ids, assistant_model=assistant.cuda()), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_sliding_window_inputs_run_flex_attention_and_match_the_cpu(monkeypatch, dtype):
    """On a GPU with sdpa, inputs longer than the window go through compiled flex_attention (the CPU goes block by
    block): logits, a padded batch, a cached continuation and the gradients of a training step as on the CPU."""
    import samba_hf.attention_samba as modeling

    calls = []
    flex = modeling.sliding_window_attention_flex
    monkeypatch.setattr(modeling, "sliding_window_attention_flex", lambda *a: calls.append(a[1].device) or flex(*a))
    shape = dict(head_dim=16, hidden_size=64, sliding_window=64)  # flex on CUDA: head_dim >= 16
    cpu, gpu = tiny_model(seed=4, **shape), tiny_model(seed=4, **shape).cuda().to(dtype)
    ids = torch.randint(3, 97, (2, 300))
    mask = torch.ones(2, 300, dtype=torch.long)
    mask[1, :50] = 0
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    with torch.no_grad():
        for args in ((ids,), (ids, mask)):
            ref = cpu(*args).logits
            out = gpu(*(a.cuda() for a in args)).logits.float().cpu()
            real = args[-1].bool() if len(args) == 2 else slice(None)
            assert (out[real] - ref[real]).abs().max() <= tol * max(1.0, ref.abs().max().item())
        cache = returned_cache(gpu(ids[:, :200].cuda(), use_cache=True))
        continued = gpu(ids[:, 200:].cuda(), cache=cache).logits.float().cpu()
        assert (continued - cpu(ids).logits[:, 200:]).abs().max() <= tol * max(1.0, ref.abs().max().item())
    # flex_attention passed its check, and ran in every sliding layer of the 3 forwards (beyond the check's own call)
    # without failing (it goes block-wise from a failure on: on an H100 with torch 2.11, the cached continuation failed
    # to compile while shapes were dynamic)
    config = gpu.config
    key = modeling.flex_attention_key(
        torch.device("cuda", torch.cuda.current_device()),
        dtype,
        config.head_dim,
        config.num_attention_heads // config.num_key_value_heads,
    )
    assert modeling._FLEX_ATTENTION_WORKS[key]
    sliding_layers = cpu.config.layer_types.count("sliding_attention")
    assert len(calls) >= 3 * sliding_layers + 1 and all(device.type == "cuda" for device in calls)
    if dtype == torch.float32:
        assert_a_training_step_matches(gpu, cpu, ids)


@pytest.mark.parametrize("kind", ["samba", "mamba2"])
def test_a_model_on_samba_hfs_triton_scans_matches_the_cpu(triton_scans_only, kind):
    from test_mamba2 import tiny_mamba2

    cpu = tiny_model(seed=4) if kind == "samba" else tiny_mamba2("megatron", seed=7)
    gpu = (tiny_model(seed=4) if kind == "samba" else tiny_mamba2("megatron", seed=7)).cuda()
    ids = torch.randint(3, 97, (2, 150))
    with torch.no_grad():
        ref = cpu(ids).logits
        out = gpu(ids.cuda()).logits.cpu()
    assert (out - ref).abs().max() <= 1e-3 * ref.abs().max()
    assert torch.equal(_greedy(gpu, ids[:, :10].cuda(), 20).cpu(), _greedy(cpu, ids[:, :10], 20))
    assert_a_training_step_matches(gpu, cpu, ids)


@pytest.mark.parametrize("compiled", ["_FLEX_SHAPES", "_FLEX_MASK_SHAPES"])
def test_flex_attention_past_the_recompile_limit_goes_block_wise(monkeypatch, caplog, compiled):
    """Once flex_attention, or its block mask builder, has been compiled for as many shapes as torch.compile's
    recompile limit (past which torch runs it uncompiled, materialising every score or the whole mask), inputs of
    new shapes go block-wise, said once, with the same result."""
    import samba_hf.attention_samba as modeling

    shape = dict(head_dim=16, hidden_size=64, sliding_window=64)
    cpu, gpu = tiny_model(seed=4, **shape), tiny_model(seed=4, **shape).cuda()
    ids = torch.randint(3, 97, (1, 300))
    limit = getattr(torch._dynamo.config, "recompile_limit", 8)
    monkeypatch.setattr(modeling, compiled, {("another shape", n) for n in range(limit)})
    with torch.no_grad(), caplog.at_level("WARNING"):
        ref = cpu(ids).logits
        out = gpu(ids.cuda()).logits.cpu()
    assert (out - ref).abs().max() <= 1e-3 * max(1.0, ref.abs().max().item())
    said = [r.getMessage() for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(said) == 1 and "block-wise" in said[0]
