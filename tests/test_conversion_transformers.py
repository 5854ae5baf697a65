"""Conversion of transformers' Mamba / Mistral / Llama folders, the tokenizer that goes with a conversion, and the
`samba-hf convert` / `samba-hf export` command lines.

Each source model is a tiny transformers model with seeded random weights, saved with `save_pretrained`; the
converted folder must give transformers' own logits. Nothing is downloaded (the Hub calls of --push-to-hub are
replaced by recorders).
"""

import importlib
import json
import random
import shlex

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from samba_hf import SambaForCausalLM
from samba_hf.conversion import ConversionError, convert, lit_gpt
from samba_hf_cli import main

VOCAB = 100


# ---------------------------------------------------------------- tiny transformers sources


@torch.no_grad()
def perturb(model, seed):
    """Move every weight off its initial value (norms to 0.5..1.5, A_log and D off their constants) so that a
    swapped, dropped or re-initialised tensor changes the logits."""
    g = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.rand(param.shape, generator=g)
        if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith("layernorm.weight"):
            param.copy_(0.5 + noise)
        elif name.endswith("A_log") or name.endswith(".D"):
            param.add_(0.5 * noise - 0.25)
        else:
            param.add_(0.02 * (noise - 0.5))
    return model.eval()


def save_mamba(folder, layers=3, seed=0):
    torch.manual_seed(seed)
    # larger weights and time steps than the defaults, so that every tensor (A_log and dt_proj included) moves
    # the logits well past the tolerance
    config = MambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=layers,
        state_size=8,
        initializer_range=0.2,
        time_step_min=0.05,
        time_step_max=0.5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = perturb(MambaForCausalLM(config), seed)
    model.save_pretrained(folder)
    return model


def attention_config(config_class, **overrides):
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.1,
    )  # q and k large enough that attention is far from uniform
    fields.update(overrides)
    return config_class(**fields)


def save_attention_model(folder, model_class, config, seed=0):
    torch.manual_seed(seed)
    model = perturb(model_class(config), seed)
    model.save_pretrained(folder)
    return model


