"""Samba's layouts against independent implementations: transformers' Mamba, Mistral and Llama, and float64."""

import pytest
import torch
from conftest import returned_cache, tiny_model
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from samba_hf import cpu_kernels_samba, ssm_samba

TOL = 1e-4


def _max_diff(a, b):
    return (a - b).abs().max().item()


def test_all_mamba_matches_transformers_mamba():
    model = tiny_model(layer_types=["linear_attention"] * 3, num_hidden_layers=3, intermediate_size=0)
    c = model.config
    ref_config = MambaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        state_size=c.mamba_d_state,
        num_hidden_layers=3,
        layer_norm_epsilon=c.rms_norm_eps,
        expand=c.mamba_expand,
        conv_kernel=c.mamba_d_conv,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=c.mamba_dt_rank,
        tie_word_embeddings=True,
        residual_in_fp32=False,
    )
    reference = MambaForCausalLM(ref_config).eval()
    renames = {
        "model.embed_tokens": "backbone.embeddings",
        "model.norm": "backbone.norm_f",
        ".input_layernorm": ".norm",
        ".mamba.": ".mixer.",
        "model.layers": "backbone.layers",
    }
    state = {}
    for key, value in model.state_dict().items():
        for old, new in renames.items():
            key = key.replace(old, new)
        state[key] = value
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    reference.tie_weights()

    ids = torch.randint(3, c.vocab_size, (2, 40))
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    assert theirs.abs().max() > 0.1
    assert _max_diff(ours, theirs) <= TOL


def _attention_reference(model, reference_cls, reference_config):
    reference = reference_cls(reference_config).eval()
    result = reference.load_state_dict(model.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return reference


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_all_sliding_matches_mistral(attn_implementation):
    model = tiny_model(layer_types=["sliding_attention"] * 3, num_hidden_layers=3)
    model.config._attn_implementation = attn_implementation
    c = model.config
    reference = _attention_reference(
        model,
        MistralForCausalLM,
        MistralConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=3,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            sliding_window=c.sliding_window,
            rms_norm_eps=c.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True,
            max_position_embeddings=c.max_position_embeddings,
            attn_implementation=attn_implementation,
        ),
    )
    ids = torch.randint(3, c.vocab_size, (2, 5 * c.sliding_window))  # several windows long
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    assert _max_diff(ours, theirs) <= TOL
    # the window matters: the same model with full attention gives other logits
    model.config.layer_types = ["full_attention"] * 3
    for layer in model.model.layers:
        layer.layer_type, layer.self_attn.sliding_window = "full_attention", None
    with torch.no_grad():
        assert _max_diff(model(ids).logits, theirs) > 1e-3


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_all_full_attention_matches_llama(attn_implementation):
    model = tiny_model(
        layer_types=["full_attention"] * 3,
        num_hidden_layers=3,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    model.config._attn_implementation = attn_implementation
    c = model.config
    reference = _attention_reference(
        model,
        LlamaForCausalLM,
        LlamaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=3,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            tie_word_embeddings=True,
            max_position_embeddings=c.max_position_embeddings,
            attn_implementation=attn_implementation,
        ),
    )
    ids = torch.randint(3, c.vocab_size, (2, 30))
    with torch.no_grad():
        assert _max_diff(model(ids).logits, reference(ids).logits) <= TOL


def test_rope_scaling_reaches_the_attention():
    plain = tiny_model(layer_types=["full_attention"] * 2, num_hidden_layers=2)
    scaled = tiny_model(
        layer_types=["full_attention"] * 2,
        num_hidden_layers=2,
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    )
    assert torch.allclose(scaled.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq / 4)
    ids = torch.randint(3, 97, (1, 12))
    with torch.no_grad():
        assert _max_diff(plain(ids).logits, scaled(ids).logits) > 1e-4


