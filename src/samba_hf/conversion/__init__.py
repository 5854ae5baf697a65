"""Checkpoint conversion into `SambaForCausalLM` folders, and back to the official code.

    convert("lit-gpt", "iter-100000-ckpt.pth", "samba-421m-hf", config="Samba_421M", tokenizer="tokenizer.model")
    convert("fla" | "mamba" | "mistral" | "llama", SRC_FOLDER, OUT)
    export_lit_gpt("samba-421m-hf", "samba-421m.pth")

Each source is checked in full (every key and shape against the config) before anything is written; the output is
written beside OUT under a temporary name and renamed at the end (see `writer.atomic_folder`).
"""

import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from ..configuration_samba import SambaConfig
from . import fla, lit_gpt, transformers_models
from .checkpoint import Checkpoint, ConversionError
from .tokenizer import save_tokenizer
from .verify import AUTO_VERIFY_MAX_PARAMS, verify
from .writer import (
    DTYPES,
    atomic_folder,
    current_umask,
    expected_tensors,
    parse_size,
    push_folder,
    write_config_and_code,
    write_model_card,
    write_safetensors,
)

SOURCES = {
    "lit-gpt": "the official code (microsoft/Samba, lit-gpt): a .pth training checkpoint or state dict",
    "fla": "flash-linear-attention's Samba: an HF folder (model_type 'samba', fla/models/samba)",
    "mamba": "transformers' MambaForCausalLM folder (e.g. state-spaces/mamba-130m-hf)",
    "mistral": "transformers' MistralForCausalLM folder",
    "llama": "transformers' LlamaForCausalLM folder",
}
PLANS = {
    "lit-gpt": lit_gpt.plan,
    "fla": fla.plan,
    "mamba": transformers_models.plan_mamba,
    "mistral": transformers_models.plan_same_names("mistral"),
    "llama": transformers_models.plan_same_names("llama"),
}


def resolve_config(config: str | os.PathLike | SambaConfig | dict | None, source: str) -> SambaConfig | None:
    """An official config name (lit-gpt), a SambaConfig JSON file or folder, a dict of SambaConfig fields, or None."""
    if config is None or isinstance(config, SambaConfig):
        if config is None and source == "lit-gpt":
            raise ConversionError(
                "the official checkpoints do not record their sizes: pass --config with the name used for training "
                f"({', '.join(lit_gpt.OFFICIAL_CONFIGS)}) or a SambaConfig JSON file."
            )
        return config
    if isinstance(config, dict):
        return SambaConfig(**config)
    if isinstance(config, str) and config in lit_gpt.OFFICIAL_CONFIGS:
        return lit_gpt.config_from_name(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        fields = json.loads(path.read_text())
        if fields.get("model_type", "samba") != "samba" or "layer_types" not in fields and "hidden_size" not in fields:
            raise ConversionError(f"{path} is not a SambaConfig JSON (no samba-hf fields).")
        fields.pop("model_type", None)
        return SambaConfig(**{k: v for k, v in fields.items() if k not in ("auto_map", "architectures", "transformers_version")})
    raise ConversionError(
        f"--config {config!r} is neither an official config name ({', '.join(lit_gpt.OFFICIAL_CONFIGS)}) nor a "
        "SambaConfig JSON file."
    )


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
    progress: bool = True,
    command: str | None = None,
) -> dict:
    """Convert `src` (a checkpoint in `source` format) into a samba-hf folder `out`.

    dtype: None keeps the source's dtype (of its embedding matrix). verify_parity: None = on for models up to 1B
    parameters. Returns {"out", "config", "parity"} (parity: the summary line, or None when not verified).
    """
    if source not in PLANS:
        raise ConversionError(f"unknown source {source!r}; choose one of: {', '.join(PLANS)}.")
    out = Path(out)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConversionError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}.")
        dtype = DTYPES[dtype]
    shard_bytes = parse_size(max_shard_size)
    checkpoint = Checkpoint(src)
    samba_config, tensors = PLANS[source](checkpoint, resolve_config(config, source))
    shapes = expected_tensors(samba_config)
    if dtype is None:
        first = next(iter(tensors.values()))()
        dtype = first.dtype if first.is_floating_point() else torch.float32
    params = sum(int(torch.Size(s).numel()) for s in shapes.values())
    if verify_parity is None:
        verify_parity = params <= AUTO_VERIFY_MAX_PARAMS
    command = command or "samba_hf.conversion.convert(" + ", ".join(repr(str(a)) for a in (source, src, out)) + ")"

    with atomic_folder(out, force) as folder:
        write_safetensors(folder, tensors, shapes, dtype, shard_bytes, progress=progress)
        write_config_and_code(folder, samba_config, dtype)
        if tokenizer is not None:
            add_bos = False if source == "lit-gpt" else None  # the official runs packed documents without BOS
            save_tokenizer(tokenizer, folder, samba_config.vocab_size, add_bos)
        parity = verify(source, checkpoint, samba_config, folder, dtype)[1] if verify_parity else None
        write_model_card(folder, source, str(src), command, parity or "not verified (pass --verify to measure it)",
                         samba_config)
    if push_to_hub:
        push_folder(out, push_to_hub)
    return {"out": out, "config": samba_config, "parity": parity}


def export_lit_gpt(src: str | os.PathLike, out: str | os.PathLike, force: bool = False) -> dict:
    """A samba-hf folder -> the official code's checkpoint file `{"model": state_dict}` (what its eval.py loads),
    in the folder's dtype. Returns {"out", "official_name"} (the matching official config name, or None)."""
    from ..modeling_samba import SambaForCausalLM

    out = Path(out)
    if out.exists() and not force:
        raise ConversionError(f"{out} exists; choose a new file name, or pass --force to replace it.")
    if not (Path(src) / "config.json").is_file():
        raise ConversionError(f"{src} is not a samba-hf model folder (no config.json).")
    model = SambaForCausalLM.from_pretrained(src, dtype="auto")
    state = lit_gpt.to_official(model.state_dict(), model.config)
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(handle)
    try:
        torch.save({"model": state}, tmp)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp made it 0600
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return {"out": out, "official_name": lit_gpt.official_name_of(model.config)}


def command_line(argv: list[str] | None = None) -> str:
    """The samba-hf command as typed: `argv` as given to `samba_hf.cli.main` (sys.argv[1:] when None)."""
    return shlex.join(["samba-hf", *(sys.argv[1:] if argv is None else argv)])


__all__ = ["SOURCES", "ConversionError", "convert", "export_lit_gpt", "resolve_config"]
