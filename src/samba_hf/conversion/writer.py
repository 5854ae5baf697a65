"""Writing a converted model folder: all or nothing, one shard in memory at a time.

The folder is written under a temporary name beside OUT and renamed at the very end, so a failure or Ctrl-C leaves
OUT as it was. Tensors are produced one by one from the (memory-mapped) source, cast, and written shard by shard.
"""

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import GenerationConfig
from transformers.dynamic_module_utils import custom_object_save

from ..configuration_samba import SambaConfig
from ..configuration_sambay import SambaYConfig
from ..hub_samba import SAMBAY_REMOTE_CODE_FILES, model_card, system_error_code
from ..modeling_samba import SambaForCausalLM
from ..modeling_sambay import SambaYForCausalLM
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
    """Mamba's A_log and D (and Mamba-2's dt_bias) stay float32 in half-precision outputs (as
    `_keep_in_fp32_modules_strict` loads them)."""
    return name.endswith((".A_log", ".mamba.D", ".dt_bias"))


def empty_model(config: SambaConfig | SambaYConfig) -> SambaForCausalLM:
    """The model on the meta device: its state dict gives every expected name and shape, for free."""
    with torch.device("meta"):
        return (SambaYForCausalLM if isinstance(config, SambaYConfig) else SambaForCausalLM)(config)