def float64_recurrence(u, dt, A, B, C, D, z, h0):
    """The Mamba recurrence written out step by step in float64: h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t,
    y_t = (<h_t, C_t> + D u_t) silu(z_t); D and z may be None. Differentiable (float64 inputs pass through)."""
    u, dt, A, B, C, h = (t.double() for t in (u, dt, A, B, C, h0))
    ys = []
    for t in range(u.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[..., None] * B[:, t, None, :]
        y = (h * C[:, t, None, :]).sum(-1)
        if D is not None:
            y = y + D.double() * u[:, t]
        ys.append(y if z is None else y * z[:, t].double() * torch.sigmoid(z[:, t].double()))
    return torch.stack(ys, dim=1), h


@pytest.fixture(params=["compiled", "pytorch"])
def selective_scan(request):
    """Both CPU scans: the compiled one (which `selective_scan` dispatches to) and the PyTorch fallback."""
    if request.param == "pytorch":
        return ssm_samba.selective_scan_pytorch
    from test_cpu_scan import require_compiled_scan

    require_compiled_scan()
    return cpu_kernels_samba.selective_scan_cpu


@pytest.mark.parametrize("seq_len", [1, 7, 64, 150])
def test_scan_matches_float64_recurrence(seq_len, selective_scan):
    b, d, n = 2, 6, 5
    u, z = torch.randn(b, seq_len, d), torch.randn(b, seq_len, d)
    dt = torch.nn.functional.softplus(torch.randn(b, seq_len, d) - 2)
    A = -torch.exp(torch.randn(d, n))
    B, C, D, h0 = torch.randn(b, seq_len, n), torch.randn(b, seq_len, n), torch.randn(d), torch.randn(b, d, n)
    y, h = selective_scan(u, dt, A, B, C, D, z, h0)
    y_ref, h_ref = float64_recurrence(u, dt, A, B, C, D, z, h0)
    assert y.dtype == torch.float32 and h.dtype == torch.float32
    assert _max_diff(y.double(), y_ref) <= 1e-5
    assert _max_diff(h.double(), h_ref) <= 1e-5


def test_scan_in_bf16_keeps_float32_state(selective_scan):
    u = torch.randn(1, 10, 4).bfloat16()
    dt = torch.full((1, 10, 4), 0.1)
    y, h = selective_scan(u, dt, -torch.ones(4, 3), torch.randn(1, 10, 3), torch.randn(1, 10, 3))
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32


def test_scan_stays_exact_at_64k_tokens(selective_scan):
    """No cumulative products: a 64K-token scan (strong and weak decays mixed) matches float64 to the end."""
    b, d, n, L = 1, 4, 4, 65536
    g = torch.Generator().manual_seed(0)
    u, z = torch.randn(b, L, d, generator=g), torch.randn(b, L, d, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, L, d, generator=g) * 2 - 1)  # steps from ~0.01 to ~5
    A = -torch.tensor([[0.001, 0.1, 1.0, 16.0]] * d)  # near-constant to near-instant forgetting
    B, C = torch.randn(b, L, n, generator=g), torch.randn(b, L, n, generator=g)
    D = torch.ones(d)
    y, h = selective_scan(u, dt, A, B, C, D, z)
    y_ref, h_ref = float64_recurrence(u, dt, A, B, C, D, z, torch.zeros(b, d, n))
    assert torch.isfinite(y).all() and torch.isfinite(h).all()
    assert _max_diff(h.double(), h_ref) <= 1e-4 * max(1.0, h_ref.abs().max().item())
    assert _max_diff(y[:, -1000:].double(), y_ref[:, -1000:]) <= 1e-4 * max(1.0, y_ref.abs().max().item())


@pytest.mark.parametrize("window, past, q_len", [(8, 0, 37), (8, 7, 20), (600, 0, 1500), (600, 599, 1100), (5, 3, 1)])
def test_blockwise_sliding_attention_equals_dense(window, past, q_len):
    from types import SimpleNamespace

    from samba_hf.attention_samba import sliding_window_attention_blockwise

    g = torch.Generator().manual_seed(window + past + q_len)
    b, heads, kv_heads, dim = 2, 4, 2, 8
    q = torch.randn(b, heads, q_len, dim, generator=g)
    k, v = (
        torch.randn(b, kv_heads, past + q_len, dim, generator=g),
        torch.randn(b, kv_heads, past + q_len, dim, generator=g),
    )
    padding = torch.ones(b, past + q_len, dtype=torch.bool)
    padding[1, : (past + q_len) // 3] = False  # left padding in the second row
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads)
    out = sliding_window_attention_blockwise(module, q, k, v, padding, window, dim**-0.5)

    # dense reference: full score matrix with the band and padding applied
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ kk.transpose(-1, -2)) * dim**-0.5
    i = torch.arange(past, past + q_len)[:, None]
    j = torch.arange(past + q_len)[None, :]
    allowed = ((i - j) >= 0) & ((i - j) < window) & padding[:, None, None, :]
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num() @ vv
    real = allowed.any(-1)[:, 0]  # queries that see at least one key (others are padding)
    assert out.shape == (b, q_len, heads, dim)
    assert (
        out.transpose(1, 2)[real[:, None].expand(-1, heads, -1)] - ref[real[:, None].expand(-1, heads, -1)]
    ).abs().max() <= 1e-5