def random_ids(batch=2, length=20, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits_of(model, ids):
    return model(ids).logits.double()


def assert_same_logits(source_model, out, ids, atol=1e-4):
    expected = logits_of(source_model, ids)
    converted = SambaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = logits_of(converted, ids)
    assert expected.abs().max() > 0.1, "degenerate source logits"
    difference = (ours - expected).abs().max().item()
    assert difference <= atol, f"max |logit difference| {difference:.3g}"
    return converted, expected


def convert_quietly(source, src, out, **options):
    return convert(source, src, out, verify_parity=options.pop("verify_parity", False), progress=False, **options)


# ---------------------------------------------------------------- logits of transformers' own classes


def test_mamba_matches_transformers(tmp_path):
    source = save_mamba(tmp_path / "mamba")
    result = convert_quietly("mamba", tmp_path / "mamba", tmp_path / "out")
    config = result["config"]
    assert config.layer_types == ["linear_attention"] * 3
    assert config.intermediate_size == 0
    assert (config.mamba_d_state, config.mamba_dt_rank, config.tie_word_embeddings) == (8, 2, True)
    converted, _ = assert_same_logits(source, tmp_path / "out", random_ids())
    assert converted.config.layer_types == ["linear_attention"] * 3 and converted.config.intermediate_size == 0


def test_mistral_with_a_sliding_window_matches_transformers(tmp_path):
    source = save_attention_model(
        tmp_path / "mistral", MistralForCausalLM, attention_config(MistralConfig, sliding_window=4)
    )
    result = convert_quietly("mistral", tmp_path / "mistral", tmp_path / "out")
    assert result["config"].layer_types == ["sliding_attention"] * 2
    assert result["config"].sliding_window == 4
    assert result["config"].num_key_value_heads == 2
    ids = random_ids(length=16)
    _, expected = assert_same_logits(source, tmp_path / "out", ids)
    # the window matters on these 16 tokens: the same weights attending to everything give other logits
    source.config.sliding_window = None
    full = MistralForCausalLM(source.config)
    full.load_state_dict(source.state_dict())
    assert (logits_of(full.eval(), ids) - expected)[:, 4:].abs().max() > 1e-3


def test_mistral_without_a_window_is_full_attention(tmp_path):
    source = save_attention_model(
        tmp_path / "mistral", MistralForCausalLM, attention_config(MistralConfig, sliding_window=None)
    )
    result = convert_quietly("mistral", tmp_path / "mistral", tmp_path / "out")
    assert result["config"].layer_types == ["full_attention"] * 2
    assert result["config"].sliding_window is None
    assert_same_logits(source, tmp_path / "out", random_ids(length=16))


@pytest.mark.parametrize(
    "options",
    [
        dict(tie_word_embeddings=True),
        dict(tie_word_embeddings=False),
        dict(tie_word_embeddings=False, head_dim=16, attention_bias=True),  # head_dim != hidden / heads, q/k/v biases
    ],
)
def test_llama_with_gqa_matches_transformers(tmp_path, options):
    tied = options["tie_word_embeddings"]
    source = save_attention_model(tmp_path / "llama", LlamaForCausalLM, attention_config(LlamaConfig, **options))
    result = convert_quietly("llama", tmp_path / "llama", tmp_path / "out")
    config = result["config"]
    assert config.layer_types == ["full_attention"] * 2
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.head_dim == options.get("head_dim", 8)
    assert config.tie_word_embeddings is tied
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied
    converted, _ = assert_same_logits(source, tmp_path / "out", random_ids())
    head, embedding = converted.lm_head.weight, converted.model.embed_tokens.weight
    assert torch.equal(head, embedding) is tied


def test_llama_with_an_mlp_bias_is_refused(tmp_path):
    save_attention_model(tmp_path / "llama", LlamaForCausalLM, attention_config(LlamaConfig, mlp_bias=True))
    with pytest.raises(ConversionError, match="mlp_bias=True"):
        convert_quietly("llama", tmp_path / "llama", tmp_path / "out")
    assert_nothing_written(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("layout", ["rope_parameters", "legacy rope_scaling"])
def test_llama_with_linear_rope_scaling_matches_transformers(tmp_path, layout):
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    config = attention_config(LlamaConfig, rope_parameters=rope)
    source = save_attention_model(tmp_path / "llama", LlamaForCausalLM, config)
    if layout == "legacy rope_scaling":  # a config.json of transformers 4 (< 4.45 spelled the type "type")
        fields = json.loads((tmp_path / "llama" / "config.json").read_text())
        del fields["rope_parameters"]
        fields.update(rope_theta=500.0, rope_scaling={"type": "linear", "factor": 2.0})
        (tmp_path / "llama" / "config.json").write_text(json.dumps(fields))
    result = convert_quietly("llama", tmp_path / "llama", tmp_path / "out")
    parameters = result["config"].rope_parameters
    assert (parameters["rope_type"], parameters["factor"], parameters["rope_theta"]) == ("linear", 2.0, 500.0)
    ids = random_ids()
    _, expected = assert_same_logits(source, tmp_path / "out", ids)
    # the scaling is not a no-op on these positions
    default = {"rope_type": "default", "rope_theta": 500.0}
    unscaled = LlamaForCausalLM(attention_config(LlamaConfig, rope_parameters=default))
    unscaled.load_state_dict(source.state_dict())
    assert (logits_of(unscaled.eval(), ids) - expected).abs().max() > 1e-3


# ---------------------------------------------------------------- --verify, model card, errors, dtype, Hub


def test_verify_reports_parity_in_the_result_and_the_model_card(tmp_path):
    save_attention_model(tmp_path / "mistral", MistralForCausalLM, attention_config(MistralConfig, sliding_window=4))
    result = convert_quietly("mistral", tmp_path / "mistral", tmp_path / "out", verify_parity=True)
    parity = result["parity"]
    assert isinstance(parity, str) and "max |logit difference|" in parity
    assert float(parity.split("max |logit difference| ")[1].split()[0]) <= 1e-4
    card = (tmp_path / "out" / "README.md").read_text()
    assert parity in card
    assert "converted from mistral" in card and str(tmp_path / "mistral") in card
    unverified = convert_quietly("mistral", tmp_path / "mistral", tmp_path / "out2")
    assert unverified["parity"] is None
    assert "not verified" in (tmp_path / "out2" / "README.md").read_text()


def assert_nothing_written(parent, out):
    assert not out.exists()
    assert not [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_a_failed_verification_writes_nothing(tmp_path, monkeypatch):
    verify = importlib.import_module("samba_hf.conversion.verify")  # the module (the package exports a function)
    real = verify.reference_logits
    monkeypatch.setattr(verify, "reference_logits", lambda *args: real(*args) + 0.01)  # a reference that disagrees
    save_attention_model(tmp_path / "llama", LlamaForCausalLM, attention_config(LlamaConfig))
    with pytest.raises(ConversionError, match=r"verification failed: max \|logit difference\| 0\.01 "):
        convert_quietly("llama", tmp_path / "llama", tmp_path / "out", verify_parity=True)
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_llama_folder_passed_as_mamba(tmp_path):
    save_attention_model(tmp_path / "llama", LlamaForCausalLM, attention_config(LlamaConfig))
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=r"model_type 'llama', not 'mamba'") as error:
        convert_quietly("mamba", tmp_path / "llama", out)
    assert "wrong source format" in str(error.value)
    assert_nothing_written(tmp_path, out)


def test_bfloat16_output_keeps_a_log_and_d_in_float32(tmp_path):
    source = save_mamba(tmp_path / "mamba", layers=2)
    convert_quietly("mamba", tmp_path / "mamba", tmp_path / "out", dtype="bfloat16")
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        dtypes = {name: f.get_tensor(name).dtype for name in f.keys()}
        a_log = f.get_tensor("model.layers.1.mamba.A_log")
    for i in range(2):
        assert dtypes[f"model.layers.{i}.mamba.A_log"] == torch.float32
        assert dtypes[f"model.layers.{i}.mamba.D"] == torch.float32
        assert dtypes[f"model.layers.{i}.mamba.in_proj.weight"] == torch.bfloat16
    assert dtypes["model.embed_tokens.weight"] == torch.bfloat16
    expected_a_log = source.backbone.layers[1].mixer.A_log
    assert torch.equal(a_log, expected_a_log)  # not rounded through bfloat16
    assert not torch.equal(expected_a_log.bfloat16().float(), expected_a_log)
    model = SambaForCausalLM.from_pretrained(tmp_path / "out")
    mamba = model.model.layers[1].mamba
    assert mamba.A_log.dtype == torch.float32 and mamba.D.dtype == torch.float32
    assert mamba.in_proj.weight.dtype == torch.bfloat16
    assert torch.equal(mamba.A_log, expected_a_log)


def test_push_to_hub_uploads_the_written_folder(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(
        huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create_repo", repo_id, kw))
    )
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **kw: calls.append(("upload_folder", kw)))
    save_mamba(tmp_path / "mamba", layers=1)
    out = tmp_path / "out"
    convert_quietly("mamba", tmp_path / "mamba", out, push_to_hub="me/samba-test")
    assert [c[0] for c in calls] == ["create_repo", "upload_folder"]
    assert calls[0][1] == "me/samba-test"
    upload = calls[1][1]
    assert upload["repo_id"] == "me/samba-test"
    assert str(upload["folder_path"]) == str(out)
    assert (out / "model.safetensors").is_file()


# ---------------------------------------------------------------- tokenizers


WORDS = (
    "the model reads tokens and writes the next one while a small state carries what came before "
    "sliding window attention looks back over recent positions only mamba layers scan the whole sequence "
    "samba mixes both kinds of layer so long prompts cost little memory"
).split()


@pytest.fixture
def sentencepiece_model(tmp_path):
    """A tiny SentencePiece BPE model with byte fallback (unk 0, bos 1, eos 2, no pad), trained here."""
    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")  # transformers reads a tokenizer.model through protobuf
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))).capitalize() + "." for _ in range(400)]
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(lines) + "\nHello, world! Samba 123.\n")
    prefix = tmp_path / "spm"
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=320,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
        num_threads=1,
    )
    return prefix.with_suffix(".model")


