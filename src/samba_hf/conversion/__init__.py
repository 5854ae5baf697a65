"""Checkpoint conversion into `SambaForCausalLM` folders, and back to the official code.

    convert("lit-gpt", "iter-100000-ckpt.pth", "samba-421m-hf", config="Samba_421M", tokenizer="tokenizer.model")
    convert("fla" | "mamba" | "mistral" | "llama", SRC_FOLDER, OUT)
    convert("megatron", "mamba2-hybrid-8b-3t-4k", OUT)          # NVIDIA's Megatron-LM folder as downloaded, or its .pt
    export_lit_gpt("samba-421m-hf", "samba-421m.pth")
    export_megatron("m-finetuned", "megatron/release/mp_rank_00/model_optim_rng.pt")

Each source is checked in full (every key and shape against the config) before anything is written; the output is
written beside OUT under a temporary name and renamed at the end (see `writer.atomic_folder`).
"""

import json
import os
import shlex
import sys
import zipfile
from pathlib import Path

import torch

from .. import __version__
from ..configuration_samba import SambaConfig
from . import fla, lit_gpt, megatron, transformers_models
from .checkpoint import Checkpoint, ConversionError
from .tokenizer import TOKENIZER_FILES, check_fits, checked_tokenizer
from .verify import AUTO_VERIFY_MAX_PARAMS, verify
from .writer import (
    DTYPES,
    atomic_folder,
    check_output,
    clean_stale,
    expected_tensors,
    os_errors,
    parse_size,
    push_folder,
    torch_save,
    write_config_and_code,
    write_model_card,
    write_safetensors,
    written_whole,
)

SOURCES = {
    "lit-gpt": "the official code (microsoft/Samba, lit-gpt): a .pth training checkpoint or state dict",
    "fla": "flash-linear-attention's Samba: an HF folder (model_type 'samba', fla/models/samba)",
    "mamba": "transformers' MambaForCausalLM folder (e.g. state-spaces/mamba-130m-hf)",
    "mistral": "transformers' MistralForCausalLM folder",
    "llama": "transformers' LlamaForCausalLM folder",
    "megatron": "NVIDIA's Megatron-LM Mamba checkpoints (Mamba-2-Hybrid 8B, Mamba-2 8B): "
    "the folder as downloaded or its .pt",
}
PLANS = {
    "lit-gpt": lit_gpt.plan,
    "fla": fla.plan,
    "mamba": transformers_models.plan_mamba,
    "mistral": transformers_models.plan_same_names("mistral"),
    "llama": transformers_models.plan_same_names("llama"),
    "megatron": megatron.plan,
}


def resolve_config(config: str | os.PathLike | SambaConfig | dict | None) -> SambaConfig | None:
    """An official config name (lit-gpt), a SambaConfig JSON file or folder, a dict of SambaConfig fields, or None."""
    if config is None or isinstance(config, SambaConfig):
        return config
    if isinstance(config, str) and config in lit_gpt.OFFICIAL_CONFIGS:
        return lit_gpt.config_from_name(config)
    path = Path(config) if not isinstance(config, dict) else None
    if path is not None and path.is_dir():
        path = path / "config.json"
    if path is not None and not path.is_file():
        raise ConversionError(
            f"--config {config!r} is neither an official config name ({', '.join(lit_gpt.OFFICIAL_CONFIGS)}) nor a "
            "SambaConfig JSON file."
        )
    try:
        fields = config if path is None else json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConversionError(f"cannot read --config {path} as JSON ({error}).") from None
    if (
        not isinstance(fields, dict)
        or fields.get("model_type", "samba") != "samba"
        or not ("layer_types" in fields or "hidden_size" in fields)
    ):
        raise ConversionError(f"--config {config}: not a SambaConfig JSON (an object of samba-hf config fields).")
    fields = {
        k: v for k, v in fields.items() if k not in ("model_type", "auto_map", "architectures", "transformers_version")
    }
    try:
        return SambaConfig(**fields)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"--config {config}: {str(error).strip().splitlines()[0]}") from None


