"""`samba-hf generate`: streams on the embedded default, and user mistakes give one line and a non-zero exit."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from samba_hf.cli import default_model_path, main

from conftest import tiny_model


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "samba_hf.cli", *args], capture_output=True, text=True, timeout=300)


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


def test_sampling_with_a_seed_is_reproducible(capsys):
    outputs = []
    for seed in (1, 1, 2):
        assert main(["generate", "abc", "--do-sample", "--seed", str(seed), "--max-new-tokens", "16", "--top-k", "0"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0] != outputs[2]


def one_line_error(capsys, argv, *fragments):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("samba-hf: error: "), err
    assert "Traceback" not in "\n".join(err)
    for fragment in fragments:
        assert fragment in err[-1], err[-1]


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
    model = tiny_model(layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=32,
                       vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=3)
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


# --dtype auto on CPU: bf16 only where the CPU multiplies it natively and the timing says it is faster
def _auto_dtype(monkeypatch, machine, native, bf16_seconds):
    import platform

    import samba_hf.cli as cli

    cli.cpu_bfloat16_is_faster.cache_clear()
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    real_linear = torch.nn.functional.linear
    clock = {"now": 0.0}

    def timed_linear(x, w):  # advances a fake clock: bf16 takes bf16_seconds, float32 one second
        clock["now"] += bf16_seconds if x.dtype == torch.bfloat16 else 1.0
        return real_linear(x, w)

    monkeypatch.setattr(torch.nn.functional, "linear", timed_linear)
    monkeypatch.setattr(cli.time, "perf_counter", lambda: clock["now"])
    try:
        return cli.resolve_dtype("auto", torch.device("cpu"))
    finally:
        cli.cpu_bfloat16_is_faster.cache_clear()


@pytest.mark.parametrize("machine, native, bf16_seconds, expected", [
    ("x86_64", False, 0.1, torch.float32),   # no AVX512-BF16 / AMX: emulated bf16, never chosen, not even timed
    ("x86_64", True, 0.5, torch.bfloat16),   # native and faster
    ("x86_64", True, 2.0, torch.float32),    # native but slower here
    ("aarch64", False, 0.5, torch.bfloat16),  # other architectures: the timing decides
    ("aarch64", False, 2.0, torch.float32),
])
def test_auto_dtype_on_cpu_takes_bf16_only_where_native_and_faster(monkeypatch, machine, native, bf16_seconds, expected):
    assert _auto_dtype(monkeypatch, machine, native, bf16_seconds) == expected


def test_auto_dtype_is_decided_once_per_process():
    import samba_hf.cli as cli

    cli.cpu_bfloat16_is_faster.cache_clear()
    first = cli.resolve_dtype("auto", torch.device("cpu"))
    assert first in (torch.float32, torch.bfloat16)
    assert cli.cpu_bfloat16_is_faster.cache_info().misses == 1
    assert cli.resolve_dtype("auto", torch.device("cpu")) == first and cli.cpu_bfloat16_is_faster.cache_info().hits == 1