@pytest.mark.parametrize("window, past, q_len", [(8, 0, 37), (8, 7, 20), (200, 0, 300), (200, 199, 150)])
def test_flex_sliding_attention_equals_the_blockwise_path(window, past, q_len):
    """The flex_attention path (on a GPU for long sliding-window inputs; eager here) attends to exactly the band and
    the padding the block-wise path does."""
    from types import SimpleNamespace

    from samba_hf.attention_samba import (
        sliding_window_attention_blockwise,
        sliding_window_attention_flex,
        sliding_window_block_mask,
    )

    g = torch.Generator().manual_seed(window + past + q_len)
    b, heads, kv_heads, dim = 2, 4, 2, 8
    q = torch.randn(b, heads, q_len, dim, generator=g)
    k, v = (
        torch.randn(b, kv_heads, past + q_len, dim, generator=g),
        torch.randn(b, kv_heads, past + q_len, dim, generator=g),
    )
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads)
    for padding in (None, torch.ones(b, past + q_len, dtype=torch.bool)):
        if padding is not None:
            padding[1, : (past + q_len) // 3] = False  # left padding in the second row
        mask = sliding_window_block_mask(padding, b, q_len, past + q_len, window, q.device)
        out = sliding_window_attention_flex(module, q, k, v, mask, dim**-0.5)
        ref = sliding_window_attention_blockwise(module, q, k, v, padding, window, dim**-0.5)
        real = slice(None) if padding is None else padding[:, past:]  # queries that are not padding
        assert out.shape == ref.shape == (b, q_len, heads, dim)
        assert (out[real] - ref[real]).abs().max() <= 1e-5


def test_flex_runs_every_length_of_a_bucket_at_one_padded_shape():
    """flex_attention runs at the next power of two of each length (one compiled kernel per bucket on a GPU, where
    torch 2.11 found no kernel for dynamic shapes): the padded queries and keys are masked out whole, and the
    result is the block-wise path's."""
    from types import SimpleNamespace

    from samba_hf import attention_samba as modeling

    assert [modeling.flex_length(n) for n in (1, 128, 129, 300, 4096, 4097)] == [128, 128, 256, 512, 4096, 8192]
    seen = []
    module = SimpleNamespace(num_key_value_groups=1)
    g = torch.Generator().manual_seed(0)
    for past, q_len in ((0, 257), (63, 200), (0, 511)):  # three lengths, one bucket of keys (512)
        q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (q_len, past + q_len, past + q_len))
        mask = modeling.sliding_window_block_mask(None, 1, q_len, past + q_len, 64, q.device)
        seen.append(mask.block_mask.shape[-2:])
        out = modeling.sliding_window_attention_flex(module, q, k, v, mask, 8**-0.5)
        ref = modeling.sliding_window_attention_blockwise(module, q, k, v, None, 64, 8**-0.5)
        assert (out - ref).abs().max() <= 1e-5
    assert seen == [(512, 512), (256, 512), (512, 512)]


def test_flex_attention_failing_in_a_forward_goes_block_wise_and_says_so(monkeypatch, caplog):
    """A compiler failure at a new shape (torch 2.11 on an H100 failed so for a cached continuation) does not end
    the forward: that call and the later ones of its kind go block-wise, with the same result, said once."""
    import samba_hf.attention_samba as modeling

    model = tiny_model(seed=3)
    ids = torch.randint(3, 97, (2, 40))
    with torch.no_grad():
        expected = model(ids).logits

    def failing(*args, **kwargs):
        raise RuntimeError("NoValidChoicesError: No choices to select")

    monkeypatch.setattr(modeling, "_FLEX_ATTENTION_WORKS", {})
    monkeypatch.setattr(modeling, "flex_attention_kernel", lambda *args: failing)
    monkeypatch.setattr(modeling, "takes_flex_attention", lambda config, inputs_embeds, training: True)
    with torch.no_grad(), caplog.at_level("WARNING"):
        got = model(ids).logits
        again = model(ids).logits
    assert torch.equal(got, expected) and torch.equal(again, expected)
    said = [r.getMessage() for r in caplog.records if "flex_attention failed" in r.getMessage()]
    assert len(said) == 1 and "No choices to select" in said[0] and "block-wise" in said[0]
    config = model.config
    key = modeling.flex_attention_key(
        torch.device("cpu"), torch.float32, config.head_dim, config.num_attention_heads // config.num_key_value_heads
    )
    assert modeling._FLEX_ATTENTION_WORKS == {key: False}


