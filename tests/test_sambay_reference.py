"""Self-consistency of the float64 SambaY reference (tests/sambay_reference.py), and its layout against the
released checkpoint index. Nothing here depends on samba_hf's own implementation."""

import json
import math
from pathlib import Path

import pytest
import torch
from sambay_reference import (
    attention_allowed,
    differential_attention,
    lambda_init,
    layer_kinds,
    random_weights,
    reference_forward,
    reference_logits,
    released_shapes,
    selective_scan,
)

RELEASE_DIR = Path(__file__).resolve().parent / "data" / "sambay"  # the release's config.json and weight index

TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=64,
    sliding_window=4,
    layer_norm_eps=1e-5,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The reference does hundreds of tiny float64 matmuls: one thread is fastest, and on a busy 2-core machine
    two threads are ~30x slower. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_weights():
    return random_weights(TINY, seed=0)


def _ids(B, T, seed=0):
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------------------------


def test_layer_kinds():
    assert layer_kinds(8) == ["mamba", "swa", "mamba", "swa", "memory_mamba", "full_attn", "gmu", "cross_attn"]
    assert layer_kinds(12)[6:] == ["memory_mamba", "full_attn", "gmu", "cross_attn", "gmu", "cross_attn"]
    kinds = layer_kinds(32)
    assert kinds.count("mamba") == 8 and kinds.count("swa") == 8 and kinds.count("gmu") == 7
    assert kinds.count("cross_attn") == 7 and kinds[16] == "memory_mamba" and kinds[17] == "full_attn"
    with pytest.raises(ValueError):
        layer_kinds(10)


def test_released_shapes_match_the_released_index():
    config = json.loads((RELEASE_DIR / "config.json").read_text())
    index = json.loads((RELEASE_DIR / "model.safetensors.index.json").read_text())
    shapes = released_shapes(config)
    assert set(shapes) == set(index["weight_map"])
    assert len(shapes) == 434
    params = sum(math.prod(s) for s in shapes.values())
    assert params == 3_852_562_944
    # A_log and lambda_* are float32 in the file, everything else bf16 (sambay.md §4): the byte total checks the
    # split of the shapes as well as their sum.
    fp32 = sum(math.prod(s) for n, s in shapes.items() if n.endswith("A_log") or ".lambda_" in n)
    assert 2 * params + 2 * fp32 == index["metadata"]["total_size"] == 7_706_608_640
    assert shapes["model.layers.16.attn.in_proj.weight"] == (10240, 2560)
    assert shapes["model.layers.18.attn.in_proj.weight"] == (5120, 2560)
    assert shapes["model.layers.17.attn.Wqkv.weight"] == (5120, 2560)
    assert shapes["model.layers.19.attn.Wqkv.weight"] == (2560, 2560)
    assert shapes["model.layers.0.attn.x_proj.weight"] == (192, 5120)


def test_random_weights_layout_and_scale(tiny_weights):
    shapes = released_shapes(TINY)
    assert {k: tuple(v.shape) for k, v in tiny_weights.items()} == shapes
    assert all(v.dtype == torch.float64 for v in tiny_weights.values())
    assert random_weights(TINY, seed=0, dtype=torch.float32)["model.layers.0.attn.A_log"].dtype == torch.float32
    logits = reference_logits(tiny_weights, TINY, _ids(2, 16))
    assert logits.shape == (2, 16, 64) and logits.dtype == torch.float64
    assert 1.0 < logits.std().item() < 10.0 and logits.abs().max().item() < 50.0


def test_every_tensor_moves_the_logits(tiny_weights):
    ids = _ids(2, 12, seed=1)
    base = reference_logits(tiny_weights, TINY, ids)
    g = torch.Generator().manual_seed(5)
    weak = []
    for name, t in tiny_weights.items():
        w = dict(tiny_weights)
        w[name] = t + 0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype)
        change = (reference_logits(w, TINY, ids) - base).abs().max().item()
        if change < 1e-3:
            weak.append((name, change))
    assert not weak


# ---------------------------------------------------------------------------------------------------------------
# Semantics
# ---------------------------------------------------------------------------------------------------------------


def test_causality(tiny_weights):
    ids = _ids(2, 20, seed=2)
    base = reference_logits(tiny_weights, TINY, ids)
    for t in (0, 5, 13):
        changed = ids.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 7) % TINY["vocab_size"]
        out = reference_logits(tiny_weights, TINY, changed)
        assert torch.allclose(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-12)
        assert (out[:, t + 1 :] - base[:, t + 1 :]).abs().max() > 1e-3


