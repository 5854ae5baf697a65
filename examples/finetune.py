"""A Trainer fine-tune that runs unchanged on one process or many (accelerate), CPU or GPU.

    python examples/finetune.py --out /tmp/ft                                   # one process
    accelerate launch --multi_gpu --num_processes 2 examples/finetune.py --out /tmp/ft2 --per-device-batch 2  # 2 CPU
                                                        # processes on a machine without CUDA (gloo)
    accelerate launch --num_processes 8 examples/finetune.py --model PATH ...   # 8 GPUs, DDP
    accelerate launch --multi_gpu --num_processes 2 examples/finetune.py --out /tmp/fsdp --fsdp [--bf16]
                                                        # FSDP2, one unit per SambaDecoderLayer (CPU or GPU)

`--global-batch` sequences per optimizer step are split over the processes (per-device batch x processes x
accumulation), so the same command gives the same training whatever the number of processes. Without --model it
fine-tunes the embedded default on the English text of `pydoc_data`. Writes the logged losses and the final model
into --out (losses.json: what tests/test_multiprocess.py and tests/test_fsdp.py compare between 1 and 2 processes).

--fsdp shards the model with transformers' load-time FSDP2 (`from_pretrained(distributed_config=...)`: each
SambaDecoderLayer a unit), which runs on CPU processes (gloo) as on GPUs. Trainer's own `fsdp=` goes through
accelerate, which applies FSDP only on GPUs: on CPU processes it trains with DDP instead, saying nothing. --bf16
adds FSDP2's bf16 mixed-precision policy (bf16 parameters in the forward, float32 gradient reduction, float32
master weights); the Mamba A_log/D/dt_bias stay float32 (see `SambaPreTrainedModel.maybe_distribute_model`).

Note: `accelerate launch --cpu --num_processes 2` starts one process (accelerate's --cpu launcher fans out only
through mpirun); `--multi_gpu` is its torchrun launcher, and without CUDA this script trains with use_cpu=True.
"""

import argparse
import json
import os
from pathlib import Path
from pydoc_data.topics import topics

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
from transformers.distributed import DistributedConfig

import samba_hf  # noqa: F401  (registers the model type)
from samba_hf.cli import default_model_path


class Blocks(torch.utils.data.Dataset):
    def __init__(self, ids: list[int], length: int, count: int):
        usable = min(count, len(ids) // length) * length
        self.ids = torch.tensor(ids[:usable]).view(-1, length)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model_path())
    parser.add_argument("--out", required=True)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--per-device-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 over the processes, one unit per decoder layer")
    parser.add_argument("--bf16", action="store_true", help="with --fsdp: FSDP2's bf16 mixed-precision policy")
    args = parser.parse_args()
    if args.bf16 and not args.fsdp:
        raise SystemExit("--bf16 is the FSDP2 mixed-precision policy: give --fsdp with it")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sharding = None
    if args.fsdp:
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        sharding = DistributedConfig(fsdp_size=processes, fsdp_mixed_precision=args.bf16)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, distributed_config=sharding)
    # the dtypes the first Mamba mixer computes with (with --bf16: A_log and D float32, the projections bf16)
    mixer = next(layer.mamba for layer in model.model.layers if hasattr(layer, "mamba"))
    seen = {}
    mixer.in_proj.register_forward_pre_hook(
        lambda module, inputs: seen.update(
            {name: str(getattr(mixer, name).dtype) for name in ("A_log", "D")}, in_proj=str(module.weight.dtype)
        )
    )
    text = "\n\n".join(topics[k] for k in sorted(topics))
    data = Blocks(tokenizer(text, add_special_tokens=False).input_ids, args.block, args.global_batch * args.steps)

    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        learning_rate=args.lr,
        per_device_train_batch_size=args.per_device_batch,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        optim="sgd",
        lr_scheduler_type="constant",
        use_cpu=not torch.cuda.is_available(),
    )
    world = training.world_size
    if args.global_batch % (args.per_device_batch * world):
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of {args.per_device_batch} x {world}")
    training.gradient_accumulation_steps = args.global_batch // (args.per_device_batch * world)
    trainer = Trainer(model=model, args=training, train_dataset=data)
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        Path(args.out, "losses.json").write_text(
            json.dumps({"world_size": world, "losses": losses, "fsdp": args.fsdp, "mamba_dtypes": seen}) + "\n"
        )
    trainer.save_model(args.out)  # on every process: a sharded model is gathered to be saved (rank 0 writes)


if __name__ == "__main__":
    main()
