"""Every folder samba-hf writes works in tools that never import samba_hf (trust_remote_code), and carries a model
card with Hub metadata, its tokenizer and a config that does not cut a model without a length limit short."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import samba_hf
from samba_hf.cli import default_model_path
from samba_hf.hub_samba import REMOTE_CODE_FILES

DEFAULT = Path(default_model_path())
PACKAGE = Path(samba_hf.__file__).parent
REMOTE_FILES = REMOTE_CODE_FILES


def card_metadata(folder) -> dict:
    text = (Path(folder) / "README.md").read_text()
    assert text.startswith("---\n"), text[:80]
    return yaml.safe_load(text.split("---\n")[1])


def assert_hub_metadata(meta, license=None):
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"samba", "mamba", "samba-hf"} <= set(meta["tags"])
    assert meta["license"] == (license or meta["license"]) and meta["license"]


# ---------------------------------------------------------------- the shipped default model


def test_the_default_model_ships_as_save_pretrained_writes_it():
    config = json.loads((DEFAULT / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_samba.SambaConfig",
        "AutoModel": "modeling_samba.SambaModel",
        "AutoModelForCausalLM": "modeling_samba.SambaForCausalLM",
    }
    for name in REMOTE_FILES:  # the package's own code, never a stale copy
        assert (DEFAULT / name).read_bytes() == (PACKAGE / name).read_bytes(), name
    assert config["use_cache"] is True
    assert config["max_position_embeddings"] >= 2**20  # no full-attention layer: nothing limits the length
    assert_hub_metadata(card_metadata(DEFAULT), license="apache-2.0")


WITHOUT_SAMBA_HF = """
import builtins, sys
real_import = builtins.__import__
def guarded(name, *args, **kwargs):
    if name == "samba_hf" or name.startswith("samba_hf.") or name == "samba_hf_cli":
        raise ImportError("samba_hf is hidden in this test")
    return real_import(name, *args, **kwargs)
builtins.__import__ = guarded
"""


def run_without_samba_hf(code: str, folder: Path, timeout=600) -> str:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(folder.parent / "modules_cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_SAMBA_HF + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder.parent,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def default_copy(tmp_path_factory):
    """The default model folder as a user gets it (a copy: nothing is written into the package)."""
    folder = tmp_path_factory.mktemp("default") / "model"
    shutil.copytree(DEFAULT, folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([[5, 17, 300, 2000, 41, 9, 4000]])
    with torch.no_grad():
        torch.save(
            {"ids": ids, "logits": model(ids).logits, "hidden": model.model(ids).last_hidden_state},
            folder.parent / "expected.pt",
        )
    return folder


def test_the_default_model_loads_without_samba_hf(default_copy):
    out = run_without_samba_hf(
        f"""
        import torch
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
        folder = {str(default_copy)!r}
        expected = torch.load({str(default_copy.parent / "expected.pt")!r})
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        base = AutoModel.from_pretrained(folder, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            assert torch.equal(model(expected["ids"]).logits, expected["logits"])
            assert torch.equal(base(expected["ids"]).last_hidden_state, expected["hidden"])
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # it reads config.json too
        ids = tokenizer("The assert statement", return_tensors="pt").input_ids
        print("OK", type(model).__name__, type(base).__name__, model.generate(ids, max_new_tokens=3).shape[1])
    """,
        default_copy,
    )
    assert out.strip().splitlines()[-1].split() == ["OK", "SambaForCausalLM", "SambaModel", "6"]


def test_trl_trains_the_default_model_from_its_path_without_samba_hf(default_copy):
    out = run_without_samba_hf(
        f"""
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer
        data = Dataset.from_dict({{"text": ["The assert statement is a way to insert checks."] * 8}})
        args = SFTConfig(output_dir="trl-out", max_steps=2, per_device_train_batch_size=4, report_to=[],
                         use_cpu=True, max_length=32, model_init_kwargs={{"trust_remote_code": True}},
                         save_strategy="no")
        trainer = SFTTrainer(model={str(default_copy)!r}, args=args, train_dataset=data)
        print("LOSS", trainer.train().training_loss)
    """,
        default_copy,
    )
    assert float(out.split("LOSS")[-1]) > 0


def test_lm_eval_scores_the_default_model_without_samba_hf(default_copy):
    """lm-evaluation-harness's HFLM (what `lm_eval --model hf` runs) on the folder: no truncation at the training
    length, and its rolling log-likelihood equals our own forward's."""
    pytest.importorskip("lm_eval")
    from pydoc_data.topics import topics

    text = topics["if"] + topics["while"] + topics["for"]
    out = run_without_samba_hf(
        f"""
        from lm_eval.api.instance import Instance
        from lm_eval.models.huggingface import HFLM
        lm = HFLM(pretrained={str(default_copy)!r}, trust_remote_code=True, batch_size=1, device="cpu",
                  dtype="float32")
        rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {{}}, ({text!r},), 0)])
        generated = lm.generate_until([Instance("generate_until", {{}}, ("The assert", {{"max_gen_toks": 4}}), 0)])
        print("MAXLEN", lm.max_length, "PREFIX", lm.prefix_token_id, "LL", rolling[0], "GEN", len(generated[0]))
    """,
        default_copy,
    )
    fields = out.split("MAXLEN")[-1].split()
    max_length, prefix, log_likelihood = int(fields[0]), int(fields[2]), float(fields[4])
    tokenizer, model = AutoTokenizer.from_pretrained(default_copy), AutoModelForCausalLM.from_pretrained(default_copy)
    ids = torch.tensor([[prefix] + tokenizer(text, add_special_tokens=False).input_ids])
    assert max_length >= 2**20 and ids.shape[1] > 600  # the whole text in one window, not cut at 256 tokens
    with torch.no_grad():
        expected = -model.float()(ids, labels=ids).loss.item() * (ids.shape[1] - 1)
    assert log_likelihood == pytest.approx(expected, rel=1e-4)
    assert int(fields[6]) > 0  # generate_until produced text


# ---------------------------------------------------------------- every folder we write


def test_save_pretrained_writes_auto_map_for_automodel_and_a_model_card(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "a")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_samba.SambaModel"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_samba.SambaForCausalLM"
    assert_hub_metadata(card_metadata(tmp_path / "a"))
    # a card the user wrote is theirs: never replaced
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "README.md").write_text("# my notes\n")
    model.save_pretrained(tmp_path / "b")
    assert (tmp_path / "b" / "README.md").read_text() == "# my notes\n"


def test_a_conversion_carries_metadata_and_the_sources_license(tmp_path):
    from transformers import MambaConfig, MambaForCausalLM

    from samba_hf.conversion import convert

    MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4)).save_pretrained(
        tmp_path / "mamba"
    )
    config = json.loads((tmp_path / "mamba" / "config.json").read_text())
    (tmp_path / "mamba" / "config.json").write_text(json.dumps({**config, "_name_or_path": "state-spaces/mamba-tiny"}))
    (tmp_path / "mamba" / "README.md").write_text("---\nlicense: mit\n---\n# a mamba\n")
    convert("mamba", tmp_path / "mamba", tmp_path / "out", verify_parity=False, progress=False)
    meta = card_metadata(tmp_path / "out")
    assert_hub_metadata(meta, license="mit")
    assert meta["base_model"] == "state-spaces/mamba-tiny" and "converted" in meta["tags"]
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"]["AutoModel"]
        == "modeling_samba.SambaModel"
    )
