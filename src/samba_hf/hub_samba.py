"""What a saved Samba folder holds beyond transformers' own files: its remote code, `auto_map` for `AutoModel`, and
a model card with Hub metadata.

Part of the remote code of a saved model: imports only torch, transformers (and huggingface_hub, which transformers
brings, for the card's metadata).
"""

import errno
import os
import re
import shutil
import tempfile
from contextlib import contextmanager

# The remote code of a saved Samba folder: the modeling file and every file it imports, at any depth (transformers'
# `get_relative_import_files` finds them; save_pretrained copies them, and the embedded models link them).
REMOTE_CODE_FILES = (
    "configuration_samba.py",
    "modeling_samba.py",
    "attention_samba.py",
    "cache_samba.py",
    "validation_samba.py",
    "hub_samba.py",
    "linear_samba.py",
    "ssm_samba.py",
    "speculative_samba.py",
    "kernels_samba.py",
    "cpu_kernels_samba.py",
    "triton_scan_samba.py",
    "triton_conv_samba.py",
)
# A SambaY folder's (Phi-4-mini-flash-reasoning's architecture): its own two files, then Samba's.
SAMBAY_REMOTE_CODE_FILES = ("configuration_sambay.py", "modeling_sambay.py", *REMOTE_CODE_FILES)


def save_folder(model, save_directory, save, *args, **kwargs):
    """`save(save_directory, *args, **kwargs)` (transformers' save_pretrained), whole or not at all, plus what tools
    that never import samba_hf need.

    - Whole or not at all: the files are written into a hidden folder inside the target (`.samba-hf-saving-*`) and
      moved out one by one once every one of them is written. A failed or interrupted save (a full disk included)
      leaves the folder as it was (or absent) and the disk's space free again; a full disk is one OSError that says
      so. Saves to push to the Hub, and those of a process that is not the main one, go straight into the folder
      as transformers' do.
    - An `auto_map` entry for `AutoModel` too (transformers writes only the saved class's), and a model card with Hub
      metadata when the folder has no README.md (one that is there is never replaced).
    - No earlier weights left beside the new ones: saving shards where an earlier save left one model.safetensors (or
      the reverse) removes the earlier one, as transformers removes earlier shards; otherwise `from_pretrained` would
      load the earlier weights.
    """
    model.config.auto_map = {**(getattr(model.config, "auto_map", None) or {}), "AutoModel": model._auto_model_entry}
    save_directory = os.fspath(save_directory)
    if kwargs.get("push_to_hub") or not kwargs.get("is_main_process", True) or os.path.isfile(save_directory):
        with named_as_saved(model):
            save(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True) and os.path.isdir(save_directory):
            write_card(model, save_directory, save_directory)
        return
    created = not os.path.isdir(save_directory)
    os.makedirs(save_directory, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".samba-hf-saving-", dir=save_directory)  # (same file system: renames)
    try:
        with named_as_saved(model):
            save(staging, *args, **kwargs)
        write_card(model, staging, save_directory)
        written = sorted(os.listdir(staging))
        earlier = earlier_weights(save_directory, written, kwargs.get("variant"))
        for name in written:
            os.replace(os.path.join(staging, name), os.path.join(save_directory, name))
        for name in earlier:
            os.remove(os.path.join(save_directory, name))
    except Exception as error:
        if system_error_code(error) == errno.ENOSPC:
            raise OSError(
                errno.ENOSPC,
                f"No space left on device while saving the model to {save_directory}; nothing was written there "
                "(free some space, or save elsewhere)",
            ) from error
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not os.listdir(save_directory):  # a failed save into a folder it made: none left
            os.rmdir(save_directory)


def system_error_code(error: BaseException) -> int | None:
    """The system's error number a failed write carries: an OSError's errno, or the one safetensors reports inside
    its own message ("... (os error 28)")."""
    if isinstance(error, OSError):
        return error.errno
    found = re.search(r"os error (\d+)", str(error))
    return int(found.group(1)) if found else None