def tokenizer_folder(model_file, folder, add_bos):
    from transformers import LlamaTokenizer

    files = folder / "_spm"
    files.mkdir(parents=True)
    (files / "tokenizer.model").write_bytes(model_file.read_bytes())
    tokenizer = LlamaTokenizer.from_pretrained(files, add_bos_token=add_bos, add_eos_token=False)
    assert (tokenizer("hello").input_ids[0] == tokenizer.bos_token_id) is add_bos
    tokenizer.save_pretrained(folder)
    return tokenizer


def tiny_lit_gpt_config(vocab_size):
    return lit_gpt.config_from_name(
        "Samba_421M", n_layer=2, n_embd=64, n_head=4, intermediate_size=64, vocab_size=vocab_size, local_window=8
    )


def save_lit_gpt(path, config, seed=0):
    """A training checkpoint {"model": state_dict} in the official layout, random weights."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in lit_gpt.official_shapes(config).items():
        if name.endswith("A_log"):
            tensor = torch.log(torch.arange(1, shape[1] + 1, dtype=torch.float32)).expand(shape).clone()
        elif "norm" in name or name.endswith("ln_f.weight") or name.endswith(".D"):
            tensor = 0.5 + torch.rand(shape, generator=g)
        else:
            tensor = 0.1 * torch.randn(shape, generator=g)
        state[name] = tensor
    state["lm_head.weight"] = state["transformer.wte.weight"]
    torch.save({"model": state, "iter_num": 100}, path)
    return state


def test_lit_gpt_conversion_saves_a_tokenizer_without_bos(tmp_path, sentencepiece_model):
    source_tokenizer = tokenizer_folder(sentencepiece_model, tmp_path / "tok", add_bos=True)
    config = tiny_lit_gpt_config(len(source_tokenizer))
    assert config.vocab_size >= len(source_tokenizer)
    save_lit_gpt(tmp_path / "ckpt.pth", config)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    convert_quietly(
        "lit-gpt", tmp_path / "ckpt.pth", tmp_path / "out", config=tmp_path / "config.json", tokenizer=tmp_path / "tok"
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tokenizer("hello world").input_ids
    assert tokenizer.bos_token_id == 1
    assert ids and ids[0] != tokenizer.bos_token_id
    assert ids == source_tokenizer("hello world").input_ids[1:]  # the same pieces, less the BOS

    # the bare SentencePiece file gives the same tokenizer
    convert_quietly("lit-gpt", tmp_path / "ckpt.pth", tmp_path / "out2", config=config, tokenizer=sentencepiece_model)
    assert AutoTokenizer.from_pretrained(tmp_path / "out2")("hello world").input_ids == ids


def test_llama_conversion_keeps_the_tokenizers_bos(tmp_path, sentencepiece_model):
    source_tokenizer = tokenizer_folder(sentencepiece_model, tmp_path / "llama", add_bos=True)
    save_attention_model(
        tmp_path / "llama", LlamaForCausalLM, attention_config(LlamaConfig, vocab_size=len(source_tokenizer))
    )
    convert_quietly("llama", tmp_path / "llama", tmp_path / "out", tokenizer=tmp_path / "llama")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tokenizer("hello world").input_ids
    assert ids[0] == tokenizer.bos_token_id == 1
    assert ids == source_tokenizer("hello world").input_ids


def test_a_tokenizer_larger_than_the_vocabulary(tmp_path, sentencepiece_model):
    config = tiny_lit_gpt_config(256)
    save_lit_gpt(tmp_path / "ckpt.pth", config)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=r"the tokenizer has 320 tokens but the model's vocabulary is 256"):
        convert_quietly("lit-gpt", tmp_path / "ckpt.pth", out, config=config, tokenizer=sentencepiece_model)
    assert_nothing_written(tmp_path, out)


# ---------------------------------------------------------------- the command line


def test_cli_convert_with_verify(tmp_path, capsys):
    source = save_attention_model(
        tmp_path / "mistral", MistralForCausalLM, attention_config(MistralConfig, sliding_window=4)
    )
    out = tmp_path / "out"
    assert main(["convert", "mistral", str(tmp_path / "mistral"), str(out), "--verify"]) == 0
    err = capsys.readouterr().err
    assert f"samba-hf: wrote {out}" in err
    assert "samba-hf: parity: max |logit difference|" in err
    assert_same_logits(source, out, random_ids(length=16))


def test_cli_model_card_records_the_command_given(tmp_path):
    save_mamba(tmp_path / "mamba", layers=1)
    out = tmp_path / "out"
    argv = ["convert", "mamba", str(tmp_path / "mamba"), str(out), "--no-verify", "--dtype", "float32"]
    assert main(argv) == 0
    assert f"- Command: `{shlex.join(['samba-hf', *argv])}`" in (out / "README.md").read_text()


def test_cli_lit_gpt_needs_a_config(tmp_path, capsys):
    save_lit_gpt(tmp_path / "ckpt.pth", tiny_lit_gpt_config(256))
    out = tmp_path / "out"
    assert main(["convert", "lit-gpt", str(tmp_path / "ckpt.pth"), str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("samba-hf: error:")]
    assert len(errors) == 1 and "--config" in errors[0]
    assert "Traceback" not in "\n".join(err)
    assert_nothing_written(tmp_path, out)


def test_cli_non_empty_out_needs_force(tmp_path, capsys):
    save_mamba(tmp_path / "mamba", layers=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    argv = ["convert", "mamba", str(tmp_path / "mamba"), str(out), "--no-verify"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("samba-hf: error:") and "--force" in err[-1]
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"

    assert main(argv + ["--force"]) == 1  # --force replaces an earlier output of ours only
    assert "holds files samba-hf does not write (keep.txt)" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"

    (out / "keep.txt").unlink()
    assert main(argv) == 0
    assert main(argv) == 1 and "--force" in capsys.readouterr().err
    assert main(argv + ["--force"]) == 0
    assert (out / "model.safetensors").is_file()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cli_export_of_a_lit_gpt_conversion(tmp_path, capsys):
    config = tiny_lit_gpt_config(256)
    state = save_lit_gpt(tmp_path / "ckpt.pth", config)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    folder, file = tmp_path / "hf", tmp_path / "export" / "samba.pth"
    assert (
        main(
            [
                "convert",
                "lit-gpt",
                str(tmp_path / "ckpt.pth"),
                str(folder),
                "--config",
                str(tmp_path / "config.json"),
                "--no-verify",
            ]
        )
        == 0
    )
    assert main(["export", "lit-gpt", str(folder), str(file)]) == 0
    assert f"samba-hf: wrote {file}" in capsys.readouterr().err
    exported = torch.load(file, weights_only=True)
    assert list(exported) == ["model", "samba_hf_export"]  # the state dict, and the mark that --force looks for
    model = exported["model"]
    assert all(name.startswith("transformer.") or name == "lm_head.weight" for name in model)
    assert any(name.startswith("transformer.") for name in model)
    assert set(model) == set(state)
    for name, tensor in state.items():
        assert torch.equal(model[name], tensor), name
    assert main(["export", "lit-gpt", str(folder), str(file)]) == 1  # exists: needs --force
    assert "--force" in capsys.readouterr().err
