"""The Samba paper's long-context result (Figures 3-4), at small scale: the commands behind docs/long-context.md.

Three models of the same size (5,904,128 parameters, 6 layers, hidden 256), trained with the same recipe on the same
data at 512 tokens:
  samba    Mamba + sliding-window attention (window 256), samba-hf's SambaForCausalLM
  mistral  sliding-window attention only (window 256), transformers' MistralForCausalLM
  llama    full attention, transformers' LlamaForCausalLM
Each is pretrained on the English text that ships with Python (as examples/train_tiny.py), then fine-tuned on
passkey prompts of up to 512 tokens (the paper: 500 steps at its training length), and measured far past 512
tokens: passkey retrieval (the fine-tuned models), perplexity vs position and phonebook lookup (the pretrained ones).

    python examples/long_context.py pretrain samba     # then mistral, llama: out/long_context/ARCH-base (CPU: minutes)
    python examples/long_context.py finetune samba --bf16   # out/long_context/ARCH-passkey (GPU: minutes; CPU: hours)
    python examples/long_context.py evaluate           # long_context/*.json, *.png (committed); --archs, --tasks
    python examples/long_context.py plot               # the combined figures and docs/long-context.md's tables
    python examples/long_context.py ship               # the passkey Samba -> src/samba_hf/passkey_model

The defaults are what docs/long-context.md reports; `--help` on each lists the knobs. Training runs on the GPU when
there is one. Checkpoints go to out/long_context (git-ignored).
"""

import argparse
import json
import math
import random
import re
import shlex
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

sys.path.insert(0, str(Path(__file__).parent))
from train_tiny import SPECIAL, Blocks, documents, package, stream, to_bfloat16_storage  # noqa: E402  (the same corpus and packaging)

from samba_hf import SambaConfig, SambaForCausalLM  # noqa: E402
from samba_hf.evaluation import (  # noqa: E402
    PASSKEY_INSTRUCTION,
    PASSKEY_NEEDLE,
    PASSKEY_QUESTION,
    _cache_argument,
    _pieces,
    _pyplot,
    _returned_cache,
    passkey_eval,
    passkey_prompt,
    perplexity_by_position,
    phonebook_eval,
    plot_passkey,
    plot_perplexity,
    plot_phonebook,
    random_digits,
)

WORK = Path("out/long_context")
DEVICE = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
RESULTS = Path("long_context")
TRAINING_LENGTH = 512
WINDOW = 256
SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
)
# Samba's Mamba layers hold a little more than attention layers: the attention-only models get a narrower MLP so
# all three have the same parameter count (5,904,128, tied embeddings).
INTERMEDIATE = {"samba": 640, "mistral": 797, "llama": 797}


def build(arch: str, vocab_size: int):
    common = dict(SHAPE, vocab_size=vocab_size, intermediate_size=INTERMEDIATE[arch])
    if arch == "samba":
        return SambaForCausalLM(SambaConfig(**common, sliding_window=WINDOW))
    if arch == "mistral":
        return MistralForCausalLM(
            MistralConfig(**common, sliding_window=WINDOW, max_position_embeddings=TRAINING_LENGTH)
        )
    return LlamaForCausalLM(LlamaConfig(**common, max_position_embeddings=TRAINING_LENGTH))


def split_documents():
    """train_tiny's corpus; 15% of the documents are held out (about 40K tokens: the long perplexity text)."""
    docs = documents()
    held_out = len(docs) * 15 // 100
    return docs[held_out:], docs[:held_out]


UNSEEN_EXCLUDED = ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo")  # side effects or GUI


def long_text_documents() -> list[str]:
    """Text none of the models trained on, for perplexity far past 512 tokens: the held-out documents, plus the
    docstrings (200+ characters) of the standard-library modules train_tiny's list leaves out (about 69K tokens on
    Python 3.11; other Pythons ship somewhat different text)."""
    import importlib
    import inspect
    import warnings

    from train_tiny import DOCSTRING_MODULES

    train_docs, held_docs = split_documents()
    docs = []
    for name in sorted(sys.stdlib_module_names):
        if name in DOCSTRING_MODULES or name.startswith("_") or name in UNSEEN_EXCLUDED:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # platform modules that do not import here
            continue
        for obj in [module] + [getattr(module, a, None) for a in sorted(dir(module)) if not a.startswith("_")]:
            doc = inspect.getdoc(obj) if (inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj)) else None
            if doc and len(doc) >= 200 and (obj is module or getattr(obj, "__module__", None) == module.__name__):
                docs.append(doc.strip())
    return held_docs + sorted(set(docs) - set(train_docs) - set(held_docs))


