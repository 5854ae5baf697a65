"""An independent float64 reference of SambaY (microsoft/Phi-4-mini-flash-reasoning), for use as a test oracle.

Written from the published math only (shared/design/sambay.md, sections 2-4 and 6); it imports nothing from
samba_hf. Clarity over speed: the Mamba scan is a Python loop over time and the attention is an explicit softmax
over masked scores. A tiny config (L=8, H=32, T~24) runs in a few milliseconds.

Public functions:
    layer_kinds(num_hidden_layers) -> list[str]
    released_shapes(config) -> dict[str, tuple[int, ...]]
    random_weights(config, seed, dtype=torch.float64) -> dict[str, Tensor]
    reference_logits(weights, config, input_ids, attention_mask=None) -> Tensor (B, T, V) float64
    reference_forward(weights, config, input_ids, attention_mask=None) -> dict (logits and intermediates)
    lambda_init(layer_idx) -> float
    attention_allowed(T, window=None, key_mask=None) -> BoolTensor (B or 1, T, T)
    differential_attention(q, k, v, lam, lam_init, subln_weight, allowed, return_weights=False)
    selective_scan(xc, dt, A, B, C, D) -> (y, last_state)

`config` is a plain dict with the released config.json field names (hidden_size, intermediate_size,
num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size, sliding_window, layer_norm_eps, and
optionally mamba_d_state / mamba_d_conv / mamba_expand, which default to 16 / 4 / 2). dt_rank is always
ceil(hidden_size / 16) (the release recomputes it and ignores mamba_dt_rank). head_dim = hidden_size /
num_attention_heads (there is no head_dim field).
"""

from __future__ import annotations

import math

import torch

KINDS = ("mamba", "swa", "memory_mamba", "full_attn", "gmu", "cross_attn")
SUBLN_EPS = 1e-5  # hard-coded RMSNorm eps of the differential attention (sambay.md §2, §6.6)


# ----------------------------------------------------------------------------------------------------------------
# Config and layout
# ----------------------------------------------------------------------------------------------------------------


def layer_kinds(num_hidden_layers: int) -> list[str]:
    """The block type of every layer index (sambay.md §3).

    0..L/2-1: even "mamba", odd "swa"; L/2 "memory_mamba"; L/2+1 "full_attn"; then even "gmu", odd "cross_attn".
    """
    L = int(num_hidden_layers)
    if L <= 0 or L % 4 != 0:
        raise ValueError(f"num_hidden_layers must be a positive multiple of 4, got {num_hidden_layers}")
    half = L // 2
    kinds = []
    for i in range(L):
        if i < half:
            kinds.append("mamba" if i % 2 == 0 else "swa")
        elif i == half:
            kinds.append("memory_mamba")
        elif i == half + 1:
            kinds.append("full_attn")
        else:
            kinds.append("gmu" if i % 2 == 0 else "cross_attn")
    return kinds


def _window(config: dict) -> int:
    w = config["sliding_window"]
    if isinstance(w, (list, tuple)):  # tolerate the config class's per-layer list: take the one window it has
        values = {int(x) for x in w if x is not None}
        if len(values) != 1:
            raise ValueError(f"cannot read one sliding window from {w!r}")
        w = values.pop()
    return int(w)


def _dims(config: dict) -> dict:
    H = int(config["hidden_size"])
    nh = int(config["num_attention_heads"])
    nkv = int(config["num_key_value_heads"])
    if H % nh != 0:
        raise ValueError("hidden_size must be divisible by num_attention_heads")
    if nh % 2 or nkv % 2 or nh % nkv:
        raise ValueError("num_attention_heads and num_key_value_heads must be even and nh divisible by nkv")
    N = int(config.get("mamba_d_state", 16) or 16)
    K = int(config.get("mamba_d_conv", 4) or 4)
    expand = int(config.get("mamba_expand", 2) or 2)
    return dict(
        H=H,
        I=int(config["intermediate_size"]),
        L=int(config["num_hidden_layers"]),
        nh=nh,
        nkv=nkv,
        d=H // nh,
        V=int(config["vocab_size"]),
        W=_window(config),
        eps=float(config.get("layer_norm_eps", 1e-5)),
        N=N,
        K=K,
        di=expand * H,
        R=math.ceil(H / 16),
    )


