"""The embedded default model (trained by examples/train_tiny.py) is a language model of English, not noise."""

import json
import math
import re
from pathlib import Path
from pydoc_data.topics import topics

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from samba_hf import SambaForCausalLM
from samba_hf.cli import default_model_path

FOLDER = Path(default_model_path())


def load():
    return AutoTokenizer.from_pretrained(FOLDER), AutoModelForCausalLM.from_pretrained(FOLDER).eval()


def test_it_loads_through_the_auto_classes_with_its_report():
    tokenizer, model = load()
    assert type(model) is SambaForCausalLM and model.config.vocab_size == len(tokenizer)
    report = json.loads((FOLDER / "training_report.json").read_text())
    assert report["command"] == "python examples/train_tiny.py --out src/samba_hf/default_model"
    assert report["train_minutes"] < 30


def test_it_predicts_english_far_better_than_chance():
    tokenizer, model = load()
    text = topics["if"]  # documentation text (from the training distribution)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :256]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert math.exp(loss) < 40, math.exp(loss)  # uniform guessing: perplexity = vocabulary size (4096)


def test_its_greedy_text_is_made_of_english_words():
    tokenizer, model = load()
    ids = tokenizer("The assert statement", return_tensors="pt", add_special_tokens=False).input_ids
    out = tokenizer.decode(model.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1] :])
    words = re.findall(r"[A-Za-z]+", out)
    known = set(re.findall(r"[A-Za-z]+", " ".join(topics.values())))
    assert len(words) >= 8, out
    assert sum(w in known for w in words) / len(words) >= 0.9, out


def test_the_model_page_quotes_what_its_command_writes():
    """docs/model.md quotes the greedy text of a `samba-hf generate` command that names its dtype: the command, run
    as the CLI runs it (weights in that dtype, no special tokens, 64 new tokens), writes the quote."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "model.md").read_text()
    command = re.search(r'`samba-hf generate "([^"]+)" --dtype (\w+)` \(greedy\):\s+\*"([^"]+)"\*', page)
    assert command, "docs/model.md no longer quotes a samba-hf generate command with its dtype"
    prompt, dtype, quote = command.groups()
    tokenizer = AutoTokenizer.from_pretrained(FOLDER)
    model = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=getattr(torch, dtype)).eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    written = prompt + tokenizer.decode(model.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1] :])
    assert " ".join(written.split()).startswith(" ".join(quote.split())), written
