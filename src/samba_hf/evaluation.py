"""Long-context evaluations for any causal LM that transformers loads (Samba, SambaY, Llama, Mistral, Mamba, ...).

- **Passkey retrieval** (Samba paper, Figure 3; Mohtashami & Jaggi 2023): a five-digit key hidden at a chosen depth
  in repeated filler text; the model must answer it after "What is the pass key? The pass key is". Exact match of
  the generated digits, over context lengths x depths x trials.
- **Phonebook lookup** (Jelassi et al. 2024, as used by the Samba paper): "Name Surname: 555-123-4567" lines, then
  one name is asked for. Accuracy vs length.
- **Perplexity vs position**: the negative log-likelihood of every token of one long text, read off one pass
  through the cache (not a sliding recomputation), averaged in position buckets.

Prompts are built from token ids piece by piece, so their lengths in tokens are known exactly (never more than asked)
and the key sits where it was put. Long inputs go through the model's cache in chunks of `prefill_chunk_size`
tokens (passkey and phonebook through `model.generate(prefill_chunk_size=...)`), so memory is bounded by the chunk.
Every random choice comes from the seed. `samba-hf eval ...` runs these from the command line.
"""

import inspect
import math
import random
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

PASSKEY_INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
PASSKEY_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = " What is the pass key? The pass key is"

FIRST_NAMES = (
    "James Mary John Patricia Robert Jennifer Michael Linda William Elizabeth David Barbara Richard Susan Joseph "
    "Jessica Thomas Sarah Charles Karen Daniel Nancy Matthew Lisa Anthony Betty Mark Sandra Donald Ashley Steven "
    "Emily Paul Donna Andrew Michelle Joshua Carol Kenneth Amanda Kevin Melissa Brian Deborah George Stephanie"
).split()
LAST_NAMES = (
    "Smith Johnson Williams Brown Jones Garcia Miller Davis Rodriguez Martinez Hernandez Lopez Gonzalez Wilson "
    "Anderson Thomas Taylor Moore Jackson Martin Lee Perez Thompson White Harris Sanchez Clark Ramirez Lewis "
    "Robinson Walker Young Allen King Wright Scott Torres Nguyen Hill Flores Green Adams Nelson Baker Hall Rivera"
).split()


@dataclass
class Prompt:
    """One evaluation prompt: its token ids (a 1D list, what the model reads), its text and the expected answer."""

    input_ids: list[int]
    text: str
    answer: str  # the digits the model must generate
    answer_start: int  # token index where the hidden fact (key sentence / asked entry) starts
    answer_tokens: int  # tokens of the answer as the text writes it (" 48213", " 555-123-4567")


def _pieces(tokenizer, *texts: str) -> list[list[int]]:
    """Token ids of each text piece; the tokenizer's own start token (BOS), if it adds one, leads the first."""
    ids = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    with_special = tokenizer(texts[0]).input_ids
    prefix = with_special[: len(with_special) - len(ids[0])] if with_special[-len(ids[0]) :] == ids[0] else []
    return [prefix + ids[0], *ids[1:]]


