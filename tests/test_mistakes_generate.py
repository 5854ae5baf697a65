"""`samba-hf generate` with mistaken inputs: one `samba-hf: error:` line, exit status 1, nothing on stdout, and never a
model run with weights that did not come from its files."""

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from samba_hf.cli import default_model_path
from samba_hf_cli import main


def refused(capsys, argv, *fragments):
    assert main(argv) == 1
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert err and err[-1].startswith("samba-hf: error: "), err
    assert len([line for line in err if line.startswith("samba-hf: error:")]) == 1 and "Traceback" not in captured.err
    assert captured.out == "", "nothing is printed before the error"
    for fragment in fragments:
        assert fragment in err[-1], err[-1]
    return err[-1]


@pytest.fixture
def folder(tmp_path):
    """A copy of the embedded default model, to damage."""
    copy = tmp_path / "model"
    shutil.copytree(default_model_path(), copy)
    return copy


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def edit_weights(folder, change):
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def generate(folder, *extra):
    return ["generate", "The assert statement", "--model", str(folder), "--max-new-tokens", "2", *extra]


def test_the_copy_runs(capsys, folder):
    assert main(generate(folder)) == 0


# ---------------------------------------------------------------- weights that are not what config.json says


def test_nan_weights(capsys, folder):
    edit_weights(folder, lambda t: t["model.layers.2.mamba.out_proj.weight"].view(-1)[7:9].fill_(float("nan")))
    refused(capsys, generate(folder), "model.layers.2.mamba.out_proj.weight", "NaN or inf")


def test_a_missing_tensor_is_not_initialised_at_random(capsys, folder):
    edit_weights(folder, lambda t: t.pop("model.layers.1.self_attn.q_proj.weight"))
    refused(capsys, generate(folder), "missing (1): model.layers.1.self_attn.q_proj.weight")


def test_weights_of_another_shape_name_the_tensor_and_both_shapes(capsys, folder):
    edit_config(folder, intermediate_size=512)
    refused(
        capsys,
        generate(folder),
        "do not match its config.json",
        "model.layers.0.mlp.gate_proj.weight: checkpoint [640, 256], config expects [512, 256]",
    )


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "empty", "gone"])
def test_unreadable_weights(capsys, folder, damage):
    file = folder / "model.safetensors"
    data = file.read_bytes()
    if damage == "gone":
        file.unlink()
    else:
        file.write_bytes({"truncated": data[: len(data) // 2], "corrupt": b"\x07" * 64, "empty": b""}[damage])
    refused(capsys, generate(folder), "model.safetensors" if damage != "gone" else "holds no *.safetensors")


# ---------------------------------------------------------------- config.json


@pytest.mark.parametrize(
    "content, fragment",
    [
        ('{"model_type": "samba",', "cannot read"),
        ("[1, 2, 3]", "not an object"),
        ("", "cannot read"),
    ],
)
def test_config_json_that_is_not_a_json_object(capsys, folder, content, fragment):
    (folder / "config.json").write_text(content)
    refused(capsys, generate(folder), "config.json", fragment)


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"hidden_size": -256}, "`hidden_size`"),
        ({"num_hidden_layers": "6"}, "`num_hidden_layers`"),
        ({"layer_types": ["linear_attention"] * 5}, "`layer_types` has 5 entries"),
        ({"hidden_act": "swishy"}, "`hidden_act`"),
        ({"rms_norm_eps": -1e-5}, "`rms_norm_eps`"),
        ({"vocab_size": 0}, "`vocab_size`"),
    ],
)
def test_config_json_with_invalid_values(capsys, folder, changes, fragment):
    edit_config(folder, **changes)
    refused(capsys, generate(folder), "config.json", fragment)


@pytest.mark.parametrize(
    "content, fragment",
    [
        ('{"max_new_tokens": 5,', "is not a valid JSON file"),
        ("[1, 2]", "'list' object is not a mapping"),
        ('{"max_new_tokens": -5}', "`max_new_tokens` must be greater than 0"),
    ],
)
def test_a_generation_config_json_that_cannot_be_read_is_not_dropped(capsys, folder, content, fragment):
    # transformers' from_pretrained drops it without a word and decodes with other settings
    (folder / "generation_config.json").write_text(content)
    refused(
        capsys,
        generate(folder),
        "generation_config.json' cannot be read",
        fragment,
        "remove it to decode with the settings of config.json",
    )
    refused(capsys, ["eval", "passkey", "--model", str(folder), "--lengths", "200"], fragment)


def test_another_model_type(capsys, folder):
    edit_config(folder, model_type="llama")
    refused(capsys, generate(folder), "'llama' model, not a Samba model", "samba-hf convert")


# ---------------------------------------------------------------- the tokenizer