def tokenizer_for_experiment(train_docs) -> PreTrainedTokenizerFast:
    """A 4,096-token byte-level BPE whose digits are single tokens (as Llama's), so a key is copied digit by digit.
    Trained once and shared by the three models."""
    path = WORK / "tokenizer"
    if (path / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(path)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(train_docs, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=1_000_000,
    )
    fast.save_pretrained(path)
    return fast


class PasskeySamples(torch.utils.data.Dataset):
    """Passkey prompts followed by their answer, of `min_length` to `length` tokens, the key at a random depth.
    The loss is on every token (`answer_only`: on the answer's alone). Sample i is the same in every run."""

    def __init__(
        self, tokenizer, count: int, length: int, min_length: int, answer_only: bool = False, min_key_distance: int = 0
    ):
        self.tokenizer, self.count, self.length, self.min_length = tokenizer, count, length, min_length
        self.answer_only, self.min_key_distance = answer_only, min_key_distance

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        rng = random.Random(f"passkey-train-{i}")
        key = random_digits(rng, 5)
        target = self.tokenizer(" " + key + ".", add_special_tokens=False).input_ids
        length = rng.randint(self.min_length, self.length)
        prompt = passkey_prompt(self.tokenizer, length - len(target), 0.0, key)  # the key as far back as it goes
        if len(prompt.input_ids) - prompt.answer_start < self.min_key_distance:
            raise ValueError(
                f"a {length}-token prompt cannot put the key {self.min_key_distance} tokens from its end: "
                "raise --passkey-min-length or lower --min-key-distance"
            )
        for _ in range(100):  # min_key_distance: a random depth that keeps the key that far from the end
            candidate = passkey_prompt(self.tokenizer, length - len(target), rng.random(), key)
            if len(candidate.input_ids) - candidate.answer_start >= self.min_key_distance:
                prompt = candidate
                break
        ids = prompt.input_ids + target
        labels = [-100] * len(prompt.input_ids) + target if self.answer_only else ids
        filler = filler_positions(self.tokenizer, prompt)
        return {"input_ids": ids, "labels": labels, "filler": filler + [False] * len(target)}


def filler_positions(tokenizer, prompt) -> list[bool]:
    """Which tokens of a `passkey_prompt` are filler: all but the instruction, the key sentence and the question."""
    instruction, needle, question = (
        len(p)
        for p in _pieces(tokenizer, PASSKEY_INSTRUCTION, PASSKEY_NEEDLE.format(key=prompt.answer), PASSKEY_QUESTION)
    )
    end = len(prompt.input_ids) - question
    return [
        instruction <= t < prompt.answer_start or prompt.answer_start + needle <= t < end
        for t in range(len(prompt.input_ids))
    ]


def attention_reach(config) -> int | None:
    """How far back stacked sliding windows reach, in tokens (None for full attention)."""
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    sliding = types.count("sliding_attention") if types else config.num_hidden_layers
    return (window - 1) * sliding if window else None


class TimeStretch:
    """Fine-tuning augmentation for the Mamba layers: each training step multiplies the step size dt of every filler
    token by a factor k drawn log-uniformly from [1, `max_factor`]. In Mamba's zero-order-hold discretization a token
    whose dt is k times larger acts as that token held for k steps (exp(k dt A) decays the state, k dt B x writes
    it), so the filler of a 512-token prompt stands for k times as much filler, in the Mamba layers only, while the
    instruction, the key sentence and the question read as they do in a prompt k times longer. Keeping a key over
    k times the distance is then what the loss asks for. The batch names the filler tokens (`filler`, popped before
    the model sees it). Hooks on the model and on `dt_proj` of every Mamba layer; `remove()` takes them off. The
    model itself is unchanged: what is saved and evaluated runs with k = 1.

    `tokens`: which tokens are stretched. "filler" is the recipe; two earlier stages of the shipped model ran with
    "all" (every token, the key and question too) and one with "non-digits" (every token but the key's digits,
    `digit_ids`), kept so that their commands still rerun."""

    def __init__(self, model, max_factor: float, tokens: str = "filler", digit_ids=(), seed: int = 0):
        self.rng, self.log_max, self.factor, self.factors = (
            random.Random(f"stretch-{seed}"),
            math.log(max_factor),
            1.0,
            None,
        )
        self.tokens, self.digit_ids = tokens, torch.tensor(sorted(digit_ids), dtype=torch.long)
        mixers = [m for m in model.modules() if hasattr(m, "dt_proj") and hasattr(m, "A_log")]
        if not mixers:
            raise ValueError("--stretch-dt needs a model with Mamba layers (samba)")
        self.handles = [model.register_forward_pre_hook(self.draw, with_kwargs=True)]
        self.handles += [m.dt_proj.register_forward_hook(self.stretch) for m in mixers]

    def draw(self, module, args, kwargs):
        filler = kwargs.pop("filler", None)  # (batch, seq) bool
        self.factor = math.exp(self.rng.uniform(0.0, self.log_max)) if module.training and filler is not None else 1.0
        if self.factor != 1.0:
            if self.tokens != "filler":
                ids = kwargs["input_ids"]
                filler = (
                    torch.ones_like(filler)
                    if self.tokens == "all"
                    else ~torch.isin(ids, self.digit_ids.to(ids.device))
                )
            self.factors = torch.where(filler, self.factor, 1.0)[..., None]  # (batch, seq, 1)
        return args, kwargs

    def stretch(self, module, args, pre):
        """Returns p' with softplus(p') = k softplus(p): the inverse softplus of the stretched step."""
        if self.factor == 1.0:
            return None
        dt = self.factors.to(pre.device) * nn.functional.softplus(pre.float())
        return torch.where(dt > 20, dt, torch.log(torch.expm1(dt.clamp(1e-20, 20)))).to(pre.dtype)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def pad_right(batch, pad_id: int):
    """Right padding (pad tokens come after every real one, so a causal model's loss is unchanged), labels -100;
    `filler` marks the filler tokens (for TimeStretch; models without it never see it)."""
    width = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), -100)
    filler = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, b in enumerate(batch):
        ids[row, : len(b["input_ids"])] = torch.tensor(b["input_ids"])
        labels[row, : len(b["labels"])] = torch.tensor(b["labels"])
        filler[row, : len(b["filler"])] = torch.tensor(b["filler"])
    return {"input_ids": ids, "labels": labels, "filler": filler}