@contextmanager
def named_as_saved(model):
    """A model sharded by FSDP2 is an instance of a class torch made (`FSDPSambaForCausalLM`, in torch's
    _fsdp_init.py): named as it is, the folder's remote code would be torch's FSDP files. Saves the model's class."""
    made = type(model)
    saved_class = next(c for c in made.__mro__ if not c.__module__.startswith("torch."))
    named = made.__module__, made.__name__, made.__qualname__
    made.__module__, made.__name__, made.__qualname__ = (
        saved_class.__module__,
        saved_class.__name__,
        saved_class.__qualname__,
    )
    try:
        yield
    finally:
        made.__module__, made.__name__, made.__qualname__ = named


def earlier_weights(folder: str, written: list[str], variant: str | None) -> list[str]:
    """The weight files of an earlier save in `folder` that a save writing `written` makes stale: shards the new save
    did not write (transformers' own rule), and the single file or the index of the other form."""
    if not os.path.isdir(folder):
        return []
    weights = "model" if variant is None else f"model.{variant}"
    if "adapter_model.safetensors" in written:
        weights = "adapter_model"
    single, index = f"{weights}.safetensors", f"{weights}.safetensors.index.json"
    other = {single: index, index: single}
    stale = {other[name] for name in (single, index) if name in written and (single in written) != (index in written)}
    shard = re.compile(rf"{re.escape(weights)}.*-\d{{5}}-of-\d{{5}}\.safetensors")
    return sorted(
        name
        for name in os.listdir(folder)
        if name not in written
        and os.path.isfile(os.path.join(folder, name))
        and (name in stale or shard.fullmatch(name))
    )


def write_card(model, folder: str, target: str):
    """A model card into `folder`, unless `target` (the folder the save is for) has a README.md."""
    if os.path.exists(os.path.join(target, "README.md")):
        return
    try:
        with open(os.path.join(folder, "README.md"), "x") as card:  # "x": only where there is none
            card.write(model_card(model.config, "Samba model", "Saved with samba-hf's `save_pretrained`."))
    except FileExistsError:
        pass


def hub_metadata(license: str = "unknown", base_model: str | None = None, extra_tags: list[str] = ()) -> str:
    """The YAML front matter of a Samba model card (Hub metadata), without the `---` lines."""
    from huggingface_hub import ModelCardData

    tags = ["samba", "mamba", "sliding-window-attention", "samba-hf", *extra_tags]
    return ModelCardData(
        library_name="transformers",
        license=license,
        tags=list(dict.fromkeys(tags)),
        pipeline_tag="text-generation",
        base_model=base_model,
    ).to_yaml()


def architecture(config) -> str:
    """What the layout is, in words, for a model card."""
    if config.model_type != "samba":
        return (
            "SambaY (Phi-4-mini-flash-reasoning's architecture): a Samba self-decoder, then a YOCO cross-decoder "
            "with Gated Memory Units"
        )
    mixers = "Mamba-2" if config.mamba_version == 2 else "Mamba"
    if "mlp" in config.layer_types:
        return (
            f"a hybrid of {mixers}, attention and MLP blocks of one sub-layer each (pattern "
            f"{config.hybrid_pattern}), as NVIDIA's Mamba-2-Hybrid (Waleffe et al., 2024)"
        )
    return (
        f"Samba (Ren et al., ICLR 2025): {mixers} and attention layers (pattern {config.hybrid_pattern}), each "
        "followed by an MLP"
        if config.mixer_mlp
        else f"{mixers} and attention layers (pattern {config.hybrid_pattern}) without MLPs"
    )


def model_card(config, title: str, details: str, **metadata) -> str:
    """A README.md for a Samba folder: Hub metadata, what the model is, and how to load it with or without samba-hf."""
    layers = ", ".join(f"{config.layer_types.count(t)} {t}" for t in dict.fromkeys(config.layer_types))
    files = SAMBAY_REMOTE_CODE_FILES if config.model_type != "samba" else REMOTE_CODE_FILES
    return f"""---
{hub_metadata(**metadata)}
---

# {title}

{details}

- Layers: {config.num_hidden_layers} ({layers}); hidden size {config.hidden_size}, vocabulary {config.vocab_size}.
- Architecture: {architecture(config)}, in the transformers implementation of samba-hf.

## Use

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO", trust_remote_code=True)  # or `import samba_hf` first
```

The folder carries its own modeling code ({", ".join(f"`{name}`" for name in files)}), so `trust_remote_code=True`
works without the samba-hf package.
"""
