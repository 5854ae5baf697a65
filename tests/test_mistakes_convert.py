"""convert / export with mistaken or hostile inputs: nothing of the user's is lost, no model is written with weights
that did not come from the file, and every mistake ends in one `samba-hf: error:` line (exit 1)."""

import errno
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import fill_disk, tiny_model
from safetensors.torch import load_file, save_file
from test_conversion_official import official_config, official_state_dict, save_fla, save_official, true_model
from test_conversion_transformers import save_mamba

from samba_hf.conversion import ConversionError, convert, lit_gpt, writer
from samba_hf_cli import main


def one_line_error(capsys, argv, *fragments):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("samba-hf: error: "), err
    assert not any(line.startswith("samba-hf: error:") for line in err[:-1]) and "Traceback" not in "\n".join(err)
    for fragment in fragments:
        assert fragment in err[-1], err[-1]
    return err[-1]


def listing(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------- --force never deletes the source or the user's files


def test_force_refuses_an_out_that_holds_the_lit_gpt_source(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    src = save_official(out, true_model(["mamba", "attn"], seed=1))
    before = listing(out)
    one_line_error(
        capsys,
        ["convert", "lit-gpt", str(src), str(out), "--force", "--config", "Samba_421M"],
        "lies inside the output folder",
        "would delete it",
    )
    assert listing(out) == before and not leftovers(tmp_path)


def test_force_refuses_converting_a_folder_into_itself(tmp_path, capsys):
    save_mamba(tmp_path / "D", layers=1)
    before = listing(tmp_path / "D")
    for out in (tmp_path / "D", tmp_path / "D" / ".." / "D"):
        one_line_error(
            capsys,
            ["convert", "mamba", str(tmp_path / "D"), str(out), "--force", "--no-verify"],
            "lies inside the output folder",
        )
    assert listing(tmp_path / "D") == before


def test_force_refuses_an_out_that_holds_the_tokenizer(tmp_path):
    save_mamba(tmp_path / "mamba", layers=1)
    out = tmp_path / "out"
    convert("mamba", tmp_path / "mamba", out, verify_parity=False, progress=False)
    (out / "tok").mkdir()
    with pytest.raises(ConversionError, match="lies inside the output folder"):
        convert("mamba", tmp_path / "mamba", out, tokenizer=out / "tok", force=True, progress=False)
    assert (out / "tok").is_dir()


def test_force_refuses_a_folder_that_is_not_an_earlier_output(tmp_path):
    save_mamba(tmp_path / "mamba", layers=1)
    for name, make in {
        "a subfolder": lambda out: (out / "runs").mkdir(),
        "a checkpoint": lambda out: (out / "iter-000100-ckpt.pth").write_bytes(b"weights"),
        "another model's config": lambda out: (out / "config.json").write_text('{"model_type": "llama"}'),
    }.items():
        out = tmp_path / name.replace(" ", "_")
        out.mkdir()
        make(out)
        before = listing(out)
        with pytest.raises(ConversionError, match="--force only replaces an earlier samba-hf output"):
            convert("mamba", tmp_path / "mamba", out, force=True, verify_parity=False, progress=False)
        assert listing(out) == before and (out / "runs").is_dir() == (name == "a subfolder")


# ---------------------------------------------------------------- every tensor comes from the file


def samba_folder(tmp_path, name="samba", **overrides):
    model = tiny_model(**overrides)
    model.save_pretrained(tmp_path / name)
    return tmp_path / name, model


def exportable_folder(tmp_path):
    """A samba-hf folder the official code can express (Mamba d_state 16, one MLP per block)."""
    return samba_folder(
        tmp_path,
        layer_types=["linear_attention", "sliding_attention"],
        num_hidden_layers=2,
        num_key_value_heads=4,
        mamba_d_state=16,
    )[0]


def test_export_of_a_llama_folder_is_refused(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4)
    ).save_pretrained(tmp_path / "llama")
    one_line_error(
        capsys,
        ["export", "lit-gpt", str(tmp_path / "llama"), str(tmp_path / "x.pth")],
        "'llama' model, not a Samba model",
    )
    assert not (tmp_path / "x.pth").exists() and not leftovers(tmp_path)


@pytest.mark.parametrize("damage", ["missing", "unexpected", "wrong shape"])
def test_export_of_a_folder_with_damaged_tensors_is_refused(tmp_path, capsys, damage):
    folder = exportable_folder(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    if damage == "missing":
        tensors.pop("model.layers.1.self_attn.o_proj.weight")
    elif damage == "unexpected":
        tensors["model.layers.0.mamba.extra"] = torch.zeros(3)
    else:
        tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    expected = {
        "missing": "missing (1): model.layers.1.self_attn.o_proj.weight",
        "unexpected": "unexpected (1): model.layers.0.mamba.extra",
        "wrong shape": "model.norm.weight: checkpoint [31], config expects [32]",
    }[damage]
    one_line_error(
        capsys, ["export", "lit-gpt", str(folder), str(tmp_path / "x.pth")], "do not match its config.json", expected
    )
    assert not (tmp_path / "x.pth").exists() and not leftovers(tmp_path)


def test_export_force_never_replaces_what_it_did_not_write(tmp_path, capsys):
    folder = exportable_folder(tmp_path)
    notes = tmp_path / "notes.pth"
    notes.write_text("my notes")
    one_line_error(
        capsys,
        ["export", "lit-gpt", str(folder), str(notes), "--force"],
        "not a checkpoint that samba-hf export wrote",
    )
    assert notes.read_text() == "my notes"
    one_line_error(
        capsys,
        ["export", "lit-gpt", str(folder), str(folder / "model.safetensors"), "--force"],
        "a file of the source folder",
    )
    one_line_error(capsys, ["export", "lit-gpt", str(folder), str(tmp_path)], "is a folder")
    assert main(["export", "lit-gpt", str(folder), str(tmp_path / "a.pth")]) == 0
    assert main(["export", "lit-gpt", str(folder), str(tmp_path / "a.pth"), "--force"]) == 0  # an earlier export


# ---------------------------------------------------------------- non-finite weights never pass


def test_nan_in_the_source_names_the_tensor_with_and_without_verify(tmp_path, capsys):
    model = true_model(["mamba", "attn"], seed=2)
    model["layers"][1]["o"][3, 5] = float("nan")
    src = save_official(tmp_path, model)
    for verify in ("--verify", "--no-verify"):
        one_line_error(
            capsys,
            ["convert", "lit-gpt", str(src), str(tmp_path / "out"), verify, "--config", str(write_config(tmp_path))],
            "model.layers.1.self_attn.o_proj.weight holds NaN or inf values in the source",
        )
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_integer_weights_in_the_source_name_the_tensor_with_and_without_verify(tmp_path, capsys):
    """Every converter's writer checks each tensor's dtype as it streams: integers are never written as weights."""
    src = tmp_path / "int8.pth"
    state = official_state_dict(true_model(["mamba", "attn"], seed=2))
    state["transformer.h.1.attn.proj.weight"] = (state["transformer.h.1.attn.proj.weight"] * 100).to(torch.int8)
    torch.save(state, src)
    for verify in ("--verify", "--no-verify"):
        one_line_error(
            capsys,
            ["convert", "lit-gpt", str(src), str(tmp_path / "out"), verify, "--config", str(write_config(tmp_path))],
            "model.layers.1.self_attn.o_proj.weight is int8 in the source checkpoint, not a floating-point",
        )
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def write_config(tmp_path, **lit_overrides):
    file = tmp_path / "samba-config.json"
    file.write_text(json.dumps(official_config(layers=2, **lit_overrides).to_dict()))
    return file


def test_a_float16_overflow_names_the_tensor_and_the_fix(tmp_path):
    model = true_model(["mamba", "attn"], seed=3)
    model["layers"][0]["gate"][0, 0] = 1e6  # beyond float16's 65504
    src = save_official(tmp_path, model)
    with pytest.raises(
        ConversionError,
        match=r"model.layers.0.mlp.gate_proj.weight has values up to 1e\+06, beyond "
        r"the range of float16.*--dtype bfloat16",
    ):
        convert("lit-gpt", src, tmp_path / "out", config=official_config(layers=2), dtype="float16", progress=False)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
    convert("lit-gpt", src, tmp_path / "out", config=official_config(layers=2), dtype="bfloat16", progress=False)


def test_verify_fails_on_non_finite_logits(tmp_path, monkeypatch):
    import importlib

    verify = importlib.import_module("samba_hf.conversion.verify")  # the module (the package exports its function)
    src = save_official(tmp_path, true_model(["mamba", "attn"], seed=4))
    real = verify.reference_logits
    monkeypatch.setattr(verify, "reference_logits", lambda *a: real(*a) * float("nan"))
    with pytest.raises(ConversionError, match="verification failed.*not finite"):
        convert("lit-gpt", src, tmp_path / "out", config=official_config(layers=2), progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the config a lit-gpt checkpoint records


@pytest.fixture
def small_official_names(monkeypatch):
    """Official names with test-sized shapes: the real ones build 421M parameters. `_nope` and the window variants
    keep the shapes of their base, as in the official list."""
    base = dict(n_layer=2, n_head=12, n_query_groups=4, n_embd=96, intermediate_size=64, vocab_size=100)
    for name, extra in {
        "Samba_421M": {},
        "Samba_421M_nope": {"nope": True},
        "Samba_421M_512_window": {"local_window": 512},
    }.items():
        monkeypatch.setitem(lit_gpt.OFFICIAL_CONFIGS, name, {**base, **extra})


def save_with_hparams(tmp_path, model_name, seed=5):
    sd = official_state_dict(true_model(["mamba", "attn"], seed=seed))
    path = tmp_path / "iter-000100-ckpt.pth"
    torch.save(
        {
            "model": sd,
            "optimizer": {"state": {}},
            "iter_num": 100,
            "hparams": {"model_name": model_name, "learning_rate": 4e-4, "name": f"tsz512x4k_20B_{model_name}"},
        },
        path,
    )
    return path


def test_the_recorded_model_name_is_used_without_config(tmp_path, capsys, small_official_names):
    src = save_with_hparams(tmp_path, "Samba_421M_nope")
    assert main(["convert", "lit-gpt", str(src), str(tmp_path / "out"), "--no-verify"]) == 0
    assert "config: Samba_421M_nope, recorded in the checkpoint" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["use_rope"] is False


@pytest.mark.parametrize("given", ["Samba_421M", "Samba_421M_512_window"])
def test_a_contradicting_config_name_is_refused_unless_forced(tmp_path, capsys, small_official_names, given):
    src = save_with_hparams(tmp_path, "Samba_421M_nope")
    argv = ["convert", "lit-gpt", str(src), str(tmp_path / "out"), "--no-verify", "--config", given]
    one_line_error(
        capsys, argv, "records model_name 'Samba_421M_nope'", "--config differs from it in", "--force-config"
    )
    assert not (tmp_path / "out").exists()
    assert main(argv + ["--force-config"]) == 0
    assert "overriding the recorded 'Samba_421M_nope'" in capsys.readouterr().err


def test_an_agreeing_config_and_an_unknown_recorded_name(tmp_path, capsys, small_official_names):
    src = save_with_hparams(tmp_path, "Samba_421M")
    assert main(["convert", "lit-gpt", str(src), str(tmp_path / "a"), "--no-verify", "--config", "Samba_421M"]) == 0
    src = save_with_hparams(tmp_path, "Samba_7B_custom")
    one_line_error(
        capsys,
        ["convert", "lit-gpt", str(src), str(tmp_path / "b"), "--no-verify"],
        "trained as model_name 'Samba_7B_custom'",
        "SambaConfig JSON",
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps(lit_gpt.config_from_name("Samba_421M").to_dict()))
    assert main(["convert", "lit-gpt", str(src), str(tmp_path / "b"), "--no-verify", "--config", str(config)]) == 0


# -------------------------------------------------------------- interrupted runs leave nothing (or say what they left)

SLOW_CONVERT = """
import sys, time
from samba_hf.conversion import writer
real = writer.save_file
def slow(*args, **kwargs):
    real(*args, **kwargs)
    print("writing", flush=True)
    time.sleep(60)
writer.save_file = slow
from samba_hf_cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_slow_conversion(tmp_path, out):
    save_mamba(tmp_path / "mamba", layers=1)
    script = tmp_path / "slow.py"
    script.write_text(SLOW_CONVERT)
    process = subprocess.Popen(
        [sys.executable, str(script), "convert", "mamba", str(tmp_path / "mamba"), str(out), "--no-verify"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "writing"  # the partial folder is on disk now
    assert [p for p in leftovers(tmp_path) if p.endswith(".partial")]
    return process


def test_sigterm_cleans_up_like_ctrl_c(tmp_path):
    out = tmp_path / "out"
    process = start_slow_conversion(tmp_path, out)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err
    assert "samba-hf: stopped by SIGTERM" in err and "Traceback" not in err
    assert not out.exists() and not leftovers(tmp_path)


def test_the_next_run_removes_what_a_killed_run_left(tmp_path, capsys):
    out = tmp_path / "out"
    process = start_slow_conversion(tmp_path, out)
    process.kill()
    process.wait(timeout=60)
    (stale,) = leftovers(tmp_path)
    assert stale.startswith(f".out.{process.pid}.") and stale.endswith(".partial")
    other = tmp_path / ".out.abcd1234.partial"  # an older samba-hf's name, no process id: reported, kept
    other.mkdir()
    assert main(["convert", "mamba", str(tmp_path / "mamba"), str(out), "--no-verify"]) == 0
    err = capsys.readouterr().err
    assert f"removed {tmp_path / stale}, left by an interrupted run (process {process.pid})" in err
    assert f"{other} (left by an older samba-hf) was left alone" in err
    assert leftovers(tmp_path) == [other.name] and (out / "model.safetensors").is_file()


def test_a_killed_swap_gets_the_earlier_output_back(tmp_path):
    save_mamba(tmp_path / "mamba", layers=1)
    out = tmp_path / "out"
    convert("mamba", tmp_path / "mamba", out, verify_parity=False, progress=False)
    before = listing(out)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    old = tmp_path / f".out.{dead.stdout.strip()}.zz_9zz99.old"  # the swap: OUT moved aside, then a SIGKILL
    old.mkdir()
    out.rename(old / "out")
    lines = writer.clean_stale(out)
    assert lines == [f"restored {out} from {old}, left by an interrupted run (process {dead.stdout.strip()})"]
    assert listing(out) == before and not leftovers(tmp_path)


def test_a_user_file_that_looks_a_little_like_ours_is_never_touched(tmp_path):
    out = tmp_path / "out"
    for name in (".out.2023.old", ".out.backup.partial", ".out.1.my-notes.partial", ".outx.12345.abcd1234.partial"):
        (tmp_path / name).write_text("mine")
    assert writer.clean_stale(out) == []
    assert len(leftovers(tmp_path)) == 4


# ---------------------------------------------------------------- the file system says no


def test_out_whose_parent_is_a_file(tmp_path, capsys):
    save_mamba(tmp_path / "mamba", layers=1)
    (tmp_path / "file").write_text("x")
    one_line_error(
        capsys,
        ["convert", "mamba", str(tmp_path / "mamba"), str(tmp_path / "file" / "out"), "--no-verify"],
        "cannot write",
        "a parent of OUT is a file",
    )
    folder = exportable_folder(tmp_path)
    one_line_error(capsys, ["export", "lit-gpt", str(folder), str(tmp_path / "file" / "x.pth")], "cannot write")


@pytest.mark.parametrize("raised", ["OSError", "SafetensorError"])  # (safetensors reports the system's error so)
@pytest.mark.parametrize("code, fix", [(errno.ENOSPC, "free some space"), (errno.EROFS, "writable location")])
def test_a_full_or_read_only_file_system(tmp_path, capsys, monkeypatch, code, fix, raised):
    from safetensors import SafetensorError

    save_mamba(tmp_path / "mamba", layers=1)

    def refuse(tensors, filename, metadata=None):
        if raised == "SafetensorError":  # its message, as safetensors gives it on a full tmpfs
            raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")
        raise OSError(code, os.strerror(code), str(filename))

    monkeypatch.setattr(writer, "save_file", refuse)
    one_line_error(
        capsys,
        ["convert", "mamba", str(tmp_path / "mamba"), str(tmp_path / "out"), "--no-verify"],
        os.strerror(code),
        fix,
    )
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_convert_onto_a_real_full_file_system(tmp_path, capsys, full_disk):
    """safetensors' own error ended the command before; now one line, nothing left there, the space free again."""
    save_mamba(tmp_path / "mamba", layers=2)
    free = fill_disk(full_disk, 16384)  # 16 KB left: too little
    one_line_error(
        capsys,
        ["convert", "mamba", str(tmp_path / "mamba"), str(full_disk / "out"), "--no-verify"],
        "No space left on device",
        "free some space or write elsewhere",
    )
    assert [p.name for p in full_disk.iterdir()] == ["filler"] and os.statvfs(full_disk).f_bfree == free


def test_export_onto_a_full_file_system(tmp_path, capsys, monkeypatch):
    """torch.save reports a failed write as a RuntimeError of its own; the export says the system's error in one
    line and leaves nothing (a file whose writes fail after 4 KB stands in for a full disk)."""
    import builtins

    folder = exportable_folder(tmp_path)

    class Full:
        def __init__(self, path, mode):
            self.file, self.written = builtins.open(path, mode), 0

        def write(self, data):
            self.written += len(data)
            if self.written > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.file.write(data)

        def flush(self):
            self.file.flush()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(writer, "open", Full, raising=False)
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "model.pth"
    one_line_error(capsys, ["export", "lit-gpt", str(folder), str(out)], "No space left on device", "free some space")
    assert list((tmp_path / "out").iterdir()) == []


def test_export_onto_a_real_full_file_system(tmp_path, capsys, full_disk):
    folder = exportable_folder(tmp_path)
    free = fill_disk(full_disk, 16384)
    one_line_error(capsys, ["export", "lit-gpt", str(folder), str(full_disk / "model.pth")], "No space left on device")
    assert [p.name for p in full_disk.iterdir()] == ["filler"] and os.statvfs(full_disk).f_bfree == free


# ---------------------------------------------------------------- wrong --config


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("{not json", "cannot read --config"),
        ("[1, 2]", "not a SambaConfig JSON"),
        ('{"hidden_size": -4}', "`hidden_size`"),
        ('{"hidden_size": "96"}', "`hidden_size`"),
        ('{"model_type": "llama", "hidden_size": 96}', "not a SambaConfig JSON"),
    ],
)
def test_a_wrong_config_json(tmp_path, capsys, content, fragment):
    src = save_official(tmp_path, true_model(["mamba", "attn"], seed=6))
    (tmp_path / "bad.json").write_text(content)
    one_line_error(
        capsys,
        ["convert", "lit-gpt", str(src), str(tmp_path / "out"), "--config", str(tmp_path / "bad.json")],
        fragment,
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("source", ["fla", "mamba", "mistral"])
@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"{not json", "is not readable JSON (Expecting property name"),
        (b"\xff\xfe{}", "is not readable JSON ('utf-8' codec can't decode"),
        (b"[1, 2]", "holds list, not a JSON object of config fields"),
    ],
)
def test_a_source_config_json_that_is_not_json(tmp_path, capsys, source, content, fragment):
    if source == "fla":
        src = save_fla(tmp_path, true_model(["mamba", "attn"], seed=6), attn_layers=[1])
    else:  # the Mistral converter reads config.json the same way; a Mamba folder's weights serve for the test
        src = tmp_path / "src"
        save_mamba(src, layers=1)
    (src / "config.json").write_bytes(content)
    before = listing(src)
    one_line_error(
        capsys, ["convert", source, str(src), str(tmp_path / "out")], fragment, "restore the source's config.json"
    )
    assert not (tmp_path / "out").exists() and listing(src) == before