def released_shapes(config: dict) -> dict[str, tuple]:
    """Every tensor name and shape of the released checkpoint layout (sambay.md §4). No lm_head.weight (tied)."""
    c = _dims(config)
    H, inter, di, N, K, R, nh, nkv, d = c["H"], c["I"], c["di"], c["N"], c["K"], c["R"], c["nh"], c["nkv"], c["d"]
    shapes: dict[str, tuple] = {
        "model.embed_tokens.weight": (c["V"], H),
        "model.final_layernorm.weight": (H,),
        "model.final_layernorm.bias": (H,),
    }
    for i, kind in enumerate(layer_kinds(c["L"])):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[p + norm + ".weight"] = (H,)
            shapes[p + norm + ".bias"] = (H,)
        shapes[p + "mlp.fc1.weight"] = (2 * inter, H)
        shapes[p + "mlp.fc2.weight"] = (H, inter)
        a = p + "attn."
        if kind in ("mamba", "memory_mamba"):
            shapes[a + "in_proj.weight"] = (2 * di, H)
            shapes[a + "conv1d.weight"] = (di, 1, K)
            shapes[a + "conv1d.bias"] = (di,)
            shapes[a + "x_proj.weight"] = (R + 2 * N, di)
            shapes[a + "dt_proj.weight"] = (di, R)
            shapes[a + "dt_proj.bias"] = (di,)
            shapes[a + "A_log"] = (di, N)
            shapes[a + "D"] = (di,)
            shapes[a + "out_proj.weight"] = (H, di)
        elif kind == "gmu":
            shapes[a + "in_proj.weight"] = (di, H)
            shapes[a + "out_proj.weight"] = (H, di)
        else:  # swa, full_attn, cross_attn
            rows = H if kind == "cross_attn" else (nh + 2 * nkv) * d
            shapes[a + "Wqkv.weight"] = (rows, H)
            shapes[a + "Wqkv.bias"] = (rows,)
            shapes[a + "out_proj.weight"] = (H, H)
            shapes[a + "out_proj.bias"] = (H,)
            for lam in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                shapes[a + "inner_cross_attn." + lam] = (d,)
            shapes[a + "inner_cross_attn.subln.weight"] = (2 * d,)
    return shapes


