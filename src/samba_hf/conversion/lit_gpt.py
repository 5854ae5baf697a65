"""The official Samba code (microsoft/Samba, lit-gpt based): its named configs and its state-dict layout.

Official keys, per block i (even i: Mamba, odd i: attention; the mixer attribute is `attn` in both):
    transformer.h.{i}.norm_1 / norm_2              -> input_layernorm / post_attention_layernorm
    transformer.h.{i}.attn.{in_proj,conv1d,...}    -> mamba.{in_proj,conv1d,...}           (Mamba blocks)
    transformer.h.{i}.attn.attn.weight             -> self_attn.{q,k,v}_proj.weight        (attention blocks)
        fused rows grouped by key/value head g: [q heads of g (q_per_kv * head_dim rows), k_g, v_g]
    transformer.h.{i}.attn.proj.weight             -> self_attn.o_proj.weight
    transformer.h.{i}.mlp.swiglu.w1 / w2 / w3      -> mlp.gate_proj / up_proj / down_proj
    transformer.wte / transformer.ln_f / lm_head   -> model.embed_tokens / model.norm / lm_head (tied)
"""

import torch

from ..configuration_samba import SambaConfig
from .checkpoint import Checkpoint, ConversionError, check_layout, heads_tied

# The Samba-shaped configs of microsoft/Samba lit_gpt/config.py (all: vocab 32000 padded to a multiple of 64,
# block_size 4096, RMSNorm eps 1e-5, LLaMAMLP, no biases, Mamba on even blocks, RoPE unless `nope`).
OFFICIAL_CONFIGS = {
    "Samba_421M": dict(n_layer=12, n_head=12, n_embd=1536, intermediate_size=4096),
    "Samba_421M_gqa2": dict(n_layer=12, n_head=12, n_query_groups=2, n_embd=1536, intermediate_size=4608),
    "Samba_421M_gqa4": dict(n_layer=12, n_head=12, n_query_groups=4, n_embd=1536, intermediate_size=4608),
    "Samba_421M_mqa": dict(n_layer=12, n_head=12, n_query_groups=1, n_embd=1536, intermediate_size=4608),
    "Samba_421M_mqa6": dict(n_layer=12, n_head=6, n_query_groups=1, n_embd=1536, intermediate_size=4608),
    "Samba_421M_nope": dict(n_layer=12, n_head=12, n_embd=1536, intermediate_size=4096, nope=True),
    "Samba_421M_1k_window": dict(n_layer=12, n_head=12, n_embd=1536, intermediate_size=4096, local_window=1024),
    "Samba_421M_512_window": dict(n_layer=12, n_head=12, n_embd=1536, intermediate_size=4096, local_window=512),
    "Samba_1.3B": dict(n_layer=18, n_head=18, n_embd=2304, intermediate_size=6144),
    "Samba_1.3B_nope": dict(n_layer=18, n_head=18, n_embd=2304, intermediate_size=6144, nope=True),
}

MAMBA_TENSORS = (
    "A_log",
    "D",
    "in_proj.weight",
    "conv1d.weight",
    "conv1d.bias",
    "x_proj.weight",
    "dt_proj.weight",
    "dt_proj.bias",
    "out_proj.weight",
)
MLP_NAMES = {"w1": "gate_proj", "w2": "up_proj", "w3": "down_proj"}