def source_card(checkpoint: Checkpoint) -> dict:
    """What the source folder says of itself for the model card: the Hub repository its config.json names
    ("org/name"), as base_model, and the license of its own model card. Empty when unknown."""
    path = getattr(checkpoint, "source", checkpoint.path)  # a Megatron checkpoint: the folder as downloaded
    folder = path if path.is_dir() else path.parent
    known = {}
    try:
        name = str(json.loads((folder / "config.json").read_text()).get("_name_or_path", ""))
        if len(name.split("/")) == 2 and all(name.split("/")) and not Path(name).exists():
            known["base_model"] = name
    except (OSError, ValueError, AttributeError):
        pass
    if (folder / "README.md").is_file():
        from huggingface_hub import ModelCard

        try:
            license = ModelCard.load(folder / "README.md").data.license
        except Exception:  # a README without (valid) metadata: nothing to learn from it
            license = None
        if license:
            known["license"] = license
    return known


def source_tokenizer(src: Path) -> Path | None:
    """The tokenizer that comes with a source folder (or lies beside a checkpoint file), if any: the folder when it
    holds a transformers tokenizer, else its SentencePiece tokenizer.model."""
    folder = src if src.is_dir() else src.parent
    if any((folder / name).is_file() for name in TOKENIZER_FILES if name != "tokenizer.model"):
        return folder
    return folder / "tokenizer.model" if (folder / "tokenizer.model").is_file() else None


def convert(
    source: str,
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    config=None,
    tokenizer: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    verify_parity: bool | None = None,
    push_to_hub: str | None = None,
    force: bool = False,
    force_config: bool = False,
    progress: bool = True,
    command: str | None = None,
) -> dict:
    """Convert `src` (a checkpoint in `source` format) into a samba-hf folder `out`.

    dtype: None keeps the source's dtype (of its embedding matrix). verify_parity: None = on for models up to 1B
    parameters. tokenizer: None takes the source folder's tokenizer when it has one. force: replace an earlier
    samba-hf output at `out` (never a folder holding the source or files samba-hf did not write). force_config:
    convert a lit-gpt checkpoint with a `config` that contradicts the model_name it records.
    Returns {"out", "config", "config_origin", "parity", "tokenizer", "cleaned"} (parity: the summary line, or None
    when not verified; cleaned: what an interrupted earlier run had left beside `out`, removed or reported).
    """
    if source not in PLANS:
        raise ConversionError(f"unknown source {source!r}; choose one of: {', '.join(PLANS)}.")
    src, out = Path(src), Path(out)
    if source == "megatron" and config is not None:
        raise ConversionError(
            "--config does not apply to megatron: the layout is read from the checkpoint itself "
            "(its blocks, shapes and args); leave --config out."
        )
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConversionError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}.")
        dtype = DTYPES[dtype]
    shard_bytes = parse_size(max_shard_size)
    if tokenizer is not None:
        tokenizer = Path(tokenizer)
    else:
        tokenizer = megatron.find_tokenizer(src) if source == "megatron" else source_tokenizer(src)
    sources = (src,) if tokenizer is None else (src, tokenizer)
    check_output(out, force, sources)  # said first (atomic_folder checks again right before it writes)
    cleaned = clean_stale(out)
    checkpoint = megatron.MegatronCheckpoint(src) if source == "megatron" else Checkpoint(src)
    samba_config, origin = resolve_config(config), "from the source's config.json"
    if source == "megatron":
        origin = "from the checkpoint's blocks, shapes and args"
    elif source == "lit-gpt":
        samba_config, origin = lit_gpt.choose_config(checkpoint, samba_config, force_config)
    elif config is not None:
        origin = "as given by --config"
    samba_config, tensors = PLANS[source](checkpoint, samba_config)
    shapes = expected_tensors(samba_config)
    if dtype is None:
        first = next(iter(tensors.values()))()
        dtype = first.dtype if first.is_floating_point() else torch.float32
    params = sum(int(torch.Size(s).numel()) for s in shapes.values())
    if verify_parity is None:
        verify_parity = params <= AUTO_VERIFY_MAX_PARAMS
    command = command or "samba_hf.conversion.convert(" + ", ".join(repr(str(a)) for a in (source, src, out)) + ")"

    hf_tokenizer = None  # loaded and checked before the weights are converted
    if source == "megatron" and tokenizer is not None:  # Megatron's GPTSentencePieceTokenizer, reproduced exactly
        hf_tokenizer = megatron_tokenizer(tokenizer, samba_config)
    elif tokenizer is not None:
        add_bos = False if source == "lit-gpt" else None  # the official runs packed documents without BOS
        hf_tokenizer = checked_tokenizer(tokenizer, samba_config.vocab_size, add_bos)

    with atomic_folder(out, force, sources) as folder:
        write_safetensors(folder, tensors, shapes, dtype, shard_bytes, progress=progress)
        write_config_and_code(folder, samba_config, dtype)
        if hf_tokenizer is not None:
            hf_tokenizer.save_pretrained(folder)
        parity = verify(source, checkpoint, samba_config, folder, dtype)[1] if verify_parity else None
        write_model_card(
            folder,
            source,
            str(src),
            command,
            parity or "not verified (pass --verify to measure it)",
            samba_config,
            **source_card(checkpoint),
        )
    if push_to_hub:
        push_folder(out, push_to_hub)
    return {
        "out": out,
        "config": samba_config,
        "config_origin": origin,
        "parity": parity,
        "tokenizer": tokenizer,
        "cleaned": cleaned,
    }


