"""Checks of the Megatron Mamba-2-Hybrid test oracle (tests/megatron_reference.py) itself.

The float64 per-token reference must agree with transformers' NemotronH (configured per the design doc, dt clamp
removed) and must notice the differences that matter; the synthetic checkpoint files must reference exactly the
non-tensor globals of the 2024 release and be unloadable by a plain torch.load without Megatron.
"""

import argparse
import enum
import io
import math
import sys

import numpy as np
import pytest
import torch
from megatron_reference import (
    megatron_args,
    megatron_logits,
    nemotron_h_logits,
    nemotron_h_model,
    random_megatron_state,
    released_shapes,
    run_nemotron_h,
    save_megatron_checkpoint,
    tiny_geometry,
)

TOL = 1e-4  # relative: max |diff| / max |logit|
HYBRID_8B = "M-M-M--M-M*-M-M-M-M--M*-M-M-M-M-M*--M-M-M-M-M*-M--M-M-M-"


def rel_diff(ours, other):
    return ((ours - other).abs().max() / ours.abs().max()).item()


def token_ids(geometry, batch=2, seq=40, seed=0):
    return torch.randint(0, geometry["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def with_small_steps(state, shift=4.6):
    """Lower every dt_bias so that most steps fall below NemotronH's default 1e-3 clamp."""
    return {k: (v - shift if k.endswith("mixer.dt_bias") else v) for k, v in state.items()}


def safe_load(path):
    """Load a synthetic release file without Megatron: weights_only with stubbed non-tensor globals (§1.6 route a)."""
    StubModelType = enum.Enum(
        "ModelType", {"encoder_or_decoder": 1, "encoder_and_decoder": 2, "retro_encoder": 3, "retro_decoder": 4}
    )
    reconstruct = getattr(np, "_core", np.core).multiarray._reconstruct
    allowed = [
        argparse.Namespace,
        io.BytesIO,
        np.ndarray,
        np.dtype,
        type(np.dtype("uint32")),
        (reconstruct, reconstruct.__module__ + "._reconstruct"),
        (StubModelType, "megatron.core.enums.ModelType"),
    ]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


# ----------------------------------------------------------------------------------------------------------------
# 1-2. Agreement with NemotronH, and controls
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["M-M*-M", "M*-M-", "MMM"])
def test_reference_matches_nemotron_h(pattern):
    geometry = tiny_geometry()  # n_groups 2, 4 q heads / 2 KV groups, chunk 16
    state = random_megatron_state(pattern, geometry, seed=1)
    ids = token_ids(geometry)  # 40 tokens = 3 SSD chunks
    ours = megatron_logits(state, pattern, geometry, ids)
    assert ours.dtype == torch.float64 and ours.shape == (2, 40, geometry["vocab_size"])
    assert 1.0 < ours.abs().max() < 50.0  # realistic scale, not tiny
    assert rel_diff(ours, nemotron_h_logits(state, pattern, geometry, ids)) <= TOL


@pytest.mark.parametrize("pattern", ["M-M*-M", "MMM"])
def test_dt_clamp_control(pattern):
    """With small steps the 1e-3 clamp NemotronH keeps by default is clearly visible; without it we agree."""
    geometry = tiny_geometry()
    state = with_small_steps(random_megatron_state(pattern, geometry, seed=1))
    ids = token_ids(geometry)
    ours = megatron_logits(state, pattern, geometry, ids)
    assert rel_diff(ours, nemotron_h_logits(state, pattern, geometry, ids)) <= TOL
    assert rel_diff(ours, nemotron_h_logits(state, pattern, geometry, ids, keep_dt_clamp=True)) > 10 * TOL


def test_ungrouped_gated_norm_control():
    """One RMS over all of d_inner (the old HF Mamba2 bug) instead of per group: far off."""
    pattern, geometry = "M-M*-M", tiny_geometry()
    state = random_megatron_state(pattern, geometry, seed=1)
    ids = token_ids(geometry)
    model = nemotron_h_model(state, pattern, geometry)
    for module in model.modules():
        if type(module).__name__ == "NemotronHRMSNormGated":
            module.group_size = module.weight.numel()
    assert rel_diff(megatron_logits(state, pattern, geometry, ids), run_nemotron_h(model, ids)) > 100 * TOL


def test_qkv_interleave_control():
    """Reading linear_qkv as plain [q; k; v] blocks instead of per-group interleaved rows is far off."""
    pattern, geometry = "*-", tiny_geometry()
    state = random_megatron_state(pattern, geometry, seed=2)
    ids = token_ids(geometry)
    ours = megatron_logits(state, pattern, geometry, ids)
    assert rel_diff(ours, nemotron_h_logits(state, pattern, geometry, ids)) <= TOL
    nh, ng, kv = geometry["num_attention_heads"], geometry["num_query_groups"], geometry["kv_channels"]
    q, k, v = state["decoder.layers.0.self_attention.linear_qkv.weight"].split([nh * kv, ng * kv, ng * kv])
    interleaved = torch.cat([q.reshape(ng, nh // ng * kv, -1), k.reshape(ng, kv, -1), v.reshape(ng, kv, -1)], 1)
    wrong = dict(state)
    wrong["decoder.layers.0.self_attention.linear_qkv.weight"] = interleaved.reshape(-1, q.shape[-1])
    assert rel_diff(ours, nemotron_h_logits(wrong, pattern, geometry, ids)) > 100 * TOL


def test_gelu_control_is_measurable():
    """tanh-GELU differs from erf-GELU only slightly at these sizes; still above the agreement level."""
    pattern, geometry = "M-M*-M", tiny_geometry()
    state = random_megatron_state(pattern, geometry, seed=1)
    ids = token_ids(geometry)
    ours = megatron_logits(state, pattern, geometry, ids)
    exact = rel_diff(ours, nemotron_h_logits(state, pattern, geometry, ids))
    tanh = rel_diff(ours, nemotron_h_logits(state, pattern, geometry, ids, mlp_hidden_act="gelu_pytorch_tanh"))
    assert tanh > 10 * exact


def test_reference_is_causal_and_per_sequence():
    pattern, geometry = "M*-M", tiny_geometry()
    state = random_megatron_state(pattern, geometry, seed=3)
    ids = token_ids(geometry, batch=2, seq=24)
    full = megatron_logits(state, pattern, geometry, ids)
    changed = ids.clone()
    changed[:, 15:] = (changed[:, 15:] + 1) % geometry["vocab_size"]
    other = megatron_logits(state, pattern, geometry, changed)
    torch.testing.assert_close(other[:, :15], full[:, :15], rtol=0, atol=1e-12)
    assert (other[:, 15:] - full[:, 15:]).abs().max() > 1e-3
    torch.testing.assert_close(megatron_logits(state, pattern, geometry, ids[1:]), full[1:], rtol=0, atol=1e-12)


def test_state_layout_and_8b_counts():
    geometry = tiny_geometry()
    state = random_megatron_state("M*-", geometry, seed=0, dtype=torch.bfloat16)
    assert {k: tuple(v.shape) for k, v in state.items()} == dict(released_shapes("M*-", geometry))
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    g8b = dict(
        vocab_size=256000,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=128,
        ffn_hidden_size=16384,
        mamba_num_heads=128,
        mamba_head_dim=64,
        mamba_num_groups=8,
        mamba_state_dim=128,
        mamba_d_conv=4,
        norm_epsilon=1e-5,
        mamba_chunk_size=128,
    )
    hybrid = released_shapes(HYBRID_8B, g8b)
    pure = released_shapes("M" * 56, g8b)
    assert (len(hybrid), sum(math.prod(s) for s in hybrid.values())) == (315, 8_654_517_248)
    assert (len(pure), sum(math.prod(s) for s in pure.values())) == (507, 8_236_999_680)
    assert hybrid["decoder.layers.0.mixer.in_proj.weight"] == (18560, 4096)
    assert hybrid["decoder.layers.10.self_attention.linear_qkv.weight"] == (6144, 4096)


# ----------------------------------------------------------------------------------------------------------------
# 3. Checkpoint files
# ----------------------------------------------------------------------------------------------------------------


def test_megatron_args():
    args = megatron_args("M-M*-M", tiny_geometry(), mamba_num_groups=2)
    assert args.num_layers == 6 and args.hybrid_attention_ratio == pytest.approx(1 / 6)
    assert args.hybrid_mlp_ratio == pytest.approx(2 / 6) and args.hybrid_override_pattern is None
    assert args.params_dtype is torch.bfloat16 and args.model_type.name == "encoder_or_decoder"
    assert args.model_type.value == 1 and type(args.model_type).__module__ == "megatron.core.enums"
    assert args.mamba_num_groups == 2
    assert not any(k.startswith("mamba_") for k in vars(megatron_args("M", tiny_geometry())))


def test_checkpoint_globals_and_no_megatron(tmp_path):
    pattern, geometry = "M*-", tiny_geometry()
    state = random_megatron_state(pattern, geometry, dtype=torch.bfloat16)
    path = save_megatron_checkpoint(tmp_path / "hub", state, megatron_args(pattern, geometry))
    assert path == tmp_path / "hub" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    assert (tmp_path / "hub" / "latest_checkpointed_iteration.txt").read_text() == "release"
    names = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    assert {"argparse.Namespace", "megatron.core.enums.ModelType", "_io.BytesIO"} <= names
    assert any(name.startswith("numpy") for name in names)
    assert not {"megatron", "megatron.core", "megatron.core.enums"} & set(sys.modules)
    with pytest.raises(ModuleNotFoundError, match="megatron"):
        torch.load(path, weights_only=False)
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(path)  # torch's default weights_only=True

    loaded = safe_load(path)
    assert set(loaded) == {"model", "args", "checkpoint_version", "iteration", "opt_param_scheduler", "rng_state"}
    assert loaded["checkpoint_version"] == 3.0 and loaded["iteration"] == 0
    assert loaded["args"].model_type.value == 1 and loaded["args"].params_dtype is torch.bfloat16
    model = loaded["model"]
    extra = {k for k in model if k.endswith("_extra_state")}
    assert extra == {
        f"decoder.layers.1.self_attention.{m}._extra_state" for m in ("linear_qkv", "linear_proj", "core_attention")
    } | {"decoder.layers.2.mlp.linear_fc1._extra_state", "decoder.layers.2.mlp.linear_fc2._extra_state"}
    assert all(isinstance(model[k], io.BytesIO) for k in extra)
    for key, value in state.items():
        assert model[key].dtype == torch.bfloat16 and torch.equal(model[key], value)
    assert set(model) - extra == set(state)


def test_checkpoint_without_extra_state(tmp_path):
    pattern, geometry = "MM", tiny_geometry()
    state = random_megatron_state(pattern, geometry)
    path = save_megatron_checkpoint(tmp_path / "x.pt", state, megatron_args(pattern, geometry), extra_state=False)
    names = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    assert "_io.BytesIO" not in names and "megatron.core.enums.ModelType" in names
    assert set(safe_load(path)["model"]) == set(state)


# ----------------------------------------------------------------------------------------------------------------
# 4. Fused-norm layout
# ----------------------------------------------------------------------------------------------------------------


def test_fused_layout_same_logits(tmp_path):
    pattern, geometry = "M*-M", tiny_geometry()
    state = random_megatron_state(pattern, geometry, seed=4)
    path = save_megatron_checkpoint(
        tmp_path / "ckpt", state, megatron_args(pattern, geometry), fused_norms=True, iteration=1000
    )
    assert path == tmp_path / "ckpt" / "iter_0001000" / "mp_rank_00" / "model_optim_rng.pt"
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1000"
    fused = safe_load(path)["model"]
    for i in (0, 3):
        assert f"decoder.layers.{i}.norm.weight" not in fused
        assert torch.equal(
            fused[f"decoder.layers.{i}.mixer.in_proj.layer_norm_weight"], state[f"decoder.layers.{i}.norm.weight"]
        )
        assert isinstance(fused[f"decoder.layers.{i}.mixer.in_proj._extra_state"], io.BytesIO)
        assert isinstance(fused[f"decoder.layers.{i}.mixer.out_proj._extra_state"], io.BytesIO)
    ids = token_ids(geometry, seq=20)
    reference = megatron_logits(state, pattern, geometry, ids)
    torch.testing.assert_close(megatron_logits(fused, pattern, geometry, ids), reference, rtol=0, atol=0)
    assert rel_diff(reference, nemotron_h_logits(fused, pattern, geometry, ids)) <= TOL