class EarlyStop(TrainerCallback):
    """Ends training after `minutes` (the step then reached goes into the report) or after step `at_step`, which
    reruns such a run exactly; the learning-rate schedule stays the one of the full run's steps."""

    def __init__(self, minutes: float | None = None, at_step: int | None = None):
        self.deadline = None if minutes is None else time.perf_counter() + 60 * minutes
        self.at_step = at_step

    def on_step_end(self, args, state, control, **kwargs):
        if (self.deadline is not None and time.perf_counter() > self.deadline) or state.global_step == self.at_step:
            control.should_training_stop = True


def rerun_command(command: str, steps_reached: int) -> str:
    """A --time-limit run's command with the limit replaced by the step it reached (--stop-at), to rerun it."""
    words = shlex.split(command)
    at = words.index("--time-limit")
    return shlex.join(words[:at] + ["--stop-at", str(steps_reached)] + words[at + 2 :])


def run_trainer(
    model,
    dataset,
    steps: int,
    lr: float,
    batch_size: int,
    collator=None,
    weight_decay: float = 0.1,
    stop: EarlyStop | None = None,
) -> float:
    args = TrainingArguments(
        output_dir=str(WORK / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 10),
        weight_decay=weight_decay,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        logging_steps=25,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_drop_last=True,
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
    )
    start = time.perf_counter()
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[stop] if stop else None
    )
    trainer.train()
    run_trainer.logged_losses = [entry for entry in trainer.state.log_history if "loss" in entry]
    run_trainer.steps_reached = trainer.state.global_step
    return (time.perf_counter() - start) / 60


def save(model, tokenizer, folder: Path, report: dict, bf16: bool = False):
    """`bf16`: stored in bfloat16 (Mamba's A_log and D stay float32), half the size."""
    model.config.use_cache = True
    model.generation_config.max_length = None
    if bf16:
        to_bfloat16_storage(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


def pretrain(args):
    torch.manual_seed(0)
    train_docs, held_docs = split_documents()
    tokenizer = tokenizer_for_experiment(train_docs)
    ids = stream(tokenizer, train_docs)
    model = build(args.arch, len(tokenizer))
    print(
        f"{args.arch}: {model.num_parameters():,} parameters; {len(ids):,} training tokens in blocks of "
        f"{TRAINING_LENGTH}",
        flush=True,
    )
    report = {
        "arch": args.arch,
        "parameters": model.num_parameters(),
        "training_length": TRAINING_LENGTH,
        "window": WINDOW if args.arch != "llama" else None,
        "training_tokens": len(ids),
        "pretrain_command": shlex.join(["python", "examples/long_context.py", *sys.argv[1:]]),
    }
    minutes = run_trainer(model, Blocks(ids, TRAINING_LENGTH), args.pretrain_steps, args.lr, args.batch_size)
    report.update(pretrain_steps=args.pretrain_steps, pretrain_minutes=round(minutes, 1), pretrain_device=DEVICE)
    held = Blocks(stream(tokenizer, held_docs), TRAINING_LENGTH)
    model.eval()
    with torch.no_grad():
        losses = [
            model(**{k: v[None].to(model.device) for k, v in held[i].items()}).loss.item() for i in range(len(held))
        ]
    report["held_out_perplexity_at_512"] = round(math.exp(sum(losses) / len(losses)), 2)
    print(f"pretrained in {minutes:.1f} min; held-out perplexity {report['held_out_perplexity_at_512']}", flush=True)
    save(model, tokenizer, WORK / f"{args.arch}-base", report)


def finetune(args):
    """Passkey fine-tuning of the pretrained model (ARCH-base) at the training length."""
    torch.manual_seed(0)
    base = Path(args.start_from) if args.start_from else WORK / f"{args.arch}-base"
    tokenizer, model = (
        AutoTokenizer.from_pretrained(base),
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
    )
    report = json.loads((base / "training_report.json").read_text())
    if args.window is not None:  # a narrower window than pretraining: less reach for attention
        model.config.sliding_window = args.window
        report.update(window=args.window, window_changed_from=report.get("window"))
    if args.start_from:
        if "passkey_command" in report:  # an earlier passkey stage: keep its record
            earlier = {k: v for k, v in report.items() if k.startswith("passkey_") and k != "passkey_stages"}
            report["passkey_stages"] = report.get("passkey_stages", []) + [earlier]
            for k in earlier:
                del report[k]
        report["passkey_started_from"] = str(args.start_from)
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]  # one token each in this tokenizer
    stretch = TimeStretch(model, args.stretch_dt, args.stretch_tokens, digits) if args.stretch_dt > 1 else None
    model.train()
    samples = PasskeySamples(
        tokenizer,
        args.passkey_steps * args.passkey_batch_size,
        args.passkey_max_length,
        args.passkey_min_length,
        answer_only=args.answer_only,
        min_key_distance=args.min_key_distance,
    )
    report["passkey_min_key_distance"] = args.min_key_distance

    def collate(batch):
        padded = pad_right(batch, tokenizer.pad_token_id)
        if stretch is None:
            del padded["filler"]
        return padded

    minutes = run_trainer(
        model,
        samples,
        args.passkey_steps,
        args.passkey_lr,
        args.passkey_batch_size,
        collator=collate,
        weight_decay=args.passkey_weight_decay,
        stop=EarlyStop(args.time_limit, args.stop_at),
    )
    if stretch is not None:
        stretch.remove()
        report.update(passkey_stretch_dt=args.stretch_dt, passkey_stretch_tokens=args.stretch_tokens)
    report.update(
        passkey_steps=args.passkey_steps,
        passkey_batch_size=args.passkey_batch_size,
        passkey_minutes=round(minutes, 1),
        passkey_device=DEVICE,
        passkey_lr=args.passkey_lr,
        passkey_weight_decay=args.passkey_weight_decay,
        passkey_lengths=[args.passkey_min_length, args.passkey_max_length],
        passkey_loss="answer" if args.answer_only else "all tokens",
        passkey_command=shlex.join(["python", "examples/long_context.py", *sys.argv[1:]]),
        passkey_logged_losses=run_trainer.logged_losses,
    )
    if run_trainer.steps_reached < args.passkey_steps:
        report.update(passkey_steps_reached=run_trainer.steps_reached)
        if args.time_limit is not None:
            report["passkey_rerun_command"] = rerun_command(report["passkey_command"], run_trainer.steps_reached)
    model.eval()
    check = passkey_eval(model, tokenizer, [TRAINING_LENGTH, 4 * TRAINING_LENGTH], [0.0, 0.5, 1.0], trials=4, seed=1)
    report["passkey_check"] = {c["length"]: c["accuracy"] for c in check["cells"] if c["depth"] == 0.0}
    print(
        f"passkey-tuned in {minutes:.1f} min; {[(c['length'], c['depth'], c['accuracy']) for c in check['cells']]}; "
        f"e.g. {[(s['passkey'], s['generated']) for s in check['cells'][2]['samples'][:2]]}",
        flush=True,
    )
    save(model, tokenizer, WORK / f"{args.arch}-passkey{args.suffix}", report, bf16=args.bf16)