def config_from_name(name: str, **lit_gpt_overrides) -> SambaConfig:
    """The SambaConfig of an official config name (overrides use lit-gpt's field names, e.g. vocab_size=...)."""
    if name not in OFFICIAL_CONFIGS:
        raise ConversionError(
            f"unknown official config {name!r}; choose one of {sorted(OFFICIAL_CONFIGS)}, or pass a SambaConfig "
            "JSON file with the checkpoint's sizes."
        )
    lit = dict(
        vocab_size=32000,
        padding_multiple=64,
        block_size=4096,
        local_window=2048,
        norm_eps=1e-5,
        nope=False,
        n_query_groups=None,
    )
    lit.update(OFFICIAL_CONFIGS[name], **lit_gpt_overrides)
    vocab = -(-lit["vocab_size"] // lit["padding_multiple"]) * lit["padding_multiple"]  # lit-gpt's padded vocab
    n_layer, window = lit["n_layer"], lit["local_window"]
    attention = "sliding_attention" if window > 0 else "full_attention"
    return SambaConfig(
        vocab_size=vocab,
        hidden_size=lit["n_embd"],
        intermediate_size=lit["intermediate_size"],
        num_hidden_layers=n_layer,
        num_attention_heads=lit["n_head"],
        num_key_value_heads=lit["n_query_groups"] or lit["n_head"],
        head_dim=lit["n_embd"] // lit["n_head"],
        max_position_embeddings=None if window > 0 else lit["block_size"],  # sliding layers: no length limit
        rms_norm_eps=lit["norm_eps"],
        sliding_window=window if window > 0 else None,
        use_rope=not lit["nope"],
        layer_types=["linear_attention" if i % 2 == 0 else attention for i in range(n_layer)],
        tie_word_embeddings=True,
    )


def check_convertible(config: SambaConfig):
    """The official code builds only a subset of SambaConfig: say which field is out of it."""
    problems = []
    if config.intermediate_size == 0:
        problems.append("intermediate_size=0 (the official blocks always have an MLP)")
    if config.attention_bias or config.mamba_proj_bias or not config.mamba_conv_bias:
        problems.append("biases other than the Mamba conv and dt_proj")
    if (config.mamba_d_state, config.mamba_d_conv, config.mamba_expand) != (16, 4, 2):
        problems.append("Mamba sizes other than d_state 16, d_conv 4, expand 2")
    if config.mamba_dt_rank != -(-config.hidden_size // 16):
        problems.append("mamba_dt_rank other than ceil(hidden_size / 16)")
    attention_head_dim = config.hidden_size // config.num_attention_heads
    if any(t != "linear_attention" for t in config.layer_types) and config.head_dim != attention_head_dim:
        problems.append(f"head_dim {config.head_dim} != hidden_size / num_attention_heads ({attention_head_dim})")
    if problems:
        raise ConversionError("the official lit-gpt code cannot express this config: " + "; ".join(problems) + ".")


def official_shapes(config: SambaConfig) -> dict[str, tuple[int, ...]]:
    """Every key of an official checkpoint of this config, with its shape (lm_head.weight included: the official
    code ties it to transformer.wte.weight, and its state dict holds both names)."""
    check_convertible(config)
    d, inner, rank, n = config.hidden_size, config.mamba_d_inner, config.mamba_dt_rank, config.mamba_d_state
    heads, groups, hs = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    shapes = {
        "transformer.wte.weight": (config.vocab_size, d),
        "lm_head.weight": (config.vocab_size, d),
        "transformer.ln_f.weight": (d,),
    }
    mamba = {
        "A_log": (inner, n),
        "D": (inner,),
        "in_proj.weight": (2 * inner, d),
        "conv1d.weight": (inner, 1, config.mamba_d_conv),
        "conv1d.bias": (inner,),
        "x_proj.weight": (rank + 2 * n, inner),
        "dt_proj.weight": (inner, rank),
        "dt_proj.bias": (inner,),
        "out_proj.weight": (d, inner),
    }
    for i, kind in enumerate(config.layer_types):
        block = f"transformer.h.{i}"
        shapes[f"{block}.norm_1.weight"] = shapes[f"{block}.norm_2.weight"] = (d,)
        shapes[f"{block}.mlp.swiglu.w1.weight"] = shapes[f"{block}.mlp.swiglu.w2.weight"] = (
            config.intermediate_size,
            d,
        )
        shapes[f"{block}.mlp.swiglu.w3.weight"] = (d, config.intermediate_size)
        if kind == "linear_attention":
            shapes.update({f"{block}.attn.{name}": shape for name, shape in mamba.items()})
        else:
            shapes[f"{block}.attn.attn.weight"] = ((heads + 2 * groups) * hs, d)
            shapes[f"{block}.attn.proj.weight"] = (d, heads * hs)
    return shapes


def describe(checkpoint: Checkpoint) -> str:
    """What the checkpoint's own shapes say, to set beside the config it did not match."""
    blocks = {name.split(".")[2] for name in checkpoint.keys() if name.startswith("transformer.h.")}
    embedding = next(
        (checkpoint.shape(n) for n in ("transformer.wte.weight", "lm_head.weight") if n in checkpoint), None
    )
    facts = f"The checkpoint has {len(blocks)} blocks" + (
        f" and embeddings of shape {list(embedding)}" if embedding else ""
    )
    return f"{facts}; official config names: {', '.join(OFFICIAL_CONFIGS)}."


def split_qkv(fused: torch.Tensor, config: SambaConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Official fused rows [q heads of group g, k_g, v_g] for each g -> separate q, k, v projection weights."""
    groups, hs = config.num_key_value_heads, config.head_dim
    q_per_kv = config.num_attention_heads // groups
    per_group = fused.reshape(groups, q_per_kv + 2, hs, fused.shape[-1])
    q = per_group[:, :q_per_kv].reshape(groups * q_per_kv * hs, -1)
    return q, per_group[:, q_per_kv].reshape(groups * hs, -1), per_group[:, q_per_kv + 1].reshape(groups * hs, -1)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: SambaConfig) -> torch.Tensor:
    """The inverse of `split_qkv`."""
    groups, hs = config.num_key_value_heads, config.head_dim
    q_per_kv = config.num_attention_heads // groups
    per_group = torch.cat(
        [q.reshape(groups, q_per_kv, hs, -1), k.reshape(groups, 1, hs, -1), v.reshape(groups, 1, hs, -1)], dim=1
    )
    return per_group.reshape(-1, q.shape[-1])


def plan(checkpoint: Checkpoint, config: SambaConfig):
    """Check the checkpoint against `config`, then return (config, {samba-hf name: producer})."""
    check_layout(
        checkpoint,
        official_shapes(config),
        "official lit-gpt (microsoft/Samba)",
        optional={"lm_head.weight", "transformer.wte.weight"},
        hint=describe(checkpoint),
    )
    if "lm_head.weight" not in checkpoint and "transformer.wte.weight" not in checkpoint:
        raise ConversionError(f"{checkpoint.path} has neither transformer.wte.weight nor lm_head.weight.")
    config.tie_word_embeddings = heads_tied(checkpoint, "transformer.wte.weight")  # the official code ties them
    embedding = "transformer.wte.weight" if "transformer.wte.weight" in checkpoint else "lm_head.weight"
    tensors = {"model.embed_tokens.weight": lambda: checkpoint[embedding]}
    for i, kind in enumerate(config.layer_types):
        src, dst = f"transformer.h.{i}", f"model.layers.{i}"
        tensors[f"{dst}.input_layernorm.weight"] = lambda s=src: checkpoint[f"{s}.norm_1.weight"]
        if kind == "linear_attention":
            for name in MAMBA_TENSORS:
                tensors[f"{dst}.mamba.{name}"] = lambda s=src, n=name: checkpoint[f"{s}.attn.{n}"]
        else:
            fused = lambda s=src, part=0: split_qkv(checkpoint[f"{s}.attn.attn.weight"], config)[part]  # noqa: E731
            for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                tensors[f"{dst}.self_attn.{proj}.weight"] = lambda f=fused, p=part: f(part=p)
            tensors[f"{dst}.self_attn.o_proj.weight"] = lambda s=src: checkpoint[f"{s}.attn.proj.weight"]
        tensors[f"{dst}.post_attention_layernorm.weight"] = lambda s=src: checkpoint[f"{s}.norm_2.weight"]
        for official, ours in MLP_NAMES.items():
            tensors[f"{dst}.mlp.{ours}.weight"] = lambda s=src, o=official: checkpoint[f"{s}.mlp.swiglu.{o}.weight"]
    tensors["model.norm.weight"] = lambda: checkpoint["transformer.ln_f.weight"]
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = lambda: checkpoint["lm_head.weight"]
    return config, tensors


def to_official(state_dict: dict[str, torch.Tensor], config: SambaConfig) -> dict[str, torch.Tensor]:
    """A samba-hf state dict -> the official one (both embedding names, as the official model's state dict)."""
    check_convertible(config)
    out = {
        "lm_head.weight": state_dict.get("lm_head.weight", state_dict["model.embed_tokens.weight"]),
        "transformer.wte.weight": state_dict["model.embed_tokens.weight"],
    }
    for i, kind in enumerate(config.layer_types):
        src, dst = f"model.layers.{i}", f"transformer.h.{i}"
        out[f"{dst}.norm_1.weight"] = state_dict[f"{src}.input_layernorm.weight"]
        out[f"{dst}.norm_2.weight"] = state_dict[f"{src}.post_attention_layernorm.weight"]
        if kind == "linear_attention":
            for name in MAMBA_TENSORS:
                out[f"{dst}.attn.{name}"] = state_dict[f"{src}.mamba.{name}"]
        else:
            q, k, v = (state_dict[f"{src}.self_attn.{p}_proj.weight"] for p in "qkv")
            out[f"{dst}.attn.attn.weight"] = fuse_qkv(q, k, v, config)
            out[f"{dst}.attn.proj.weight"] = state_dict[f"{src}.self_attn.o_proj.weight"]
        for official, ours in MLP_NAMES.items():
            out[f"{dst}.mlp.swiglu.{official}.weight"] = state_dict[f"{src}.mlp.{ours}.weight"]
    out["transformer.ln_f.weight"] = state_dict["model.norm.weight"]
    return out


# The fields that tell official configs apart (the rest is the same for all of them).
MODEL_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "sliding_window",
    "use_rope",
    "layer_types",
)


def differences(a: SambaConfig, b: SambaConfig) -> list[str]:
    return [field for field in MODEL_FIELDS if getattr(a, field) != getattr(b, field)]


def official_name_of(config: SambaConfig) -> str | None:
    """The official config name with exactly these sizes, if there is one."""
    return next((name for name in OFFICIAL_CONFIGS if not differences(config_from_name(name), config)), None)


def choose_config(checkpoint: Checkpoint, config: SambaConfig | None, force_config: bool = False):
    """The config to convert with, and a line saying where it came from.

    A training checkpoint records its `hparams["model_name"]`: it is used when no config is given, and a given
    config that builds a different model is refused unless `force_config` (the `_nope` and window variants have the
    same shapes as Samba_421M, so only the record tells them apart). A bare state dict records nothing."""
    recorded = checkpoint.hparams.get("model_name")
    if recorded is None:
        if config is None:
            raise ConversionError(
                f"{checkpoint.path} does not record its config (no hparams['model_name']): pass --config with the "
                f"name used for training ({', '.join(OFFICIAL_CONFIGS)}) or a SambaConfig JSON file."
            )
        return config, "as given by --config (the checkpoint records no model_name)"
    if recorded not in OFFICIAL_CONFIGS:
        if config is None:
            raise ConversionError(
                f"{checkpoint.path} was trained as model_name {recorded!r}, which is not a Samba config samba-hf "
                f"knows ({', '.join(OFFICIAL_CONFIGS)}): pass --config with a SambaConfig JSON of its sizes."
            )
        return config, f"as given by --config (the recorded model_name {recorded!r} is not an official config)"
    official = config_from_name(recorded)
    if config is None:
        return official, f"{recorded}, recorded in the checkpoint"
    changed = differences(official, config)
    if not changed:
        return config, f"{recorded}, recorded in the checkpoint and given by --config"
    if not force_config:
        raise ConversionError(
            f"{checkpoint.path} records model_name {recorded!r}, but --config differs from it in "
            f"{', '.join(changed)}: these weights would run as a different model. Leave --config out to use "
            f"{recorded}, or pass --force-config if the recorded name is wrong."
        )
    return (
        config,
        f"as given by --config with --force-config, overriding the recorded {recorded!r} ({', '.join(changed)})",
    )
