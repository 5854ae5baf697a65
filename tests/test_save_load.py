"""save_pretrained / from_pretrained, with our package and as remote code without it."""

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import fill_disk, tiny_model
from transformers import AutoModelForCausalLM

import samba_hf
from samba_hf import SambaForCausalLM
from samba_hf.hub_samba import REMOTE_CODE_FILES, SAMBAY_REMOTE_CODE_FILES

REMOTE_FILES = set(REMOTE_CODE_FILES)
PACKAGE = Path(samba_hf.__file__).parent


@pytest.mark.parametrize(
    "modeling, files", [("modeling_samba.py", REMOTE_CODE_FILES), ("modeling_sambay.py", SAMBAY_REMOTE_CODE_FILES)]
)
def test_the_remote_code_files_are_what_the_modeling_file_imports(modeling, files):
    """`hub_samba.REMOTE_CODE_FILES` (which the card, the examples and the embedded models use) is exactly what
    transformers copies into a saved folder: the modeling file and every file it imports, at any depth."""
    from transformers.dynamic_module_utils import get_relative_import_files

    found = {Path(path).name for path in get_relative_import_files(str(PACKAGE / modeling))}
    assert found | {modeling} == set(files) and len(files) == len(set(files))


@pytest.mark.parametrize("embedded", ["default_model", "passkey_model"])
def test_the_embedded_models_link_every_remote_code_file(embedded):
    folder = PACKAGE / embedded
    code = {path.name for path in folder.iterdir() if path.suffix == ".py"}
    assert code == REMOTE_FILES
    for name in code:
        assert (folder / name).is_symlink() and (folder / name).resolve() == (PACKAGE / name).resolve(), name


def test_the_vllm_plugin_links_what_its_remote_code_files_import():
    """The plugin carries some of samba-hf's remote-code files as links (it never imports samba_hf): every file they
    import is linked beside them."""
    from transformers.dynamic_module_utils import get_relative_import_files

    folder = PACKAGE.parents[1] / "vllm_plugin" / "src" / "samba_hf_vllm"
    linked = {path.name for path in folder.iterdir() if path.is_symlink()}
    assert (
        {"configuration_samba.py", "configuration_sambay.py", "ssm_samba.py"}
        <= linked
        <= REMOTE_FILES | set(SAMBAY_REMOTE_CODE_FILES)
    )
    for name in linked:
        assert (folder / name).resolve() == (PACKAGE / name).resolve(), name
        assert {Path(path).name for path in get_relative_import_files(str(folder / name))} <= linked, name


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    model = tiny_model(seed=7)
    model.save_pretrained(folder)
    ids = torch.randint(3, 97, (2, 25))
    with torch.no_grad():
        logits = model(ids).logits
    torch.save({"ids": ids, "logits": logits}, folder / "expected.pt")
    return folder, model, ids, logits


def test_folder_holds_safetensors_config_and_remote_code(saved):
    folder, *_ = saved
    files = set(os.listdir(folder))
    assert "model.safetensors" in files and "config.json" in files
    assert REMOTE_FILES <= files
    config = json.load(open(folder / "config.json"))
    assert config["model_type"] == "samba"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_samba.SambaForCausalLM"
    assert config["auto_map"]["AutoConfig"] == "configuration_samba.SambaConfig"


def test_remote_code_imports_only_torch_transformers_and_siblings(saved):
    folder, *_ = saved
    for name in REMOTE_FILES:
        for line in open(folder / name):
            stripped = line.strip()
            if stripped.startswith(("import ", "from ")) and not line.startswith((" ", "\t")):
                module = stripped.split()[1]
                # torch, transformers, the standard library (the compiled scan builds with ctypes/subprocess), siblings
                top = module.split(".")[0]
                assert top in {"torch", "transformers"} | sys.stdlib_module_names or module.startswith("."), (
                    name,
                    stripped,
                )


def test_round_trip_with_the_package(saved):
    folder, model, ids, logits = saved
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded) is SambaForCausalLM
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(loaded.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)


def test_bf16_round_trip(tmp_path):
    model = tiny_model(seed=2).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    loaded = SambaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a.float(), b.float()), name
    ids = torch.randint(3, 97, (1, 12))
    with torch.no_grad():
        ours, theirs = model(ids).logits, loaded(ids).logits
    # `from_pretrained` keeps A_log and D in float32 where `.to(bfloat16)` rounded them: equal up to bf16 rounding
    assert theirs.dtype == torch.bfloat16
    assert (ours.float() - theirs.float()).abs().max() < 2e-2


