"""`samba-hf convert megatron` and `export megatron`: NVIDIA's released Megatron-LM files (built here in their layout,
with the pickled globals the release holds) into samba-hf and back, exactly, without running pickled code; and one
clear error, with nothing written, for every mistaken input."""

import argparse

import pytest
import torch
from conftest import tiny_model
from megatron_reference import (
    megatron_args,
    megatron_logits,
    random_megatron_state,
    released_shapes,
    save_megatron_checkpoint,
    tiny_geometry,
)
from test_mamba2 import in_memory_checkpoint
from test_mistakes_convert import leftovers, one_line_error

from samba_hf import SambaConfig, SambaForCausalLM
from samba_hf.conversion import ConversionError, convert, export_megatron, megatron
from samba_hf_cli import main

PATTERN = "M-M*-M"
GEOMETRY = tiny_geometry()


def release_args(pattern=PATTERN, **overrides):
    """The args of a release, plus the Mamba-2 sizes that later Megatron records (the tiny ones are not the 2024
    defaults the converter otherwise assumes)."""
    fields = dict(
        hybrid_override_pattern=pattern,
        mamba_num_groups=GEOMETRY["mamba_num_groups"],
        mamba_state_dim=GEOMETRY["mamba_state_dim"],
    )
    return megatron_args(pattern, GEOMETRY, **{**fields, **overrides})


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A Megatron folder as downloaded (tracker, release/mp_rank_00/model_optim_rng.pt), bf16 as released."""
    folder = tmp_path_factory.mktemp("hub") / "mamba2-hybrid-tiny"
    state = random_megatron_state(PATTERN, GEOMETRY, seed=1, dtype=torch.bfloat16)
    save_megatron_checkpoint(folder, state, release_args())
    return folder, state


def logits(folder, ids):
    model = SambaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits.double()


def test_the_folder_as_downloaded_converts_exactly(release, tmp_path):
    folder, state = release
    result = convert("megatron", folder, tmp_path / "out", dtype="float32", progress=False)
    assert "max |logit difference|" in result["parity"]  # --verify is on by default at this size
    config = result["config"]
    assert config.hybrid_pattern == PATTERN and config.mamba_version == 2 and not config.use_rope
    assert (config.mamba2_n_groups, config.mamba_d_state, config.mamba2_head_dim) == (2, 8, 8)
    ids = torch.randint(0, GEOMETRY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))
    reference = megatron_logits(state, PATTERN, GEOMETRY, ids)
    assert (logits(tmp_path / "out", ids) - reference).abs().max() <= 1e-4 * reference.abs().max()


def test_the_fused_norm_layout_and_the_pt_file_itself(tmp_path):
    state = random_megatron_state(PATTERN, GEOMETRY, seed=2, dtype=torch.bfloat16)
    pt = save_megatron_checkpoint(tmp_path / "ckpt.pt", state, release_args(), fused_norms=True)
    convert("megatron", pt, tmp_path / "out", dtype="float32", progress=False)
    ids = torch.randint(0, GEOMETRY["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(1))
    reference = megatron_logits(state, PATTERN, GEOMETRY, ids)
    assert (logits(tmp_path / "out", ids) - reference).abs().max() <= 1e-4 * reference.abs().max()


def test_export_of_a_conversion_gives_the_release_back_tensor_for_tensor(release, tmp_path):
    folder, state = release
    convert("megatron", folder, tmp_path / "hf", progress=False)  # bf16 as the source: A_log, D, dt_bias in float32
    out = tmp_path / "megatron" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    result = export_megatron(tmp_path / "hf", out)
    assert (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "release"
    exported = megatron.load_checkpoint_file(out)
    assert list(exported["model"]) == list(state)  # the released names, in the released order
    for name, tensor in state.items():
        assert exported["model"][name].dtype == torch.bfloat16 and torch.equal(exported["model"][name], tensor), name
    args = exported["args"]
    assert (
        args.hybrid_override_pattern == PATTERN
        and args.num_query_groups == 2
        and args.position_embedding_type == "none"
    )
    assert result["tracker"] is not None
    # and it converts again to the same model
    convert("megatron", tmp_path / "megatron", tmp_path / "again", progress=False)
    ids = torch.randint(0, GEOMETRY["vocab_size"], (1, 20))
    assert torch.equal(logits(tmp_path / "hf", ids), logits(tmp_path / "again", ids))


def test_the_8b_shapes_give_the_presets():
    """The released key set at full size (meta tensors: no memory) converts to the presets' configs."""
    geometry = dict(
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
    for preset, pattern in (
        ("mamba2-hybrid-8b", SambaConfig.from_preset("mamba2-hybrid-8b").hybrid_pattern),
        ("mamba2-8b", "M" * 56),
    ):
        shapes = released_shapes(pattern, geometry)
        args = vars(megatron_args(pattern, geometry))  # the 2024 args: ratios, no Mamba-2 sizes
        checkpoint = in_memory_checkpoint(
            {name: torch.empty(shape, device="meta") for name, shape in shapes.items()},
            {
                **args,
                "hybrid_attention_ratio": 0.08 if "*" in pattern else 0.0,
                "hybrid_mlp_ratio": 0.5 if "-" in pattern else 0.0,
            },
        )
        config, tensors = megatron.plan(checkpoint)
        expected = SambaConfig.from_preset(preset)
        for field in (
            "layer_types",
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "mamba_d_state",
            "mamba2_head_dim",
            "mamba2_n_groups",
            "mamba_expand",
            "mlp_gated",
            "mlp_hidden_act",
            "use_rope",
            "tie_word_embeddings",
            "max_position_embeddings",
            "rms_norm_eps",
            "mamba_d_conv",
            "hidden_act",
            "mamba2_chunk_size",
            "mamba_version",
        ):
            assert getattr(config, field) == getattr(expected, field), (preset, field)
        assert len(tensors) == len(shapes) + 2 * pattern.count("*")  # q, k, v from one linear_qkv


# ------------------------------------------------------------------------------------------ no pickled code runs


class Payload:
    def __reduce__(self):
        import os

        return os.system, ("touch PWNED_BY_CHECKPOINT",)


def test_a_planted_payload_is_refused_without_running(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = random_megatron_state(PATTERN, GEOMETRY, seed=3)
    pt = tmp_path / "model_optim_rng.pt"
    torch.save({"model": state, "args": argparse.Namespace(num_layers=6), "payload": Payload()}, pt)
    with pytest.raises(ConversionError, match=r"posix\.system|os\.system"):
        megatron.load_checkpoint_file(pt)
    one_line_error(capsys, ["convert", "megatron", str(pt), str(tmp_path / "out")], "refused", "system")
    assert not (tmp_path / "PWNED_BY_CHECKPOINT").exists() and not (tmp_path / "out").exists()


def test_allowed_globals_become_inert_stand_ins(release):
    folder, _ = release
    data = megatron.load_checkpoint_file(megatron.find_checkpoint(folder))
    assert isinstance(data["args"].model_type, megatron.ModelTypeStandIn)
    with pytest.raises(ModuleNotFoundError):  # a plain load would need Megatron installed
        torch.load(megatron.find_checkpoint(folder), weights_only=False)


# --------------------------------------------------------------------- mistakes: one line, exit 1, nothing written


def damaged(tmp_path, change):
    """A Megatron folder (as downloaded) whose state dict `change` has damaged."""
    state = random_megatron_state(PATTERN, GEOMETRY, seed=4, dtype=torch.bfloat16)
    change(state)
    save_megatron_checkpoint(tmp_path / "src", state, release_args())
    return tmp_path / "src"


@pytest.mark.parametrize(
    "case, fragments",
    [
        ("samba folder", ["not a Megatron-LM checkpoint folder", "latest_checkpointed_iteration.txt"]),
        ("llama folder", ["not a Megatron-LM checkpoint folder"]),
        ("truncated", ["truncated"]),
        ("missing tensor", ["missing (1): decoder.layers.0.mixer.D"]),
        ("nan tensor", ["model.layers.3.self_attn.q_proj.weight", "NaN", "Nothing was written"]),
        ("args disagree", ["the blocks in the file are M-M*-M but its args describe"]),
        ("two ranks", ["2 model-parallel ranks", "--target-tp-size 1"]),
        ("not a checkpoint", ["cannot read"]),
    ],
)
def test_mistakes_end_in_one_line_and_write_nothing(tmp_path, capsys, case, fragments):
    if case == "samba folder":
        src = tmp_path / "samba"
        tiny_model().save_pretrained(src)
    elif case == "llama folder":
        from transformers import LlamaConfig, LlamaForCausalLM

        src = tmp_path / "llama"
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
            )
        ).save_pretrained(src)
    elif case == "truncated":
        src = damaged(tmp_path, lambda state: None)
        pt = megatron.find_checkpoint(src)
        pt.write_bytes(pt.read_bytes()[: pt.stat().st_size // 2])
    elif case == "missing tensor":
        src = damaged(tmp_path, lambda state: state.pop("decoder.layers.0.mixer.D"))
    elif case == "nan tensor":
        src = damaged(
            tmp_path,
            lambda state: (
                state["decoder.layers.3.self_attention.linear_qkv.weight"].view(-1).__setitem__(5, float("nan"))
            ),
        )
    elif case == "args disagree":
        src = tmp_path / "src"
        state = random_megatron_state(PATTERN, GEOMETRY, seed=5)
        save_megatron_checkpoint(src, state, release_args(hybrid_override_pattern="M*M--M"))
    elif case == "two ranks":
        src = damaged(tmp_path, lambda state: None)
        (src / "release" / "mp_rank_01").mkdir()
    else:
        src = tmp_path / "file.pt"
        src.write_text("not a checkpoint")
    out = tmp_path / "out"
    one_line_error(capsys, ["convert", "megatron", str(src), str(out)], *fragments)
    assert not out.exists() and not leftovers(tmp_path)


def test_export_refuses_a_samba_folder(tmp_path, capsys):
    tiny_model().save_pretrained(tmp_path / "samba")
    one_line_error(
        capsys,
        ["export", "megatron", str(tmp_path / "samba"), str(tmp_path / "m.pt")],
        "cannot be written in Megatron's Mamba layout",
        "Mamba-1",
    )
    assert not (tmp_path / "m.pt").exists()


def test_cli_convert_and_export(release, tmp_path, capsys):
    folder, _ = release
    assert main(["convert", "megatron", str(folder), str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert "parity: max |logit difference|" in err
    out = tmp_path / "m" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    assert main(["export", "megatron", str(tmp_path / "hf"), str(out)]) == 0
    assert "latest_checkpointed_iteration.txt" in capsys.readouterr().err
    one_line_error(capsys, ["export", "megatron", str(tmp_path / "hf"), str(out)], "exists", "--force")
    assert main(["export", "megatron", str(tmp_path / "hf"), str(out), "--force"]) == 0


def test_the_sentencepiece_model_becomes_a_tokenizer_that_encodes_as_megatron(tmp_path):
    """The folder's .model is converted (Megatron's GPTSentencePieceTokenizer: encode_as_ids, no BOS/EOS) and the
    model stops generating at its end-of-document id."""
    import io

    import sentencepiece
    from transformers import AutoTokenizer, GenerationConfig

    text = ["Mamba layers read the sequence once.", "def f(x):\n    return 2 * x  # 12345", "状態空間モデル ✓"] * 30
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_writer=model,
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
    )
    folder = tmp_path / "hub"
    geometry = {**GEOMETRY, "vocab_size": 384}  # a padded vocabulary, as Megatron's
    state = random_megatron_state(PATTERN, geometry, seed=6, dtype=torch.bfloat16)
    save_megatron_checkpoint(
        folder,
        state,
        megatron_args(PATTERN, geometry, hybrid_override_pattern=PATTERN, mamba_num_groups=2, mamba_state_dim=8),
    )
    (folder / "nvidia_tokenizer_256k.model").write_bytes(model.getvalue())
    result = convert("megatron", folder, tmp_path / "out", progress=False)
    assert result["tokenizer"] == folder / "nvidia_tokenizer_256k.model"
    sp = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    for sample in ("Mamba reads 42 tokens.\n\n  indented", "状態 ✓ ünïcödé 🙂", " leading space"):
        assert tokenizer(sample).input_ids == sp.encode_as_ids(sample)
        assert tokenizer.decode(sp.encode_as_ids(sample)) == sp.decode_ids(sp.encode_as_ids(sample))
    config = SambaForCausalLM.config_class.from_pretrained(tmp_path / "out")
    assert config.eos_token_id == sp.eos_id() == tokenizer.eos_token_id
    assert GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == sp.eos_id()


def test_a_config_is_refused_and_the_origin_of_the_layout_is_said(release, tmp_path, capsys):
    folder, _ = release
    one_line_error(
        capsys,
        ["convert", "megatron", str(folder), str(tmp_path / "out"), "--config", "Samba_421M"],
        "--config does not apply to megatron",
    )
    assert not (tmp_path / "out").exists()
    assert main(["convert", "megatron", str(folder), str(tmp_path / "out"), "--no-verify"]) == 0
    assert "config: from the checkpoint's blocks, shapes and args" in capsys.readouterr().err


def test_export_force_never_replaces_a_checkpoint_it_did_not_write(release, tmp_path, capsys):
    folder, _ = release
    convert("megatron", folder, tmp_path / "hf", progress=False)
    original = megatron.find_checkpoint(folder)
    before = original.read_bytes()
    one_line_error(
        capsys,
        ["export", "megatron", str(tmp_path / "hf"), str(original), "--force"],
        "not a checkpoint that samba-hf export wrote",
    )
    assert original.read_bytes() == before


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(mlp_hidden_act="silu"), "MLP activation is 'silu'"),
        (dict(hidden_act="gelu", mlp_hidden_act="gelu"), "Mamba activation is 'gelu'"),
        (dict(rms_norm_eps=1e-6), "rms_norm_eps is 1e-06"),
    ],
)
def test_export_refuses_what_megatron_would_compute_differently(tmp_path, capsys, change, fragment):
    from test_mamba2 import tiny_mamba2

    tiny_mamba2("megatron", **change).save_pretrained(tmp_path / "hf")
    one_line_error(capsys, ["export", "megatron", str(tmp_path / "hf"), str(tmp_path / "m.pt")], fragment)
    assert not (tmp_path / "m.pt").exists()


