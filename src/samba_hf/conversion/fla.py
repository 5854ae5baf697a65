"""flash-linear-attention's Samba (`fla/models/samba`, model_type "samba"): its config fields and keys.

FLA registers the same model_type name as this package, so its config.json is read as plain JSON here.
Keys, per layer i (Mamba unless i is in `attn["layers"]`):
    backbone.layers.{i}.mixer_norm / mlp_norm         -> input_layernorm / post_attention_layernorm
    backbone.layers.{i}.mixer.{in_proj,conv1d,...}     -> mamba.{in_proj,conv1d,...}
    backbone.layers.{i}.mixer.{q,k,v,o}_proj           -> self_attn.{q,k,v,o}_proj
    backbone.layers.{i}.mlp.{gate,up,down}_proj        -> mlp.{gate,up,down}_proj
    backbone.embeddings / backbone.norm_f / lm_head    -> model.embed_tokens / model.norm / lm_head (untied by default)
"""

import math

from ..configuration_samba import SambaConfig
from .checkpoint import Checkpoint, ConversionError, check_layout, heads_tied

# FLA's Samba defaults (fla/models/samba/configuration_samba.py), for fields a config.json leaves out.
DEFAULT_ATTN = {
    "layers": (1, 3, 5, 7, 9, 11, 13, 15, 17),
    "num_heads": 18,
    "num_kv_heads": 18,
    "qkv_bias": False,
    "window_size": 2048,
    "rope_theta": 10000.0,
}


def mlp_size(hidden_size: int, hidden_ratio: float | None) -> int:
    """FLA's GatedMLP width: 2/3 of hidden_ratio * hidden_size, rounded up to a multiple of 256."""
    width = int(hidden_size * (4 if hidden_ratio is None else hidden_ratio) * 2 / 3)
    return 256 * math.ceil(width / 256)


def config_from_fla(fla: dict) -> SambaConfig:
    if "layer_types" in fla or "mamba_d_state" in fla:
        raise ConversionError("config.json is already a samba-hf config: load the folder directly, no conversion.")
    if fla.get("model_type") != "samba" or "attn" not in fla and "state_size" not in fla:
        raise ConversionError(
            f"config.json has model_type {fla.get('model_type')!r} and no FLA Samba fields (`attn`, `state_size`): "
            "not a flash-linear-attention Samba checkpoint (wrong source format?)."
        )
    hidden, layers = fla.get("hidden_size", 2304), fla.get("num_hidden_layers", 18)
    attn = fla.get("attn") or DEFAULT_ATTN
    if attn.get("qkv_bias"):
        raise ConversionError("FLA attention with qkv_bias=True (and no output bias) has no samba-hf equivalent.")
    if fla.get("hidden_act", "swish") not in ("swish", "silu"):
        raise ConversionError(f"FLA hidden_act {fla['hidden_act']!r} is not supported (only swish/silu).")
    window = attn.get("window_size")
    attention = "sliding_attention" if window else "full_attention"
    attn_layers = set(attn.get("layers", ()))
    rank = fla.get("time_step_rank", "auto")
    return SambaConfig(
        vocab_size=fla.get("vocab_size", 32000),
        hidden_size=hidden,
        intermediate_size=fla.get("intermediate_size") or mlp_size(hidden, fla.get("hidden_ratio", 4)),
        num_hidden_layers=layers,
        num_attention_heads=attn["num_heads"],
        num_key_value_heads=attn.get("num_kv_heads") or attn["num_heads"],
        head_dim=hidden // attn["num_heads"],
        max_position_embeddings=None if window else fla.get("max_position_embeddings", 2048),  # windows: no limit
        rms_norm_eps=fla.get("norm_eps", 1e-5),
        rope_parameters={"rope_type": "default", "rope_theta": float(attn.get("rope_theta") or 10000.0)},
        sliding_window=window or None,
        layer_types=[attention if i in attn_layers else "linear_attention" for i in range(layers)],
        mamba_d_state=fla.get("state_size", 16),
        mamba_d_conv=fla.get("conv_kernel", 4),
        mamba_expand=fla.get("expand", 2),
        mamba_dt_rank=math.ceil(hidden / 16) if rank == "auto" else rank,
        mamba_conv_bias=fla.get("use_conv_bias", True),
        mamba_proj_bias=fla.get("use_bias", False),
        tie_word_embeddings=fla.get("tie_word_embeddings", False),
        bos_token_id=fla.get("bos_token_id", 1),
        eos_token_id=fla.get("eos_token_id", 2),
        pad_token_id=fla.get("pad_token_id", 0),
    )