def train(args):
    pretrain(args)
    finetune(args)


def evaluate(args):
    RESULTS.mkdir(exist_ok=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    command = shlex.join(["python", "examples/long_context.py", *sys.argv[1:]])
    perplexities = {}
    for arch in args.archs.split(","):
        if "passkey" in args.tasks:
            folder = WORK / f"{arch}-passkey{args.suffix}"
            tokenizer, model = AutoTokenizer.from_pretrained(folder), load(folder)
            start = time.perf_counter()
            if args.prompts == "evaluation":
                result = passkey_eval(
                    model,
                    tokenizer,
                    lengths,
                    depths,
                    trials=args.trials,
                    seed=args.seed,
                    prefill_chunk_size=args.prefill_chunk_size,
                    progress=True,
                )
            else:
                result = independent_passkey_eval(
                    model, tokenizer, lengths, depths, args.trials, args.seed, args.prompts
                )
            result["attention_reach"] = attention_reach(model.config)
            result.update(
                model=arch,
                command=command,
                minutes=round((time.perf_counter() - start) / 60, 1),
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            )
            name = f"passkey_{arch}{args.suffix}" + ("" if args.prompts == "evaluation" else f"_{args.prompts}")
            (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
            plot_passkey(
                result,
                RESULTS / f"{name}.png",
                f"{arch}{args.suffix}: passkey accuracy (%), trained at 512"
                + ("" if args.prompts == "evaluation" else f", filler: {args.prompts}"),
            )
            print(
                arch, "passkey", {c["length"]: c["accuracy"] for c in result["cells"] if c["depth"] == 0.0}, flush=True
            )
        if "perplexity" in args.tasks:
            folder = WORK / f"{arch}-base"
            tokenizer, model = AutoTokenizer.from_pretrained(folder), load(folder)
            perplexities[arch] = perplexity_over_orders(model, tokenizer, args)
            perplexities[arch].update(
                model=arch,
                command=command,
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            )
            (RESULTS / f"perplexity_{arch}.json").write_text(json.dumps(perplexities[arch], indent=1) + "\n")
        if "phonebook" in args.tasks:  # the pretrained models: no phonebook was seen in training or fine-tuning
            folder = WORK / f"{arch}-base"
            tokenizer, model = AutoTokenizer.from_pretrained(folder), load(folder)
            result = phonebook_eval(
                model,
                tokenizer,
                [128, 256, 512, 1024, 2048],
                trials=10,
                seed=args.seed,
                prefill_chunk_size=args.prefill_chunk_size,
                progress=True,
            )
            result.update(
                model=arch,
                command=command,
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            )
            (RESULTS / f"phonebook_{arch}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(args)


def plot(args=None):
    """The figures that combine the models, from whatever results/*.json there are (each model may be evaluated
    by a separate run, on another machine)."""
    plt = _pyplot()
    results = {
        kind: {
            arch: json.loads((RESULTS / f"{kind}_{arch}.json").read_text())
            for arch in INTERMEDIATE
            if (RESULTS / f"{kind}_{arch}.json").exists()
        }
        for kind in ("passkey", "perplexity", "phonebook")
    }
    if results["perplexity"]:
        plot_perplexity(
            results["perplexity"],
            RESULTS / "perplexity_buckets.png",
            "unseen text: perplexity vs position, trained at 512",
            training_length=TRAINING_LENGTH,
        )
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for arch, result in results["perplexity"].items():
            spans = position_ranges(result)
            ax.plot([b for _, b in spans], [range_perplexity(result, a, b) for a, b in spans], marker="o", label=arch)
        ax.axvline(TRAINING_LENGTH, color="grey", linestyle=":", label="training length")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("end of position range 0-512, 512-1K, 1K-2K, ... (tokens)")
        ax.set_ylabel("perplexity over the range")
        ax.set_title("unseen text: perplexity vs position, trained at 512")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "perplexity.png", dpi=120)
        plt.close(fig)
    if results["phonebook"]:
        plot_phonebook(results["phonebook"], RESULTS / "phonebook.png", "phonebook lookup, pretrained at 512")
    if results["passkey"]:
        # accuracy over all depths per length, one line per model (the paper's Figure 3 view)
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for i, (arch, result) in enumerate(results["passkey"].items()):
            mean = [
                sum(c["accuracy"] for c in result["cells"] if c["length"] == n) / len(result["depths"])
                for n in result["lengths"]
            ]
            learned = (
                mean[result["lengths"].index(TRAINING_LENGTH)] >= 0.95
                if TRAINING_LENGTH in result["lengths"]
                else True
            )
            # smaller markers for each later model: lines that coincide stay visible
            (line,) = ax.plot(
                result["lengths"],
                mean,
                marker="os^D"[i % 4],
                markersize=9 - 2 * (i % 4),
                linewidth=2.5 - 0.6 * (i % 4),
                label=arch if learned else f"{arch} (did not learn the task at {TRAINING_LENGTH})",
            )
            if result.get("attention_reach"):
                ax.axvline(
                    result["attention_reach"],
                    color=line.get_color(),
                    linestyle="--",
                    linewidth=0.8,
                    label=f"{arch}: attention's reach",
                )
        ax.axvline(TRAINING_LENGTH, color="grey", linestyle=":", label="fine-tuning length")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("passkey accuracy, all depths")
        ax.set_title("passkey retrieval after fine-tuning at 512 tokens")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "passkey.png", dpi=120)
        plt.close(fig)
    print(tables(results))


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 else str(tokens)


def position_ranges(result: dict) -> list[tuple[int, int]]:
    """0-512, 512-1K, 1K-2K, ... up to the end of the text."""
    last = result["buckets"][-1]["end"]
    edges = [0, TRAINING_LENGTH]
    while edges[-1] < last:
        edges.append(min(2 * edges[-1], last))
    return list(zip(edges, edges[1:]))


def range_perplexity(result: dict, start: int, end: int) -> float:
    inside = [b for b in result["buckets"] if start <= b["start"] and b["end"] <= end]
    return math.exp(sum(b["nll"] for b in inside) / len(inside))


def tables(results) -> str:
    """docs/long-context.md's tables, in Markdown, from the results."""
    lines = []
    for arch, result in results["passkey"].items():
        lines += [
            f"passkey, {arch} ({result['trials']} trials per cell, {result.get('device', 'cpu')}):",
            "",
            "| depth | " + " | ".join(f"{n:,}" for n in result["lengths"]) + " |",
            "|---|" + "---|" * len(result["lengths"]),
        ]
        for depth in result["depths"]:
            cells = {c["length"]: c["accuracy"] for c in result["cells"] if c["depth"] == depth}
            lines.append(f"| {depth:.0%} | " + " | ".join(f"{cells[n]:.0%}" for n in result["lengths"]) + " |")
        lines.append("")
    if results["perplexity"]:
        # position ranges that double: 0-512 (the training length), 512-1K, 1K-2K, ..., each the mean NLL of its
        # 512-token buckets (longer ranges average over more text, so the far end is not one bucket's noise)
        spans = position_ranges(next(iter(results["perplexity"].values())))
        lines += [
            f"perplexity by position range (mean over {TRAINING_LENGTH}-token buckets):",
            "",
            "| model | " + " | ".join(f"{_k(a)}-{_k(b)}" for a, b in spans) + " | last / first |",
            "|---|" + "---|" * (len(spans) + 1),
        ]
        for arch, result in results["perplexity"].items():
            ppl = [range_perplexity(result, a, b) for a, b in spans]
            lines.append(f"| {arch} | " + " | ".join(f"{p:.1f}" for p in ppl) + f" | {ppl[-1] / ppl[0]:.2f} |")
        lines.append("")
    for arch, result in results["phonebook"].items():
        lines.append(f"phonebook {arch}: " + ", ".join(f"{r['length']}: {r['accuracy']:.0%}" for r in result["rows"]))
    return "\n".join(lines)


# The independent check: passkey prompts built here, not by samba_hf.evaluation. The paper's format (instruction,
# filler, key sentence, filler, question), written as one string and tokenized whole; the filler is other text than
# the fine-tuning's; keys from another seed; greedy decoding through a loop of our own.
OTHER_FILLER = (
    " The river runs down to the sea. Birds sing in the old trees. The road is long and quiet."
    " Night follows the day. Snow falls on the far hills."
)


def filler_sentences(kind: str) -> list[str]:
    """`other`: five fixed sentences never seen in fine-tuning. `text`: every sentence (8-40 words, digits removed)
    of the unseen documents (`long_text_documents`), in order, so the filler never repeats within 32K tokens."""
    if kind == "other":
        return [" " + s.strip() + "." for s in OTHER_FILLER.split(".") if s.strip()]
    sentences = []
    for doc in long_text_documents():
        for sentence in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", re.sub(r"\d", "", doc))):
            if 8 <= len(sentence.split()) <= 40 and sentence.endswith("."):
                sentences.append(" " + sentence.strip())
    return sentences


def independent_prompt(tokenizer, sentences: list[str], length: int, depth: float, key: str, start: int) -> str:
    """A passkey prompt of at most `length` tokens: the filler cycles through `sentences` from index `start`."""
    head = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there."
    )
    needle, question = (
        f" The pass key is {key}. Remember it. {key} is the pass key.",
        " What is the pass key? The pass key is",
    )
    budget = length - len(tokenizer(head + needle + question).input_ids) - 2
    filler, used = [], 0
    while True:
        sentence = sentences[(start + len(filler)) % len(sentences)]
        cost = len(tokenizer(sentence, add_special_tokens=False).input_ids)
        if used + cost > budget:
            break
        filler.append(sentence)
        used += cost
    cut = round(depth * len(filler))
    text = head + "".join(filler[:cut]) + needle + "".join(filler[cut:]) + question
    while len(tokenizer(text).input_ids) > length:  # tokens merge differently in context: trim from the end
        filler.pop()
        cut = min(cut, len(filler))
        text = head + "".join(filler[:cut]) + needle + "".join(filler[cut:]) + question
    return text