def test_a_torch_dist_checkpoint_is_named(tmp_path, capsys):
    (tmp_path / "ckpt" / "iter_0001000").mkdir(parents=True)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1000")
    (tmp_path / "ckpt" / "iter_0001000" / ".metadata").write_bytes(b"")
    (tmp_path / "ckpt" / "iter_0001000" / "__0_0.distcp").write_bytes(b"")
    one_line_error(
        capsys,
        ["convert", "megatron", str(tmp_path / "ckpt"), str(tmp_path / "out")],
        "torch_dist",
        "legacy torch format",
    )


def test_damaged_args_are_one_error(tmp_path, capsys):
    state = random_megatron_state(PATTERN, GEOMETRY, seed=7)
    save_megatron_checkpoint(
        tmp_path / "src", state, release_args(hybrid_override_pattern=None, hybrid_attention_ratio="lots")
    )
    one_line_error(
        capsys,
        ["convert", "megatron", str(tmp_path / "src"), str(tmp_path / "out")],
        "args.hybrid_attention_ratio is 'lots'",
    )


@pytest.mark.parametrize("flags", [[], ["--no-verify"]])
def test_untied_args_without_the_output_layer_are_refused(tmp_path, capsys, flags):
    """A file without output_layer.weight is a tied model only when its args do not say otherwise."""
    src = damaged(tmp_path, lambda state: state.pop("output_layer.weight"))  # args: untie_embeddings_... True
    one_line_error(
        capsys,
        ["convert", "megatron", str(src), str(tmp_path / "out"), *flags],
        "no output_layer.weight",
        "untie_embeddings_and_output_weights=True",
        "Nothing was written",
    )
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_tied_args_give_a_tied_model_and_refuse_an_output_layer(tmp_path, capsys):
    state = random_megatron_state(PATTERN, GEOMETRY, seed=8)
    save_megatron_checkpoint(tmp_path / "with", state, release_args(untie_embeddings_and_output_weights=False))
    one_line_error(
        capsys,
        ["convert", "megatron", str(tmp_path / "with"), str(tmp_path / "out"), "--no-verify"],
        "unexpected (1): output_layer.weight",
    )
    state.pop("output_layer.weight")
    save_megatron_checkpoint(tmp_path / "tied", state, release_args(untie_embeddings_and_output_weights=False))
    result = convert("megatron", tmp_path / "tied", tmp_path / "out", verify_parity=False, progress=False)
    assert result["config"].tie_word_embeddings


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool])
def test_non_float_weights_are_refused_by_name_without_verify(tmp_path, capsys, dtype):
    """--no-verify (the default above 1B parameters) checks every tensor's dtype as it streams."""

    def quantize(state):
        state["decoder.layers.0.mixer.in_proj.weight"] = (state["decoder.layers.0.mixer.in_proj.weight"] * 10).to(
            dtype
        )

    src = damaged(tmp_path, quantize)
    one_line_error(
        capsys,
        ["convert", "megatron", str(src), str(tmp_path / "out"), "--no-verify"],
        "model.layers.0.mamba.in_proj.weight",
        str(dtype).removeprefix("torch."),
        "not a floating-point type",
        "Nothing was written",
    )
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_all_int8_weights_are_refused(tmp_path, capsys):
    src = damaged(tmp_path, lambda state: state.update({k: (v * 10).to(torch.int8) for k, v in state.items()}))
    one_line_error(
        capsys,
        ["convert", "megatron", str(src), str(tmp_path / "out"), "--no-verify"],
        "model.embed_tokens.weight is int8",
    )
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_export_to_a_tracker_that_is_a_folder_writes_nothing(release, tmp_path, capsys):
    folder, _ = release
    convert("megatron", folder, tmp_path / "hf", progress=False)
    (tmp_path / "m" / "latest_checkpointed_iteration.txt").mkdir(parents=True)
    out = tmp_path / "m" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    one_line_error(
        capsys,
        ["export", "megatron", str(tmp_path / "hf"), str(out)],
        "latest_checkpointed_iteration.txt is not a file",
        "export elsewhere",
    )
    assert not (tmp_path / "m" / "release").exists()
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["latest_checkpointed_iteration.txt"]