def fla_shapes(config: SambaConfig) -> dict[str, tuple[int, ...]]:
    d, inner, rank, n = config.hidden_size, config.mamba_d_inner, config.mamba_dt_rank, config.mamba_d_state
    heads, kv, hs, mlp = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
    )
    shapes = {
        "backbone.embeddings.weight": (config.vocab_size, d),
        "backbone.norm_f.weight": (d,),
        "lm_head.weight": (config.vocab_size, d),
    }
    for i, kind in enumerate(config.layer_types):
        layer = f"backbone.layers.{i}"
        shapes[f"{layer}.mixer_norm.weight"] = shapes[f"{layer}.mlp_norm.weight"] = (d,)
        shapes.update(
            {
                f"{layer}.mlp.gate_proj.weight": (mlp, d),
                f"{layer}.mlp.up_proj.weight": (mlp, d),
                f"{layer}.mlp.down_proj.weight": (d, mlp),
            }
        )
        if kind == "linear_attention":
            shapes.update(
                {
                    f"{layer}.mixer.A_log": (inner, n),
                    f"{layer}.mixer.D": (inner,),
                    f"{layer}.mixer.in_proj.weight": (2 * inner, d),
                    f"{layer}.mixer.conv1d.weight": (inner, 1, config.mamba_d_conv),
                    f"{layer}.mixer.x_proj.weight": (rank + 2 * n, inner),
                    f"{layer}.mixer.dt_proj.weight": (inner, rank),
                    f"{layer}.mixer.dt_proj.bias": (inner,),
                    f"{layer}.mixer.out_proj.weight": (d, inner),
                }
            )
            if config.mamba_conv_bias:
                shapes[f"{layer}.mixer.conv1d.bias"] = (inner,)
            if config.mamba_proj_bias:
                shapes[f"{layer}.mixer.in_proj.bias"] = (2 * inner,)
                shapes[f"{layer}.mixer.out_proj.bias"] = (d,)
        else:
            shapes.update(
                {
                    f"{layer}.mixer.q_proj.weight": (heads * hs, d),
                    f"{layer}.mixer.k_proj.weight": (kv * hs, d),
                    f"{layer}.mixer.v_proj.weight": (kv * hs, d),
                    f"{layer}.mixer.o_proj.weight": (d, heads * hs),
                }
            )
    return shapes


def plan(checkpoint: Checkpoint, config: SambaConfig | None = None):
    config = config or config_from_fla(checkpoint.read_config())
    shapes = fla_shapes(config)
    check_layout(
        checkpoint,
        shapes,
        "flash-linear-attention Samba",
        optional={"lm_head.weight"} if config.tie_word_embeddings else set(),
        ignored=lambda name: name.endswith("rotary.inv_freq"),
    )
    config.tie_word_embeddings = heads_tied(
        checkpoint, "backbone.embeddings.weight", declared=config.tie_word_embeddings
    )
    tensors = {"model.embed_tokens.weight": lambda: checkpoint["backbone.embeddings.weight"]}
    for i, kind in enumerate(config.layer_types):
        src, dst = f"backbone.layers.{i}", f"model.layers.{i}"
        tensors[f"{dst}.input_layernorm.weight"] = lambda s=src: checkpoint[f"{s}.mixer_norm.weight"]
        # the mixer's tensors have the same names after `mixer.` as after samba-hf's `mamba.` / `self_attn.`
        prefix = "mamba" if kind == "linear_attention" else "self_attn"
        mixer = f"{src}.mixer."
        for name in shapes:
            if name.startswith(mixer):
                tensors[f"{dst}.{prefix}.{name.removeprefix(mixer)}"] = lambda n=name: checkpoint[n]
        tensors[f"{dst}.post_attention_layernorm.weight"] = lambda s=src: checkpoint[f"{s}.mlp_norm.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"{dst}.mlp.{proj}.weight"] = lambda s=src, p=proj: checkpoint[f"{s}.mlp.{p}.weight"]
    tensors["model.norm.weight"] = lambda: checkpoint["backbone.norm_f.weight"]
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = lambda: checkpoint["lm_head.weight"]
    return config, tensors