def megatron_tokenizer(path: Path, config: SambaConfig):
    """The SentencePiece model as a transformers tokenizer that encodes as Megatron's `GPTSentencePieceTokenizer`
    (no BOS or EOS added); the config takes its end-of-document id, where generation stops."""
    from .sentencepiece_tokenizer import tokenizer_from_sentencepiece

    if not (path.is_file() and path.suffix == ".model"):
        raise ConversionError(f"--tokenizer {path}: Megatron's tokenizer is a SentencePiece .model file.")
    tokenizer = tokenizer_from_sentencepiece(path)
    check_fits(tokenizer, config.vocab_size)
    config.eos_token_id, config.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def export_lit_gpt(src: str | os.PathLike, out: str | os.PathLike, force: bool = False) -> dict:
    """A samba-hf folder -> the official code's checkpoint file `{"model": state_dict}` (what its eval.py loads),
    in the folder's dtype. Every tensor comes from the folder (a missing, unexpected or mis-shaped one, or NaN/inf,
    is an error). Returns {"out", "official_name", "cleaned"} (official_name: the matching official config name, or
    None; cleaned: what an interrupted earlier run had left beside `out`)."""
    src, out = Path(src), Path(out)
    model, cleaned = load_for_export(src, out, force)
    if model.config.mamba_version != 1 or "mlp" in model.config.layer_types:
        raise ConversionError(
            f"{src} holds a Mamba-2 layout: the official Samba code has no layout for it (export "
            "megatron writes Megatron-LM's)."
        )
    write_checkpoint({"model": lit_gpt.to_official(model.state_dict(), model.config), EXPORT_MARKER: __version__}, out)
    return {"out": out, "official_name": lit_gpt.official_name_of(model.config), "cleaned": cleaned}


