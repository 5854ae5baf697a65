"""Reading source checkpoints lazily, and checking them against the layout a config implies.

A `Checkpoint` maps tensor names to tensors without loading them: `.pth`/`.bin` files are opened with
`torch.load(mmap=True, weights_only=True)` (no code is unpickled, and tensor data stays on disk until it is
read), safetensors files with `safe_open`. Shapes are read from the headers, so every key and shape is checked
before a single byte is converted.
"""

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open


class ConversionError(ValueError):
    """A problem with the user's input (paths, checkpoint, config): the message names it and the fix."""


def _torch_load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # truncated, not a torch file, or holds pickled code
        raise ConversionError(
            f"cannot read {path} as a PyTorch checkpoint ({type(error).__name__}: {str(error).splitlines()[0]}). "
            "The file may be truncated or corrupt; only plain tensor checkpoints are read (weights_only=True)."
        ) from None


class Checkpoint:
    """Named tensors of one checkpoint (a file or an HF folder), read lazily."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._tensors: dict[str, torch.Tensor] = {}  # from torch files (memory-mapped)
        self._safetensors: dict[str, Path] = {}  # name -> file, read on demand
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.hparams: dict = {}  # what a training checkpoint records about its run (the official "model_name")
        if not self.path.exists():
            raise ConversionError(f"{self.path} does not exist; pass the checkpoint file or model folder to convert.")
        if self.path.is_dir():
            self._open_folder()
        elif self.path.suffix == ".safetensors":
            self._add_safetensors(self.path)
        else:
            self._add_torch_file(self.path)

    def _open_folder(self):
        files = sorted(self.path.glob("*.safetensors"))
        for file in files:
            self._add_safetensors(file)
        if not files:
            bins = sorted(self.path.glob("pytorch_model*.bin")) + sorted(self.path.glob("*.pth"))
            if not bins:
                raise ConversionError(
                    f"{self.path} holds no *.safetensors, pytorch_model*.bin or *.pth file: is it the model folder?"
                )
            for file in bins:
                self._add_torch_file(file)

    def _add_safetensors(self, file: Path):
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    self._safetensors[name] = file
                    self._shapes[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as error:
            raise ConversionError(f"cannot read {file} as safetensors ({error}); the file may be truncated.") from None

    def _add_torch_file(self, file: Path):
        data = _torch_load(file)
        if isinstance(data, dict) and isinstance(data.get("model"), dict):
            # a training checkpoint of the official code: {"model", "optimizer", "hparams", "iter_num", ...}
            if isinstance(data.get("hparams"), dict):
                self.hparams = data["hparams"]
            data = data["model"]
        if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
            raise ConversionError(
                f"{file} is not a state dict (a mapping of names to tensors) nor a training checkpoint with a "
                "'model' state dict."
            )
        for name, tensor in data.items():
            self._tensors[name] = tensor
            self._shapes[name] = tuple(tensor.shape)

    def keys(self) -> list[str]:
        return list(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._tensors:
            return self._tensors[name]
        with safe_open(self._safetensors[name], framework="pt") as handle:
            return handle.get_tensor(name)

    def read_config(self) -> dict:
        """config.json of a model folder, read as plain JSON (not through AutoConfig: see the FLA converter)."""
        file = self.path / "config.json" if self.path.is_dir() else self.path.parent / "config.json"
        if not file.is_file():
            raise ConversionError(f"no config.json beside {self.path}: pass the model folder that holds it.")
        try:
            fields = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise ConversionError(
                f"{file} is not readable JSON ({error}): restore the source's config.json, "
                "or pass --config with the model's configuration."
            ) from None
        if not isinstance(fields, dict):
            raise ConversionError(
                f"{file} holds {type(fields).__name__}, not a JSON object of config fields: "
                "restore the source's config.json."
            )
        return fields


def heads_tied(checkpoint: Checkpoint, embedding: str, head: str = "lm_head.weight", declared: bool = True) -> bool:
    """Whether the converted model ties its head to the embeddings: as the source declares, unless the checkpoint
    holds both names with different values (then each keeps its own)."""
    if not declared:
        return False
    if head in checkpoint and embedding in checkpoint:
        return torch.equal(checkpoint[head], checkpoint[embedding])
    return True


def check_layout(
    checkpoint: Checkpoint,
    expected: dict[str, tuple[int, ...]],
    source: str,
    optional: set[str] = frozenset(),
    ignored=lambda name: False,
    hint: str = "",
    header: str | None = None,
    likely_cause: str = "a wrong config name or wrong sizes for this checkpoint.",
):
    """Compare the checkpoint's keys and shapes with `expected` (names the config implies) and raise one
    ConversionError that lists every missing, unexpected and mis-shaped tensor."""
    present = set(checkpoint.keys())
    missing = sorted(set(expected) - present - set(optional))
    unexpected = sorted(k for k in present - set(expected) if not ignored(k))
    misshaped = sorted(
        f"{k}: checkpoint {list(checkpoint.shape(k))}, config expects {list(expected[k])}"
        for k in set(expected) & present
        if tuple(checkpoint.shape(k)) != tuple(expected[k])
    )
    if not (missing or unexpected or misshaped):
        return
    lines = [header or f"{checkpoint.path} does not match the {source} layout of the chosen config:"]
    for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped)):
        if items:
            shown = items[:8] + ([f"... and {len(items) - 8} more"] if len(items) > 8 else [])
            lines.append(f"  {title} ({len(items)}): " + "; ".join(shown))
    if present and len(missing) == len(set(expected) - set(optional)):
        lines.append(
            f"  No expected key is present: this is probably not a {source} checkpoint (wrong source format)."
        )
    elif misshaped or missing:
        lines.append(f"  Likely cause: {likely_cause}" + (f" {hint}" if hint else ""))
    raise ConversionError("\n".join(lines))