@torch.no_grad()
def greedy_answer(model, ids: torch.Tensor, new_tokens: int, chunk: int = 2048) -> list[int]:
    """Prefill in chunks through the model's cache, then greedy decoding, one token at a time."""
    cache, out, name = (
        None,
        None,
        _cache_argument(model),
    )  # `cache` from transformers 5.24 on, `past_key_values` before
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start : start + chunk], **{name: cache}, use_cache=True, logits_to_keep=1)
        cache = _returned_cache(out)
    tokens = []
    for _ in range(new_tokens):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token.item())
        out = model(input_ids=token, **{name: cache}, use_cache=True)
        cache = _returned_cache(out)
    return tokens


def independent_passkey_eval(model, tokenizer, lengths, depths, trials: int, seed: int, filler: str) -> dict:
    sentences, cells = filler_sentences(filler), []
    device = next(model.parameters()).device
    for length in lengths:
        for depth in depths:
            rng, correct, samples = random.Random(f"independent-{seed}-{length}-{depth}"), 0, []
            for _ in range(trials):
                key = "".join(rng.choice("0123456789") for _ in range(5))
                text = independent_prompt(tokenizer, sentences, length, depth, key, rng.randrange(len(sentences)))
                ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
                generated = tokenizer.decode(greedy_answer(model, ids, 6))
                found = re.search(r"\d+", generated)
                correct += found is not None and found.group() == key
                samples.append({"passkey": key, "generated": generated, "tokens": ids.shape[1]})
            cells.append({"length": length, "depth": depth, "accuracy": correct / trials, "samples": samples})
            print(f"{length} {depth}: {correct}/{trials}", flush=True)
    return {
        "task": "passkey",
        "prompts": f"independent, filler {filler}",
        "lengths": list(lengths),
        "depths": list(depths),
        "trials": trials,
        "seed": seed,
        "cells": cells,
    }


