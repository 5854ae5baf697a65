"""transformers' Mamba, Mistral and Llama folders as Samba layouts: the paper's baselines in the same class.

- `MambaForCausalLM` -> all "linear_attention" layers, no MLP (`intermediate_size=0`);
  backbone.embeddings / layers.{i}.norm / layers.{i}.mixer.* / norm_f
  -> embed_tokens / input_layernorm / mamba.* / norm.
- `MistralForCausalLM` -> all "sliding_attention" layers (all "full_attention" when `sliding_window` is null);
- `LlamaForCausalLM` -> all "full_attention" layers.
  Mistral and Llama keys are already samba-hf's (model.layers.{i}.self_attn.q_proj, mlp.gate_proj, ...).
"""

from ..configuration_samba import SambaConfig
from .checkpoint import Checkpoint, ConversionError, check_layout, heads_tied
from .writer import expected_tensors


def _require(hf: dict, model_type: str):
    if hf.get("model_type") != model_type:
        raise ConversionError(
            f"config.json has model_type {hf.get('model_type')!r}, not {model_type!r}: wrong source format? "
            "(samba-hf convert mamba | mistral | llama | fla | lit-gpt)"
        )


def config_from_mamba(hf: dict) -> SambaConfig:
    _require(hf, "mamba")
    hidden = hf["hidden_size"]
    rank = hf.get("time_step_rank", "auto")
    return SambaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=0,
        num_hidden_layers=hf["num_hidden_layers"],
        layer_types=["linear_attention"] * hf["num_hidden_layers"],
        rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        hidden_act=hf.get("hidden_act", "silu"),
        mamba_d_state=hf.get("state_size", 16),
        mamba_d_conv=hf.get("conv_kernel", 4),
        mamba_expand=hf.get("expand", 2),
        mamba_dt_rank=-(-hidden // 16) if rank == "auto" else rank,
        mamba_conv_bias=hf.get("use_conv_bias", True),
        mamba_proj_bias=hf.get("use_bias", False),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        sliding_window=None,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
    )


def _attention_config(hf: dict, layer_type: str, sliding_window) -> SambaConfig:
    if hf.get("mlp_bias"):
        raise ConversionError("mlp_bias=True has no samba-hf equivalent (its MLP has no biases).")
    heads = hf["num_attention_heads"]
    scaling = dict(hf.get("rope_scaling") or {})
    if "type" in scaling:  # configs written before transformers 4.45 name the rope type "type"
        scaling.setdefault("rope_type", scaling.pop("type"))
    rope = hf.get("rope_parameters") or {
        "rope_type": "default",
        "rope_theta": hf.get("rope_theta", 10000.0),
        **scaling,
    }
    return SambaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        hidden_act=hf.get("hidden_act", "silu"),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_parameters=rope,
        sliding_window=sliding_window,
        attention_bias=hf.get("attention_bias", False),
        attention_dropout=hf.get("attention_dropout", 0.0),
        layer_types=[layer_type] * hf["num_hidden_layers"],
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
    )


def config_from_mistral(hf: dict) -> SambaConfig:
    _require(hf, "mistral")
    window = hf.get("sliding_window")
    return _attention_config(hf, "sliding_attention" if window else "full_attention", window or None)


def config_from_llama(hf: dict) -> SambaConfig:
    _require(hf, "llama")
    return _attention_config(hf, "full_attention", None)


def plan_mamba(checkpoint: Checkpoint, config: SambaConfig | None = None):
    config = config or config_from_mamba(checkpoint.read_config())
    # the mixer's tensors have the same names in both (mixer.* / mamba.*): only the prefixes change
    renames = (
        ("model.embed_tokens.", "backbone.embeddings."),
        ("model.norm.", "backbone.norm_f."),
        ("model.layers.", "backbone.layers."),
        (".input_layernorm.", ".norm."),
        (".mamba.", ".mixer."),
    )
    names = {"lm_head.weight": "lm_head.weight"}
    for ours in expected_tensors(config):
        theirs = ours
        for old, new in renames:
            theirs = theirs.replace(old, new)
        names[ours] = theirs
    return _rename(checkpoint, config, names, "transformers Mamba", "backbone.embeddings.weight")


def plan_same_names(source: str):
    def plan(checkpoint: Checkpoint, config: SambaConfig | None = None):
        if config is None:
            hf = checkpoint.read_config()
            config = config_from_mistral(hf) if source == "mistral" else config_from_llama(hf)
        names = {name: name for name in expected_tensors(config)} | {"lm_head.weight": "lm_head.weight"}
        return _rename(checkpoint, config, names, f"transformers {source.capitalize()}", "model.embed_tokens.weight")

    return plan


def _rename(checkpoint, config, names, source, embedding):
    """Check, then map samba-hf name -> source name (entries our config does not hold are dropped first)."""
    targets = expected_tensors(config) | {"lm_head.weight": (config.vocab_size, config.hidden_size)}
    names = {ours: theirs for ours, theirs in names.items() if ours in targets}
    check_layout(
        checkpoint,
        {names[ours]: shape for ours, shape in targets.items()},
        source,
        optional={"lm_head.weight"} if config.tie_word_embeddings else set(),
        ignored=lambda name: name.endswith("rotary_emb.inv_freq"),
    )
    config.tie_word_embeddings = heads_tied(checkpoint, embedding, declared=config.tie_word_embeddings)
    if config.tie_word_embeddings:
        names.pop("lm_head.weight")
    return config, {ours: (lambda theirs=theirs: checkpoint[theirs]) for ours, theirs in names.items()}