def test_a_folder_without_tokenizer_files_says_which_and_how(capsys, folder, tmp_path):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.move(folder / name, tokenizer / name)
    refused(capsys, generate(folder), "no tokenizer vocabulary", "tokenizer.json", "--tokenizer")
    assert main(generate(folder, "--tokenizer", str(tokenizer))) == 0


def test_a_tokenizer_larger_than_the_vocabulary(capsys, folder):
    edit_config(folder, vocab_size=1000)
    edit_weights(folder, lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"][:1000]}))
    refused(capsys, generate(folder), "the tokenizer has 4096 tokens but the model's vocabulary has 1000")


# ---------------------------------------------------------------- arguments, checked before anything is loaded


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--do-sample", "--temperature", "0"], "--temperature must be a finite number above 0"),
        (["--do-sample", "--temperature", "-1"], "--temperature must be"),
        (["--do-sample", "--temperature", "nan"], "--temperature must be"),
        (["--do-sample", "--temperature", "inf"], "--temperature must be"),
        (["--do-sample", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--do-sample", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--do-sample", "--top-p", "nan"], "--top-p must be in (0, 1]"),
        (["--do-sample", "--top-k", "-1"], "--top-k must be 0 (no limit) or more"),
        (["--do-sample", "--seed", str(2**64)], "--seed must be between 0 and 2**64 - 1"),
        (["--do-sample", "--seed", "-3"], "--seed must be between"),
        (["--temperature", "0.7"], "--temperature only applies when sampling: add --do-sample"),
        (["--top-k", "5", "--seed", "1"], "--top-k, --seed only apply when sampling"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--prefill-chunk-size", "0"], "--prefill-chunk-size must be at least 1"),
        (["--model", ""], "--model is empty"),
        (["--model", "  "], "--model is empty"),
        (["--tokenizer", ""], "--tokenizer is empty"),
    ],
)
def test_flags_transformers_would_reject_or_ignore(capsys, flags, fragment):
    refused(capsys, ["generate", "The assert statement", *flags], fragment)


def test_a_file_given_as_the_model(capsys, folder):
    refused(capsys, generate(folder / "config.json"), "is a file; --model takes a model folder")