@torch.no_grad()
def retention(args):
    """How much of what the Mamba state held before the filler survives it: over the filler after the key of a
    depth-0 passkey prompt, each channel keeps exp(A * sum(dt)) of each state entry; per layer, the channels whose
    best entry keeps more than half, and the best five."""
    folder = Path(args.model) if args.model else WORK / f"samba-passkey{args.suffix}"
    tokenizer, model = AutoTokenizer.from_pretrained(folder), load(folder)
    mixers = [(i, layer.mamba) for i, layer in enumerate(model.model.layers) if hasattr(layer, "mamba")]
    for length in [int(n) for n in args.lengths.split(",")]:
        prompt = passkey_prompt(tokenizer, length, 0.0, "12345")
        steps = {i: [] for i, _ in mixers}  # dt of every chunk the model runs
        hooks = [
            m.dt_proj.register_forward_hook(
                lambda mod, a, out, i=i: steps[i].append(nn.functional.softplus(out.float()))
            )
            for i, m in mixers
        ]
        model(torch.tensor([prompt.input_ids], device=model.device), logits_to_keep=1)
        for hook in hooks:
            hook.remove()
        filler = torch.tensor(filler_positions(tokenizer, prompt))  # depth 0: all of it after the key
        for i, mixer in mixers:
            dt = torch.cat(steps[i], dim=1)[0, filler.to(model.device)].sum(0)  # (d_inner,)
            kept = torch.exp(mixer.decay_rates() * dt[:, None]).amax(1)  # (d_inner,) best state entry
            print(
                f"{len(prompt.input_ids):>6} tokens, layer {i}: {int(filler.sum())} filler tokens; "
                f"{int((kept > 0.5).sum())} of {kept.numel()} channels keep > 1/2; best "
                + " ".join(f"{v:.3f}" for v in kept.sort(descending=True).values[:5].tolist()),
                flush=True,
            )


