"""What a saved Samba folder holds beyond transformers' own files: its remote code, `auto_map` for `AutoModel`, and
a model card with Hub metadata.

Part of the remote code of a saved model: imports only torch, transformers (and huggingface_hub, which transformers
brings, for the card's metadata).
"""

import os

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
    """`save(save_directory, *args, **kwargs)` (transformers' save_pretrained), plus what tools that never import
    samba_hf need: an `auto_map` entry for `AutoModel` too (transformers writes only the saved class's), and a model
    card with Hub metadata when the folder has no README.md (one that is there is never replaced). Saving shards
    where an earlier save left one model.safetensors (or the reverse) removes the earlier one, as transformers
    removes earlier shards: otherwise `from_pretrained` would load the earlier weights."""
    model.config.auto_map = {**(getattr(model.config, "auto_map", None) or {}), "AutoModel": model._auto_model_entry}
    single, index = (
        os.path.join(save_directory, name) for name in ("model.safetensors", "model.safetensors.index.json")
    )

    def stamp(path):  # what tells a file this call wrote from the one that was there
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return None
        return stat.st_mtime_ns, stat.st_ino, stat.st_size

    before = {path: stamp(path) for path in (single, index)}
    # A model sharded by FSDP2 is an instance of a class torch made (`FSDPSambaForCausalLM`, in torch's
    # _fsdp_init.py): named as it is, the folder's remote code would be torch's FSDP files. Save the model's class.
    made = type(model)
    saved_class = next(c for c in made.__mro__ if not c.__module__.startswith("torch."))
    named = made.__module__, made.__name__, made.__qualname__
    made.__module__, made.__name__, made.__qualname__ = (
        saved_class.__module__,
        saved_class.__name__,
        saved_class.__qualname__,
    )
    try:
        save(save_directory, *args, **kwargs)
    finally:
        made.__module__, made.__name__, made.__qualname__ = named
    if kwargs.get("is_main_process", True):
        written = [path for path in (single, index) if stamp(path) not in (None, before[path])]
        if len(written) == 1:  # the other one, if there, is an earlier save's
            earlier = index if written[0] == single else single
            if os.path.isfile(earlier):
                os.remove(earlier)
        try:
            with open(f"{save_directory}/README.md", "x") as card:  # "x": only where there is none
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
