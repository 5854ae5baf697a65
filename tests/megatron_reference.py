"""An independent float64 reference of NVIDIA's Megatron-LM Mamba-2-Hybrid (and pure Mamba-2) 8B, plus synthetic
Megatron checkpoint files, for use as test oracles.

Written from the published math (shared/design/mamba2-hybrid.md §2-§3, §1.3-§1.6, §5.2); it imports nothing from
samba_hf. Clarity over speed: the Mamba-2 mixer is a per-token Python loop (no chunked SSD), attention is an explicit
masked softmax, and everything runs in float64. A tiny geometry (hidden 32, 6 layers, 40 tokens) takes milliseconds.

Public functions:
    tiny_geometry(**overrides) -> dict
    random_megatron_state(pattern, geometry, seed=0, dtype=torch.float32) -> dict[str, Tensor]   (released layout)
    megatron_logits(state, pattern, geometry, ids) -> Tensor (batch, seq, vocab) float64
    megatron_args(pattern, geometry, **overrides) -> argparse.Namespace
    save_megatron_checkpoint(path, state, args, *, extra_state=True, fused_norms=False, iteration="release") -> Path
    nemotron_h_logits(state, pattern, geometry, ids, *, keep_dt_clamp=False, mlp_hidden_act="gelu") -> Tensor
Extra helpers: released_shapes, nemotron_h_state (key mapping), nemotron_h_model / run_nemotron_h (for controls).

`pattern` is a Megatron hybrid pattern string: "M" Mamba-2 layer, "*" attention-only layer, "-" MLP-only layer.
`geometry` is a dict with Megatron argument names (see tiny_geometry).
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import io
import math
import random
import sys
import types
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

GEOMETRY_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "mamba_num_heads",
    "mamba_head_dim",
    "mamba_num_groups",
    "mamba_state_dim",
    "mamba_d_conv",
    "norm_epsilon",
    "mamba_chunk_size",
)

# The enum that the release pickles into args.model_type. Its pickled name must be megatron.core.enums.ModelType, so
# the class claims that module; save_megatron_checkpoint registers a fake module only while pickling.
ModelType = enum.Enum(
    "ModelType",
    {"encoder_or_decoder": 1, "encoder_and_decoder": 2, "retro_encoder": 3, "retro_decoder": 4},
    module="megatron.core.enums",
    qualname="ModelType",
)

# TE modules that carry `_extra_state` in the released hybrid (§2.1) and in the fused-norm layout (§2.2).
_ATTENTION_EXTRA = ("self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.core_attention")
_MLP_EXTRA = ("mlp.linear_fc1", "mlp.linear_fc2")
_MAMBA_FUSED_EXTRA = ("mixer.in_proj", "mixer.out_proj")


# ----------------------------------------------------------------------------------------------------------------
# Geometry and random weights
# ----------------------------------------------------------------------------------------------------------------


def tiny_geometry(**overrides) -> dict:
    """A tiny Mamba-2-Hybrid geometry (Megatron argument names); d_inner = heads*head_dim = 2*hidden."""
    geometry = dict(
        vocab_size=96,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        ffn_hidden_size=64,
        mamba_num_heads=8,
        mamba_head_dim=8,
        mamba_num_groups=2,
        mamba_state_dim=8,
        mamba_d_conv=4,
        norm_epsilon=1e-5,
        mamba_chunk_size=16,
    )
    unknown = set(overrides) - set(geometry)
    if unknown:
        raise KeyError(f"unknown geometry keys: {sorted(unknown)}")
    geometry.update(overrides)
    _check_geometry(geometry)
    return geometry


def _check_geometry(g: dict) -> None:
    if g["num_attention_heads"] % g["num_query_groups"]:
        raise ValueError("num_attention_heads must be a multiple of num_query_groups")
    if g["mamba_num_heads"] % g["mamba_num_groups"]:
        raise ValueError("mamba_num_heads must be a multiple of mamba_num_groups")


def _check_pattern(pattern: str) -> None:
    if not pattern or set(pattern) - set("M*-"):
        raise ValueError(f"pattern must be a non-empty string over 'M', '*', '-', got {pattern!r}")


def _mamba_dims(g: dict) -> tuple[int, int, int]:
    """(d_inner, conv_dim, in_proj rows)."""
    d_inner = g["mamba_num_heads"] * g["mamba_head_dim"]
    conv_dim = d_inner + 2 * g["mamba_num_groups"] * g["mamba_state_dim"]
    return d_inner, conv_dim, d_inner + conv_dim + g["mamba_num_heads"]


def released_shapes(pattern: str, geometry: dict) -> "OrderedDict[str, tuple[int, ...]]":
    """Key -> shape of the released (2024, unfused) layout, tensors only, in module order."""
    _check_pattern(pattern)
    g = geometry
    h, v = g["hidden_size"], g["vocab_size"]
    d_inner, conv_dim, in_rows = _mamba_dims(g)
    nh, ng, kv = g["num_attention_heads"], g["num_query_groups"], g["kv_channels"]
    shapes = OrderedDict()
    shapes["embedding.word_embeddings.weight"] = (v, h)
    for i, kind in enumerate(pattern):
        p = f"decoder.layers.{i}."
        if kind == "M":
            shapes[p + "norm.weight"] = (h,)
            shapes[p + "mixer.in_proj.weight"] = (in_rows, h)
            shapes[p + "mixer.conv1d.weight"] = (conv_dim, 1, g["mamba_d_conv"])
            shapes[p + "mixer.conv1d.bias"] = (conv_dim,)
            shapes[p + "mixer.A_log"] = (g["mamba_num_heads"],)
            shapes[p + "mixer.D"] = (g["mamba_num_heads"],)
            shapes[p + "mixer.dt_bias"] = (g["mamba_num_heads"],)
            shapes[p + "mixer.norm.weight"] = (d_inner,)
            shapes[p + "mixer.out_proj.weight"] = (h, d_inner)
        elif kind == "*":
            shapes[p + "self_attention.linear_qkv.layer_norm_weight"] = (h,)
            shapes[p + "self_attention.linear_qkv.weight"] = ((nh + 2 * ng) * kv, h)
            shapes[p + "self_attention.linear_proj.weight"] = (h, nh * kv)
        else:
            shapes[p + "mlp.linear_fc1.layer_norm_weight"] = (h,)
            shapes[p + "mlp.linear_fc1.weight"] = (g["ffn_hidden_size"], h)
            shapes[p + "mlp.linear_fc2.weight"] = (h, g["ffn_hidden_size"])
    shapes["decoder.final_norm.weight"] = (h,)
    shapes["output_layer.weight"] = (v, h)
    return shapes


def random_megatron_state(pattern: str, geometry: dict, seed: int = 0, dtype=torch.float32) -> dict:
    """Random weights in the released (unfused) Megatron layout; values chosen so that every part matters."""
    _check_geometry(geometry)
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, mean=0.0, std=1.0):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo

    state = OrderedDict()
    for key, shape in released_shapes(pattern, geometry).items():
        if key.endswith("norm.weight") or key.endswith("layer_norm_weight"):
            value = uniform(shape, 0.5, 1.5)
        elif key.endswith("mixer.A_log"):
            value = torch.log(uniform(shape, 1.0, 16.0))  # A = -exp(A_log) in [-16, -1]
        elif key.endswith("mixer.D"):
            value = normal(shape, 1.0, 0.5)
        elif key.endswith("mixer.dt_bias"):
            # softplus(dt_bias) log-uniform in [1e-3, 1] (inverse softplus: log(expm1(y))); with dt_raw ~ O(1)
            # added per token, the steps span roughly 1e-4 .. 3, below NemotronH's default 1e-3 clamp too.
            target = torch.exp(uniform(shape, math.log(1e-3), 0.0))
            value = torch.log(torch.expm1(target))
        elif key.endswith("mixer.conv1d.weight"):
            value = normal(shape, 0.0, 1.0 / math.sqrt(shape[-1]))
        elif key.endswith("mixer.conv1d.bias"):
            value = normal(shape, 0.0, 0.5)
        elif key == "embedding.word_embeddings.weight":
            value = normal(shape)
        elif key == "output_layer.weight":
            value = normal(shape, 0.0, 2.0 / math.sqrt(shape[1]))  # logits O(1-10)
        else:  # projection weights [out, in]
            value = normal(shape, 0.0, 1.0 / math.sqrt(shape[1]))
        state[key] = value.to(dtype)
    return state


# ----------------------------------------------------------------------------------------------------------------
# The float64 reference forward (§3)
# ----------------------------------------------------------------------------------------------------------------


def _rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _silu(x):
    return x * torch.sigmoid(x)


def _softplus(x):
    # The Mamba kernels: x <= 20 ? log1p(exp(x)) : x.
    return torch.where(x <= 20.0, torch.log1p(torch.exp(torch.clamp(x, max=20.0))), x)


def _gelu_erf(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _mamba_mixer(p: dict, x, g: dict):
    """Megatron Mamba.forward (TP=1) for already-normed input x (b, t, hidden) -> (b, t, hidden)."""
    b, t, _ = x.shape
    nheads, headdim = g["mamba_num_heads"], g["mamba_head_dim"]
    ngroups, dstate, kconv = g["mamba_num_groups"], g["mamba_state_dim"], g["mamba_d_conv"]
    d_inner, conv_dim, in_rows = _mamba_dims(g)
    _expect(p["in_proj.weight"], (in_rows, x.shape[-1]), "mixer.in_proj.weight")
    _expect(p["conv1d.weight"], (conv_dim, 1, kconv), "mixer.conv1d.weight")

    zxbcdt = x @ p["in_proj.weight"].T  # (b, t, 2*d_inner + 2*G*N + H)
    z = zxbcdt[..., :d_inner]  # (b, t, d_inner)
    xbc = zxbcdt[..., d_inner : d_inner + conv_dim]  # (b, t, conv_dim)
    dt_raw = zxbcdt[..., d_inner + conv_dim :]  # (b, t, H)

    # Depthwise causal conv: out[t, c] = bias[c] + sum_k w[c, 0, k] * xbc[t - (K-1) + k, c] (zeros before t=0).
    w = p["conv1d.weight"][:, 0, :]  # (conv_dim, K)
    padded = torch.cat([xbc.new_zeros(b, kconv - 1, conv_dim), xbc], dim=1)
    conv = p["conv1d.bias"].expand(b, t, conv_dim).clone()
    for k in range(kconv):
        conv = conv + w[:, k] * padded[:, k : k + t, :]
    xbc = _silu(conv)

    xs = xbc[..., :d_inner].reshape(b, t, nheads, headdim)  # layout (h p)
    bs = xbc[..., d_inner : d_inner + ngroups * dstate].reshape(b, t, ngroups, dstate)
    cs = xbc[..., d_inner + ngroups * dstate :].reshape(b, t, ngroups, dstate)
    group = torch.arange(nheads) // (nheads // ngroups)  # head h -> group h // (H/G)

    A = -torch.exp(p["A_log"])  # (H,)
    dt = _softplus(dt_raw + p["dt_bias"])  # (b, t, H); no clamp
    D = p["D"]  # (H,)

    state = x.new_zeros(b, nheads, headdim, dstate)  # S_0 = 0
    ys = []
    for step in range(t):
        dt_t = dt[:, step]  # (b, H)
        x_t = xs[:, step]  # (b, H, P)
        b_t = bs[:, step][:, group]  # (b, H, N)
        c_t = cs[:, step][:, group]  # (b, H, N)
        decay = torch.exp(dt_t * A)  # (b, H)
        state = decay[..., None, None] * state + dt_t[..., None, None] * x_t[..., :, None] * b_t[..., None, :]
        y_t = (state * c_t[..., None, :]).sum(-1) + D[:, None] * x_t  # (b, H, P)
        ys.append(y_t.reshape(b, d_inner))
    y = torch.stack(ys, dim=1)  # (b, t, d_inner)

    # Gated RMSNorm, norm_before_gate=False, one RMS per group of d_inner / ngroups channels.
    u = (y * _silu(z)).reshape(b, t, ngroups, d_inner // ngroups)
    u = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + g["norm_epsilon"])
    u = u.reshape(b, t, d_inner) * p["norm.weight"]
    return u @ p["out_proj.weight"].T


def _attention(p: dict, x, g: dict):
    """Megatron SelfAttention (NoPE, causal, GQA, interleaved linear_qkv) for normed x (b, t, hidden)."""
    b, t, _ = x.shape
    nh, ng, kv = g["num_attention_heads"], g["num_query_groups"], g["kv_channels"]
    per_group = nh // ng
    _expect(p["linear_qkv.weight"], ((nh + 2 * ng) * kv, x.shape[-1]), "linear_qkv.weight")
    mixed = (x @ p["linear_qkv.weight"].T).reshape(b, t, ng, (per_group + 2) * kv)
    q = mixed[..., : per_group * kv].reshape(b, t, nh, kv)  # q head = group * per_group + j
    k = mixed[..., per_group * kv : (per_group + 1) * kv]  # (b, t, ng, kv)
    v = mixed[..., (per_group + 1) * kv :]  # (b, t, ng, kv)
    kv_of_head = torch.arange(nh) // per_group
    k, v = k[:, :, kv_of_head], v[:, :, kv_of_head]  # (b, t, nh, kv)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(kv)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, nh * kv)
    return out @ p["linear_proj.weight"].T


def _mlp(p: dict, x):
    return _gelu_erf(x @ p["linear_fc1.weight"].T) @ p["linear_fc2.weight"].T


def _expect(tensor, shape, name):
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")


def _layer_params(state: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def megatron_logits(state: dict, pattern: str, geometry: dict, ids: torch.LongTensor) -> torch.Tensor:
    """Float64 logits (batch, seq, vocab) straight from a Megatron state dict (released or fused-norm layout)."""
    _check_pattern(pattern)
    _check_geometry(geometry)
    eps = geometry["norm_epsilon"]
    tensors = {k: v.detach().to("cpu", torch.float64) for k, v in state.items() if not k.endswith("_extra_state")}
    extra = [k for k in tensors if not isinstance(state[k], torch.Tensor)]
    if extra:
        raise TypeError(f"non-tensor entries: {extra}")
    used = set()

    def take(key):
        if key not in tensors:
            raise KeyError(f"missing Megatron key {key}")
        used.add(key)
        return tensors[key]

    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids[None]
    h = F.embedding(ids, take("embedding.word_embeddings.weight"))  # (b, t, hidden)
    for i, kind in enumerate(pattern):
        pre = f"decoder.layers.{i}."
        if kind == "M":
            fused = pre + "mixer.in_proj.layer_norm_weight"
            norm_w = take(fused) if fused in tensors else take(pre + "norm.weight")
            names = (
                "in_proj.weight",
                "conv1d.weight",
                "conv1d.bias",
                "A_log",
                "D",
                "dt_bias",
                "norm.weight",
                "out_proj.weight",
            )
            p = {n: take(pre + "mixer." + n) for n in names}
            h = h + _mamba_mixer(p, _rms_norm(h, norm_w, eps), geometry)
        elif kind == "*":
            a = pre + "self_attention."
            p = {n: take(a + n) for n in ("linear_qkv.weight", "linear_proj.weight")}
            h = h + _attention(p, _rms_norm(h, take(a + "linear_qkv.layer_norm_weight"), eps), geometry)
        else:
            m = pre + "mlp."
            p = {n: take(m + n) for n in ("linear_fc1.weight", "linear_fc2.weight")}
            h = h + _mlp(p, _rms_norm(h, take(m + "linear_fc1.layer_norm_weight"), eps))
    h = _rms_norm(h, take("decoder.final_norm.weight"), eps)
    logits = h @ take("output_layer.weight").T
    unused = set(tensors) - used
    if unused:
        raise KeyError(f"state has keys the pattern {pattern!r} does not use: {sorted(unused)[:8]}")
    return logits


# ----------------------------------------------------------------------------------------------------------------
# args and checkpoint files (§1.3-§1.6)
# ----------------------------------------------------------------------------------------------------------------


def megatron_args(pattern: str, geometry: dict, **overrides) -> argparse.Namespace:
    """The pickled `args` of the 2024 release (§1.4): no mamba_* geometry fields."""
    _check_pattern(pattern)
    g = geometry
    n = len(pattern)
    fields = dict(
        num_layers=n,
        encoder_num_layers=n,
        hidden_size=g["hidden_size"],
        ffn_hidden_size=g["ffn_hidden_size"],
        num_attention_heads=g["num_attention_heads"],
        group_query_attention=True,
        num_query_groups=g["num_query_groups"],
        kv_channels=g["kv_channels"],
        norm_epsilon=g["norm_epsilon"],
        normalization="RMSNorm",
        hybrid_attention_ratio=pattern.count("*") / n,
        hybrid_mlp_ratio=pattern.count("-") / n,
        hybrid_override_pattern=None,
        position_embedding_type="none",
        untie_embeddings_and_output_weights=True,
        padded_vocab_size=g["vocab_size"],
        make_vocab_size_divisible_by=128,
        params_dtype=torch.bfloat16,
        bf16=True,
        fp16=False,
        fp32_residual_connection=False,
        apply_residual_connection_post_layernorm=False,
        seq_length=4096,
        max_position_embeddings=4096,
        add_bias_linear=False,
        bias_gelu_fusion=False,
        swiglu=False,
        squared_relu=False,
        apply_layernorm_1p=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        tokenizer_type="GPTSentencePieceTokenizer",
        spec=["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"],
        model_type=ModelType.encoder_or_decoder,
    )
    fields.update(overrides)
    return argparse.Namespace(**fields)


@contextlib.contextmanager
def _fake_megatron_enums():
    """Register megatron, megatron.core, megatron.core.enums (with ModelType) in sys.modules, then remove them."""
    names = ("megatron", "megatron.core", "megatron.core.enums")
    clash = [name for name in names if name in sys.modules]
    if clash:
        raise RuntimeError(f"a real or leftover {clash[0]} module is loaded; cannot fake megatron.core.enums")
    modules = {name: types.ModuleType(name) for name in names}
    modules["megatron"].core = modules["megatron.core"]
    modules["megatron.core"].enums = modules["megatron.core.enums"]
    modules["megatron.core.enums"].ModelType = ModelType
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


def _extra_state_value(module_key: str) -> io.BytesIO:
    """Stand-in for a TE < 2.0 get_extra_state(): a BytesIO holding opaque bytes (never to be unpickled)."""
    return io.BytesIO(b"TE extra state for " + module_key.encode() + b"\x00\x01\x02")


def _file_state(state: dict, pattern: str, extra_state: bool, fused_norms: bool) -> "OrderedDict":
    out = OrderedDict()
    for key, value in state.items():
        if key.endswith("_extra_state"):
            continue
        parts = key.split(".")
        if fused_norms and key.startswith("decoder.layers.") and parts[3:] == ["norm", "weight"]:
            key = f"decoder.layers.{parts[2]}.mixer.in_proj.layer_norm_weight"
        out[key] = value
    if extra_state:
        for i, kind in enumerate(pattern):
            mods = {"*": _ATTENTION_EXTRA, "-": _MLP_EXTRA, "M": _MAMBA_FUSED_EXTRA if fused_norms else ()}[kind]
            for mod in mods:
                out[f"decoder.layers.{i}.{mod}._extra_state"] = _extra_state_value(mod)
    return out


def _pattern_from_state(state: dict) -> str:
    kinds = {}
    for key in state:
        parts = key.split(".")
        if key.startswith("decoder.layers.") and len(parts) > 3:
            kinds[int(parts[2])] = {"mixer": "M", "norm": "M", "self_attention": "*", "mlp": "-"}[parts[3]]
    return "".join(kinds[i] for i in range(len(kinds)))


def save_megatron_checkpoint(
    path, state: dict, args, *, extra_state: bool = True, fused_norms: bool = False, iteration="release"
) -> Path:
    """Write a legacy Megatron torch checkpoint like the 2024 release; a folder `path` gets the Hub layout."""
    path = Path(path)
    if path.suffix != ".pt":
        folder = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
        path.mkdir(parents=True, exist_ok=True)
        (path / "latest_checkpointed_iteration.txt").write_text(str(iteration))
        target = path / folder / "mp_rank_00" / "model_optim_rng.pt"
    else:
        target = path
    target.parent.mkdir(parents=True, exist_ok=True)

    pattern = _pattern_from_state(state)
    checkpoint = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 0 if iteration == "release" else int(iteration),
        "model": _file_state(state, pattern, extra_state, fused_norms),
        "opt_param_scheduler": {
            "max_lr": 3e-4,
            "lr_warmup_steps": 0,
            "num_steps": 0,
            "lr_decay_style": "cosine",
            "lr_decay_steps": 1,
            "min_lr": 3e-5,
            "start_wd": 0.1,
            "end_wd": 0.1,
            "wd_incr_style": "constant",
            "wd_incr_steps": 1,
        },
        "rng_state": [
            {
                "random_rng_state": random.getstate(),
                "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state(),
                "cuda_rng_state": torch.get_rng_state().clone(),  # stand-in for torch.cuda.get_rng_state()
                "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state().clone()},
            }
        ],
    }
    with _fake_megatron_enums():
        torch.save(checkpoint, target)

    names = set(torch.serialization.get_unsafe_globals_in_checkpoint(target))
    needed = {"argparse.Namespace", "megatron.core.enums.ModelType"}
    if extra_state and ("*" in pattern or "-" in pattern or fused_norms):
        needed.add("_io.BytesIO")
    missing = needed - names
    if missing or not any(name.startswith("numpy") for name in names):
        raise AssertionError(f"checkpoint globals {sorted(names)} lack {sorted(missing) or 'a numpy global'}")
    return target


# ----------------------------------------------------------------------------------------------------------------
# transformers' NemotronH as a second reference (§5)
# ----------------------------------------------------------------------------------------------------------------


def nemotron_h_state(state: dict, pattern: str, geometry: dict) -> dict:
    """Map a Megatron state dict (released or fused layout) to NemotronHForCausalLM in-memory names (`model.`)."""
    g = geometry
    nh, ng, kv = g["num_attention_heads"], g["num_query_groups"], g["kv_channels"]
    per_group = nh // ng
    src = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    out = {"model.embeddings.weight": src["embedding.word_embeddings.weight"]}
    for i, kind in enumerate(pattern):
        pre, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        if kind == "M":
            fused = pre + "mixer.in_proj.layer_norm_weight"
            out[dst + "norm.weight"] = src[fused] if fused in src else src[pre + "norm.weight"]
            for name in (
                "in_proj.weight",
                "conv1d.weight",
                "conv1d.bias",
                "A_log",
                "D",
                "dt_bias",
                "norm.weight",
                "out_proj.weight",
            ):
                out[dst + "mixer." + name] = src[pre + "mixer." + name]
        elif kind == "*":
            a = pre + "self_attention."
            out[dst + "norm.weight"] = src[a + "linear_qkv.layer_norm_weight"]
            w = src[a + "linear_qkv.weight"]
            w = w.reshape(ng, per_group + 2, kv, w.shape[-1])
            out[dst + "mixer.q_proj.weight"] = w[:, :per_group].reshape(nh * kv, -1)
            out[dst + "mixer.k_proj.weight"] = w[:, per_group].reshape(ng * kv, -1)
            out[dst + "mixer.v_proj.weight"] = w[:, per_group + 1].reshape(ng * kv, -1)
            out[dst + "mixer.o_proj.weight"] = src[a + "linear_proj.weight"]
        else:
            m = pre + "mlp."
            out[dst + "norm.weight"] = src[m + "linear_fc1.layer_norm_weight"]
            out[dst + "mixer.up_proj.weight"] = src[m + "linear_fc1.weight"]
            out[dst + "mixer.down_proj.weight"] = src[m + "linear_fc2.weight"]
    out["model.norm_f.weight"] = src["decoder.final_norm.weight"]
    out["lm_head.weight"] = src["output_layer.weight"]
    return out


def nemotron_h_model(
    state: dict, pattern: str, geometry: dict, *, keep_dt_clamp: bool = False, mlp_hidden_act: str = "gelu"
):
    """transformers' NemotronHForCausalLM (fp32, eval, eager attention) configured per §5.2 and loaded from `state`.

    Faithful settings are keep_dt_clamp=False (dt limit (0, inf), as Megatron) and mlp_hidden_act="gelu" (erf);
    the other values exist for controls.
    """
    from transformers import NemotronHConfig, NemotronHForCausalLM

    g = geometry
    d_inner = g["mamba_num_heads"] * g["mamba_head_dim"]
    config = NemotronHConfig(
        vocab_size=g["vocab_size"],
        hidden_size=g["hidden_size"],
        hybrid_override_pattern=pattern,
        num_attention_heads=g["num_attention_heads"],
        num_key_value_heads=g["num_query_groups"],
        head_dim=g["kv_channels"],
        attention_bias=False,
        intermediate_size=g["ffn_hidden_size"],
        mlp_hidden_act=mlp_hidden_act,
        mlp_bias=False,
        ssm_state_size=g["mamba_state_dim"],
        mamba_num_heads=g["mamba_num_heads"],
        mamba_head_dim=g["mamba_head_dim"],
        n_groups=g["mamba_num_groups"],
        conv_kernel=g["mamba_d_conv"],
        expand=max(1, d_inner // g["hidden_size"]),
        chunk_size=g["mamba_chunk_size"],
        use_conv_bias=True,
        use_bias=False,
        mamba_hidden_act="silu",
        layer_norm_epsilon=g["norm_epsilon"],
        residual_in_fp32=False,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    config._attn_implementation = "eager"
    model = NemotronHForCausalLM(config).to(torch.float32).eval()
    weights = {k: v.detach().to(torch.float32) for k, v in nemotron_h_state(state, pattern, geometry).items()}
    model.load_state_dict(weights, strict=True)
    if not keep_dt_clamp:
        for module in model.modules():
            if type(module).__name__ == "NemotronHMamba2Mixer":
                module.time_step_limit = (0.0, float("inf"))  # 5.15+: the scan's dt_limit
                module.time_step_min = 0.0  # <= 5.14 torch path clamped with this attribute
    return model


def nemotron_h_logits(
    state: dict, pattern: str, geometry: dict, ids, *, keep_dt_clamp: bool = False, mlp_hidden_act: str = "gelu"
) -> torch.Tensor:
    """Float64 logits (batch, seq, vocab) of NemotronHForCausalLM (run in fp32, use_cache=False) from `state`."""
    model = nemotron_h_model(state, pattern, geometry, keep_dt_clamp=keep_dt_clamp, mlp_hidden_act=mlp_hidden_act)
    return run_nemotron_h(model, ids)


def run_nemotron_h(model, ids) -> torch.Tensor:
    """Float64 logits of a NemotronH model on ids (batch, seq) without a cache (needed for all-'M' patterns)."""
    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids[None]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    return logits.to(torch.float64)