def test_loading_in_bf16_keeps_a_log_and_d_in_float32(saved):
    folder, *_ = saved
    loaded = SambaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    mixer = loaded.model.layers[0].mamba
    assert mixer.in_proj.weight.dtype == torch.bfloat16
    assert mixer.A_log.dtype == torch.float32 and mixer.D.dtype == torch.float32


def test_untied_round_trip(tmp_path):
    model = tiny_model(seed=4, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    model.save_pretrained(tmp_path)
    loaded = SambaForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_trust_remote_code_without_the_package(saved):
    folder, *_ = saved
    assert_loads_without_the_package(folder)


def assert_loads_without_the_package(folder, class_name="SambaForCausalLM", atol=0.0):
    """A fresh interpreter in which `import samba_hf` fails loads the folder through its own code and reproduces
    the logits saved in `folder/expected.pt` ({"ids", "logits"}), exactly by default."""
    script = textwrap.dedent(f"""
        import builtins, sys, torch
        real_import = builtins.__import__
        def guarded(name, *args, **kwargs):
            if name == "samba_hf" or name.startswith("samba_hf."):
                raise ImportError("samba_hf is hidden in this test")
            return real_import(name, *args, **kwargs)
        builtins.__import__ = guarded
        sys.path = [p for p in sys.path if "samba" not in p.lower() or "site-packages" in p]
        try:
            import samba_hf
            raise SystemExit("samba_hf should not be importable here")
        except ImportError:
            pass
        from transformers import AutoModelForCausalLM
        folder = {str(folder)!r}
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        expected = torch.load(folder + "/expected.pt")
        with torch.no_grad():
            logits = model(expected["ids"]).logits
        assert torch.allclose(logits, expected["logits"], rtol=0, atol={atol}), (
            (logits - expected["logits"]).abs().max())
        print("REMOTE-OK", type(model).__name__)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(folder / "modules_cache")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"REMOTE-OK {class_name}" in result.stdout


# Folders that samba-hf's main wrote before a change of its code's layout (see each expected.safetensors' metadata):
# before its files were split (a Samba), and before #47's kernel switch, mixer scaffold and cache and attention owned
# once (a Samba with Mamba-2 layers). Their config's auto_map, parameter names and remote code (which registers the
# same torch.ops.samba_hf operators) must keep loading, with the package and without it. Their logits and greedy
# tokens were computed when they were written.
SAVED_EARLIER = [
    os.path.join(os.path.dirname(__file__), "data", name) for name in ("saved_2026-11-28", "saved_00ea575")
]


def saved_earlier(tmp_path, source):
    from safetensors.torch import load_file

    folder = tmp_path / os.path.basename(source)  # its name names the remote code's modules: one each
    shutil.copytree(source, folder)
    return folder, load_file(folder / "expected.safetensors")


@pytest.mark.parametrize("source", SAVED_EARLIER, ids=os.path.basename)
def test_a_folder_saved_earlier_loads_with_the_package(tmp_path, source):
    folder, expected = saved_earlier(tmp_path, source)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model) is SambaForCausalLM
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
        greedy = model.generate(expected["input_ids"], max_new_tokens=16, do_sample=False)[:, 20:]
    torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=1e-5)
    assert torch.equal(greedy, expected["greedy"])


@pytest.fixture(scope="module")
def modules_cache(tmp_path_factory):
    """One cache of remote-code modules for the folders of this file (`transformers_modules` is imported once per
    process, from the first cache it was given)."""
    return str(tmp_path_factory.mktemp("modules_cache"))


@pytest.mark.parametrize("source", SAVED_EARLIER, ids=os.path.basename)
def test_a_folder_saved_earlier_loads_as_remote_code_beside_the_package(tmp_path, monkeypatch, modules_cache, source):
    """In a process that has imported samba_hf (and so registered its operators), the folder's own older code
    (which the Auto classes would not take here: samba_hf registered "samba" with them)."""
    from transformers import dynamic_module_utils

    folder, expected = saved_earlier(tmp_path, source)
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", modules_cache)
    model_class = dynamic_module_utils.get_class_from_dynamic_module("modeling_samba.SambaForCausalLM", str(folder))
    model = model_class.from_pretrained(folder)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("source", SAVED_EARLIER, ids=os.path.basename)
def test_a_folder_saved_earlier_loads_without_the_package(tmp_path, source):
    folder, expected = saved_earlier(tmp_path, source)
    torch.save({"ids": expected["input_ids"], "logits": expected["logits"]}, folder / "expected.pt")
    assert_loads_without_the_package(folder, atol=1e-5)


def test_a_save_replaces_the_weights_of_an_earlier_save_in_the_same_folder(tmp_path):
    """Shards saved where one model.safetensors was (or the reverse): the reload gives the new weights. transformers'
    Llama keeps the earlier model.safetensors beside the new shards and from_pretrained loads it instead."""

    def weights(model):
        return [p.detach().clone() for p in model.parameters()]

    folder = tmp_path / "m"
    for step, (seed, shard) in enumerate([(1, None), (2, "20KB"), (3, None), (4, "20KB")]):
        model = tiny_model(seed=seed)
        model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
        names = sorted(p.name for p in folder.glob("model*.safetensors*"))
        if shard:
            assert "model.safetensors" not in names and "model.safetensors.index.json" in names and len(names) > 2
        else:
            assert names == ["model.safetensors"], names
        reloaded = SambaForCausalLM.from_pretrained(folder)
        for a, b in zip(weights(reloaded), weights(model)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    (folder / "notes.txt").write_text("mine")
    tiny_model(seed=5).save_pretrained(folder)  # nothing else of the folder is touched
    assert (folder / "notes.txt").read_text() == "mine"


def saved_bytes(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("room", ["none", "code only"])
def test_a_save_onto_a_full_disk_is_one_error_and_leaves_nothing(tmp_path, full_disk, room):
    """transformers writes straight into the folder: a full disk left the files written so far (the remote code,
    part of the weights) and the space they took. samba-hf's save fails whole: one OSError saying so, nothing in the
    folder, the free space as before. "code only": room for the config and the remote code, not the weights
    (safetensors' own error, "os error 28")."""
    model = tiny_model()
    code = sum(-(-os.path.getsize(os.path.join(samba_hf.__path__[0], f)) // 4096) * 4096 for f in REMOTE_CODE_FILES)
    free = fill_disk(full_disk, 16384 if room == "none" else code + 32768)
    with pytest.raises(OSError, match=r"No space left on device while saving the model to .*free some space") as error:
        model.save_pretrained(full_disk / "out")
    assert error.value.errno == errno.ENOSPC
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"] and os.statvfs(full_disk).f_bfree == free


def test_a_save_that_fails_leaves_an_earlier_save_as_it_was(tmp_path, full_disk):
    """Saving again over a folder on a disk with no room for the new files: the earlier save is untouched and
    still loads."""
    folder = full_disk / "m"
    tiny_model(seed=1, hidden_size=32, intermediate_size=64).save_pretrained(folder)
    before = saved_bytes(folder)
    free = fill_disk(full_disk, 16384)
    with pytest.raises(OSError, match="No space left on device"):
        tiny_model(seed=2, hidden_size=32, intermediate_size=64).save_pretrained(folder, max_shard_size="20KB")
    assert saved_bytes(folder) == before and os.statvfs(full_disk).f_bfree == free
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler", "m"]


def test_an_interrupted_save_leaves_an_earlier_save_as_it_was(tmp_path, monkeypatch):
    """Ctrl-C while the weights are written: the folder holds the earlier save, and no staging folder is left."""
    import transformers.modeling_utils

    folder = tmp_path / "m"
    tiny_model(seed=1).save_pretrained(folder)
    before = saved_bytes(folder)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):  # (another shape: its config.json differs)
        tiny_model(seed=2, hidden_size=32, intermediate_size=64).save_pretrained(folder)
    assert saved_bytes(folder) == before and sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_save_with_fewer_shards_removes_the_earlier_save_s_extra_shards(tmp_path):
    """transformers removes shards an earlier save left that the new one did not write; samba-hf's save, which
    writes elsewhere first, keeps that rule."""
    folder = tmp_path / "m"
    tiny_model(seed=1).save_pretrained(folder, max_shard_size="20KB")
    many = sorted(p.name for p in folder.glob("model-*.safetensors"))
    tiny_model(seed=2).save_pretrained(folder, max_shard_size="60KB")
    few = sorted(p.name for p in folder.glob("model-*.safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(few) < len(many) and few == sorted(set(index["weight_map"].values()))
    reloaded = SambaForCausalLM.from_pretrained(folder)
    for a, b in zip(reloaded.parameters(), tiny_model(seed=2).parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