def perplexity_over_orders(model, tokenizer, args) -> dict:
    """Perplexity per position bucket of unseen documents (`long_text_documents`) joined into one sequence of
    `--ppl-length` tokens, averaged over `--orders` random orders of the documents (so every bucket sees the same text
    on average, and a rise with position is the model's, not the text's)."""
    held_docs = long_text_documents()
    runs = []
    for order in range(args.orders):
        docs = held_docs[:]
        random.Random(f"order-{order}").shuffle(docs)
        ids = torch.tensor(stream(tokenizer, docs)[: args.ppl_length])
        if ids.numel() < args.ppl_length:
            raise SystemExit(f"the unseen text has only {ids.numel()} tokens; ask for fewer with --ppl-length")
        runs.append(
            perplexity_by_position(
                model, ids, bucket=TRAINING_LENGTH, prefill_chunk_size=args.prefill_chunk_size, progress=True
            )
        )
    buckets = []
    for parts in zip(*(run["buckets"] for run in runs)):
        nll = sum(b["nll"] * b["tokens"] for b in parts) / sum(b["tokens"] for b in parts)
        buckets.append({"start": parts[0]["start"], "end": parts[0]["end"], "nll": nll, "perplexity": math.exp(nll)})
    return {
        "task": "perplexity",
        "tokens": args.ppl_length,
        "bucket": TRAINING_LENGTH,
        "orders": args.orders,
        "buckets": buckets,
    }


def load(folder):
    """float32, on the GPU when there is one."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def passkey_stages(report: dict) -> list[dict]:
    """Every passkey fine-tuning stage that led to the model of `report`, first to last: the earlier stages'
    records, which `finetune --start-from` carries in `passkey_stages`, then its own (passkey_* fields, without the
    logged losses)."""

    def record(fields):
        return {
            k: v
            for k, v in fields.items()
            if k.startswith("passkey_") and k not in ("passkey_stages", "passkey_logged_losses")
        }

    return [record(stage) for stage in report.get("passkey_stages", [])] + [record(report)]


def ship(args):
    """The passkey-tuned Samba (`--suffix`) into the package, packaged as the default model is (bf16, A_log/D
    float32), its training report listing every fine-tuning stage."""
    folder = WORK / f"samba-passkey{args.suffix}"
    model = SambaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    report = json.loads((folder / "training_report.json").read_text())
    stages = report["passkey_stages"] = passkey_stages(report)
    report.update(
        attention_reach=attention_reach(model.config),
        stretch=int(max(st.get("passkey_stretch_dt") or 1 for st in stages)),
    )
    report.update(
        stage_count=len(stages),
        all_passkey_steps=sum(st["passkey_steps"] for st in stages),
        all_passkey_minutes=round(sum(st["passkey_minutes"] for st in stages), 1),
        stage_commands="\n".join(
            f"{st.get('passkey_command_now', st['passkey_command'])}\n"
            f"    # {st['passkey_steps']} steps of "
            f"{st['passkey_batch_size']}, {st['passkey_minutes']} min on "
            f"{st['passkey_device']}"
            for st in stages
        ),
    )
    package(model, tokenizer, report, args.out, card=CARD)


CARD = """---
{metadata}
---

# samba-hf's passkey model

