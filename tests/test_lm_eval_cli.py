"""The `lm_eval` command-line tool (lm-evaluation-harness) scores a samba-hf model folder offline, in a process that
cannot import samba_hf (the folder's own code, via trust_remote_code, is all it uses), and its numbers are the ones
transformers gives directly: per-choice log-likelihoods and acc of a multiple-choice task, perplexities of a
loglikelihood_rolling task. Both tasks are tiny YAML tasks over local JSON-lines files, passed with --include_path."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from samba_hf.cli import default_model_path

pytest.importorskip("lm_eval")

MC_TASK, PPL_TASK = "samba_hf_tiny_choice", "samba_hf_tiny_perplexity"

# Two choices per question; `label` is the index of the "right" one. Half the labels point at the nonsense choice so
# that acc lands strictly between 0 and 1 and a wrong comparison of the choices would change it.
MC_DOCS = [
    {
        "question": "The assert statement",
        "choices": ["checks that a condition is true", "purple elephant sings"],
        "label": 0,
    },
    {"question": "A for loop", "choices": ["banana telescope", "iterates over the items of a sequence"], "label": 1},
    {
        "question": "The while statement",
        "choices": ["repeats while a condition is true", "yellow submarine"],
        "label": 1,
    },
    {"question": "An if statement", "choices": ["zebra violin cloud", "runs code when a condition holds"], "label": 0},
]
PPL_DOCS = [
    {"text": "The if statement is used for conditional execution. It selects exactly one of the suites."},
    {"text": "The for statement is used to iterate over the elements of a sequence, such as a string or a list."},
]

MC_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
PPL_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
"""

# Put first on PYTHONPATH as sitecustomize: the lm_eval process cannot import samba_hf (nor the repo's samba_hf_cli),
# however it tries (import statement or importlib), and reports at exit which samba modules it did load.
HIDE_SAMBA_HF = """\
import atexit, json, sys

class _HideSambaHF:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("samba_hf", "samba_hf_cli"):
            raise ImportError(f"{name} is hidden in this test")
        return None

sys.meta_path.insert(0, _HideSambaHF())

@atexit.register
def _report():
    with open(REPORT, "w") as f:
        json.dump(sorted(name for name in sys.modules if "samba" in name), f)
"""


def write_jsonl(path: Path, docs) -> Path:
    path.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    return path


def lm_eval_command() -> list:
    """The venv's `lm_eval` entry point when there is one, else `python -m lm_eval` (the same CLI)."""
    script = Path(sys.executable).with_name("lm_eval")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lm_eval"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One `lm_eval` run over both tasks; returns the model folder, the results JSON, the logged samples and the
    samba modules the process loaded."""
    tmp = tmp_path_factory.mktemp("lm_eval_cli")
    folder = tmp / "model"
    shutil.copytree(default_model_path(), folder, symlinks=False)  # the remote-code files are links in the package
    tasks = tmp / "tasks"
    tasks.mkdir()
    (tasks / f"{MC_TASK}.yaml").write_text(MC_YAML.format(task=MC_TASK, data=write_jsonl(tmp / "mc.jsonl", MC_DOCS)))
    (tasks / f"{PPL_TASK}.yaml").write_text(
        PPL_YAML.format(task=PPL_TASK, data=write_jsonl(tmp / "ppl.jsonl", PPL_DOCS))
    )
    guard, report = tmp / "guard", tmp / "modules.json"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(f"REPORT = {str(report)!r}\n" + HIDE_SAMBA_HF)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf_home"),  # datasets cache and transformers_modules: nothing outside tmp
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(guard), os.environ.get("PYTHONPATH")])),
    }
    command = lm_eval_command() + [
        "--model",
        "hf",
        "--model_args",
        f"pretrained={folder},trust_remote_code=True,dtype=float32",
        "--device",
        "cpu",
        "--batch_size",
        "1",
        "--tasks",
        f"{MC_TASK},{PPL_TASK}",
        "--include_path",
        str(tasks),
        "--output_path",
        str(tmp / "out"),
        "--log_samples",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (results_file,) = (tmp / "out").rglob("results_*.json")
    samples = {}
    for task in (MC_TASK, PPL_TASK):
        (samples_file,) = (tmp / "out").rglob(f"samples_{task}_*.jsonl")
        samples[task] = sorted(
            (json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda sample: sample["doc_id"]
        )
    return {
        "folder": folder,
        "results": json.loads(results_file.read_text())["results"],
        "samples": samples,
        "modules": json.loads(report.read_text()),
        "stdout": result.stdout,
    }


@pytest.fixture(scope="module")
def reference(run):
    """The same folder through transformers directly (samba_hf's classes in this process, not the folder's copy)."""
    tokenizer = AutoTokenizer.from_pretrained(run["folder"])
    model = AutoModelForCausalLM.from_pretrained(run["folder"], dtype=torch.float32).eval()
    return tokenizer, model


@torch.no_grad()
def continuation_log_likelihood(model, context: list, continuation: list) -> float:
    """log P(continuation | context), summed over the continuation's tokens, from one forward."""
    ids = torch.tensor([context + continuation])
    log_probs = model(ids[:, :-1]).logits.float().log_softmax(-1)[0]
    per_token = log_probs.gather(-1, ids[0, 1:, None])[:, 0]
    return per_token[-len(continuation) :].sum().item()


