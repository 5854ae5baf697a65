"""Fine-tuning with transformers' Trainer (and TRL's SFTTrainer): padding, accumulation, checkpointing, resume."""

import importlib.util

import pytest
import torch
from conftest import tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast, Trainer, TrainingArguments

VOCAB = 97


def tokenizer(padding_side="right"):
    """A word-level tokenizer over "w3".."w96" (ids 3-96), pad 0 / bos 1 / eos 2: enough for the collators."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side=padding_side
    )


def examples(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 15, (n,), generator=g)
    return [{"input_ids": torch.randint(3, VOCAB, (int(k),), generator=g).tolist()} for k in lengths]


def arguments(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    return TrainingArguments(**(base | overrides))


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_loss_equals_the_token_weighted_loss_of_each_sequence(side):
    model = tiny_model(seed=1).eval()
    data = examples(4)
    batch = DataCollatorForLanguageModeling(tokenizer(side), mlm=False)(data)
    assert (batch["labels"] == -100).any()  # padding is ignored in the loss
    with torch.no_grad():
        padded = model(**batch).loss
        total, count = 0.0, 0
        for item in data:
            ids = torch.tensor(item["input_ids"])[None]
            total += model(ids, labels=ids).loss * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    assert abs(padded.item() - (total / count).item()) <= 1e-5


def test_gradient_accumulation_matches_one_large_batch(tmp_path):
    """num_items_in_batch makes 2 x 2 accumulated sequences of unequal length equal one batch of 4."""
    data, collator = examples(8, seed=1), DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    finals = []
    for batch_size, accumulation in ((4, 1), (2, 2)):
        model = tiny_model(seed=2)
        args = arguments(
            tmp_path,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            max_steps=2,
            learning_rate=1e-2,
            optim="sgd",
        )
        Trainer(model=model, args=args, train_dataset=data, data_collator=collator).train()
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert (finals[0] - finals[1]).abs().max() <= 1e-5


def test_gradient_checkpointing_trains_the_same(tmp_path):
    data, collator = examples(8, seed=2), DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    losses = []
    for checkpointing in (False, True):
        trainer = Trainer(
            model=tiny_model(seed=3),
            args=arguments(tmp_path, activation_checkpointing=checkpointing),
            train_dataset=data,
            data_collator=collator,
        )
        trainer.train()
        losses.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert len(losses[0]) == 4 and max(abs(a - b) for a, b in zip(*losses)) <= 1e-4


def test_resume_from_a_checkpoint_continues_the_loss_curve_exactly(tmp_path):
    data, collator = examples(16, seed=3), DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    straight = Trainer(
        model=tiny_model(seed=4),
        args=arguments(tmp_path / "a", max_steps=6),
        train_dataset=data,
        data_collator=collator,
    )
    straight.train()
    expected = [h["loss"] for h in straight.state.log_history if "loss" in h]

    args = arguments(tmp_path / "b", max_steps=6, save_strategy="steps", save_steps=3)
    first = Trainer(model=tiny_model(seed=4), args=args, train_dataset=data, data_collator=collator)
    first.train()
    resumed = Trainer(model=tiny_model(seed=99), args=args, train_dataset=data, data_collator=collator)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "run" / "checkpoint-3"))
    after = [h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > 3]
    assert after == expected[3:]
    final_straight = torch.cat([p.detach().flatten() for p in straight.model.parameters()])
    final_resumed = torch.cat([p.detach().flatten() for p in resumed.model.parameters()])
    assert torch.equal(final_straight, final_resumed)


def test_bf16_autocast_on_cpu_trains(tmp_path):
    data, collator = examples(8, seed=4), DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    trainer = Trainer(
        model=tiny_model(seed=5),
        args=arguments(tmp_path, bf16=True, max_steps=3),
        train_dataset=data,
        data_collator=collator,
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)
    assert trainer.model.model.layers[0].mamba.A_log.dtype == torch.float32  # master weights stay float32


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (in the dev extra)")
def test_trl_sft_trainer_with_a_lora_config(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from samba_hf.training import lora_config

    g = torch.Generator().manual_seed(5)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(3, VOCAB, (12,), generator=g)) for _ in range(8)]
    model = tiny_model(seed=6)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        max_length=32,
        learning_rate=1e-2,
        activation_checkpointing=True,
    )  # TRL's default, under transformers' current name
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tokenizer(),
        peft_config=lora_config(r=4),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3
    lora = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert lora and any(p.abs().sum() > 0 for p in lora)  # B starts at zero: training moved it
    for name, param in trainer.model.get_base_model().named_parameters():
        if "lora_" not in name and name.replace("base_layer.", "") in before:
            assert torch.equal(param, before[name.replace("base_layer.", "")]), name  # the base stays frozen


def test_torch_compile_trains_the_same(tmp_path):
    """Trainer's torch_compile (aot_eager here: the same graphs, no C++ toolchain needed) gives the eager losses."""
    data, collator = examples(8, seed=6), DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    losses = []
    for compiled in (False, True):
        options = dict(torch_compile=True, torch_compile_backend="aot_eager") if compiled else {}
        trainer = Trainer(
            model=tiny_model(seed=7),
            args=arguments(tmp_path, max_steps=2, **options),
            train_dataset=data,
            data_collator=collator,
        )
        trainer.train()
        losses.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert len(losses[1]) == 2 and max(abs(a - b) for a, b in zip(*losses)) <= 1e-4
