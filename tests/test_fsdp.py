"""FSDP2 on two CPU processes (gloo): `examples/finetune.py --fsdp`, transformers' load-time sharding
(`from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))`, each SambaDecoderLayer a unit), trained by
Trainer. Launched as tests/test_multiprocess.py launches DDP (accelerate's torchrun launcher).

Trainer's own `fsdp=` option goes through accelerate, which applies FSDP only on GPUs (accelerate 1.15: on CPU
processes it trains with DDP and says nothing), hence the load-time sharding here."""

import json
import sys

import test_multiprocess
import torch
from safetensors.torch import load_file
from test_multiprocess import SCRIPT, free_port, run

start = test_multiprocess.start  # the module's fixture, which pytest finds here under this name

COMMON = ["--global-batch", "4", "--per-device-batch", "2", "--steps", "3", "--block", "32"]


def two_processes(model, out, *options):
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
            "--model",
            str(model),
            "--out",
            str(out),
            *COMMON,
            "--fsdp",
            *options,
        ],
        cwd=out.parent,
    )
    return json.loads((out / "losses.json").read_text())


def test_fsdp2_two_cpu_processes_match_one_process(start, tmp_path):
    from transformers import AutoModelForCausalLM

    run([sys.executable, str(SCRIPT), "--model", str(start), "--out", str(tmp_path / "one"), *COMMON], cwd=tmp_path)
    one = json.loads((tmp_path / "one" / "losses.json").read_text())
    two = two_processes(start, tmp_path / "two")
    assert (one["world_size"], two["world_size"], two["fsdp"]) == (1, 2, True)
    assert len(one["losses"]) == len(two["losses"]) == 3
    # The same global batches; the gradients are reduce-scattered (summed across the two shards of the batch in
    # another order than one process sums them): equal to float32 round-off, 1e-5 relative.
    for a, b in zip(one["losses"], two["losses"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (one["losses"], two["losses"])
    # The sharded model, gathered by save_model, loads back with from_pretrained: the one-process weights. Its
    # remote code is samba-hf's, not the files of torch's FSDP class that wrapped it (FSDPSambaForCausalLM).
    auto_map = json.loads((tmp_path / "two" / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_samba.SambaForCausalLM"
    assert (tmp_path / "two" / "modeling_samba.py").is_file() and not list((tmp_path / "two").glob("_fsdp*"))
    weights_one = load_file(tmp_path / "one" / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "two", dtype=torch.float32).state_dict()
    for name, tensor in weights_one.items():
        assert torch.allclose(tensor, loaded[name], atol=1e-6, rtol=1e-5), name

    # FSDP2's bf16 policy: the projections run in bf16, the Mamba A_log and D stay float32 (a unit of their own).
    bf16 = two_processes(start, tmp_path / "bf16", "--bf16")
    assert bf16["mamba_dtypes"] == {"A_log": "torch.float32", "D": "torch.float32", "in_proj": "torch.bfloat16"}
    assert two["mamba_dtypes"] == {"A_log": "torch.float32", "D": "torch.float32", "in_proj": "torch.float32"}
    for a, b in zip(one["losses"], bf16["losses"]):  # bf16 rounding of the weights and activations: ~1e-3
        assert abs(a - b) <= 1e-2 * abs(a), (one["losses"], bf16["losses"])
    saved = load_file(tmp_path / "bf16" / "model.safetensors")  # float32 master weights, saved as such
    assert all(tensor.dtype == torch.float32 for tensor in saved.values())