def test_no_block_mask_is_built_past_the_recompile_limit(monkeypatch, caplog):
    """On a GPU the block mask builder is compiled per shape; past torch.compile's recompile limit it would run
    uncompiled and materialise the whole (queries x keys) mask, so a new shape gets none (the block-wise path runs),
    said once. (Decided before anything touches the device: this runs without one.)"""
    from samba_hf import attention_samba as modeling

    limit = getattr(torch._dynamo.config, "recompile_limit", 8)
    monkeypatch.setattr(modeling, "_FLEX_MASK_SHAPES", {("another shape", n) for n in range(limit)})
    with caplog.at_level("WARNING"):
        for _ in range(2):
            assert modeling.sliding_window_block_mask(None, 1, 300, 300, 64, torch.device("cuda")) is None
    said = [r.getMessage() for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(said) == 1 and "block-wise" in said[0]


def test_sdpa_over_a_cache_on_a_gpu_leaves_cudnn_out():
    """cuDNN's attention builds and keeps a graph for every new key length, so a step over a growing cache would
    build one per layer per step: on a GPU a call with fewer queries than keys runs with cuDNN's switch off, and the
    switch is as it was once the last such call, in any thread, is over (it is the process's). (Decided before
    anything touches the device: this runs without one; tests/test_gpu.py profiles real decoding steps.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from samba_hf.attention_samba import sdpa_backends

    cuda, gpu = torch.backends.cuda, torch.device("cuda")

    def enabled():
        return (
            cuda.cudnn_sdp_enabled(),
            cuda.flash_sdp_enabled(),
            cuda.mem_efficient_sdp_enabled(),
            cuda.math_sdp_enabled(),
        )

    before = enabled()
    assert before[0]
    with sdpa_backends(gpu, 1, 300):
        assert enabled() == (False, *before[1:])
    assert enabled() == before
    for device, queries, keys in ((gpu, 300, 300), (torch.device("cpu"), 1, 300)):  # a prompt; a CPU
        with sdpa_backends(device, queries, keys):
            assert enabled() == before
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):  # a user's choice: the others off
        with sdpa_backends(gpu, 1, 300):
            assert enabled() == (False, True, False, False)
        assert enabled() == (True, True, False, False)
    for chosen in ([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], [SDPBackend.CUDNN_ATTENTION]):
        with sdpa_kernel(chosen):  # flash and memory-efficient turned off by the user: cuDNN stays
            inside = enabled()
            with sdpa_backends(gpu, 1, 300):
                assert enabled() == inside and inside[0]
    # two calls overlapping (two threads): off until the last is over, then as before
    first, second = sdpa_backends(gpu, 1, 300), sdpa_backends(gpu, 1, 40)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not cuda.cudnn_sdp_enabled()
    second.__exit__(None, None, None)
    assert enabled() == before
    with pytest.raises(RuntimeError), sdpa_backends(gpu, 1, 300):  # and after a failure inside
        raise RuntimeError("attention failed")
    assert enabled() == before


def test_a_model_through_flex_sliding_attention_equals_the_blockwise_path(monkeypatch):
    """Where flex_attention is chosen (a GPU), a long prompt, a padded batch and a cached continuation give what the
    block-wise path gives, and flex_attention ran for every sliding layer. (Its backward runs on a GPU only:
    tests/test_gpu.py.)"""
    import samba_hf.attention_samba as modeling

    model = tiny_model(seed=3)
    ids = torch.randint(3, 97, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :6] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        cached = returned_cache(model(ids[:, :25], use_cache=True))
        expected_continued = model(ids[:, 25:], cache=cached).logits

    calls = []
    flex = modeling.sliding_window_attention_flex
    monkeypatch.setattr(modeling, "sliding_window_attention_flex", lambda *a: calls.append(1) or flex(*a))
    monkeypatch.setattr(modeling, "takes_flex_attention", lambda config, inputs_embeds, training: True)
    sliding_layers = model.config.layer_types.count("sliding_attention")
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
        cached = returned_cache(model(ids[:, :25], use_cache=True))
        continued = model(ids[:, 25:], cache=cached).logits
    assert len(calls) == 3 * sliding_layers  # 25 and 15 tokens: both past the window of 8
    real = mask.bool()
    assert (got[real] - expected[real]).abs().max() <= 1e-5
    assert (continued - expected_continued).abs().max() <= 1e-5


@pytest.mark.parametrize("flex", [False, True])
def test_a_4d_mask_on_a_long_input_is_used_as_given(monkeypatch, flex):
    """A 4D attention mask (boolean, or additive: 0 where allowed, -inf elsewhere) on an input longer than the window
    goes to the sliding layers as given, on the block-wise (CPU) and the flex_attention (GPU) choice alike: here the
    sliding band itself, which must give the logits of no mask at all. (An additive mask was taken as a boolean one
    there, its band inverted; the flex path failed on its shape.)"""
    import samba_hf.attention_samba as modeling

    model = tiny_model(seed=5)
    if flex:
        monkeypatch.setattr(modeling, "takes_flex_attention", lambda config, inputs_embeds, training: True)
    ids = torch.randint(3, 97, (2, 30))
    i, j = torch.arange(30)[:, None], torch.arange(30)[None, :]
    band = ((i - j >= 0) & (i - j < model.config.sliding_window))[None, None].expand(2, 1, 30, 30)
    additive = torch.zeros(band.shape).masked_fill(~band, float("-inf"))
    with torch.no_grad():
        expected = model(ids).logits
        for mask in (band, additive):
            assert (model(ids, attention_mask=mask).logits - expected).abs().max() <= 1e-5


def test_flex_attention_that_fails_is_said_once_and_left_out(monkeypatch, caplog):
    import samba_hf.attention_samba as modeling

    config = tiny_model().config
    monkeypatch.setattr(modeling, "_FLEX_ATTENTION_WORKS", {})
    assert modeling.flex_attention_works(torch.device("cpu"), torch.float32, config)

    def broken(*args):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(modeling, "_FLEX_ATTENTION_WORKS", {})
    monkeypatch.setattr(modeling, "sliding_window_attention_flex", broken)
    with caplog.at_level("WARNING"):
        assert not modeling.flex_attention_works(torch.device("cpu"), torch.bfloat16, config)
        assert not modeling.flex_attention_works(torch.device("cpu"), torch.bfloat16, config)
    said = [r.getMessage() for r in caplog.records if "flex_attention" in r.getMessage()]
    assert len(said) == 1 and "no kernel for this GPU" in said[0] and "block-wise" in said[0]


def test_long_inputs_build_no_full_sliding_mask(monkeypatch):
    """Past the window, sliding layers go block by block: the L x L sliding mask builder is never called."""
    import samba_hf.modeling_samba as modeling

    model = tiny_model()
    ids = torch.randint(3, 97, (1, 50))
    with torch.no_grad():
        expected = model(ids).logits

    def refuse(**kwargs):
        raise AssertionError("an L x L sliding-window mask was built")

    monkeypatch.setitem(modeling.MASK_BUILDERS, "sliding_attention", refuse)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_over_grouped_heads_under_a_mask_shares_them_with_transformers_numbers(dtype, monkeypatch):
    """On a CPU, samba-hf's sdpa gives a masked call over grouped key/value heads (a check of drafted tokens over a
    cache, an inference chunk) to torch with `enable_gqa` instead of copying the keys and values per query head as
    transformers does (`repeat_kv`): exactly transformers' numbers, bool and additive masks, without the copy."""
    from types import SimpleNamespace

    from transformers.integrations import sdpa_attention

    from samba_hf.attention_samba import ALL_ATTENTION_FUNCTIONS

    copies = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: copies.append(1) or repeat_kv(*a))
    module = SimpleNamespace(num_key_value_groups=3, training=False, is_causal=True)
    torch.manual_seed(0)
    for queries, keys in ((9, 300), (16, 16), (2, 5)):
        q = torch.randn(1, 6, queries, 32, dtype=dtype)
        k, v = torch.randn(2, 1, 2, keys, 32, dtype=dtype)
        allowed = torch.ones(1, 1, queries, keys, dtype=torch.bool).tril(keys - queries)
        additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        for mask in (allowed, additive):
            ours, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, mask, dropout=0.0, scaling=0.2)
            assert not copies
            expected, _ = sdpa_attention.sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.2)
            assert copies and torch.equal(ours, expected), (queries, keys, mask.dtype)
            copies.clear()
