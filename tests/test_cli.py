"""`samba-hf generate`: streams on the embedded default, and user mistakes give one line and a non-zero exit."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from samba_hf.cli import default_model_path
from samba_hf_cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "samba_hf_cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_on_the_embedded_default_streams_greedy_tokens():
    result = run_cli("generate", "Samba is", "--max-new-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert "embedded default model" in result.stderr and "trained" in result.stderr
    assert "12 new tokens" in result.stderr
    path = default_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    ids = tokenizer("Samba is", return_tensors="pt", add_special_tokens=False).input_ids
    expected = tokenizer.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :])
    assert result.stdout.rstrip("\n") == "Samba is" + expected


def test_compile_gives_the_eager_text_and_says_it_compiled():
    """--compile: a static cache and a compiled decode step (transformers' switches); the same greedy text, past the
    embedded model's 256-token window, and a rate measured after compiling."""
    args = ("generate", "The history of", "--max-new-tokens", "300", "--dtype", "float32")
    compiled, eager = run_cli(*args, "--compile"), run_cli(*args)
    assert compiled.returncode == 0 and eager.returncode == 0, compiled.stderr + eager.stderr
    assert compiled.stdout == eager.stdout and len(compiled.stdout) > 300
    assert "compiling the decoding step" in compiled.stderr and "--compile in" not in compiled.stderr
    assert re.search(
        r"tokens/s per step \(median\) after compiling, which took \d+ s, cpu, float32\)", compiled.stderr
    )


def test_compile_says_before_compiling_how_long_it_takes_and_in_bfloat16_that_the_text_can_differ(capsys):
    """Both said before anything compiles: a one-token run compiles nothing (its token comes from the uncompiled
    prefill), so this costs no compilation. The text difference in bfloat16 is measured in docs/cli.md."""
    from samba_hf.cli import compiler_missing

    if compiler_missing(torch.device("cpu")):
        pytest.skip("no C++ compiler for torch.compile here: --compile decodes without compiling")
    assert main(["generate", "The history of", "--max-new-tokens", "1", "--dtype", "bfloat16", "--compile"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"compiling the decoding step after the first token \(about .* minute", err), err
    assert "--compile in bfloat16: the static cache and the compiled step round" in err
    assert "--dtype float32 gives the same text" in err


def test_compile_without_a_cpp_compiler_decodes_eagerly_with_one_line(tmp_path):
    """inductor compiles C++ with $CXX (else g++): with CXX naming a missing program, inductor's own lookup finds no
    compiler before anything compiles, and --compile says so in one line and decodes eagerly (today's alternative: a
    95-line inductor traceback at the first decoding step)."""
    args = ("generate", "The history of", "--max-new-tokens", "8", "--dtype", "float32")
    result = subprocess.run(
        [sys.executable, "-m", "samba_hf_cli", *args, "--compile"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CXX": str(tmp_path / "no-such-g++")},
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    notes = [line for line in result.stderr.splitlines() if "--compile" in line]
    assert len(notes) == 1 and "no working C++ compiler" in notes[0] and "decoding without compiling" in notes[0], (
        notes
    )
    assert "8 new tokens" in result.stderr and "after compiling" not in result.stderr
    assert result.stdout == run_cli(*args).stdout


def test_sampling_with_a_seed_is_reproducible(capsys):
    outputs = []
    for seed in (1, 1, 2):
        assert (
            main(["generate", "abc", "--do-sample", "--seed", str(seed), "--max-new-tokens", "16", "--top-k", "0"])
            == 0
        )
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0] != outputs[2]


def one_line_error(capsys, argv, *fragments):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("samba-hf: error: "), err
    assert "Traceback" not in "\n".join(err)
    for fragment in fragments:
        assert fragment in err[-1], err[-1]


def test_every_help_shows_the_defaults(capsys):
    """`samba-hf --help` says what runs without --model; in each command's help every option has a text, and each
    default (other than off / not given) is shown."""
    import argparse

    from samba_hf_cli import build_parser

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "Without --model, generate and eval phonebook / perplexity run the embedded default model" in " ".join(
        capsys.readouterr().out.split()
    )
    seen = 0
    for parser in parsers(build_parser()):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{parser.prog} {action.option_strings[0]} has no help text"
            if action.default is not None and action.default is not False:
                assert f"default: {action.default})" in text or f"default {action.default}" in text, (
                    parser.prog,
                    action.option_strings[0],
                )
                seen += 1
    assert seen > 20
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert (
        "--max-new-tokens MAX_NEW_TOKENS the most tokens to generate after the prompt (fewer if the model ends its "
        "text) (default: 64)"
    ) in " ".join(capsys.readouterr().out.split())


def test_missing_folder(capsys, tmp_path):
    one_line_error(capsys, ["generate", "hi", "--model", str(tmp_path / "nope")], "no such model folder")


def test_folder_without_config(capsys, tmp_path):
    one_line_error(capsys, ["generate", "hi", "--model", str(tmp_path)], "not a model folder")


def test_folder_of_another_model_type(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    one_line_error(capsys, ["generate", "hi", "--model", str(tmp_path)], "'llama' model, not a Samba model")


def test_device_that_is_not_there(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    one_line_error(capsys, ["generate", "hi", "--device", "cuda"], "not available")
    one_line_error(capsys, ["generate", "hi", "--device", "warp-drive"], "unknown device")


def test_empty_prompt(capsys):
    one_line_error(capsys, ["generate", ""], "prompt is empty")


def test_prompt_too_long_for_full_attention_layers(capsys, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model = tiny_model(
        layer_types=["linear_attention", "full_attention"] * 2,
        max_position_embeddings=32,
        vocab_size=len(tokenizer),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    long_prompt = " ".join(["statement"] * 40)
    assert len(tokenizer(long_prompt).input_ids) > 32
    one_line_error(capsys, ["generate", long_prompt, "--model", str(tmp_path)], "at most 32 positions")
    assert main(["generate", "The statement", "--model", str(tmp_path), "--max-new-tokens", "4"]) == 0


def test_long_prompt_goes_through_chunked_prefill(capsys):
    prompt = " ".join(["The assert statement"] * 40)
    length = len(AutoTokenizer.from_pretrained(default_model_path())(prompt, add_special_tokens=False).input_ids)
    assert length > 64
    assert main(["generate", prompt, "--max-new-tokens", "4", "--prefill-chunk-size", "64"]) == 0
    assert f"{length}-token prompt" in capsys.readouterr().err


# --dtype auto: decided from what the machine is (its instruction set), never from a timing
@pytest.mark.parametrize(
    "machine, avx512_bf16, amx, features, expected",
    [
        ("x86_64", False, False, "", torch.float32),  # no native bf16: PyTorch would emulate it, 6-9x slower
        ("x86_64", True, False, "", torch.bfloat16),  # AVX512-BF16
        ("x86_64", False, True, "", torch.bfloat16),  # AMX
        ("aarch64", False, False, "fp asimd sve", torch.float32),
        ("aarch64", False, False, "fp asimd sve bf16", torch.bfloat16),  # Arm's BF16 extension
        ("riscv64", True, True, "", torch.float32),  # anything else: float32
    ],
)
def test_auto_dtype_follows_the_instruction_set(monkeypatch, tmp_path, machine, avx512_bf16, amx, features, expected):
    import builtins
    import platform

    import samba_hf.cli as cli

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nFeatures\t: {features}\n")
    real_open = builtins.open
    monkeypatch.setattr(
        builtins, "open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k)
    )
    monkeypatch.setattr(torch.nn.functional, "linear", None)  # nothing is timed: a product would fail here
    assert cli.resolve_dtype("auto", torch.device("cpu")) == expected
    assert cli.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_the_same_command_gives_the_same_text_and_says_which_dtype(tmp_path):
    """`samba-hf generate` with `--dtype auto` (the default), three times on this machine: one dtype, said on stderr
    with its reason, and the same text each time."""
    import subprocess
    import sys

    import samba_hf.cli as cli

    runs = [
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from samba_hf_cli import main; sys.exit(main())",
                "generate",
                "The history of",
                "--max-new-tokens",
                "40",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        for _ in range(3)
    ]
    assert runs[0].stdout.startswith("The history of") and len(runs[0].stdout) > len("The history of") + 20
    assert all(run.stdout == runs[0].stdout for run in runs)
    dtype, why = cli.auto_dtype(torch.device("cpu"))
    said = f"samba-hf: --dtype auto: {str(dtype).removeprefix('torch.')}, as {why}"
    assert all(said in run.stderr and f"cpu, {str(dtype).removeprefix('torch.')})" in run.stderr for run in runs)


def test_the_commands_module_does_not_import_the_entry_point_back():
    """samba_hf_cli (parsing, stdlib only) imports samba_hf.cli (the commands) once a command runs; never the
    reverse."""
    code = (
        "import sys, samba_hf.cli; assert 'samba_hf_cli' not in sys.modules, 'cycle'; import samba_hf_cli; print('ok')"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