def random_weights(config: dict, seed: int, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Random weights in the released layout, scaled so a tiny model has logits of order 1-10 and every tensor
    (norm weights and biases, A_log, D, dt_proj bias, conv bias, Wqkv/out_proj biases, lambdas, subln) visibly
    moves the logits.

    - Linear weights N(0, 1/fan_in); embedding N(0, 0.5²) (it is also the head).
    - LayerNorm and subln weights U(0.5, 1.5); LayerNorm, conv, Wqkv and out_proj biases N(0, 0.2²).
    - A_log = log(1..N) + N(0, 0.1²) per channel; D ~ U(0.5, 1.5).
    - dt_proj.bias = softplus⁻¹(dt0) with dt0 log-uniform in [0.02, 0.3]; dt_proj.weight N(0, 0.5²/R).
    - lambda_q1/k1/q2/k2 ~ N(0, 0.25²): small, but with d=4 large enough that λ differs visibly from λ_init.
    Generated in float64 from `seed` (independent of the global RNG), then cast to `dtype`.
    """
    g = torch.Generator().manual_seed(int(seed))
    f64 = torch.float64

    def normal(shape, std):
        return torch.randn(shape, generator=g, dtype=f64) * std

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=g, dtype=f64)

    out = {}
    for name, shape in released_shapes(config).items():
        leaf = name.rsplit(".", 2)[-2:]  # e.g. ["in_proj", "weight"], ["attn", "A_log"]
        if name == "model.embed_tokens.weight":
            t = normal(shape, 0.5)
        elif name.endswith("layernorm.weight") or name.endswith("subln.weight"):
            t = uniform(shape, 0.5, 1.5)
        elif name.endswith("layernorm.bias"):
            t = normal(shape, 0.2)
        elif name.endswith(".A_log"):
            N = shape[1]
            t = torch.log(torch.arange(1, N + 1, dtype=f64)).expand(shape).clone() + normal(shape, 0.1)
        elif name.endswith(".D"):
            t = uniform(shape, 0.5, 1.5)
        elif name.endswith("dt_proj.bias"):
            dt0 = torch.exp(uniform(shape, math.log(0.02), math.log(0.3)))
            t = dt0 + torch.log(-torch.expm1(-dt0))  # inverse softplus
        elif name.endswith("dt_proj.weight"):
            t = normal(shape, 0.5 / math.sqrt(shape[1]))
        elif name.endswith("conv1d.weight"):
            t = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif "lambda_" in name:
            t = normal(shape, 0.25)
        elif leaf[-1] == "bias":  # conv1d, Wqkv, out_proj biases
            t = normal(shape, 0.2)
        elif leaf[-1] == "weight" and len(shape) == 2:  # plain linear layers
            t = normal(shape, 1.0 / math.sqrt(shape[1]))
        else:
            raise AssertionError(f"no init rule for {name}")
        out[name] = t.to(dtype)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Building blocks (all float64)
# ----------------------------------------------------------------------------------------------------------------


def layer_norm(x, weight, bias, eps):
    """nn.LayerNorm: biased variance over the last dim, then ·weight + bias."""
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def silu(a):
    return a * torch.sigmoid(a)


def softplus(a):
    """torch / mamba_ssm softplus with threshold 20: a itself above 20."""
    return torch.where(a > 20, a, torch.log1p(torch.exp(torch.clamp(a, max=20))))


def linear(x, weight, bias=None):
    y = x @ weight.T
    return y if bias is None else y + bias


def mlp(x, fc1, fc2):
    """SwiGLU (§6.3): fc1 rows [0, I) are the gate, rows [I, 2I) the up projection."""
    inter = fc2.shape[1]
    gu = linear(x, fc1)
    gate, up = gu[..., :inter], gu[..., inter:]
    return linear(silu(gate) * up, fc2)


def causal_depthwise_conv(xs, weight, bias):
    """xs (B, T, C), weight (C, 1, K) or (C, K), bias (C,). out[t] = bias + Σ_k weight[:, k] · xs[t-(K-1)+k],
    with zeros for t-(K-1)+k < 0 (left zero padding)."""
    w = weight.reshape(weight.shape[0], -1)
    K = w.shape[1]
    B, T, C = xs.shape
    padded = torch.cat([xs.new_zeros(B, K - 1, C), xs], dim=1)
    out = bias.expand(B, T, C).clone()
    for k in range(K):
        out = out + w[:, k] * padded[:, k : k + T, :]
    return out


def selective_scan(xc, dt, A, B, C, D):
    """Mamba-1 recurrence, token by token (§6.4).

    xc, dt: (Bt, T, di); A: (di, N) (already -exp(A_log)); B, C: (Bt, T, N); D: (di,).
        h_t = exp(dt_t ⊙ A) ⊙ h_{t-1} + (dt_t ⊙ xc_t) ⊗ B_t,   h_{-1} = 0
        y_t = h_t · C_t + D ⊙ xc_t
    Returns y (Bt, T, di) and the last state (Bt, di, N).
    """
    Bt, T, di = xc.shape
    h = xc.new_zeros(Bt, di, A.shape[1])
    ys = []
    for t in range(T):
        decay = torch.exp(dt[:, t, :, None] * A)  # (Bt, di, N)
        inject = (dt[:, t] * xc[:, t])[:, :, None] * B[:, t, None, :]  # (Bt, di, N)
        h = decay * h + inject
        ys.append((h * C[:, t, None, :]).sum(-1) + D * xc[:, t])
    return torch.stack(ys, dim=1), h


def mamba_mixer(x, w, prefix, dims, mask=None):
    """Mamba-1 mixer (§6.4). Returns (out, y) where y is the pre-gate scan output (the memory at layer L/2).

    With `mask` (B, T) of 0/1 the release zeroes xs before the conv and xc after the conv, and nothing else: at a
    padded position dt = softplus(dt_proj.bias) is NOT zero, B = C = 0, so the state is multiplied by exp(dt·A)
    (it decays) and receives nothing. In a LEFT-padded row the state is still exactly zero when the first real
    token arrives (0 stays 0 under decay), so the real positions equal the unpadded row's. (Zeros in the middle of
    a row would make the state decay across them: the release does not support that, nor does this oracle.)
    """
    di, R, N = dims["di"], dims["R"], dims["N"]
    xz = linear(x, w[prefix + "in_proj.weight"])
    xs, z = xz[..., :di], xz[..., di:]
    if mask is not None:
        xs = xs * mask[..., None]
    xc = silu(causal_depthwise_conv(xs, w[prefix + "conv1d.weight"], w[prefix + "conv1d.bias"]))
    if mask is not None:
        xc = xc * mask[..., None]
    x_dbl = linear(xc, w[prefix + "x_proj.weight"])
    dt_low, Bm, Cm = x_dbl[..., :R], x_dbl[..., R : R + N], x_dbl[..., R + N : R + 2 * N]
    dt = softplus(linear(dt_low, w[prefix + "dt_proj.weight"]) + w[prefix + "dt_proj.bias"])
    A = -torch.exp(w[prefix + "A_log"])
    y, _ = selective_scan(xc, dt, A, Bm, Cm, w[prefix + "D"])
    out = linear(y * silu(z), w[prefix + "out_proj.weight"])
    return out, y


def gmu(x, w, prefix, mem):
    """Gated Memory Unit (§6.5): (silu(x·in_projᵀ) ⊙ mem) · out_projᵀ, mem = layer L/2's y at the same position."""
    return linear(silu(linear(x, w[prefix + "in_proj.weight"])) * mem, w[prefix + "out_proj.weight"])


