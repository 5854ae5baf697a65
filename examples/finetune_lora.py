"""LoRA fine-tune of the embedded default model on a small new domain, with before/after numbers.

    python examples/finetune_lora.py            # a few minutes on 2 CPU cores; saves the adapter in out/finetune-lora

The task: the Python license text (LICENSE.txt of the standard library), a kind of English the default model never
saw (it was trained on documentation topics and docstrings). The first 80% is the training set, the rest is held
out. Prints the held-out perplexity before and after, and a greedy continuation of the same prompt before and after.
The adapter goes on `samba_hf.training.LORA_TARGET_MODULES` (attention, MLP and Mamba projections).
"""

import argparse
import math
import sysconfig
from pathlib import Path

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

import samba_hf  # noqa: F401
from samba_hf.cli import default_model_path
from samba_hf.training import lora_config


def blocks(ids: list[int], length: int) -> list[dict]:
    return [
        {"input_ids": torch.tensor(ids[i : i + length]), "labels": torch.tensor(ids[i : i + length])}
        for i in range(0, len(ids) - length + 1, length)
    ]


@torch.no_grad()
def perplexity(model, data) -> float:
    model.eval()
    losses = [model(input_ids=b["input_ids"][None], labels=b["labels"][None]).loss.item() for b in data]
    return math.exp(sum(losses) / len(losses))


def continuation(model, tokenizer, prompt: str) -> str:
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer.decode(model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1] :])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model_path())
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", default="out/finetune-lora", help="where the adapter goes (default: git-ignored)")
    args = parser.parse_args()
    torch.manual_seed(0)

    text = Path(sysconfig.get_paths()["stdlib"], "LICENSE.txt").read_text()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    split = int(len(ids) * 0.8)
    train, held_out = blocks(ids[:split], 128), blocks(ids[split:], 128)
    prompt = "Permission to use, copy, modify, and distribute this software"

    before = perplexity(model, held_out), continuation(model, tokenizer, prompt)
    model = get_peft_model(model, lora_config(r=args.rank))
    trainable, total = model.get_nb_trainable_parameters()
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=2e-3,
        lr_scheduler_type="cosine",
        warmup_steps=10,
        logging_steps=25,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
    )
    Trainer(model=model, args=training, train_dataset=train).train()
    after = perplexity(model, held_out), continuation(model, tokenizer, prompt)
    model.save_pretrained(args.out)

    print(
        f"LoRA rank {args.rank}: {trainable:,} trainable of {total:,} parameters; {len(train)} training blocks "
        f"of 128 tokens, {len(held_out)} held out"
    )
    print(f"held-out perplexity: before {before[0]:.2f}, after {after[0]:.2f}")
    print(f"prompt: {prompt!r}\n  before: {before[1]!r}\n  after:  {after[1]!r}")


if __name__ == "__main__":
    main()