def random_digits(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def passkey_prompt(tokenizer, length: int, depth: float, passkey: str) -> Prompt:
    """The passkey prompt of at most `length` tokens (as many whole filler sentences as fit) with the key sentence
    after `depth` (0 = first, 1 = last) of the filler: instruction, filler, key, filler, question."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be between 0 and 1, got {depth}")
    instruction, filler, needle, question = _pieces(
        tokenizer, PASSKEY_INSTRUCTION, PASSKEY_FILLER, PASSKEY_NEEDLE.format(key=passkey), PASSKEY_QUESTION
    )
    fixed = len(instruction) + len(needle) + len(question)
    repeats = (length - fixed) // len(filler)
    if repeats < 1:
        raise ValueError(
            f"a passkey prompt needs at least {fixed + len(filler)} tokens with this tokenizer; {length} asked"
        )
    before = round(depth * repeats)
    ids = instruction + filler * before + needle + filler * (repeats - before) + question
    text = (
        PASSKEY_INSTRUCTION
        + PASSKEY_FILLER * before
        + PASSKEY_NEEDLE.format(key=passkey)
        + PASSKEY_FILLER * (repeats - before)
        + PASSKEY_QUESTION
    )
    answer_tokens = len(tokenizer(" " + passkey, add_special_tokens=False).input_ids)
    return Prompt(ids, text, passkey, len(instruction) + before * len(filler), answer_tokens)


PHONEBOOK_HEADER = "Below is a phonebook. Find the phone number of the person asked for.\n"
PHONEBOOK_QUESTION = "What is the phone number of {name}?\n{name}:"


def phonebook_prompt(tokenizer, length: int, rng: random.Random) -> Prompt:
    """A phonebook of as many "First Last: ddd-ddd-dddd" lines as fit in `length` tokens together with the
    question (distinct names while the 2,116 last), then the question for one entry picked at random."""
    names = [f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES]
    rng.shuffle(names)
    (header,) = _pieces(tokenizer, PHONEBOOK_HEADER)
    lines, entries, questions, used = [], [], [], len(header)

    def question_ids(name):
        return tokenizer(PHONEBOOK_QUESTION.format(name=name), add_special_tokens=False).input_ids

    while True:
        name = names[len(entries) % len(names)]
        number = f"{random_digits(rng, 3)}-{random_digits(rng, 3)}-{random_digits(rng, 4)}"
        line = tokenizer(f"{name}: {number}\n", add_special_tokens=False).input_ids
        question = question_ids(name)
        longest = max([len(question), *map(len, questions)])  # whichever entry is asked, its question fits
        if used + len(line) + longest > length:
            break
        lines.append(line)
        entries.append((name, number))
        questions.append(question)
        used += len(line)
    if not entries:
        raise ValueError(f"a phonebook prompt needs more than {length} tokens with this tokenizer")
    asked = rng.randrange(len(entries))
    name, number = entries[asked]
    ids = header + [i for line in lines for i in line] + questions[asked]
    text = PHONEBOOK_HEADER + "".join(f"{n}: {p}\n" for n, p in entries) + PHONEBOOK_QUESTION.format(name=name)
    answer_tokens = len(tokenizer(" " + number, add_special_tokens=False).input_ids)
    return Prompt(ids, text, number.replace("-", ""), len(header) + sum(map(len, lines[:asked])), answer_tokens)


def exact_match(generated: str, answer: str) -> bool:
    """Whether the digits the model generated first (ignoring spaces and dashes between them) are the answer."""
    digits = re.match(r"[\s\-]*([\d\s\-]*)", generated).group(1)
    return re.sub(r"\D", "", digits)[: len(answer) + 1] == answer


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _new_tokens(prompt: Prompt) -> int:
    """The tokens `answer` generates: enough for the answer and two more."""
    return prompt.answer_tokens + 2


@torch.no_grad()
def answer(model, tokenizer, prompt: Prompt, prefill_chunk_size: int | None = 2048) -> str:
    """Greedy continuation of the prompt (enough tokens for the answer and two more), through `model.generate`;
    prompts longer than `prefill_chunk_size` tokens are prefilled through the cache in chunks of that size."""
    ids = torch.tensor([prompt.input_ids], device=_device(model))
    new = _new_tokens(prompt)
    chunked = prefill_chunk_size is not None and ids.shape[1] > prefill_chunk_size
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        prefill_chunk_size=prefill_chunk_size if chunked else None,
        pad_token_id=pad,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def _trial_rng(seed: int, *where) -> random.Random:
    return random.Random("-".join(map(str, (seed, *where))))  # string seeds are hashed: stable across runs


def _progress(total: int, enabled: bool, what: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc=what, unit="prompt", leave=False)


PROGRESS_AFTER_S = 5.0  # a run or a prompt that takes longer than this gets an estimate / a bar of its tokens


class _TokenProgress:
    """What `progress=True` shows inside the prompts, counting the tokens each forward of the model reads: once the
    first forward of the run is done, an estimate of the whole run at that forward's rate (said through `say`, when
    the run looks longer than `after` seconds); in a prompt that runs past `after` seconds, a bar of its tokens read
    so far."""

    def __init__(self, total_tokens: int, enabled: bool, say=None, after: float | None = None):
        self.total, self.enabled, self.say = total_tokens, enabled, say
        self.after = PROGRESS_AFTER_S if after is None else after
        self.estimated, self.bar = False, None

    @contextmanager
    def prompt(self, model, tokens: int):
        """Counts the tokens `model` reads inside the block: one prompt and its answer, `tokens` in all."""
        if not self.enabled:
            yield
            return
        self.tokens, self.read, self.start = tokens, 0, time.perf_counter()
        hooks = [
            model.register_forward_pre_hook(lambda *_: setattr(self, "forward_start", time.perf_counter())),
            model.register_forward_hook(
                lambda module, args, kwargs, output: self._forward(args, kwargs), with_kwargs=True
            ),
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    def _forward(self, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        read = ids.shape[-1] if ids is not None else kwargs["inputs_embeds"].shape[1]
        self.read += read
        now = time.perf_counter()
        if not self.estimated:  # the run's first forward
            self.estimated = True
            seconds = now - self.forward_start
            whole = seconds * self.total / read
            if whole > self.after and self.say is not None:
                self.say(
                    f"the first {read:,} tokens took {seconds:.1f} s: about {_duration(whole)} for all "
                    f"{self.total:,} at that rate"
                )
        if self.bar is None and now - self.start > self.after:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=self.tokens, initial=self.read, desc="tokens", unit="token", unit_scale=True, leave=False
            )
        elif self.bar is not None:
            self.bar.update(read)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} seconds"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds / 3600:.1f} hours"


def passkey_eval(
    model,
    tokenizer,
    lengths,
    depths,
    trials: int = 5,
    seed: int = 0,
    digits: int = 5,
    prefill_chunk_size: int | None = 2048,
    progress: bool = False,
    say=None,
    progress_after: float | None = None,
) -> dict:
    """Passkey accuracy for every (length, depth): `trials` prompts each, with keys drawn from the seed.
    `progress`: bars of the prompts and, in prompts longer than `progress_after` seconds, of their tokens; an
    estimate of the whole run from its first forward, said through `say` (a function of one line of text)."""
    cells = []
    bar = _progress(len(lengths) * len(depths) * trials, progress, "passkey")
    tokens = _TokenProgress(sum(lengths) * len(depths) * trials, progress, say, progress_after)
    for length in lengths:
        for depth in depths:
            correct, samples = 0, []
            for trial in range(trials):
                key = random_digits(_trial_rng(seed, length, depth, trial), digits)
                prompt = passkey_prompt(tokenizer, length, depth, key)
                with tokens.prompt(model, len(prompt.input_ids) + _new_tokens(prompt)):
                    generated = answer(model, tokenizer, prompt, prefill_chunk_size)
                correct += exact_match(generated, key)
                samples.append({"passkey": key, "generated": generated, "tokens": len(prompt.input_ids)})
                bar.update()
            cells.append({"length": length, "depth": depth, "accuracy": correct / trials, "samples": samples})
    bar.close()
    return {
        "task": "passkey",
        "lengths": list(lengths),
        "depths": list(depths),
        "trials": trials,
        "seed": seed,
        "cells": cells,
    }


def phonebook_eval(
    model,
    tokenizer,
    lengths,
    trials: int = 10,
    seed: int = 0,
    prefill_chunk_size: int | None = 2048,
    progress: bool = False,
    say=None,
    progress_after: float | None = None,
) -> dict:
    """Phonebook lookup accuracy for every length: `trials` books each, drawn from the seed (`progress`, `say`,
    `progress_after`: as for `passkey_eval`)."""
    rows = []
    bar = _progress(len(lengths) * trials, progress, "phonebook")
    tokens = _TokenProgress(sum(lengths) * trials, progress, say, progress_after)
    for length in lengths:
        correct, samples = 0, []
        for trial in range(trials):
            prompt = phonebook_prompt(tokenizer, length, _trial_rng(seed, length, trial))
            with tokens.prompt(model, len(prompt.input_ids) + _new_tokens(prompt)):
                generated = answer(model, tokenizer, prompt, prefill_chunk_size)
            correct += exact_match(generated, prompt.answer)
            samples.append({"number": prompt.answer, "generated": generated, "tokens": len(prompt.input_ids)})
            bar.update()
        rows.append({"length": length, "accuracy": correct / trials, "samples": samples})
    bar.close()
    return {"task": "phonebook", "lengths": list(lengths), "trials": trials, "seed": seed, "rows": rows}


def _cache_argument(model) -> str:
    """The name under which the model's forward takes its cache: `cache` from transformers 5.24 on (samba-hf's
    models take it with any version), `past_key_values` up to 5.23 (`cache_params` for its Mamba)."""
    parameters = inspect.signature(model.forward).parameters
    names = [name for name in ("cache", "past_key_values", "cache_params") if name in parameters]
    return names[0] if names else "past_key_values"


def _returned_cache(output):
    """The cache a forward returned, under the field name of the installed transformers (`cache` from 5.24 on)."""
    return next((output[name] for name in ("cache", "past_key_values", "cache_params") if name in output.keys()), None)


@torch.no_grad()
def token_nll(
    model, input_ids: torch.Tensor, prefill_chunk_size: int | None = 2048, progress: bool = False
) -> torch.Tensor:
    """-log p(token t | tokens < t) for t = 1 .. n-1 of one sequence (1D ids), in float32, from one pass: chunks of
    `prefill_chunk_size` tokens go through the cache, each chunk's last logits score the next chunk's first token."""
    ids = input_ids.reshape(1, -1).to(_device(model))
    chunk = prefill_chunk_size or ids.shape[1]
    argument, cache, losses, previous = _cache_argument(model), None, [], None
    starts = range(0, ids.shape[1], chunk)
    bar = _progress(len(starts), progress, "perplexity")
    bar.unit = "chunk"
    for start in starts:
        piece = ids[:, start : start + chunk]
        kwargs = {argument: cache, "use_cache": True}
        if argument == "cache_params" and cache is not None:
            kwargs["cache_position"] = torch.arange(start, start + piece.shape[1], device=ids.device)
        out = model(input_ids=piece, **kwargs)
        cache = _returned_cache(out)
        logits = out.logits[0].float()  # (chunk, vocab): logits[i] predicts the token after piece[i]
        if previous is None:  # the first token has nothing before it to be scored from
            losses.append(torch.nn.functional.cross_entropy(logits[:-1], piece[0, 1:], reduction="none"))
        else:
            scoring = torch.cat([previous, logits[:-1]])
            losses.append(torch.nn.functional.cross_entropy(scoring, piece[0], reduction="none"))
        previous = logits[-1:]
        bar.update()
    bar.close()
    return torch.cat(losses).cpu()


def perplexity_by_position(
    model, input_ids: torch.Tensor, bucket: int = 512, prefill_chunk_size: int | None = 2048, progress: bool = False
) -> dict:
    """Mean NLL and perplexity of the tokens in each `bucket`-token span of positions of one long sequence."""
    nll = token_nll(model, input_ids, prefill_chunk_size, progress)
    positions = torch.arange(1, nll.numel() + 1)  # nll[i] scores the token at position i + 1
    buckets = []
    for start in range(0, int(positions[-1]) + 1, bucket):
        inside = (positions >= start) & (positions < start + bucket)
        if inside.any():
            mean = nll[inside].double().mean().item()
            buckets.append(
                {
                    "start": start,
                    "end": min(start + bucket, int(positions[-1]) + 1),
                    "tokens": int(inside.sum()),
                    "nll": mean,
                    "perplexity": math.exp(mean),
                }
            )
    return {
        "task": "perplexity",
        "tokens": int(nll.numel()) + 1,
        "bucket": bucket,
        "buckets": buckets,
        "nll": nll.double().mean().item(),
    }


def default_text() -> str:
    """Long English text that comes with every Python: the documentation topics of `pydoc_data`, in name order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