def expected_tensors(config: SambaConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes a saved SambaForCausalLM holds (a tied lm_head is not stored)."""
    shapes = {name: tuple(t.shape) for name, t in empty_model(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


# What a samba-hf folder holds (writer and save_pretrained): `--force` replaces a folder of these names only.
OUR_FILES = re.compile(
    r"config\.json|generation_config\.json|README\.md|model(-\d{5}-of-\d{5})?\.safetensors|"
    r"model\.safetensors\.index\.json|"
    + "|".join(re.escape(name) for name in SAMBAY_REMOTE_CODE_FILES)
    + r"|tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json|chat_template\.jinja|"
    r"vocab\.json|merges\.txt"
)


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def check_output(out: Path, force: bool, sources: tuple[Path, ...] = ()):
    """OUT may be replaced only when it is empty, or (with --force) an earlier samba-hf output that holds none of
    the sources: --force never deletes a checkpoint or anything samba-hf did not write."""
    for source in sources:
        if _inside(Path(source), out):
            raise ConversionError(
                f"the source {source} lies inside the output folder {out}: writing there would delete it. "
                "Choose an output folder outside the source."
            )
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out} exists and is not a folder; choose another output path.")
    if not (out.is_dir() and any(out.iterdir())):
        return
    if not force:
        raise ConversionError(f"{out} is not empty; choose a new folder, or pass --force to replace it.")
    foreign = sorted(
        p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if p.is_dir() or not OUR_FILES.fullmatch(p.name)
    )
    if foreign or not _is_samba_config(out / "config.json"):
        what = (
            f"holds files samba-hf does not write ({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''})"
            if foreign
            else "is not a samba-hf model folder (no samba config.json)"
        )
        raise ConversionError(
            f"{out} {what}; --force only replaces an earlier samba-hf output. Choose a new folder, or move those "
            "files away yourself."
        )


def _is_samba_config(file: Path) -> bool:
    try:
        return json.loads(file.read_text()).get("model_type") == "samba"
    except (OSError, ValueError, AttributeError):
        return False


def temporary_name(out: Path) -> str:
    """Prefix of the temporary entries written beside OUT: `.{OUT}.{pid}.` + random + `.partial` / `.old`, so a
    later run can tell the ones left by a process that no longer runs."""
    return f".{out.name}.{os.getpid()}."


def clean_stale(out: Path) -> list[str]:
    """Remove what an interrupted (killed) run of ours left beside OUT; returns one line per entry handled.

    `.partial` entries of a process that no longer runs are deleted. An `.old` folder holds the previous OUT during
    the final swap: it is put back when OUT is missing, and deleted when OUT is there. Entries of a running process,
    or without a process id (samba-hf before 0.1.1), are reported and left alone."""
    out = Path(out)
    # mkdtemp / mkstemp add 8 characters of [a-z0-9_]: nothing else beside OUT matches
    pattern = re.compile(re.escape(f".{out.name}.") + r"(?:(\d+)\.)?[a-z0-9_]{8}\.(partial|old)")
    lines = []
    if not out.parent.is_dir():
        return lines
    for entry in sorted(out.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if not match:
            continue
        pid, kind = match.group(1), match.group(2)
        if pid is None or _running(int(pid)):
            owner = f"process {pid} is still running" if pid else "left by an older samba-hf"
            lines.append(f"{entry} ({owner}) was left alone; delete it once no conversion is running")
        elif kind == "old" and not out.exists() and (entry / out.name).exists():
            (entry / out.name).rename(out)
            entry.rmdir()
            lines.append(f"restored {out} from {entry}, left by an interrupted run (process {pid})")
        else:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            lines.append(f"removed {entry}, left by an interrupted run (process {pid})")
    return lines


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextmanager
def atomic_folder(out: Path, force: bool, sources: tuple[Path, ...] = ()):
    """Yield a temporary folder beside `out`; on success it replaces `out`, on any failure it is deleted."""
    out = Path(out)
    check_output(out, force, sources)
    with os_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=temporary_name(out), suffix=".partial", dir=out.parent))
    try:
        with os_errors(out):
            yield tmp
            _usual_permissions(tmp)
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=temporary_name(out), suffix=".old", dir=out.parent))
                out.rename(old / out.name)
                tmp.rename(out)
                shutil.rmtree(old)
            else:
                tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def os_errors(out: Path):
    """An OSError while writing OUT (read-only or full file system, a parent that is a file, no permission) becomes
    a ConversionError that says what happened where."""
    try:
        try:
            yield
        except SafetensorError as error:  # safetensors reports the system's error inside its own message
            code = system_error_code(error)
            if code is None:
                raise
            raise OSError(code, os.strerror(code), None) from None
    except OSError as error:
        where = error.filename or out
        fix = {
            errno.ENOSPC: "free some space or write elsewhere",
            errno.EROFS: "choose a writable location",
            errno.EACCES: "choose a folder you can write to",
            errno.ENOTDIR: "a parent of OUT is a file; choose another path",
            errno.EEXIST: "a parent of OUT is a file; choose another path",
        }.get(error.errno, "check the output path")
        raise ConversionError(f"cannot write {out}: {error.strerror or error} ({where}); {fix}.") from None


@contextmanager
def written_whole(out: Path):
    """A temporary path beside `out` to write a file to: renamed to `out` when the block ends (with the permissions
    the umask gives new files; mkstemp's are the owner's alone), removed if it fails or is interrupted. `out` is
    whole or untouched."""
    handle, tmp = tempfile.mkstemp(prefix=temporary_name(out), suffix=".partial", dir=out.parent)
    os.close(handle)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def torch_save(obj, path: str | Path):
    """torch.save to `path`, a write error raised as the OSError it was (torch reports a failed write, a full disk
    among them, as a RuntimeError of its own, which `os_errors` could not name)."""

    class KeepsWriteError:
        def __init__(self, file):
            self.file, self.error = file, None

        def write(self, data):
            try:
                return self.file.write(data)
            except OSError as error:
                self.error = error
                raise

        def flush(self):
            return self.file.flush()

    with open(path, "wb") as file:
        writer = KeepsWriteError(file)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
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
    than that gets a shard of its own), with an index when there is more than one shard. Every tensor is checked as
    it streams, verified or not: a floating-point dtype, and finite once cast."""
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
                if not tensor.is_floating_point():  # quantized or damaged: casting would write integers as weights
                    raise ConversionError(
                        f"{name} is {str(tensor.dtype).removeprefix('torch.')} in the source checkpoint, not a "
                        "floating-point type: samba-hf converts floating-point weights (dequantize a quantized "
                        "checkpoint first). Nothing was written."
                    )
                cast = tensor.to(torch.float32 if keeps_float32(name) else dtype).contiguous()
                if not bool(torch.isfinite(cast).all()):
                    raise ConversionError(non_finite_message(name, tensor, cast.dtype))
                tensor = cast
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


def non_finite_message(name: str, source: torch.Tensor, dtype: torch.dtype) -> str:
    """Why a tensor would be written with NaN/inf: damaged in the source, or too large for the output dtype."""
    if not bool(torch.isfinite(source).all()):
        return (
            f"{name} holds NaN or inf values in the source checkpoint: the checkpoint is damaged (a diverged or "
            "interrupted training run?). Nothing was written."
        )
    largest = source.abs().max().item()
    return (
        f"{name} has values up to {largest:.4g}, beyond the range of {str(dtype).removeprefix('torch.')} "
        f"(they would be written as inf). Convert with --dtype bfloat16 or float32. Nothing was written."
    )


def write_config_and_code(folder: Path, config: SambaConfig, dtype: torch.dtype):
    """config.json (with auto_map), generation_config.json and the remote-code files."""
    config.dtype = dtype
    config.auto_map = {**(getattr(config, "auto_map", None) or {}), "AutoModel": SambaForCausalLM._auto_model_entry}
    custom_object_save(empty_model(config), folder, config=config)  # copies modeling/configuration/ssm files
    config.save_pretrained(folder)
    generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(folder)


def write_model_card(
    folder: Path,
    source: str,
    src: str,
    command: str,
    parity: str,
    config: SambaConfig,
    base_model: str | None = None,
    license: str = "unknown",
):
    params = sum(int(torch.Size(s).numel()) for s in expected_tensors(config).values())
    details = (
        f"Converted with samba-hf from `{src}` ({source} format): {params:,} parameters, weights stored as "
        f"{str(config.dtype).replace('torch.', '')}.\n\n- Command: `{command}`\n- Parity at conversion: {parity}"
    )
    mamba2 = config.mamba_version == 2
    text = model_card(
        config,
        f"{'Mamba-2 hybrid' if mamba2 else 'Samba'} model converted from {source}",
        details,
        license=license,
        base_model=base_model,
        extra_tags=["converted", source, *(["mamba2"] if mamba2 else [])],
    )
    (folder / "README.md").write_text(text)


def push_folder(folder: Path, repo_id: str):
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message="Upload Samba model (samba-hf convert)")