def test_a_prompt_that_is_not_utf8():
    result = subprocess.run(
        [sys.executable, "-m", "samba_hf_cli", "generate", b"caf\xe9 \xff"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip() == (
        "samba-hf: error: the prompt is not valid UTF-8 text (byte 0xe9 at character 3); pass UTF-8 text"
    )


def test_help_and_argument_errors_load_neither_torch_nor_transformers():
    code = (
        "import sys\nfrom samba_hf_cli import main\n"
        "for argv in (['--help'], ['generate', '--help'], ['convert', 'nope'], ['generate', 'x', '--top-p', '2']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stderr


@pytest.mark.parametrize(
    "argv, fragment",
    [
        ([], "the following arguments are required: command"),
        (["generate"], "the following arguments are required: prompt"),
        (["generate", "x", "--max-new-tokens", "many"], "invalid int value: 'many'"),
        (["generate", "x", "--dtype", "float8"], "invalid choice: 'float8'"),
        (["convert", "safetensors", "a", "b"], "invalid choice: 'safetensors'"),
        (["export", "lit-gpt", "a"], "the following arguments are required: out"),
    ],
)
def test_argument_errors_are_one_line_too(capsys, argv, fragment):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("samba-hf: error: ") and fragment in err[0], err


# ---------------------------------------------------------------- speculative decoding


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--prompt-lookup", "0"], ["--prompt-lookup", "at least 1, got 0"]),
        (["--prompt-lookup", "-3"], ["at least 1, got -3"]),
        (["--prompt-lookup", "1000000000"], ["--prompt-lookup takes at most 64 drafted tokens, got 1000000000"]),
        (["--prompt-lookup", "3", "--assistant", "x"], ["give one of them"]),
        (["--prompt-lookup", "3", "--compile"], ["--prompt-lookup verifies drafts on the dynamic cache"]),
        (["--assistant", " "], ["--assistant is empty"]),
    ],
)
def test_speculative_flags_that_cannot_work(capsys, argv, fragments):
    refused(capsys, ["generate", "The assert statement", *argv], *fragments)


def test_an_assistant_that_is_not_a_model_folder(capsys, folder, tmp_path):
    refused(capsys, generate(folder, "--assistant", str(tmp_path / "missing")), "--assistant: no such model folder")
    (tmp_path / "empty").mkdir()
    refused(capsys, generate(folder, "--assistant", str(tmp_path / "empty")), "--assistant:")


def test_an_assistant_with_another_tokenizer(capsys, folder):
    refused(capsys, generate(folder, "--assistant", default_model_path("passkey")), "has another tokenizer")


def small_assistant(folder, kind: str = "samba", tokenizer: bool = True, **config):
    """A tiny assistant saved to `folder` (random weights), with the embedded default's tokenizer unless told."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    import samba_hf

    torch.manual_seed(0)
    vocab = config.pop("vocab_size", 4096)  # (the embedded default's)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=32, n_layer=1, n_head=2, **config))
    else:
        model = samba_hf.SambaForCausalLM(samba_hf.SambaConfig.from_preset("tiny", vocab_size=vocab, **config))
    model.save_pretrained(folder)
    if tokenizer:
        AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(folder)
    return folder


def test_an_assistant_with_fewer_positions_than_the_text_needs(capsys, tmp_path):
    """A GPT-2 of 16 positions: refused before generating (transformers would fail inside with an IndexError)."""
    assistant = small_assistant(tmp_path / "gpt2", kind="gpt2", n_positions=16)
    argv = ["generate", "The assert statement", "--max-new-tokens", "20", "--assistant", str(assistant)]
    refused(capsys, argv, "takes at most 16 positions", "the prompt has 3 tokens with 20 more asked for")


def test_an_assistant_with_the_same_tokenizer_and_another_vocabulary_size(capsys, tmp_path):
    assistant = small_assistant(tmp_path / "wide", vocab_size=4160)
    argv = ["generate", "The assert statement", "--max-new-tokens", "2", "--assistant", str(assistant)]
    refused(capsys, argv, "has a vocabulary of 4160 entries and the model 4096")


def test_an_assistant_without_a_tokenizer_drafts_with_the_models_and_says_nothing_of_transformers_call(
    capfd, tmp_path
):
    """An assistant folder without tokenizer files reads the main model's; the tokens are plain greedy's; and
    transformers' deprecation line about its own call of the assistant's generate is not printed."""
    import logging

    import transformers.utils.logging

    assistant = small_assistant(tmp_path / "bare", tokenizer=False)
    argv = ["generate", "The assert statement", "--max-new-tokens", "12", "--dtype", "float32"]
    assert main(argv) == 0
    plain = capfd.readouterr().out
    transformers.utils.logging.warning_once.cache_clear()  # (a warning said once per process could be said already)
    said = []  # what transformers' loggers pass on (its own handler writes to the stderr of its import time)
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        assert main(argv + ["--assistant", str(assistant)]) == 0
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert capfd.readouterr().out == plain
    assert not [message for message in said if "generation_config" in message], said


def test_prompt_lookup_and_an_assistant_give_the_plain_greedy_text(capsys, folder):
    argv = [
        "generate",
        "The assert statement. The assert statement",
        "--model",
        str(folder),
        "--max-new-tokens",
        "24",
        "--dtype",
        "float32",
    ]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    for extra in (["--prompt-lookup", "4"], ["--assistant", str(folder)]):
        assert main(argv + extra) == 0
        assert capsys.readouterr().out == plain, extra


def torchao_int8_folder(folder):
    """The default model's folder as transformers saves it torchao-quantized (int8 weight-only): each linear
    layer's weight as `_weight_qdata` (int8), `_weight_scale` and `_weight_zero_point`, and the quantization_config
    in config.json. Made without torchao, whose absence is what is tested."""
    import torch

    def quantize(tensors):
        for name in [n for n in tensors if n.endswith("_proj.weight") and n.startswith("model.layers.")]:
            weight = tensors.pop(name)
            scale = weight.abs().amax(1, keepdim=True) / 127
            layer = name.removesuffix(".weight")
            tensors[f"{layer}._weight_qdata"] = (weight / scale).round().to(torch.int8)
            tensors[f"{layer}._weight_scale"] = scale
            tensors[f"{layer}._weight_zero_point"] = torch.zeros_like(scale, dtype=torch.int8)

    edit_weights(folder, quantize)
    edit_config(folder, quantization_config={"quant_method": "torchao", "quant_type": {"default": {}}})


def test_a_torchao_quantized_folder_without_torchao(capsys, folder):
    """Its weights match its config.json (the quantized names are read as the layers' weights); what is missing is
    torchao, and the line says so, where transformers raised an ImportError."""
    torchao_int8_folder(folder)
    refused(capsys, generate(folder), "are torchao-quantized", "torchao is not installed", "samba-hf[quantize]")


def test_a_torchao_quantized_folder_missing_a_layer_s_int8_values_is_refused_as_incomplete(capsys, folder):
    torchao_int8_folder(folder)
    edit_weights(folder, lambda t: t.pop("model.layers.0.mlp.up_proj._weight_qdata"))
    refused(capsys, generate(folder), "do not match its config.json", "missing (1): model.layers.0.mlp.up_proj.weight")
