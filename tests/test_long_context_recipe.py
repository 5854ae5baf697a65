"""The pieces of examples/long_context.py's passkey recipe that the trained models depend on: the time-stretch
augmentation (exact on the Mamba step sizes, gone after training), the fine-tuning prompts' key distance, and the
independently built evaluation prompts."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from transformers import AutoTokenizer

from samba_hf.cli import default_model_path
from samba_hf.evaluation import PASSKEY_FILLER, PASSKEY_INSTRUCTION, PASSKEY_NEEDLE, PASSKEY_QUESTION

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import long_context  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path("passkey"))  # the experiment's: one token per digit


def record(model, seen):
    """Hooks that keep softplus(dt_proj(...)) of every Mamba layer, as the mixer computes it."""
    return [
        m.dt_proj.register_forward_hook(lambda mod, args, out: seen.append(torch.nn.functional.softplus(out)))
        for m in model.modules()
        if hasattr(m, "dt_proj")
    ]


def test_time_stretch_multiplies_the_fillers_step_sizes_while_training_only():
    model, ids = tiny_model(), torch.randint(0, 90, (2, 12))
    filler = torch.ones(2, 12, dtype=torch.bool)
    filler[0, 3], filler[1, 7:9] = False, False  # the key sentence: read unstretched
    raw, stretched = [], []
    before = record(model, raw)  # hooks run in the order they were registered: before and after the stretch
    stretch = long_context.TimeStretch(model, max_factor=64.0, seed=3)
    after = record(model, stretched)
    model.train()(input_ids=ids, filler=filler)
    assert 1.0 < stretch.factor <= 64.0 and len(raw) == len(stretched) == 2
    factor = torch.where(filler, stretch.factor, 1.0)[..., None]
    for a, b in zip(raw, stretched):
        torch.testing.assert_close(b, factor * a, rtol=1e-5, atol=1e-8)
    factors = set()
    for _ in range(5):  # a new factor for every training forward
        model(input_ids=ids, filler=filler)
        factors.add(stretch.factor)
    assert len(factors) == 5 and all(1.0 <= f <= 64.0 for f in factors)
    raw.clear(), stretched.clear()
    logits = model.eval()(input_ids=ids, filler=filler).logits  # evaluation runs unstretched
    for a, b in zip(raw, stretched):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    stretch.remove()
    for hook in before + after:
        hook.remove()
    torch.testing.assert_close(model.train()(ids).logits, logits, rtol=0, atol=0)  # removed: the plain model


@pytest.mark.parametrize("tokens", ["all", "non-digits"])
def test_time_stretch_of_the_earlier_stages(tokens):
    model, ids = tiny_model(), torch.randint(10, 90, (1, 12))
    ids[0, 4:6] = 3  # a "digit"
    raw, stretched = [], []
    record(model, raw)
    stretch = long_context.TimeStretch(model, max_factor=64.0, tokens=tokens, digit_ids=range(10), seed=1)
    record(model, stretched)
    model.train()(input_ids=ids, filler=torch.zeros(1, 12, dtype=torch.bool))  # the filler mask is not used
    factor = torch.full((1, 12, 1), stretch.factor)
    if tokens == "non-digits":
        factor[0, 4:6] = 1.0
    for a, b in zip(raw, stretched):
        torch.testing.assert_close(b, factor * a, rtol=1e-5, atol=1e-8)


def test_time_stretch_needs_mamba_layers():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    with pytest.raises(ValueError, match="needs a model with Mamba layers"):
        long_context.TimeStretch(llama, 8.0)


def test_fine_tuning_prompts_keep_the_key_beyond_reach(tokenizer):
    samples = long_context.PasskeySamples(tokenizer, 20, 512, 400, answer_only=True, min_key_distance=320)
    for i in range(20):
        sample = samples[i]
        ids, labels = sample["input_ids"], sample["labels"]
        answer = [t for t in labels if t != -100]
        assert 400 - 30 <= len(ids) <= 512 and ids[-len(answer) :] == answer  # whole filler sentences: up to one fewer
        key = tokenizer.decode(answer).strip(" .")
        assert len(key) == 5 and key.isdigit()
        prompt = tokenizer.decode(ids[: -len(answer)])
        assert prompt.endswith(" What is the pass key? The pass key is")
        # the key's first mention lies at least 320 tokens before the end of the prompt
        where = prompt.index(f"The pass key is {key}")
        assert len(ids) - len(answer) - len(tokenizer(prompt[:where], add_special_tokens=False).input_ids) >= 320
        # the filler mask covers the filler sentences and nothing else
        filler = tokenizer.decode([t for t, f in zip(ids, sample["filler"]) if f])
        rest = tokenizer.decode([t for t, f in zip(ids, sample["filler"]) if not f])
        assert set(filler.replace(PASSKEY_FILLER, "|")) == {"|"}
        assert rest == (
            PASSKEY_INSTRUCTION + PASSKEY_NEEDLE.format(key=key) + PASSKEY_QUESTION + tokenizer.decode(answer)
        )
    with pytest.raises(ValueError, match="raise --passkey-min-length or lower --min-key-distance"):
        long_context.PasskeySamples(tokenizer, 1, 300, 200, min_key_distance=400)[0]


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_independent_prompts_have_the_papers_parts_and_fit(tokenizer, depth):
    sentences = long_context.filler_sentences("other")
    text = long_context.independent_prompt(tokenizer, sentences, 700, depth, "40213", start=2)
    n = len(tokenizer(text).input_ids)
    assert 650 <= n <= 700
    assert text.startswith("There is an important info hidden inside a lot of irrelevant text.")
    assert text.endswith(" What is the pass key? The pass key is")
    assert text.count("40213") == 2 and "grass" not in text
    before = text.index("The pass key is 40213")
    filler = text[text.index("there.") + 6 : text.rindex(" What is")].replace(
        " The pass key is 40213. Remember it. 40213 is the pass key.", "|"
    )
    share = filler.index("|") / max(1, len(filler) - 1)
    assert abs(share - depth) < 0.05 and before > 0


def test_a_time_limited_run_is_rerun_exactly_by_its_stop_at_command(tmp_path, monkeypatch):
    """The baselines' GPU runs stopped at a time limit; their reports give the --stop-at command that reruns them:
    the same steps of the same (longer) learning-rate schedule, so the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.chdir(tmp_path)
    rows = [{"input_ids": list(range(i, i + 16)), "labels": list(range(i, i + 16))} for i in range(64)]
    runs = []
    for stop in (long_context.EarlyStop(minutes=1e-9), long_context.EarlyStop(at_step=1), long_context.EarlyStop()):
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=100,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
            )
        )
        long_context.run_trainer(model, rows, steps=8, lr=1e-2, batch_size=4, stop=stop)
        runs.append((long_context.run_trainer.steps_reached, [p.detach().clone() for p in model.parameters()]))
    (timed, timed_weights), (rerun, rerun_weights), (full, full_weights) = runs
    assert timed == rerun == 1 and full == 8
    for a, b in zip(timed_weights, rerun_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(timed_weights, full_weights))
    command = "python examples/long_context.py finetune llama --passkey-steps 8 --time-limit 6.8 --suffix=-h1"
    assert long_context.rerun_command(command, 1) == (
        "python examples/long_context.py finetune llama --passkey-steps 8 --stop-at 1 --suffix=-h1"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ship", "--suffix=-nope", "--out", "OUT"], "samba-passkey-nope is not a model folder of this experiment"),
        (["retention", "--model", "MISSING"], "MISSING is not a model folder of this experiment"),
        (["finetune", "samba", "--start-from", "MISSING"], "MISSING is not a model folder of this experiment"),
        (["finetune", "samba", "--stretch-dt", "0.5"], "--stretch-dt must be at least 1"),
        (["finetune", "llama", "--stretch-dt", "8"], "--stretch-dt stretches Mamba layers: llama has none"),
        (["finetune", "llama", "--passkey-max-length", "4096"], "--passkey-max-length <= 512 (the training length)"),
        (["finetune", "llama", "--passkey-min-length", "300", "--passkey-max-length", "200"], "got 300 and 200"),
        (["finetune", "mistral", "--time-limit", "-1"], "--time-limit is in minutes and must be positive"),
        (
            ["finetune", "llama", "--passkey-steps", "10", "--stop-at", "11"],
            "--stop-at must be a step of the schedule",
        ),
    ],
)
def test_wrong_inputs_end_in_one_error_and_write_nothing(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    argv = [str(tmp_path / a) if a in ("OUT", "MISSING") else a for a in argv]
    monkeypatch.setattr(sys, "argv", ["long_context.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        long_context.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written