def lambda_init(layer_idx: int) -> float:
    """λ_init(i) = 0.8 − 0.6·exp(−0.3·i), i = the global layer index (§6.6)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def attention_allowed(T: int, window: int | None = None, key_mask=None):
    """Which key j each query t may see: j ≤ t, and t − (W−1) ≤ j if a window W is given (W keys including the
    query itself, §6.7), and key_mask[b, j] == 1 if a (B, T) key mask is given. Returns bool (B or 1, T, T)."""
    t = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    allowed = j <= t
    if window is not None:
        allowed = allowed & (j >= t - (window - 1))
    allowed = allowed[None]
    if key_mask is not None:
        allowed = allowed & key_mask.bool()[:, None, :]
    return allowed


def _masked_softmax(scores, allowed):
    """softmax over the last dim of scores where allowed; rows with no allowed key give all-zero weights."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(scores - row_max) * allowed
    denom = e.sum(dim=-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


def differential_attention(q, k, v, lam, lam_init, subln_weight, allowed, return_weights=False):
    """Differential attention core (§6.6), written per head pair.

    q: (B, T, nh, d); k, v: (B, S, nkv, d); lam: the layer's scalar λ; lam_init: λ_init(i); subln_weight: (2d,);
    allowed: bool broadcastable to (B, T, S). Returns o (B, T, nh, d) (before out_proj), and with
    return_weights=True also A1, A2 of shape (B, nh/2, T, S).

    Pair p = q heads (2p, 2p+1) uses kv pair r = p // G, G = nh/nkv, i.e. kv heads (2r, 2r+1):
        A1_p = softmax(q[2p]·k[2r]ᵀ/√d), A2_p = softmax(q[2p+1]·k[2r+1]ᵀ/√d)
        O_p = (A1_p − λ·A2_p)·[v[2r] | v[2r+1]]  → RMSNorm over 2d (eps 1e-5) · subln → ·(1 − λ_init)
        head 2p ← O_p[:, :d], head 2p+1 ← O_p[:, d:]
    Queries with no visible key (padded queries) get O_p = 0 before the norm, as the release's unpad path does;
    their values are a convention and not meaningful.
    """
    B, T, nh, d = q.shape
    nkv = k.shape[2]
    G = nh // nkv
    q1, q2 = q[:, :, 0::2], q[:, :, 1::2]  # (B, T, nh/2, d)
    k1, k2 = k[:, :, 0::2], k[:, :, 1::2]  # (B, S, nkv/2, d)
    v1, v2 = v[:, :, 0::2], v[:, :, 1::2]
    scale = 1.0 / math.sqrt(d)
    o = q.new_zeros(B, T, nh, d)
    A1s, A2s = [], []
    for p in range(nh // 2):
        r = p // G
        A1 = _masked_softmax(torch.einsum("btd,bsd->bts", q1[:, :, p], k1[:, :, r]) * scale, allowed)
        A2 = _masked_softmax(torch.einsum("btd,bsd->bts", q2[:, :, p], k2[:, :, r]) * scale, allowed)
        vcat = torch.cat([v1[:, :, r], v2[:, :, r]], dim=-1)  # (B, S, 2d)
        Op = A1 @ vcat - lam * (A2 @ vcat)  # (B, T, 2d)
        Op = Op / torch.sqrt((Op * Op).mean(dim=-1, keepdim=True) + SUBLN_EPS) * subln_weight
        Op = Op * (1.0 - lam_init)
        o[:, :, 2 * p] = Op[..., :d]
        o[:, :, 2 * p + 1] = Op[..., d:]
        A1s.append(A1)
        A2s.append(A2)
    if return_weights:
        return o, torch.stack(A1s, dim=1), torch.stack(A2s, dim=1)
    return o


def _layer_lambda(w, a):
    lq1, lk1 = w[a + "inner_cross_attn.lambda_q1"], w[a + "inner_cross_attn.lambda_k1"]
    lq2, lk2 = w[a + "inner_cross_attn.lambda_q2"], w[a + "inner_cross_attn.lambda_k2"]
    return torch.exp((lq1 * lk1).sum()) - torch.exp((lq2 * lk2).sum())


def attention_mixer(x, w, prefix, dims, layer_idx, kind, shared_kv, key_mask):
    """SWA (§6.7), full (§6.8) or cross (§6.9) differential attention. Returns (out, (k, v))."""
    B, T, _ = x.shape
    nh, nkv, d = dims["nh"], dims["nkv"], dims["d"]
    qkv = linear(x, w[prefix + "Wqkv.weight"], w[prefix + "Wqkv.bias"])
    q = qkv[..., : nh * d].reshape(B, T, nh, d)
    if kind == "cross_attn":
        k, v = shared_kv
    else:
        k = qkv[..., nh * d : (nh + nkv) * d].reshape(B, T, nkv, d)
        v = qkv[..., (nh + nkv) * d : (nh + 2 * nkv) * d].reshape(B, T, nkv, d)
    window = dims["W"] if kind == "swa" else None
    allowed = attention_allowed(T, window, key_mask)
    li = lambda_init(layer_idx)
    lam = _layer_lambda(w, prefix) + li
    o = differential_attention(q, k, v, lam, li, w[prefix + "inner_cross_attn.subln.weight"], allowed)
    out = linear(o.reshape(B, T, nh * d), w[prefix + "out_proj.weight"], w[prefix + "out_proj.bias"])
    return out, (k, v)


# ----------------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------------


def _check_weights(weights: dict, config: dict) -> dict:
    expected = released_shapes(config)
    w = {}
    problems = []
    for name, shape in expected.items():
        if name not in weights:
            problems.append(f"missing {name}")
        elif tuple(weights[name].shape) != shape:
            problems.append(f"{name}: shape {tuple(weights[name].shape)} != {shape}")
        else:
            w[name] = weights[name].detach().to(torch.float64)
    for name in weights:
        if name == "lm_head.weight":
            if not torch.equal(
                weights[name].detach().to(torch.float64),
                weights["model.embed_tokens.weight"].detach().to(torch.float64),
            ):
                problems.append("lm_head.weight differs from model.embed_tokens.weight (the release is tied)")
        elif name not in expected:
            problems.append(f"unexpected {name}")
    if problems:
        raise ValueError("weights do not match the released layout: " + "; ".join(problems[:10]))
    return w


@torch.no_grad()
def reference_forward(weights: dict, config: dict, input_ids, attention_mask=None) -> dict:
    """The full float64 forward (§6.1-6.10). Returns a dict:
        logits (B, T, V); hidden_states: list of L+1 residual streams (embeddings, then after each layer,
        before the final norm); mem: layer L/2's pre-gate scan output (B, T, di); shared_kv: layer L/2+1's (k, v),
        each (B, T, nkv, d).
    attention_mask: optional (B, T) of 0/1 for LEFT padding. Logits at padded positions follow a convention
    (see differential_attention / mamba_mixer) and should not be compared; logits at real positions equal those
    of the unpadded row.
    """
    dims = _dims(config)
    w = _check_weights(weights, config)
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() != 2:
        raise ValueError("input_ids must be (B, T)")
    mask = None
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask).to(torch.float64)
        if mask.shape != input_ids.shape:
            raise ValueError("attention_mask must have the shape of input_ids")
    key_mask = None if mask is None else mask > 0.5
    eps = dims["eps"]

    E = w["model.embed_tokens.weight"]
    h = E[input_ids]  # no scaling, no positions, no dropout
    hidden_states = [h]
    mem = None
    shared_kv = None
    for i, kind in enumerate(layer_kinds(dims["L"])):
        p = f"model.layers.{i}."
        a = p + "attn."
        x = layer_norm(h, w[p + "input_layernorm.weight"], w[p + "input_layernorm.bias"], eps)
        if kind in ("mamba", "memory_mamba"):
            y, scan_y = mamba_mixer(x, w, a, dims, mask)
            if kind == "memory_mamba":
                mem = scan_y
        elif kind == "gmu":
            y = gmu(x, w, a, mem)
        else:
            y, kv = attention_mixer(x, w, a, dims, i, kind, shared_kv, key_mask)
            if kind == "full_attn":
                shared_kv = kv
        h = h + y
        x = layer_norm(h, w[p + "post_attention_layernorm.weight"], w[p + "post_attention_layernorm.bias"], eps)
        h = h + mlp(x, w[p + "mlp.fc1.weight"], w[p + "mlp.fc2.weight"])
        hidden_states.append(h)
    h = layer_norm(h, w["model.final_layernorm.weight"], w["model.final_layernorm.bias"], eps)
    logits = h @ E.T  # tied head, no bias
    return dict(logits=logits, hidden_states=hidden_states, mem=mem, shared_kv=shared_kv)


def reference_logits(weights: dict, config: dict, input_ids, attention_mask=None) -> torch.Tensor:
    """Logits (B, T, V) in float64 for every position. See reference_forward."""
    return reference_forward(weights, config, input_ids, attention_mask)["logits"]
