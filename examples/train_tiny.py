"""Train the small Samba that ships as the embedded default, from scratch, on CPU, with `transformers.Trainer`.

    python examples/train_tiny.py                       # ~18 min on 2 CPU cores; writes out/train_tiny
    python examples/train_tiny.py --max-steps 20 --out /tmp/try   # a quick look

The embedded default model that ships with samba-hf was built, and is rebuilt, from the repository root with

    python examples/train_tiny.py --out src/samba_hf/default_model

(only that explicit --out writes into the package; the default, out/train_tiny, is git-ignored). The command, as
given, is recorded in the folder's training_report.json. The shipped folder's code files link to the package's own
modules. `--repackage FOLDER` rewrites a trained folder the way this script packages one (same weights), after a
change of the packaging:

    python examples/train_tiny.py --repackage src/samba_hf/default_model --out src/samba_hf/default_model

Data: English text every Python installation carries: the documentation topics of `pydoc_data` plus the docstrings
of a fixed list of standard-library modules. Documents are shuffled with a fixed seed; 5% are held out for the
perplexity reported at the end. Tokenizer: a byte-level BPE trained here with `tokenizers` (no BOS; an EOS between
documents, as the official Samba runs). Model: a few million parameters, Mamba + sliding-window attention layers.
"""

import argparse
import importlib
import inspect
import json
import math
import random
import shlex
import sys
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Trainer, TrainingArguments

from samba_hf import SambaConfig, SambaForCausalLM
from samba_hf.cli import default_model_path
from samba_hf.configuration_samba import UNLIMITED_POSITIONS
from samba_hf.hub_samba import REMOTE_CODE_FILES, hub_metadata

DOCSTRING_MODULES = [
    "abc",
    "argparse",
    "array",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "bz2",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "colorsys",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "doctest",
    "email",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "http.client",
    "http.server",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "locale",
    "logging",
    "lzma",
    "mailbox",
    "math",
    "mimetypes",
    "multiprocessing",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "profile",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "signal",
    "smtplib",
    "socket",
    "socketserver",
    "sqlite3",
    "ssl",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "typing",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "zipfile",
    "zlib",
]
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0-3, as the config's bos 1 / eos 2 / pad 3


def documents() -> list[str]:
    """The corpus, one string per document (a pydoc topic, or one docstring of at least 200 characters)."""
    docs = [text.strip() for _, text in sorted(topics.items())]
    for name in DOCSTRING_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        objects = [module] + [getattr(module, a) for a in sorted(dir(module)) if not a.startswith("_")]
        for obj in objects:
            doc = inspect.getdoc(obj) if (inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj)) else None
            if doc and len(doc) >= 200 and (obj is module or getattr(obj, "__module__", None) == module.__name__):
                docs.append(doc.strip())
    docs = sorted(set(docs))
    random.Random(0).shuffle(docs)
    return docs


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=1_000_000,
    )


