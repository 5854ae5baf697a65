import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import samba_hf
from samba_hf import SambaConfig, SambaForCausalLM


def count_parameters(config) -> int:
    with torch.device("meta"):
        model = SambaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())  # tied lm_head/embed_tokens counted once


def test_defaults_are_samba_421m():
    config = SambaConfig()
    assert config.model_type == "samba"
    assert config.layer_types == ["linear_attention", "sliding_attention"] * 6
    assert (config.sliding_window, config.rms_norm_eps, config.tie_word_embeddings) == (2048, 1e-5, True)
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert (config.mamba_d_state, config.mamba_d_conv, config.mamba_expand, config.mamba_dt_rank) == (16, 4, 2, 96)
    assert config.to_dict() == SambaConfig.from_preset("samba-421m").to_dict()


def test_preset_421m_has_the_official_parameter_count():
    assert count_parameters(SambaConfig.from_preset("samba-421m")) == 421_793_280


@pytest.mark.parametrize(
    "name, low, high",
    [("samba-1.3b", 1.2e9, 1.45e9), ("samba-1.7b", 1.6e9, 1.9e9), ("samba-3.8b", 3.6e9, 4.0e9), ("tiny", 1e5, 1e6)],
)
def test_presets_have_their_advertised_size(name, low, high):
    assert low <= count_parameters(SambaConfig.from_preset(name)) <= high


def test_preset_1_3b_shapes():
    config = SambaConfig.from_preset("samba-1.3b")
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.head_dim) == (
        18,
        2304,
        18,
        128,
    )
    assert config.mamba_dt_rank == 144


def test_preset_overrides_and_unknown_name():
    assert SambaConfig.from_preset("tiny", sliding_window=8).sliding_window == 8
    with pytest.raises(ValueError, match="Unknown Samba preset 'samba-7b'"):
        SambaConfig.from_preset("samba-7b")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3),
            "has 3 entries but `num_hidden_layers` is 4",
        ),
        (dict(num_hidden_layers=2, layer_types=["mamba", "sliding_attention"]), r"contains \['mamba'\]"),
        (dict(num_attention_heads=12, num_key_value_heads=5), "must be a multiple of `num_key_value_heads`"),
        (dict(hidden_size=100, num_attention_heads=12, head_dim=None), "not divisible by `num_attention_heads`"),
        (dict(sliding_window=0), "`sliding_window` must be a positive integer"),
        (dict(intermediate_size=-1), "`intermediate_size` must be >= 0"),
        (dict(head_dim=7), "`head_dim` must be even"),
        (dict(mamba_d_state=0), "`mamba_d_state` must be a positive integer"),
        (dict(mamba_dt_min=0.2, mamba_dt_max=0.1), "mamba_dt_min"),
    ],
)
def test_invalid_configs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SambaConfig(**kwargs)


def test_all_mamba_config_needs_no_attention_fields():
    config = SambaConfig(
        num_hidden_layers=2,
        layer_types=["linear_attention"] * 2,
        num_attention_heads=12,
        num_key_value_heads=5,
        sliding_window=None,
        intermediate_size=0,
    )
    assert config.layer_types == ["linear_attention"] * 2


def test_auto_classes_know_samba(tmp_path):
    config = SambaConfig.from_preset("tiny")
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, SambaConfig)
    strip = lambda d: {k: v for k, v in d.items() if k != "_name_or_path"}  # noqa: E731
    assert strip(loaded.to_dict()) == strip(config.to_dict())
    assert type(AutoModelForCausalLM.from_config(config)) is samba_hf.SambaForCausalLM


@pytest.mark.parametrize("layers", [6, 12, 3])
def test_pattern_and_a_num_hidden_layers_that_disagree_are_refused(layers):
    # 12 is the old default: an explicit 12 is refused too, not taken for "not given"
    with pytest.raises(
        ValueError,
        match=rf"`hybrid_override_pattern` 'M\*M-' has 4 layers but `num_hidden_layers` is "
        rf"{layers}: the pattern gives the layer count",
    ):
        SambaConfig(hybrid_override_pattern="M*M-", num_hidden_layers=layers)


def test_pattern_with_an_agreeing_or_no_num_hidden_layers(tmp_path):
    assert SambaConfig(hybrid_override_pattern="M*M-").num_hidden_layers == 4
    assert SambaConfig(hybrid_override_pattern="M*M-", num_hidden_layers=4).hybrid_pattern == "M*M-"
    assert SambaConfig().num_hidden_layers == 12 and SambaConfig(num_hidden_layers=None).num_hidden_layers == 12
    # a preset's own layer count gives way to a pattern passed with it; an explicit count does not
    assert SambaConfig.from_preset("mamba2-hybrid-8b", hybrid_override_pattern="M-M*-M-").num_hidden_layers == 7
    assert SambaConfig.from_preset("mamba2-hybrid-8b").num_hidden_layers == 56
    with pytest.raises(ValueError, match="has 56 layers but `num_hidden_layers` is 8"):
        SambaConfig.from_preset("mamba2-hybrid-8b", num_hidden_layers=8)
    # a config.json that has both, in agreement, loads; a saved Mamba-2-Hybrid loads back
    config = SambaConfig.from_preset("mamba2-hybrid-8b", hybrid_override_pattern="M-M*-", vocab_size=64)
    config.save_pretrained(tmp_path)
    strip = lambda d: {k: v for k, v in d.items() if k != "_name_or_path"}  # noqa: E731
    assert strip(SambaConfig.from_pretrained(tmp_path).to_dict()) == strip(config.to_dict())
    fields = {**config.to_dict(), "hybrid_override_pattern": "M-M*-"}
    assert SambaConfig.from_dict(fields).layer_types == config.layer_types
    with pytest.raises(ValueError, match="has 4 layers but `num_hidden_layers` is 5"):
        SambaConfig.from_dict({**fields, "hybrid_override_pattern": "M-M*", "layer_types": None})
