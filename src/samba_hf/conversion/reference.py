"""Forwards computed straight from a source state dict, in float64, for `--verify`.

They read the source's own key names and follow the source code's own computation (the official code splits its
fused qkv activations per key/value group; FLA has separate projections), sharing nothing with `modeling_samba`:
a converted model that matches them is a faithful conversion. For transformers' Mamba/Mistral/Llama folders the
reference is transformers' own class instead (see `samba_hf.conversion.verify`).
"""

import torch
import torch.nn.functional as F

from ..configuration_samba import SambaConfig


def _rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, theta):
    # x (batch, seq, heads, head_dim), rotate-half layout: pairs (i, i + head_dim/2) rotate by position * theta^(-2i/d)
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half))
    angle = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv_freq[None, :]  # (seq, half)
    cos, sin = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _attention(q, k, v, config: SambaConfig, window: int | None):
    # q (b, t, heads, hs); k, v (b, t, kv_heads, hs); key/value head of query head h is h // (heads / kv_heads)
    t = q.shape[1]
    if config.use_rope:
        theta = config.rope_parameters["rope_theta"]
        q, k = _rope(q, theta), _rope(k, theta)
    repeat = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / q.shape[-1] ** 0.5
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v).flatten(2)


def _causal_conv(u, weight, bias):
    # u (b, t, channels); weight (channels, 1, width): out[t] = sum_k weight[:, k] * u[t - width + 1 + k] (+ bias)
    width = weight.shape[-1]
    padded = F.pad(u.transpose(1, 2), (width - 1, 0))
    conv = sum(padded[..., k : k + u.shape[1]] * weight[:, 0, k, None] for k in range(width)).transpose(1, 2)
    return conv if bias is None else conv + bias


