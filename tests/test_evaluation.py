"""samba_hf.evaluation and `samba-hf eval`: prompts, scoring, one-pass chunked likelihoods, the CLI's errors, and
oracle models (one that copies the key scores 100%, one that cannot see it scores 0)."""

import json
import random
import re
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoTokenizer,
    GenerationMixin,
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import CausalLMOutput

from samba_hf import SambaConfig, SambaForCausalLM
from samba_hf.cli import default_model_path
from samba_hf.evaluation import (
    PASSKEY_FILLER,
    PASSKEY_INSTRUCTION,
    PASSKEY_NEEDLE,
    PASSKEY_QUESTION,
    Prompt,
    answer,
    exact_match,
    passkey_eval,
    passkey_prompt,
    perplexity_by_position,
    phonebook_eval,
    phonebook_prompt,
    token_nll,
)
from samba_hf_cli import main


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


# ---- prompts ----


@pytest.mark.parametrize("length", [120, 333, 1000, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_passkey_prompt_length_and_depth(tokenizer, length, depth):
    filler, needle = ids_of(tokenizer, PASSKEY_FILLER), ids_of(tokenizer, PASSKEY_NEEDLE.format(key="90817"))
    prompt = passkey_prompt(tokenizer, length, depth, "90817")
    ids = prompt.input_ids
    assert length - len(filler) < len(ids) <= length  # as many whole filler sentences as fit
    assert tokenizer.decode(ids) == prompt.text  # the ids are the text's
    start = prompt.answer_start
    assert ids[start : start + len(needle)] == needle
    before = (start - len(ids_of(tokenizer, PASSKEY_INSTRUCTION))) // len(filler)
    after = (len(ids) - start - len(needle) - len(ids_of(tokenizer, PASSKEY_QUESTION))) // len(filler)
    assert before == round(depth * (before + after))
    assert ids[-len(ids_of(tokenizer, PASSKEY_QUESTION)) :] == ids_of(tokenizer, PASSKEY_QUESTION)
    assert prompt.text.count("90817") == 2 and prompt.answer == "90817"


def test_passkey_prompt_too_short_or_bad_depth(tokenizer):
    with pytest.raises(ValueError, match="needs at least"):
        passkey_prompt(tokenizer, 40, 0.5, "12345")
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(tokenizer, 400, 1.5, "12345")


def test_prompts_lead_with_the_tokenizers_own_start_token(tokenizer):
    from tokenizers.processors import TemplateProcessing

    with_bos = AutoTokenizer.from_pretrained(default_model_path())
    with_bos._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert with_bos("x").input_ids[0] == 1
    prompt = passkey_prompt(with_bos, 500, 0.5, "12345")
    assert prompt.input_ids[0] == 1 and prompt.input_ids.count(1) == 1 and len(prompt.input_ids) <= 500
    assert prompt.input_ids[1:] == passkey_prompt(tokenizer, 499, 0.5, "12345").input_ids


@pytest.mark.parametrize("length", [100, 300, 2000])
def test_phonebook_prompt(tokenizer, length):
    prompt = phonebook_prompt(tokenizer, length, random.Random(length))
    assert len(prompt.input_ids) <= length
    assert tokenizer.decode(prompt.input_ids) == prompt.text
    lines = prompt.text.splitlines()
    book = dict(line.split(": ") for line in lines[1:-2])
    asked = lines[-1].removesuffix(":")
    assert lines[-2] == f"What is the phone number of {asked}?"
    assert book[asked].replace("-", "") == prompt.answer and len(prompt.answer) == 10
    assert len(set(book)) == len(lines) - 3  # distinct names
    bigger = phonebook_prompt(tokenizer, length + 200, random.Random(length))
    assert len(bigger.text.splitlines()) > len(lines)  # longer prompts hold more entries


def test_exact_match():
    assert exact_match(" 48213. Remember", "48213")
    assert exact_match("48213", "48213")
    assert exact_match(" 4 8 2 1 3", "48213")  # digit-by-digit tokenizers may decode with spaces
    assert exact_match(" 609-323-7777\n", "6093237777")
    assert not exact_match(" 4821", "48213")
    assert not exact_match(" 482134", "48213")  # a longer number is another number
    assert not exact_match(" 48214", "48213")
    assert not exact_match(" the key is 48213", "48213")  # the digits must come first
    assert not exact_match("", "48213")


# ---- one pass through the cache, in chunks ----


def tiny_models():
    torch.manual_seed(0)
    shape = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return {
        "samba": SambaForCausalLM(
            SambaConfig(**shape, sliding_window=16, layer_types=["linear_attention", "sliding_attention"])
        ),
        "mistral": MistralForCausalLM(MistralConfig(**shape, sliding_window=16)),
        "llama": LlamaForCausalLM(LlamaConfig(**shape)),
        "mamba": MambaForCausalLM(MambaConfig(vocab_size=97, hidden_size=32, state_size=8, num_hidden_layers=2)),
    }


@pytest.mark.parametrize("name", ["samba", "mistral", "llama", "mamba"])
def test_chunked_likelihood_equals_one_pass(name):
    model = tiny_models()[name].eval()
    ids = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids[None]).logits[0].double()
    reference = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")  # no cache, no chunks
    # transformers' own Mamba continues a several-token chunk from its cache only to ~2e-3 (measured: its logits
    # differ that much from one pass when fed two halves by hand; its one-token steps are exact)
    tolerance = 5e-3 if name == "mamba" else 1e-4
    for chunk in (None, 100, 7, 16, 33):
        nll = token_nll(model, ids, prefill_chunk_size=chunk)
        assert nll.shape == (99,)
        torch.testing.assert_close(nll.double(), reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name", ["samba", "mistral", "llama"])
def test_chunked_generation_equals_one_pass(name):
    """`answer` prefills long prompts through generate(prefill_chunk_size=...): the same greedy tokens, from the same
    last logits, as the prompt read in one piece."""
    model = tiny_models()[name].eval()
    ids = torch.randint(4, 97, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    prompt = Prompt(ids, "", "12345", 0, answer_tokens=6)
    with torch.no_grad():
        whole = model.generate(
            torch.tensor([ids]),
            max_new_tokens=8,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        chunked = model.generate(
            torch.tensor([ids]),
            max_new_tokens=8,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            prefill_chunk_size=25,
        )
    assert chunked.sequences.tolist() == whole.sequences.tolist()
    torch.testing.assert_close(chunked.logits[0], whole.logits[0], rtol=1e-4, atol=1e-4)

    class Tokens:  # `answer` decodes with the tokenizer: here, the ids themselves
        pad_token_id, eos_token_id = 0, None

        def decode(self, ids, skip_special_tokens=True):
            return ",".join(map(str, ids.tolist()))

    expected = ",".join(map(str, whole.sequences[0, 120:].tolist()))
    assert answer(model, Tokens(), prompt, prefill_chunk_size=25) == expected
    assert answer(model, Tokens(), prompt, prefill_chunk_size=None) == expected


def test_perplexity_buckets():
    model = tiny_models()["samba"].eval()
    ids = torch.randint(0, 97, (90,), generator=torch.Generator().manual_seed(2))
    nll = token_nll(model, ids, prefill_chunk_size=None).double()
    result = perplexity_by_position(model, ids, bucket=32, prefill_chunk_size=20)
    assert [(b["start"], b["end"], b["tokens"]) for b in result["buckets"]] == [
        (0, 32, 31),
        (32, 64, 32),
        (64, 90, 26),
    ]
    for bucket, piece in zip(result["buckets"], (nll[:31], nll[31:63], nll[63:])):
        assert bucket["nll"] == pytest.approx(piece.mean().item(), rel=1e-5)
        assert bucket["perplexity"] == pytest.approx(torch.exp(piece.mean()).item(), rel=1e-5)
    assert result["tokens"] == 90 and result["nll"] == pytest.approx(nll.mean().item(), rel=1e-5)


# ---- oracles: a model that copies the key scores 100%, one that cannot see it scores 0 ----


class CopierConfig(PretrainedConfig):
    model_type = "induction-copier"

    def __init__(self, vocab_size=4096, window=None, **kwargs):
        self.vocab_size, self.window = vocab_size, window
        super().__init__(**kwargs)


class InductionCopier(PreTrainedModel, GenerationMixin):
    """A perfect induction head written out: the next token is the one that followed the longest earlier match of
    the context's end. It sees only the last `window` tokens when a window is set (a sliding window, no memory)."""

    config_class = CopierConfig
    _supports_cache_class = False

    def __init__(self, config):
        super().__init__(config)
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.post_init()

    def forward(self, input_ids, attention_mask=None, **kwargs):
        tokens = input_ids[0].tolist()
        seen = tokens[-self.config.window :] if self.config.window else tokens
        best, prediction = 0, 0
        for j in range(len(seen) - 1):
            k = 0
            while k <= j and seen[j - k] == seen[len(seen) - 1 - k] and k < len(seen) - 1:
                k += 1
            if k >= best and k > 0:
                best, prediction = k, seen[j + 1]
        logits = torch.full((1, 1, self.config.vocab_size), -1e4)
        logits[0, 0, prediction] = 0.0
        return CausalLMOutput(logits=logits)


def test_a_model_that_copies_the_key_scores_100_and_one_that_cannot_scores_0(tokenizer):
    copier = InductionCopier(CopierConfig(use_cache=False)).eval()
    copier.generation_config.use_cache = False
    result = passkey_eval(copier, tokenizer, [300, 700], [0.0, 0.5, 1.0], trials=3, seed=4, prefill_chunk_size=None)
    assert [c["accuracy"] for c in result["cells"]] == [1.0] * 6
    assert all(len(s["passkey"]) == 5 for c in result["cells"] for s in c["samples"])
    # seen through a 150-token window, the key is out of sight unless it is near the end
    blind = InductionCopier(CopierConfig(window=150, use_cache=False)).eval()
    blind.generation_config.use_cache = False
    result = passkey_eval(blind, tokenizer, [700], [0.0, 0.5], trials=3, seed=4, prefill_chunk_size=None)
    assert [c["accuracy"] for c in result["cells"]] == [0.0, 0.0]
    phonebook = phonebook_eval(copier, tokenizer, [200, 500], trials=3, seed=0, prefill_chunk_size=None)
    assert [r["accuracy"] for r in phonebook["rows"]] == [1.0, 1.0]


def test_evaluation_is_deterministic_under_a_seed(tokenizer):
    copier = InductionCopier(CopierConfig(use_cache=False)).eval()
    copier.generation_config.use_cache = False
    runs = [
        passkey_eval(copier, tokenizer, [300], [0.5], trials=2, seed=seed, prefill_chunk_size=None)
        for seed in (7, 7, 8)
    ]
    keys = [[s["passkey"] for s in run["cells"][0]["samples"]] for run in runs]
    assert keys[0] == keys[1] != keys[2]


# ---- the command line ----


def one_line_error(capsys, argv, *fragments):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("samba-hf: error: "), err
    assert "Traceback" not in "\n".join(err)
    for fragment in fragments:
        assert fragment in err[-1], err[-1]


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, tokenizer):
    """A tiny transformers Llama with the default model's tokenizer: eval takes any causal LM."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=4096,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
    )
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_eval_passkey_writes_json_and_heatmap_and_never_overwrites(capsys, tmp_path, llama_folder):
    argv = [
        "eval",
        "passkey",
        "--model",
        str(llama_folder),
        "--lengths",
        "150,300",
        "--depths",
        "0,1",
        "--trials",
        "1",
        "--out",
        str(tmp_path / "res"),
        "--prefill-chunk-size",
        "64",
        "--device",
        "cpu",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "depth" in captured.out and "150" in captured.out and "300" in captured.out
    assert "past this model's max_position_embeddings (256)" in captured.err  # measured there, but said
    result = json.loads((tmp_path / "res" / "passkey.json").read_text())
    assert [(c["length"], c["depth"]) for c in result["cells"]] == [(150, 0.0), (150, 1.0), (300, 0.0), (300, 1.0)]
    assert result["command"].startswith("samba-hf eval passkey")
    png = (tmp_path / "res" / "passkey.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    one_line_error(capsys, argv, "passkey.json exists; pass --force")
    assert (tmp_path / "res" / "passkey.png").read_bytes() == png
    assert main(argv + ["--force"]) == 0
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == ["passkey.json", "passkey.png"]  # no leftovers


def test_eval_perplexity_of_a_text_file(capsys, tmp_path, llama_folder):
    text = tmp_path / "text.txt"
    text.write_text("The grass is green and the sky is blue. " * 40)
    assert (
        main(
            [
                "eval",
                "perplexity",
                "--model",
                str(llama_folder),
                "--text",
                str(text),
                "--max-tokens",
                "250",
                "--bucket",
                "100",
                "--out",
                str(tmp_path / "res"),
            ]
        )
        == 0
    )
    rows = [line for line in capsys.readouterr().out.splitlines() if " - " in line]
    assert len(rows) == 3
    result = json.loads((tmp_path / "res" / "perplexity.json").read_text())
    assert result["tokens"] == 250 and [b["end"] for b in result["buckets"]] == [100, 200, 250]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["passkey", "--lengths", ""], "--lengths is empty"),
        (["passkey", "--lengths", "512,abc"], "comma-separated whole numbers"),
        (["passkey", "--lengths", "0"], "at least 1"),
        (["passkey", "--lengths", "512,1000000000000"], "--lengths 1000000000000 is more than the 16,777,216 tokens"),
        (["phonebook", "--lengths", "16777217"], "--lengths 16777217 is more than the 16,777,216 tokens"),
        (["passkey", "--depths", "0,1.5"], "from 0 to 1"),
        (["passkey", "--depths", "nan"], "from 0 to 1"),
        (["passkey", "--trials", "0"], "--trials must be at least 1"),
        (["phonebook", "--trials", "-1"], "--trials must be at least 1"),
        (["passkey", "--prefill-chunk-size", "0"], "--prefill-chunk-size must be at least 1"),
        (["perplexity", "--bucket", "0"], "--bucket must be at least 1"),
        (["perplexity", "--max-tokens", "1"], "at least 2"),
        (["passkey", "--model", ""], "--model is empty"),
        (["passkey", "--seed", "-3"], "--seed must be between 0 and 2**64 - 1, got -3"),
        (["phonebook", "--seed", str(2**64)], f"--seed must be between 0 and 2**64 - 1, got {2**64}"),
        (["passkey", "--lengths", "20"], "--lengths 20: a passkey prompt needs at least"),
        (["phonebook", "--lengths", "10"], "--lengths 10: a phonebook prompt needs more than"),
        (["perplexity", "--text", "/nonexistent/file.txt"], "no such file"),
    ],
)
def test_eval_mistakes(capsys, argv, fragment):
    one_line_error(
        capsys,
        ["eval", *argv, "--model", default_model_path()] if "--model" not in argv else ["eval", *argv],
        fragment,
    )


def test_eval_file_mistakes(capsys, tmp_path, llama_folder):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 10)
    one_line_error(
        capsys,
        ["eval", "perplexity", "--model", str(llama_folder), "--text", str(tmp_path / "latin1.txt")],
        "not UTF-8 text",
    )
    (tmp_path / "empty.txt").write_text("")
    one_line_error(
        capsys,
        ["eval", "perplexity", "--model", str(llama_folder), "--text", str(tmp_path / "empty.txt")],
        "perplexity needs at least 2",
    )
    (tmp_path / "file").write_text("x")
    one_line_error(
        capsys,
        ["eval", "passkey", "--model", str(llama_folder), "--out", str(tmp_path / "file")],
        "is a file; give a folder",
    )
    one_line_error(capsys, ["eval", "passkey", "--model", str(tmp_path / "nope")], "no such model folder")


def test_eval_kernels_on_a_model_that_is_not_samba_s(capsys, tmp_path, llama_folder):
    """--kernels chooses samba-hf's kernels: given with a model of another library (which eval takes), one line
    instead of a switch that would do nothing."""
    text = tmp_path / "text.txt"
    text.write_text("The grass is green and the sky is blue. " * 10)
    argv = ["eval", "perplexity", "--model", str(llama_folder), "--text", str(text), "--kernels", "pytorch"]
    one_line_error(capsys, argv, "--kernels pytorch chooses samba-hf's kernels", "is not a samba-hf model")


def test_eval_refuses_a_model_with_weights_missing(capsys, tmp_path, llama_folder):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(llama_folder, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    one_line_error(
        capsys,
        ["eval", "passkey", "--model", str(broken), "--lengths", "150"],
        "lack model.layers.1.mlp.down_proj.weight",
        "nothing was run",
    )


def test_embedded_models():
    assert default_model_path().endswith("default_model")
    assert (Path(default_model_path("passkey")) / "config.json").is_file()
    assert default_model_path("passkey") != default_model_path()
    with pytest.raises(ValueError, match="no embedded model 'nope'"):
        default_model_path("nope")


def test_the_passkey_model_answers_past_its_training_length_through_plain_generate():
    """The shipped passkey Samba (fine-tuned on prompts of at most 512 tokens, window 64: its three attention layers
    reach 189 tokens back) through `model.generate` alone: the prompt as text, chunked prefill, greedy. What
    docs/long-context.md measured: keys far beyond attention's reach, which only the Mamba state can carry, found at
    2x, 16x and 64x the fine-tuning length."""
    from transformers import AutoModelForCausalLM

    path = default_model_path("passkey")
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    reach = (model.config.sliding_window - 1) * model.config.layer_types.count("sliding_attention")
    assert reach == 189
    for length, depth, key in ((1024, 0.5, "68142"), (8192, 0.0, "30917"), (32768, 0.25, "52706")):
        prompt = passkey_prompt(tokenizer, length, depth, key)
        ids = tokenizer(prompt.text, return_tensors="pt").input_ids
        assert ids[0].tolist() == prompt.input_ids
        assert len(prompt.input_ids) - prompt.answer_start > reach
        out = model.generate(ids, max_new_tokens=7, do_sample=False, prefill_chunk_size=4096)
        assert exact_match(tokenizer.decode(out[0, ids.shape[1] :]), key), (length, depth)


def test_eval_passkey_runs_the_passkey_model_by_default(capsys):
    assert main(["eval", "passkey", "--lengths", "1024", "--depths", "0.5", "--trials", "2"]) == 0
    captured = capsys.readouterr()
    assert "embedded passkey model" in captured.err
    assert captured.out.splitlines()[-1].split() == ["0.50", "100%"]


def test_eval_says_what_it_is_about_to_run_before_it_runs(capsys, llama_folder, monkeypatch):
    """A bare `eval passkey` names its prompts, the longest and the tokens in all; the line comes before any prompt."""
    import samba_hf.evaluation as evaluation
    from samba_hf.cli import _say_the_work
    from samba_hf_cli import build_parser, check_eval_arguments

    args = build_parser().parse_args(["eval", "passkey"])
    check_eval_arguments(args)
    _say_the_work(args)
    assert capsys.readouterr().err == (
        "samba-hf: passkey: 24 prompts (4 lengths x 3 depths x 2 trials), the longest "
        "32,768 tokens, up to 261,120 tokens in all\n"
    )
    said = []
    run = evaluation.phonebook_eval
    monkeypatch.setattr(
        evaluation,
        "phonebook_eval",
        lambda *args, **kwargs: said.append(capsys.readouterr().err) or run(*args, **kwargs),
    )
    assert main(["eval", "phonebook", "--model", str(llama_folder), "--lengths", "120", "--trials", "1"]) == 0
    assert said[0].endswith(
        "samba-hf: phonebook: 1 prompt (1 length x 1 trial), the longest 120 tokens, up to 120 tokens in all\n"
    )


def test_long_work_gets_an_estimate_and_a_bar_of_tokens_inside_a_prompt(capsys, tokenizer, llama_folder, monkeypatch):
    """Work longer than `progress_after` seconds is sized from its first forward (one prefill chunk), and a prompt
    that runs longer shows the tokens read so far; shorter work shows neither. Here the threshold is 0 seconds."""
    import samba_hf.evaluation as evaluation

    model = LlamaForCausalLM.from_pretrained(llama_folder).eval()
    said = []
    passkey_eval(
        model,
        tokenizer,
        [300],
        [0.5],
        trials=2,
        prefill_chunk_size=64,
        progress=True,
        say=said.append,
        progress_after=0,
    )
    assert len(said) == 1 and re.fullmatch(
        r"the first 64 tokens took \d+\.\d s: about \d+ seconds for all 600 at "
        r"that rate",
        said[0],
    ), said
    err = capsys.readouterr().err
    assert re.search(r"tokens: +\d+%.*\| *[\d.]+/\d+ ", err), err  # a bar of tokens inside the prompt ("64.0/298")
    passkey_eval(
        model,
        tokenizer,
        [300],
        [0.5],
        trials=1,
        prefill_chunk_size=64,
        progress=True,
        say=said.append,
        progress_after=3600,
    )
    assert len(said) == 1 and "tokens:" not in capsys.readouterr().err
    monkeypatch.setattr(evaluation, "PROGRESS_AFTER_S", 0)  # the CLI's threshold
    assert (
        main(
            [
                "eval",
                "passkey",
                "--model",
                str(llama_folder),
                "--lengths",
                "200",
                "--depths",
                "1",
                "--trials",
                "1",
                "--prefill-chunk-size",
                "50",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "samba-hf: the first 50 tokens took" in err and "for all 200 at that rate" in err and "tokens:" in err


def test_eval_phonebook_says_when_the_model_was_never_taught_the_task(capsys, llama_folder, monkeypatch):
    import samba_hf.evaluation as evaluation

    assert main(["eval", "phonebook", "--lengths", "120", "--trials", "1"]) == 0  # the embedded default model
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1].split() == ["120", "tokens", "0%"]
    assert captured.err.splitlines()[-1] == (
        "samba-hf: note: 0% at every length, as expected: the embedded default model was never trained for phonebook "
        "lookup (it writes documentation-flavoured English); pass --model to evaluate a model that was"
    )
    assert main(["eval", "phonebook", "--model", str(llama_folder), "--lengths", "120", "--trials", "1"]) == 0
    assert (
        "0% at every length: the model found no number at all, as one never trained for phonebook lookup does"
        in (capsys.readouterr().err.splitlines()[-1])
    )
    right = {"rows": [{"length": 120, "accuracy": 0.2, "samples": []}]}  # one right answer in five: no note
    monkeypatch.setattr(evaluation, "phonebook_eval", lambda *args, **kwargs: dict(right))
    assert main(["eval", "phonebook", "--model", str(llama_folder), "--lengths", "120", "--trials", "5"]) == 0
    assert "note" not in capsys.readouterr().err


def test_eval_interrupted_while_writing_leaves_no_partial_file(capsys, tmp_path, llama_folder, monkeypatch):
    import samba_hf.evaluation as evaluation

    def interrupted(result, path, title=""):
        open(path, "wb").write(b"\x89PNG half")  # a plot cut off halfway
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluation, "plot_passkey", interrupted)
    out = tmp_path / "res"
    assert (
        main(
            [
                "eval",
                "passkey",
                "--model",
                str(llama_folder),
                "--lengths",
                "150",
                "--depths",
                "0",
                "--trials",
                "1",
                "--out",
                str(out),
            ]
        )
        == 130
    )
    assert "interrupted" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["passkey.json"]  # complete; no plot, no temporary file
    assert json.loads((out / "passkey.json").read_text())["cells"][0]["length"] == 150


def test_eval_and_generate_take_a_sentencepiece_model_file(capsys, tmp_path, llama_folder):
    """`--tokenizer FILE.model` is read as `convert` reads it (tokenizer_from_sentencepiece), by eval and generate
    alike; a damaged one, or another kind of file, is one error line that says what --tokenizer takes."""
    sentencepiece = pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")
    import io

    from conftest import tiny_model

    from samba_hf.conversion.sentencepiece_tokenizer import tokenizer_from_sentencepiece
    from samba_hf.model_folder import tokenizer_for

    blob = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([PASSKEY_FILLER, PASSKEY_INSTRUCTION, "The pass key is 12345. Remember it."] * 20),
        model_writer=blob,
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
        hard_vocab_limit=False,
    )
    model_file = tmp_path / "tokenizer.model"
    model_file.write_bytes(blob.getvalue())
    tiny_model(vocab_size=400).save_pretrained(tmp_path / "samba")  # no tokenizer of its own
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    text = "The grass is green. The pass key is 90817."
    tokenizer = tokenizer_for(tmp_path / "samba", model_file)
    assert tokenizer(text).input_ids == sp.encode_as_ids(text)
    assert tokenizer.get_vocab() == tokenizer_from_sentencepiece(model_file).get_vocab()
    eval_argv = [
        "eval",
        "passkey",
        "--model",
        str(llama_folder),
        "--lengths",
        "300",
        "--depths",
        "0",
        "--trials",
        "1",
        "--tokenizer",
        str(model_file),
    ]
    generate_argv = [
        "generate",
        "The grass is green.",
        "--model",
        str(tmp_path / "samba"),
        "--max-new-tokens",
        "2",
        "--tokenizer",
        str(model_file),
    ]
    assert main(eval_argv) == 0
    assert main(generate_argv) == 0
    capsys.readouterr()
    (tmp_path / "cut.model").write_bytes(blob.getvalue()[:100])
    (tmp_path / "tokenizer.json").write_text("{}")
    for argv in (eval_argv, generate_argv):
        one_line_error(capsys, [*argv[:-1], str(tmp_path / "cut.model")], "cut.model is not a SentencePiece model")
        one_line_error(capsys, [*argv[:-1], str(tmp_path / "missing.model")], "no such file: ")
        one_line_error(
            capsys,
            [*argv[:-1], str(tmp_path / "tokenizer.json")],
            "--tokenizer takes a tokenizer folder (tokenizer.json, tokenizer_config.json, ...), a Hub name "
            "or a SentencePiece .model file",
        )