class Blocks(torch.utils.data.Dataset):
    """The token stream (documents joined by EOS) cut into blocks of `length` tokens."""

    def __init__(self, ids: list[int], length: int):
        self.ids = torch.tensor(ids[: len(ids) // length * length]).view(-1, length)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def stream(tokenizer, docs) -> list[int]:
    ids = []
    for ids_of_doc in tokenizer(docs, add_special_tokens=False).input_ids:
        ids += ids_of_doc + [tokenizer.eos_token_id]
    return ids


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out",
        default="out/train_tiny",
        help="folder to write (default: out/train_tiny, git-ignored); the shipped model: "
        "--out src/samba_hf/default_model",
    )
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--repackage",
        metavar="FOLDER",
        default=None,
        help="no training: rewrite the trained FOLDER into --out as this script packages a model",
    )
    args = parser.parse_args()
    if args.repackage:
        return repackage(args.repackage, args.out)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    docs = documents()
    held_out = max(1, len(docs) // 20)
    train_docs, eval_docs = docs[held_out:], docs[:held_out]
    tokenizer = train_tokenizer(train_docs, args.vocab_size)
    train_ids, eval_ids = stream(tokenizer, train_docs), stream(tokenizer, eval_docs)
    print(
        f"{len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f} M characters; {len(train_ids):,} training "
        f"tokens, {len(eval_ids):,} held-out tokens; vocabulary {len(tokenizer)}"
    )

    config = SambaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,  # no max_position_embeddings: Samba has no length limit
    )
    model = SambaForCausalLM(config)
    print(f"model: {model.num_parameters():,} parameters, layers {config.layer_types}")

    training = TrainingArguments(
        output_dir=str(Path(args.out).with_name(Path(args.out).name + "-checkpoints")),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.max_steps // 10),
        weight_decay=0.1,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        logging_steps=50,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_drop_last=True,
        use_cpu=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=Blocks(train_ids, args.block))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    minutes = seconds / 60
    tokens_per_s = args.max_steps * args.batch_size * args.block / seconds

    model.eval()
    held = Blocks(eval_ids, args.block)
    with torch.no_grad():
        losses = [model(**{k: v[None] for k, v in held[i].items()}).loss.item() for i in range(len(held))]
    perplexity = math.exp(sum(losses) / len(losses))
    prompt = "The assert statement"
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    sample = tokenizer.decode(model.generate(ids, max_new_tokens=40, do_sample=False)[0])
    print(
        f"trained in {minutes:.1f} min ({tokens_per_s:,.0f} tokens/s); "
        f"held-out perplexity {perplexity:.2f} on {len(held) * args.block:,} tokens"
    )
    print(f"greedy sample: {sample!r}")

    report = {
        "train_minutes": round(minutes, 1),
        "train_tokens_per_s": round(tokens_per_s),
        "final_train_loss": round(trainer.state.log_history[-1]["train_loss"], 4),
        "held_out_perplexity": round(perplexity, 2),
        "held_out_tokens": len(held) * args.block,
        "training_tokens": len(train_ids),
        "steps": args.max_steps,
        "parameters": model.num_parameters(),
        "sample_prompt": prompt,
        "greedy_sample": sample,
        "stored": "bfloat16 (A_log, D float32)",
        "command": shlex.join(["python", "examples/train_tiny.py", *sys.argv[1:]]),
    }
    package(model, tokenizer, report, args.out)


def to_bfloat16_storage(model) -> None:
    """bfloat16 weights, except Mamba's A_log and D, which stay float32 (as the official checkpoints store them)."""
    keep = {name: param.data.float() for name, param in model.named_parameters() if name.endswith((".A_log", ".D"))}
    model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if name in keep:
            param.data = keep[name]


def package(model, tokenizer, report: dict, out: str, card: str | None = None):
    """Write the folder as save_pretrained does (weights, config with auto_map, the modeling code, so tools that do
    not import samba_hf load it with trust_remote_code), stored in bfloat16 (A_log and D stay float32: half the
    size, the same held-out perplexity to 0.01), with its tokenizer, training report and model card."""
    model.config.use_cache = True  # Trainer turns it off while training
    model.config.max_position_embeddings = UNLIMITED_POSITIONS  # trained on 256-token blocks, but no length limit
    model.generation_config.max_length = None
    to_bfloat16_storage(model)
    code = [Path(out, name) for name in REMOTE_CODE_FILES]
    for link in code:
        if link.is_symlink():  # a link written below by an earlier run: save_pretrained copies the code anew
            link.unlink()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    Path(out, "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    Path(out, "README.md").write_text((card or CARD).format(metadata=hub_metadata(license="apache-2.0"), **report))
    if Path(out).resolve().parent == Path(default_model_path()).resolve().parent:
        # a folder shipped in the package links the package's own code instead of copies that would go stale
        for link in code:
            link.unlink()
            link.symlink_to(Path("..", link.name))


CARD = """---
{metadata}
---

# samba-hf's embedded default model

A {parameters:,}-parameter Samba (Mamba + sliding-window attention, 6 layers, hidden size 256, a 4,096-token
byte-level BPE) trained from scratch in {train_minutes} minutes on 2 CPU cores with `{command}` (samba-hf), on the
English text that ships with Python: the documentation topics of `pydoc_data` and standard-library docstrings.
Held-out perplexity {held_out_perplexity} on {held_out_tokens:,} tokens. It is a demo that writes
documentation-flavoured English, not a useful model.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True)  # or `import samba_hf` first
tokenizer = AutoTokenizer.from_pretrained("PATH")
```

Greedy from "{sample_prompt}": {greedy_sample!r}
"""


def repackage(folder: str, out: str):
    """Rewrite an already trained folder as `package` writes it (the same weights; for a new packaging only)."""
    from transformers import AutoTokenizer

    model = SambaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    files = {name: Path(folder, name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json")}
    report = json.loads(Path(folder, "training_report.json").read_text())
    package(model, tokenizer, report, out)
    for name, data in files.items():  # the tokenizer files as they were (a reload adds loading options to them)
        Path(out, name).write_bytes(data)


if __name__ == "__main__":
    main()
