"""A Trainer fine-tune that runs unchanged on one process or many (accelerate), CPU or GPU.

    python examples/finetune.py --out /tmp/ft                                   # one process
    accelerate launch --multi_gpu --num_processes 2 examples/finetune.py --out /tmp/ft2 --per-device-batch 2  # 2 CPU
                                                        # processes on a machine without CUDA (gloo)
    accelerate launch --num_processes 8 examples/finetune.py --model PATH ...   # 8 GPUs, DDP
    accelerate launch --config_file fsdp.yaml examples/finetune.py --model PATH  # FSDP (see docs/fine-tuning.md)

`--global-batch` sequences per optimizer step are split over the processes (per-device batch x processes x
accumulation), so the same command gives the same training whatever the number of processes. Without --model it
fine-tunes the embedded default on the English text of `pydoc_data`. Writes the logged losses and the final model
into --out (losses.json: what tests/test_multiprocess.py compares between 1 and 2 processes).

Note: `accelerate launch --cpu --num_processes 2` starts one process (accelerate's --cpu launcher fans out only
through mpirun); `--multi_gpu` is its torchrun launcher, and without CUDA this script trains with use_cpu=True.
"""

import argparse
import json
from pathlib import Path

import torch
from pydoc_data.topics import topics
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

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
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    text = "\n\n".join(topics[k] for k in sorted(topics))
    data = Blocks(tokenizer(text, add_special_tokens=False).input_ids, args.block, args.global_batch * args.steps)

    training = TrainingArguments(output_dir=args.out, max_steps=args.steps, learning_rate=args.lr,
                                 per_device_train_batch_size=args.per_device_batch, logging_steps=1,
                                 save_strategy="no", report_to=[], seed=0, data_seed=0, optim="sgd",
                                 lr_scheduler_type="constant", use_cpu=not torch.cuda.is_available())
    world = training.world_size
    if args.global_batch % (args.per_device_batch * world):
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of {args.per_device_batch} x {world}")
    training.gradient_accumulation_steps = args.global_batch // (args.per_device_batch * world)
    trainer = Trainer(model=model, args=training, train_dataset=data)
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        Path(args.out, "losses.json").write_text(json.dumps({"world_size": world, "losses": losses}) + "\n")
        trainer.save_model(args.out)


if __name__ == "__main__":
    main()