# ---------------------------------------------------------------- the source folder's tokenizer comes along


def test_a_source_folders_tokenizer_is_kept_without_tokenizer_flag(tmp_path, capsys):
    from transformers import AutoTokenizer, MambaConfig, MambaForCausalLM

    from samba_hf.cli import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    MambaForCausalLM(
        MambaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, state_size=4)
    ).save_pretrained(tmp_path / "bare")
    (tmp_path / "mamba").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "mamba" / name).write_bytes((tmp_path / "bare" / name).read_bytes())
    tokenizer.save_pretrained(tmp_path / "mamba")
    assert main(["convert", "mamba", str(tmp_path / "mamba"), str(tmp_path / "out"), "--no-verify"]) == 0
    assert "no tokenizer written" not in capsys.readouterr().err
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("The assert").input_ids == tokenizer("The assert").input_ids

    assert main(["convert", "mamba", str(tmp_path / "bare"), str(tmp_path / "out2"), "--no-verify"]) == 0
    assert "no tokenizer written (the source has none beside it); pass --tokenizer" in capsys.readouterr().err
    assert not any((tmp_path / "out2" / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))


def sentencepiece_model() -> bytes:
    """A small SentencePiece BPE model, trained here."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(["Mamba layers read the sequence once."] * 40),
        model_writer=model,
        vocab_size=60,
        model_type="bpe",
        minloglevel=2,
        hard_vocab_limit=False,
    )
    return model.getvalue()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_damaged_sentencepiece_tokenizer_is_named_before_converting(tmp_path, capsys, damage):
    """One check of .model files for every converter (convert megatron's too): not transformers' guess at another
    format ("`tiktoken` is required")."""
    pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")
    blob = sentencepiece_model()
    src = save_official(tmp_path, true_model(["mamba", "attn"], seed=2))
    argv = [
        "convert",
        "lit-gpt",
        str(src),
        str(tmp_path / "out"),
        "--config",
        str(write_config(tmp_path)),
        "--tokenizer",
        str(tmp_path / "tokenizer.model"),
    ]
    (tmp_path / "tokenizer.model").write_bytes(blob)
    assert main(argv) == 0  # the whole file converts
    (tmp_path / "tokenizer.model").write_bytes(
        {"garbage": b"\x0a\x05hello, not a model" * 3, "truncated": blob[: len(blob) // 2], "empty": b""}[damage]
    )
    one_line_error(
        capsys,
        [*argv[:3], str(tmp_path / "out2"), *argv[4:]],
        f"{tmp_path / 'tokenizer.model'} is not a SentencePiece model",
        "truncated, corrupt",
    )
    assert not (tmp_path / "out2").exists() and not leftovers(tmp_path)