def export_megatron(src: str | os.PathLike, out: str | os.PathLike, force: bool = False) -> dict:
    """A samba-hf folder of a Megatron layout (what `convert("megatron", ...)` writes, fine-tuned or not) -> a
    Megatron-LM checkpoint file in the released layout: `{"model", "args", "checkpoint_version", "iteration"}`, the
    same key names, the interleaved linear_qkv, bfloat16. When OUT is `.../release/mp_rank_00/model_optim_rng.pt`,
    the folder two levels up gets the `latest_checkpointed_iteration.txt` Megatron looks for (if it has none).
    Returns {"out", "tracker" (the tracker written, or None), "notes", "cleaned"}."""
    src, out = Path(src), Path(out)
    tracker, notes = None, []  # the tracker to write; an existing one is read before anything is written
    if out.parent.name == "mp_rank_00" and out.parent.parent.name == "release":
        tracker = out.parents[2] / megatron.TRACKER
        if tracker.exists() or tracker.is_symlink():
            if not tracker.is_file():
                raise ConversionError(
                    f"{tracker} is not a file: Megatron reads the iteration to load from it. "
                    "Remove it, or export elsewhere."
                )
            try:
                iteration = tracker.read_text(errors="replace").strip()
            except OSError as error:
                raise ConversionError(
                    f"cannot read {tracker} ({error.strerror or error}): Megatron reads the "
                    "iteration to load from it. Make it readable, or export elsewhere."
                ) from None
            if iteration != "release":
                notes.append(
                    f"{tracker} names another iteration, so Megatron will not load this export from "
                    f"{out.parents[2]} unless it says 'release' (it was left as it is)"
                )
            tracker = None  # left as it is
    model, cleaned = load_for_export(src, out, force)
    megatron.check_exportable(model.config, src)
    state = megatron.to_megatron(model.state_dict(), model.config)
    write_checkpoint(
        {
            "model": state,
            "args": megatron.megatron_args(model.config),
            "checkpoint_version": 3.0,
            "iteration": 0,
            EXPORT_MARKER: __version__,
        },
        out,
    )
    if tracker is not None:
        with os_errors(tracker):
            tracker.write_text("release")
    return {"out": out, "tracker": tracker, "notes": notes, "cleaned": cleaned}


def load_for_export(src: Path, out: Path, force: bool):
    """(the model of a samba-hf folder, what an interrupted earlier export left beside OUT), after checking OUT."""
    from ..model_folder import ModelFolderError, load_model

    check_export_target(out, src, force)
    cleaned = clean_stale(out)
    try:
        model = load_model(src, dtype="auto")
    except ModelFolderError as error:
        raise ConversionError(str(error)) from None
    if model.config.model_type != "samba":
        raise ConversionError(
            f"{src} holds a {model.config.model_type!r} model; export takes samba-hf folders of model type 'samba'."
        )
    return model, cleaned


def write_checkpoint(checkpoint: dict, out: Path):
    """torch.save under a temporary name beside OUT, renamed at the end: OUT is whole or untouched."""
    with os_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        with written_whole(out) as tmp:
            torch_save(checkpoint, tmp)


# A top-level key of every checkpoint file export writes: `--force` replaces only files that carry it (never a training
# checkpoint of the official code or NVIDIA's release, which are PyTorch zip files too).
EXPORT_MARKER = "samba_hf_export"


def check_export_target(out: Path, src: Path, force: bool):
    """OUT is a new file, or (with --force) an earlier export (a checkpoint that carries `EXPORT_MARKER`), not a file
    of SRC."""
    if out.is_dir():
        raise ConversionError(f"{out} is a folder; give the file to write, e.g. {out / 'samba.pth'}.")
    if not out.exists():
        return
    if not force:
        raise ConversionError(f"{out} exists; choose a new file name, or pass --force to replace it.")
    if out.resolve().parent == src.resolve():
        raise ConversionError(f"{out} is a file of the source folder {src}; write the export elsewhere.")
    if not is_our_export(out):
        raise ConversionError(
            f"{out} is not a checkpoint that samba-hf export wrote; --force only replaces an earlier export, never "
            "another checkpoint. Choose a new file name."
        )


def is_our_export(path: Path) -> bool:
    """A torch.save zip archive whose pickled structure names `EXPORT_MARKER`: read as bytes, nothing unpickled, no
    tensor read."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
            return len(pickles) == 1 and EXPORT_MARKER.encode() in archive.read(pickles[0])
    except (OSError, zipfile.BadZipFile):
        return False


def command_line(argv: list[str] | None = None) -> str:
    """The samba-hf command as typed: `argv` as given to `samba_hf_cli.main` (sys.argv[1:] when None)."""
    return shlex.join(["samba-hf", *(sys.argv[1:] if argv is None else argv)])


__all__ = ["SOURCES", "ConversionError", "convert", "export_lit_gpt", "export_megatron", "resolve_config"]