def finite(value) -> float:
    assert isinstance(value, (int, float)) and math.isfinite(value), value
    return float(value)


def test_lm_eval_cli_ran_on_the_folders_own_code_without_samba_hf(run):
    assert not [name for name in run["modules"] if name.split(".")[0] in ("samba_hf", "samba_hf_cli")], run["modules"]
    remote = [name for name in run["modules"] if name.startswith("transformers_modules.")]
    assert any(name.endswith(".modeling_samba") for name in remote), run["modules"]  # the folder's copy of the code
    assert MC_TASK in run["stdout"] and PPL_TASK in run["stdout"]  # the results table


def test_lm_eval_cli_multiple_choice_matches_transformers(run, reference):
    tokenizer, model = reference

    def encode(text):  # what HFLM.tok_encode does with this tokenizer (it adds no special tokens)
        return tokenizer(text).input_ids

    correct = []
    for doc, sample in zip(MC_DOCS, run["samples"][MC_TASK], strict=True):
        assert sample["doc"] == doc
        got = [float(log_likelihood) for log_likelihood, _ in sample["filtered_resps"]]
        expected = []
        for choice in doc["choices"]:  # the harness's split: encode context + " " + choice, cut at the context
            context = encode(doc["question"])
            whole = encode(doc["question"] + " " + choice)
            assert whole[: len(context)] == context
            expected.append(continuation_log_likelihood(model, context, whole[len(context) :]))
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-3), doc
        correct.append(float(max(range(len(expected)), key=expected.__getitem__) == doc["label"]))
        assert sample["acc"] == correct[-1]
    acc = sum(correct) / len(correct)
    assert 0 < acc < 1  # the data makes the model miss some: acc tells a right comparison from a wrong one
    assert finite(run["results"][MC_TASK]["acc,none"]) == pytest.approx(acc)


def test_lm_eval_cli_perplexity_matches_transformers(run, reference):
    tokenizer, model = reference
    log_likelihoods = []
    for doc, sample in zip(PPL_DOCS, run["samples"][PPL_TASK], strict=True):
        ids = tokenizer(doc["text"]).input_ids
        assert len(ids) > 10
        # one rolling window (the folder's max length is 2**20), the first token predicted from the BOS prefix
        expected = continuation_log_likelihood(model, [tokenizer.bos_token_id], ids)
        (got,) = map(float, sample["filtered_resps"])  # logged as ["<log-likelihood>"]
        assert got == pytest.approx(expected, rel=1e-4), doc
        log_likelihoods.append(expected)
    words = sum(len(doc["text"].split()) for doc in PPL_DOCS)
    n_bytes = sum(len(doc["text"].encode()) for doc in PPL_DOCS)
    results = run["results"][PPL_TASK]
    assert finite(results["word_perplexity,none"]) == pytest.approx(math.exp(-sum(log_likelihoods) / words), rel=1e-3)
    assert finite(results["byte_perplexity,none"]) == pytest.approx(
        math.exp(-sum(log_likelihoods) / n_bytes), rel=1e-3
    )
    assert finite(results["bits_per_byte,none"]) == pytest.approx(
        -sum(log_likelihoods) / n_bytes / math.log(2), rel=1e-4
    )
    assert 1 < results["byte_perplexity,none"] < 256  # a trained model: better than uniform over bytes