def _mamba(x, get, config: SambaConfig):
    # x (b, t, d); get(name) -> float64 tensor of this mixer; the recurrence token by token
    inner, n, rank = config.mamba_d_inner, config.mamba_d_state, config.mamba_dt_rank
    xz = x @ get("in_proj.weight").T + (get("in_proj.bias") if config.mamba_proj_bias else 0)
    u, z = xz[..., :inner], xz[..., inner:]
    u = F.silu(_causal_conv(u, get("conv1d.weight"), get("conv1d.bias") if config.mamba_conv_bias else None))
    dbc = u @ get("x_proj.weight").T
    dt = F.softplus(dbc[..., :rank] @ get("dt_proj.weight").T + get("dt_proj.bias"))
    B, C = dbc[..., rank : rank + n], dbc[..., rank + n :]
    A = -torch.exp(get("A_log"))
    h = torch.zeros(x.shape[0], inner, n, dtype=torch.float64)
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[..., None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
    y = (torch.stack(ys, dim=1) + u * get("D")) * F.silu(z)
    return y @ get("out_proj.weight").T + (get("out_proj.bias") if config.mamba_proj_bias else 0)


def _swiglu(h, gate, up, down):
    return (F.silu(h @ gate.T) * (h @ up.T)) @ down.T


def lit_gpt_logits(state_dict, config: SambaConfig, ids: torch.Tensor) -> torch.Tensor:
    """The official model (lit_gpt/model.py: GPT, Block, CausalSelfAttention, LLaMAMLP) in float64."""

    def get(name):
        return state_dict[name].double()

    eps, hs = config.rms_norm_eps, config.head_dim
    groups = config.num_key_value_heads
    q_per_kv = config.num_attention_heads // groups
    embedding = "transformer.wte.weight" if "transformer.wte.weight" in state_dict else "lm_head.weight"  # tied
    x = F.embedding(ids, get(embedding))
    for i, kind in enumerate(config.layer_types):
        block = f"transformer.h.{i}"
        h = _rms_norm(x, get(f"{block}.norm_1.weight"), eps)
        if kind == "linear_attention":
            h = _mamba(h, lambda name: get(f"{block}.attn.{name}"), config)
        else:
            b, t, _ = h.shape
            qkv = (h @ get(f"{block}.attn.attn.weight").T).view(b, t, groups, q_per_kv + 2, hs)
            q, k, v = qkv.split((q_per_kv, 1, 1), dim=-2)
            q, k, v = q.reshape(b, t, -1, hs), k.reshape(b, t, -1, hs), v.reshape(b, t, -1, hs)
            window = config.sliding_window if kind == "sliding_attention" else None
            h = _attention(q, k, v, config, window) @ get(f"{block}.attn.proj.weight").T
        x = x + h
        h = _rms_norm(x, get(f"{block}.norm_2.weight"), eps)
        x = x + _swiglu(h, *(get(f"{block}.mlp.swiglu.{w}.weight") for w in ("w1", "w2", "w3")))  # gate, up, down
    x = _rms_norm(x, get("transformer.ln_f.weight"), eps)
    head = "lm_head.weight" if "lm_head.weight" in state_dict else "transformer.wte.weight"
    return x @ get(head).T


def fla_logits(state_dict, config: SambaConfig, ids: torch.Tensor) -> torch.Tensor:
    """FLA's SambaForCausalLM (fla/models/samba/modeling_samba.py) in float64."""

    def get(name):
        return state_dict[name].double()

    eps, hs = config.rms_norm_eps, config.head_dim
    x = F.embedding(ids, get("backbone.embeddings.weight"))
    for i, kind in enumerate(config.layer_types):
        layer = f"backbone.layers.{i}"
        h = _rms_norm(x, get(f"{layer}.mixer_norm.weight"), eps)
        if kind == "linear_attention":
            h = _mamba(h, lambda name: get(f"{layer}.mixer.{name}"), config)
        else:
            b, t, _ = h.shape
            q, k, v = (h @ get(f"{layer}.mixer.{p}_proj.weight").T for p in "qkv")
            window = config.sliding_window if kind == "sliding_attention" else None
            h = _attention(q.view(b, t, -1, hs), k.view(b, t, -1, hs), v.view(b, t, -1, hs), config, window)
            h = h @ get(f"{layer}.mixer.o_proj.weight").T
        x = x + h
        h = _rms_norm(x, get(f"{layer}.mlp_norm.weight"), eps)
        x = x + _swiglu(h, *(get(f"{layer}.mlp.{p}_proj.weight") for p in ("gate", "up", "down")))
    x = _rms_norm(x, get("backbone.norm_f.weight"), eps)
    head = "lm_head.weight" if "lm_head.weight" in state_dict else "backbone.embeddings.weight"
    return x @ get(head).T


def _mamba2(x, get, config: SambaConfig):
    # x (b, t, d); Megatron's Mamba-2 mixer (megatron/core/ssm/mamba_mixer.py) with the recurrence token by token
    inner, n, groups = config.mamba_d_inner, config.mamba_d_state, config.mamba2_n_groups
    heads, head_dim = config.mamba2_num_heads, config.mamba2_head_dim
    batch, length, _ = x.shape
    z, xBC, dt = (x @ get("in_proj.weight").T).split([inner, inner + 2 * groups * n, heads], dim=-1)
    xBC = F.silu(_causal_conv(xBC, get("conv1d.weight"), get("conv1d.bias")))
    u, B, C = xBC.split([inner, groups * n, groups * n], dim=-1)
    u = u.reshape(batch, length, heads, head_dim)
    # head h reads group h // (heads / groups)
    B = B.reshape(batch, length, groups, n).repeat_interleave(heads // groups, dim=2)
    C = C.reshape(batch, length, groups, n).repeat_interleave(heads // groups, dim=2)
    dt = F.softplus(dt + get("dt_bias"))  # (b, t, heads)
    A, D = -torch.exp(get("A_log")), get("D")
    state = torch.zeros(batch, heads, head_dim, n, dtype=torch.float64)
    ys = []
    for t in range(length):
        step = dt[:, t, :, None, None]
        state = torch.exp(step * A[:, None, None]) * state + step * u[:, t, :, :, None] * B[:, t, :, None, :]
        ys.append((state * C[:, t, :, None, :]).sum(-1) + D[:, None] * u[:, t])
    y = torch.stack(ys, dim=1).reshape(batch, length, inner) * F.silu(z)
    y = y.reshape(batch, length, groups, -1)  # the gated RMSNorm: one group per group of heads
    y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(batch, length, inner) * get("norm.weight")
    return y @ get("out_proj.weight").T


def megatron_logits(state_dict, config: SambaConfig, ids: torch.Tensor) -> torch.Tensor:
    """Megatron-LM's MambaModel (megatron/core/models/mamba, the blocks of its hybrid stack) in float64, from the
    checkpoint's own key names: the unfused (released) or fused Mamba norm, the GQA-interleaved linear_qkv."""

    def get(name):
        return state_dict[name].double()

    eps, hs = config.rms_norm_eps, config.head_dim
    x = F.embedding(ids, get("embedding.word_embeddings.weight"))
    for i, kind in enumerate(config.layer_types):
        block = f"decoder.layers.{i}"
        if kind == "linear_attention":
            norm = (
                f"{block}.norm.weight"
                if f"{block}.norm.weight" in state_dict
                else f"{block}.mixer.in_proj.layer_norm_weight"
            )
            x = x + _mamba2(_rms_norm(x, get(norm), eps), lambda name: get(f"{block}.mixer.{name}"), config)
        elif kind == "full_attention":
            h = _rms_norm(x, get(f"{block}.self_attention.linear_qkv.layer_norm_weight"), eps)
            b, t, _ = h.shape
            groups = config.num_key_value_heads
            per_group = config.num_attention_heads // groups
            qkv = (h @ get(f"{block}.self_attention.linear_qkv.weight").T).view(b, t, groups, per_group + 2, hs)
            q, k, v = qkv.split((per_group, 1, 1), dim=-2)
            q, k, v = q.reshape(b, t, -1, hs), k.reshape(b, t, -1, hs), v.reshape(b, t, -1, hs)
            x = x + _attention(q, k, v, config, None) @ get(f"{block}.self_attention.linear_proj.weight").T
        else:
            h = _rms_norm(x, get(f"{block}.mlp.linear_fc1.layer_norm_weight"), eps)
            act = (
                (lambda a: F.relu(a) ** 2) if config.mlp_hidden_act == "relu2" else F.gelu
            )  # Megatron: exact erf GELU
            x = x + act(h @ get(f"{block}.mlp.linear_fc1.weight").T) @ get(f"{block}.mlp.linear_fc2.weight").T
    x = _rms_norm(x, get("decoder.final_norm.weight"), eps)
    head = "output_layer.weight" if "output_layer.weight" in state_dict else "embedding.word_embeddings.weight"
    return x @ get(head).T