def test_sliding_window_edges():
    W, T, nh, nkv, d = 4, 10, 4, 2, 3
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, T, n, d, generator=g, dtype=torch.float64) for n in (nh, nkv, nkv))
    allowed = attention_allowed(T, window=W)
    o, A1, A2 = differential_attention(
        q, k, v, 0.4, 0.3, torch.ones(2 * d, dtype=torch.float64), allowed, return_weights=True
    )
    t = 8
    for A in (A1, A2):
        assert (A[0, :, t, t - W] == 0).all()  # W back: outside the window
        assert (A[0, :, t, t - W + 1] > 0).all()  # W-1 back: inside
        assert (A[0, :, t, t + 1 :] == 0).all()  # future: never
        assert torch.allclose(A.sum(-1), torch.ones_like(A.sum(-1)), atol=1e-14)
    # Through the values: a key/value W back cannot move the output at t, one W-1 back does.
    for back, moves in ((W, False), (W - 1, True)):
        k2, v2 = k.clone(), v.clone()
        k2[0, t - back] += 5.0
        v2[0, t - back] += 5.0
        o2 = differential_attention(q, k2, v2, 0.4, 0.3, torch.ones(2 * d, dtype=torch.float64), allowed)
        assert ((o2[0, t] - o[0, t]).abs().max() > 1e-3) == moves
    # No window: causal only.
    full = attention_allowed(T)
    assert full[0].equal(torch.ones(T, T, dtype=torch.bool).tril())


def test_swa_window_in_the_model(tiny_weights):
    """Layer 1 (the first SWA layer) sees only layer 0's output; perturb that at one position and watch which
    queries of layer 1's attention move."""
    from sambay_reference import _dims, attention_mixer

    dims = _dims(TINY)
    W, T = TINY["sliding_window"], 12
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, T, 32, generator=g, dtype=torch.float64)
    w = tiny_weights
    base, _ = attention_mixer(x, w, "model.layers.1.attn.", dims, 1, "swa", None, None)
    s = 3
    x2 = x.clone()
    x2[0, s] += 1.0
    out, _ = attention_mixer(x2, w, "model.layers.1.attn.", dims, 1, "swa", None, None)
    moved = (out - base).abs().amax(-1)[0] > 1e-9
    expected = torch.tensor([s <= t <= s + W - 1 for t in range(T)])
    assert moved.equal(expected)


def test_lambda_init_table():
    table = {
        1: 0.3555,
        3: 0.5561,
        5: 0.6661,
        7: 0.7265,
        9: 0.7597,
        11: 0.7779,
        13: 0.7879,
        15: 0.7933,
        17: 0.7963,
        19: 0.7980,
        31: 0.7999,
    }
    for i, value in table.items():
        assert abs(lambda_init(i) - value) < 1e-4, i


def test_gqa_head_pairing():
    """nh=8, nkv=4 (G=2): q pair p uses kv pair p//2, so q head 2 uses kv head 0 (not h//G = 1), q head 3 kv head
    1, q heads 4/6 kv head 2 and 5/7 kv head 3."""
    T, nh, nkv, d = 3, 8, 4, 2
    one = torch.ones(2 * d, dtype=torch.float64)
    allowed = attention_allowed(T)
    # (1) through the values: uniform attention (q = 0), λ = 0, λ_init = 0, kv head j has constant value c_j.
    c = torch.tensor([1.0, 2.0, -3.0, -4.0], dtype=torch.float64)
    q = torch.zeros(1, T, nh, d, dtype=torch.float64)
    k = torch.zeros(1, T, nkv, d, dtype=torch.float64)
    v = c[None, None, :, None].expand(1, T, nkv, d).clone()
    o = differential_attention(q, k, v, 0.0, 0.0, one, allowed)
    rms0 = math.sqrt((1 + 4) / 2)  # pair 0 output [1..1 | 2..2]
    rms1 = math.sqrt((9 + 16) / 2)  # pair 1 output [-3.. | -4..]
    expected_head = [1 / rms0, 2 / rms0, 1 / rms0, 2 / rms0, -3 / rms1, -4 / rms1, -3 / rms1, -4 / rms1]
    for h, value in enumerate(expected_head):
        assert torch.allclose(o[0, :, h], torch.full((T, d), value, dtype=torch.float64), atol=1e-5), h
    # (2) through the weights: kv head 0 makes query 2 prefer key 0, kv head 1 key 1, kv heads 2/3 key 2.
    q = torch.zeros(1, T, nh, d, dtype=torch.float64)
    q[0, :, :, 0] = 10.0
    k = torch.zeros(1, T, nkv, d, dtype=torch.float64)
    for head, key in ((0, 0), (1, 1), (2, 2), (3, 2)):
        k[0, key, head, 0] = 1.0
    _, A1, A2 = differential_attention(q, k, v, 0.0, 0.0, one, allowed, return_weights=True)
    # q head 2 = first half of pair 1 -> A1[:, 1] must peak at key 0 (kv head 0); with the h//G mapping (kv head 1)
    # it would peak at key 1.
    assert A1[0, 1, 2].argmax().item() == 0 and A1[0, 1, 2, 0] > 0.99
    assert A2[0, 1, 2].argmax().item() == 1  # q head 3 -> kv head 1
    assert A1[0, 2, 2].argmax().item() == 2  # q head 4 -> kv head 2
    assert A1[0, 3, 2].argmax().item() == 2  # q head 6 -> kv head 2


