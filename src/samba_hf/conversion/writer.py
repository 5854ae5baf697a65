"""Writing a converted model folder: all or nothing, one shard in memory at a time.

The folder is written under a temporary name beside OUT and renamed at the very end, so a failure or Ctrl-C leaves
OUT as it was. Tensors are produced one by one from the (memory-mapped) source, cast, and written shard by shard.
"""

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import GenerationConfig
from transformers.dynamic_module_utils import custom_object_save

from ..configuration_samba import SambaConfig
from ..modeling_samba import SambaForCausalLM
from .checkpoint import ConversionError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: str | int) -> int:
    """'5GB' -> 5_000_000_000; an int is bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), flags=re.IGNORECASE)
    if not match:
        raise ConversionError(f"cannot read the shard size {size!r}; write it like 5GB, 500MB or 2GiB.")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").upper()])


def keeps_float32(name: str) -> bool:
    """Mamba's A_log and D stay float32 in half-precision outputs (as `_keep_in_fp32_modules_strict` loads them)."""
    return name.endswith((".A_log", ".mamba.D"))


def empty_model(config: SambaConfig) -> SambaForCausalLM:
    """The model on the meta device: its state dict gives every expected name and shape, for free."""
    with torch.device("meta"):
        return SambaForCausalLM(config)


def expected_tensors(config: SambaConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes a saved SambaForCausalLM holds (a tied lm_head is not stored)."""
    shapes = {name: tuple(t.shape) for name, t in empty_model(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def check_output(out: Path, force: bool):
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out} exists and is not a folder; choose another output path.")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConversionError(f"{out} is not empty; choose a new folder, or pass --force to replace it.")


@contextmanager
def atomic_folder(out: Path, force: bool):
    """Yield a temporary folder beside `out`; on success it replaces `out`, on any failure it is deleted."""
    out = Path(out)
    check_output(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
        _usual_permissions(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            out.rename(old / out.name)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def current_umask() -> int:
    umask = os.umask(0)  # the only way to read it is to set it
    os.umask(umask)
    return umask


def _usual_permissions(folder: Path):
    """mkdtemp makes a 0700 folder (and safetensors 0600 files): give them what the user's umask gives new files."""
    umask = current_umask()
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def write_safetensors(
    folder: Path,
    tensors: dict[str, Callable[[], torch.Tensor]],
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    max_shard_size: int,
    progress: bool = True,
):
    """Write `tensors` (name -> producer) as safetensors shards of at most `max_shard_size` bytes (a tensor larger
    than that gets a shard of its own), with an index when there is more than one shard."""
    if set(tensors) != set(shapes):  # a converter bug, not a user error
        raise RuntimeError(f"conversion plan does not cover the model: {sorted(set(tensors) ^ set(shapes))[:5]}")

    def nbytes(name):
        itemsize = 4 if keeps_float32(name) else torch.empty((), dtype=dtype).element_size()
        return itemsize * int(torch.Size(shapes[name]).numel())

    shards, size = [[]], 0
    for name in tensors:
        if shards[-1] and size + nbytes(name) > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes(name)

    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    with tqdm(total=len(tensors), desc="converting", unit="tensor", disable=not progress) as bar:
        for file, names in zip(files, shards):
            shard = {}
            for name in names:
                tensor = tensors[name]()
                if tuple(tensor.shape) != tuple(shapes[name]):
                    raise RuntimeError(f"{name}: produced {list(tensor.shape)}, model expects {list(shapes[name])}")
                tensor = tensor.to(torch.float32 if keeps_float32(name) else dtype).contiguous()
                if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                    tensor = tensor.clone()  # a view into a larger tensor (a slice of a fused weight)
                shard[name] = tensor
                weight_map[name] = file
                bar.update()
            save_file(shard, folder / file, metadata={"format": "pt"})
            del shard
    if len(files) > 1:
        total = sum(nbytes(name) for name in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_config_and_code(folder: Path, config: SambaConfig, dtype: torch.dtype):
    """config.json (with auto_map), generation_config.json and the remote-code files."""
    config.dtype = dtype
    custom_object_save(empty_model(config), folder, config=config)  # copies modeling/configuration/ssm files
    config.save_pretrained(folder)
    generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(folder)


def write_model_card(folder: Path, source: str, src: str, command: str, parity: str, config: SambaConfig):
    params = sum(int(torch.Size(s).numel()) for s in expected_tensors(config).values())
    layers = ", ".join(f"{config.layer_types.count(t)} {t}" for t in dict.fromkeys(config.layer_types))
    text = f"""---
library_name: transformers
tags:
- samba
- mamba
- sliding-window-attention
---

# Samba model converted from {source}

Converted with samba-hf from `{src}` ({source} format).

- Command: `{command}`
- Parameters: {params:,} ({config.num_hidden_layers} layers: {layers}; hidden size {config.hidden_size},
  vocabulary {config.vocab_size}); weights stored as {str(config.dtype).replace("torch.", "")}.
- Parity at conversion: {parity}

## Use

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO", trust_remote_code=True)  # or `import samba_hf` first
```

The folder carries its own modeling code (`modeling_samba.py`, `configuration_samba.py`, `ssm_samba.py`), so
`trust_remote_code=True` works without the samba-hf package.
"""
    (folder / "README.md").write_text(text)


def push_folder(folder: Path, repo_id: str):
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message="Upload Samba model (samba-hf convert)")