A {parameters:,}-parameter Samba (Mamba + sliding-window attention, 6 layers, hidden size 256, window {window}: its
three attention layers reach {attention_reach} tokens back at most). Pretrained at 512 tokens on the English \
text that ships
with Python ({pretrain_steps} steps of 8 x 512 tokens, {pretrain_minutes} minutes on 2 CPU cores), then fine-tuned
on passkey prompts of at most 512 tokens in {stage_count} stages ({all_passkey_steps} steps in all), with samba-hf's
examples/long_context.py (the second stage started from the passkey model shipped before, the first stage's):

```text
{stage_commands}
```

The later stages put the key beyond attention's reach and stretch the Mamba layers' step sizes (`--stretch-dt`), so
that only the recurrent state can answer and it must keep the key over up to {stretch} times the filler's length.
docs/long-context.md in samba-hf has the recipe and the measurements (passkey retrieval far past 512 tokens). It is a
demo of the evaluation tools, not a useful model.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True)  # or `import samba_hf` first
tokenizer = AutoTokenizer.from_pretrained("PATH")
```
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("train", "pretrain, then passkey-fine-tune, one architecture"),
        ("pretrain", "pretrain one architecture (writes ARCH-base)"),
        ("finetune", "passkey-fine-tune ARCH-base (writes ARCH-passkey)"),
    ):
        p = commands.add_parser(name, help=text)
        p.add_argument("arch", choices=list(INTERMEDIATE))
        p.add_argument("--pretrain-steps", type=int, default=200)
        p.add_argument("--passkey-steps", type=int, default=1600)
        p.add_argument("--passkey-batch-size", type=int, default=32)
        p.add_argument("--batch-size", type=int, default=8)
        p.add_argument("--lr", type=float, default=3e-3)
        p.add_argument("--passkey-lr", type=float, default=1.5e-3)
        p.add_argument("--passkey-min-length", type=int, default=128)
        p.add_argument(
            "--passkey-max-length",
            type=int,
            default=TRAINING_LENGTH,
            help="the longest fine-tuning prompt (shorter for a curriculum's first stage)",
        )
        p.add_argument(
            "--time-limit",
            type=float,
            default=None,
            help="stop the passkey fine-tuning after this many minutes (the report records the step "
            "reached, and the command with --stop-at that reruns it)",
        )
        p.add_argument(
            "--stop-at",
            type=int,
            default=None,
            help="stop the passkey fine-tuning after this step of its --passkey-steps schedule",
        )
        p.add_argument("--answer-only", action="store_true", help="fine-tune with the loss on the answer alone")
        p.add_argument("--suffix", default="", help="written to ARCH-passkeySUFFIX (trying recipes)")
        p.add_argument("--bf16", action="store_true", help="store the fine-tuned weights in bfloat16")
        p.add_argument("--start-from", default=None, help="fine-tune this model folder instead of ARCH-base")
        p.add_argument("--window", type=int, default=None, help="fine-tune with this sliding window (samba, mistral)")
        p.add_argument(
            "--stretch-dt",
            type=float,
            default=1.0,
            help="fine-tune with the Mamba step size dt of the filler tokens multiplied by a factor drawn "
            "per step from [1, K] (log-uniform): the filler stands for up to K times as much "
            "(TimeStretch)",
        )
        p.add_argument(
            "--stretch-tokens",
            choices=["filler", "all", "non-digits"],
            default="filler",
            help="the tokens --stretch-dt stretches (TimeStretch)",
        )
        p.add_argument("--passkey-weight-decay", type=float, default=0.1)
        p.add_argument(
            "--min-key-distance",
            type=int,
            default=0,
            help="fine-tuning prompts put the key at least this many tokens before their end",
        )
    p = commands.add_parser("evaluate", help="passkey and perplexity of the trained models")
    p.add_argument("--archs", default="samba,mistral,llama")
    p.add_argument("--tasks", default="passkey,perplexity,phonebook")
    p.add_argument("--lengths", default="512,1024,2048,4096,8192,16384,32768")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-chunk-size", type=int, default=2048)
    p.add_argument("--ppl-length", type=int, default=32768)
    p.add_argument("--orders", type=int, default=1)
    p.add_argument("--suffix", default="", help="evaluate ARCH-passkeySUFFIX; results as passkey_ARCHSUFFIX.json")
    p.add_argument(
        "--prompts",
        choices=["evaluation", "other", "text"],
        default="evaluation",
        help="passkey prompts from samba_hf.evaluation (the paper's), or built here independently with "
        "other fixed filler or unseen text as filler (results as passkey_ARCHSUFFIX_PROMPTS.json)",
    )
    commands.add_parser("plot", help="redraw the combined figures from long_context/*.json")
    p = commands.add_parser("retention", help="how much of the Mamba state survives a passkey prompt's filler")
    p.add_argument("--suffix", default="", help="samba-passkeySUFFIX")
    p.add_argument("--model", default=None, help="a model folder instead")
    p.add_argument("--lengths", default="512,2048,8192,32768")
    p = commands.add_parser("ship", help="write the passkey Samba into the package")
    p.add_argument("--out", default="src/samba_hf/passkey_model")
    p.add_argument("--suffix", default="", help="ship ARCH-passkeySUFFIX")
    args = parser.parse_args()
    if getattr(args, "stretch_dt", 1.0) < 1:
        parser.error(f"--stretch-dt must be at least 1 (1: no stretch), got {args.stretch_dt}")
    if getattr(args, "stretch_dt", 1.0) > 1 and args.arch != "samba":
        parser.error(f"--stretch-dt stretches Mamba layers: {args.arch} has none")
    if hasattr(args, "passkey_max_length"):
        if not args.passkey_min_length <= args.passkey_max_length <= TRAINING_LENGTH:
            parser.error(
                f"fine-tuning prompts need --passkey-min-length <= --passkey-max-length <= {TRAINING_LENGTH} "
                f"(the training length), got {args.passkey_min_length} and {args.passkey_max_length}"
            )
        if args.time_limit is not None and args.time_limit <= 0:
            parser.error(f"--time-limit is in minutes and must be positive, got {args.time_limit}")
        if args.stop_at is not None and not 1 <= args.stop_at <= args.passkey_steps:
            parser.error(
                f"--stop-at must be a step of the schedule, 1 to --passkey-steps ({args.passkey_steps}), "
                f"got {args.stop_at}"
            )
    folder = {
        "ship": lambda: WORK / f"samba-passkey{args.suffix}",
        "finetune": lambda: args.start_from,
        "retention": lambda: args.model or WORK / f"samba-passkey{args.suffix}",
    }.get(args.command, lambda: None)()
    if folder and not (Path(folder) / "training_report.json").is_file():
        parser.error(
            f"{folder} is not a model folder of this experiment (no training_report.json): "
            "fine-tune it first, or check --suffix / --start-from / --model"
        )
    torch.set_num_threads(max(1, torch.get_num_threads()))
    {
        "train": train,
        "pretrain": pretrain,
        "finetune": finetune,
        "evaluate": evaluate,
        "plot": plot,
        "retention": retention,
        "ship": ship,
    }[args.command](args)


if __name__ == "__main__":
    main()