# ---- plots (matplotlib, the `eval` extra) ----


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("plots need matplotlib: pip install matplotlib (or samba-hf[eval])") from error
    return plt


def _length_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def plot_passkey(result: dict, path: str, title: str = "") -> None:
    """Heatmap like the paper's Figure 4: context length on x, key depth on y, accuracy as colour and number."""
    plt = _pyplot()
    lengths, depths = result["lengths"], result["depths"]
    grid = [
        [next(c["accuracy"] for c in result["cells"] if c["length"] == n and c["depth"] == d) for n in lengths]
        for d in depths
    ]
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(lengths), 1.2 + 0.45 * len(depths)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for y, row in enumerate(grid):
        for x, value in enumerate(row):
            ax.text(x, y, f"{value:.0%}".replace("%", ""), ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("passkey depth")
    ax.set_title(title or "passkey retrieval accuracy (%)")
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_perplexity(results: dict, path: str, title: str = "", training_length: int | None = None) -> None:
    """Perplexity per position bucket, one line per model (`results`: name -> perplexity_by_position result)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, result in results.items():
        ends = [b["end"] for b in result["buckets"]]
        ax.plot(ends, [b["perplexity"] for b in result["buckets"]], marker=".", label=name)
    if training_length:
        ax.axvline(training_length, color="grey", linestyle=":", label="training length")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel(f"perplexity per {next(iter(results.values()))['bucket']}-token bucket")
    ax.set_title(title or "perplexity vs position")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_phonebook(results: dict, path: str, title: str = "") -> None:
    """Phonebook accuracy vs length, one line per model (`results`: name -> phonebook_eval result)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, result in results.items():
        ax.plot([r["length"] for r in result["rows"]], [r["accuracy"] for r in result["rows"]], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("phonebook length (tokens)")
    ax.set_ylabel("accuracy")
    ax.set_title(title or "phonebook lookup")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
