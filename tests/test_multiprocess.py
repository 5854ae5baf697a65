"""Two CPU processes (accelerate launch, DDP on gloo) train exactly as one process with the same global batch.

`accelerate launch --cpu --num_processes 2` starts ONE process in accelerate 1.x (its --cpu launcher only fans out
through mpirun); `--multi_gpu` is the torchrun launcher, and on a machine without CUDA the script's Trainer runs
with use_cpu=True, so the two processes form a gloo group."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "finetune.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(command, cwd):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "CUDA_VISIBLE_DEVICES": "",
    }
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A tiny model with the embedded default's tokenizer, as the starting point of both runs."""
    from transformers import AutoTokenizer

    from samba_hf.cli import default_model_path

    folder = tmp_path_factory.mktemp("start")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    tiny_model(seed=0, vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_two_cpu_processes_match_one_process(start, tmp_path):
    common = ["--model", str(start), "--global-batch", "4", "--per-device-batch", "2", "--steps", "3", "--block", "32"]
    run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "one"), *common], cwd=tmp_path)
    run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            str(SCRIPT),
            "--out",
            str(tmp_path / "two"),
            *common,
        ],
        cwd=tmp_path,
    )
    one = json.loads((tmp_path / "one" / "losses.json").read_text())
    two = json.loads((tmp_path / "two" / "losses.json").read_text())
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert len(one["losses"]) == len(two["losses"]) == 3
    # The same global batches and the same gradients (DDP averages them over the processes): the losses agree to
    # float32 round-off of a different summation order, 1e-5 relative.
    for a, b in zip(one["losses"], two["losses"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (one["losses"], two["losses"])
    weights_one = load_file(tmp_path / "one" / "model.safetensors")
    weights_two = load_file(tmp_path / "two" / "model.safetensors")
    for name, tensor in weights_one.items():
        assert torch.allclose(tensor, weights_two[name], atol=1e-6, rtol=1e-5), name