def test_selective_scan_matches_closed_form():
    """The loop against y_t = Σ_{s≤t} C_t·(Π_{r=s+1..t} exp(dt_r A)) dt_s xc_s B_s + D xc_t."""
    g = torch.Generator().manual_seed(6)
    Bt, T, di, N = 2, 7, 5, 3
    xc = torch.randn(Bt, T, di, generator=g, dtype=torch.float64)
    dt = torch.rand(Bt, T, di, generator=g, dtype=torch.float64) * 0.5
    A = -torch.rand(di, N, generator=g, dtype=torch.float64) * 3
    B = torch.randn(Bt, T, N, generator=g, dtype=torch.float64)
    C = torch.randn(Bt, T, N, generator=g, dtype=torch.float64)
    D = torch.randn(di, generator=g, dtype=torch.float64)
    y, _ = selective_scan(xc, dt, A, B, C, D)
    cum = torch.cumsum(dt, dim=1)  # Σ_{r≤t} dt_r
    expected = D * xc
    for t in range(T):
        for s in range(t + 1):
            decay = torch.exp((cum[:, t] - cum[:, s])[:, :, None] * A)  # (Bt, di, N)
            contrib = decay * (dt[:, s] * xc[:, s])[:, :, None] * B[:, s, None, :] * C[:, t, None, :]
            expected[:, t] = expected[:, t] + contrib.sum(-1)
    assert torch.allclose(y, expected, atol=1e-12)


def test_left_padding_equals_unpadded_rows(tiny_weights):
    """sambay.md §7 Padding: Mamba zeroes pads before and after the conv (the state stays exactly zero through a
    left pad, whatever dt does), attention never sees pad keys, GMU/MLP are per position: a left-padded row equals
    its unpadded row at the real positions."""
    T = 18
    long = _ids(1, T, seed=7)
    short = _ids(1, 11, seed=8)
    pad = T - short.shape[1]
    junk = _ids(1, pad, seed=9)  # deliberately not a fixed pad id: pads must not matter at all
    ids = torch.cat([long, torch.cat([junk, short], dim=1)])
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    batch = reference_forward(tiny_weights, TINY, ids, mask)
    alone_long = reference_logits(tiny_weights, TINY, long)
    alone_short = reference_forward(tiny_weights, TINY, short)
    assert torch.allclose(batch["logits"][0], alone_long[0], rtol=0, atol=1e-10)
    assert torch.allclose(batch["logits"][1, pad:], alone_short["logits"][0], rtol=0, atol=1e-10)
    assert torch.allclose(batch["mem"][1, pad:], alone_short["mem"][0], rtol=0, atol=1e-10)
    assert (batch["mem"][1, :pad] == 0).all()
    # An all-ones mask is the same as no mask.
    assert torch.allclose(reference_logits(tiny_weights, TINY, long, torch.ones(1, T)), alone_long, rtol=0, atol=1e-12)
    # Without the mask the junk does change the row (so the test above is not vacuous).
    unmasked = reference_logits(tiny_weights, TINY, ids)
    assert (unmasked[1, pad:] - alone_short["logits"][0]).abs().max() > 1e-3


def test_memory_and_shared_kv_are_used(tiny_weights):
    """GMU reads layer L/2's pre-gate y; cross attention reads layer L/2+1's k, v (only through them)."""
    ids = _ids(1, 10, seed=10)
    out = reference_forward(tiny_weights, TINY, ids)
    assert out["mem"].shape == (1, 10, 64)
    k, v = out["shared_kv"]
    assert k.shape == v.shape == (1, 10, 4, 4)
    # Layer 7 (cross) has no K/V rows of its own.
    assert tiny_weights["model.layers.7.attn.Wqkv.weight"].shape == (32, 32)
    assert len(out["hidden_states"]) == 9


def test_rejects_wrong_layouts(tiny_weights):
    w = dict(tiny_weights)
    w["model.layers.6.attn.in_proj.weight"] = torch.zeros(128, 32, dtype=torch.float64)  # Mamba shape in a GMU layer
    with pytest.raises(ValueError, match="in_proj"):
        reference_logits(w, TINY, _ids(1, 4))
    w = dict(tiny_weights)
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()  # tied copy is accepted
    reference_logits(w, TINY, _ids(1, 4))
