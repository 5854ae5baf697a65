"""Opening a samba-hf model folder to run or export it: every tensor comes from the folder's files, or nothing runs.

`from_pretrained` alone initialises missing tensors at random (with a log line) and drops unexpected ones; this
module checks the folder first and raises one `ModelFolderError` that names the problem and the fix:

    config.json          missing, not a JSON object, another model_type, or values SambaConfig refuses
    weights              missing, unreadable (truncated, corrupt, empty), or not the tensors config.json implies
                         (every missing, unexpected and mis-shaped tensor listed, with both shapes)
    values               NaN or inf in any tensor
    tokenizer            no vocabulary files (say which are missing and how to add them)

`tokenizer_for` gives the tokenizer to run a folder with: its own, or one from elsewhere completed with the folder's
chat format (the released Phi-4-mini-flash-reasoning folder has a chat template and chat tokens, but no vocabulary).
"""

import importlib.util
import json
import os
from pathlib import Path

import torch
from transformers import PreTrainedConfig

from .configuration_samba import SambaConfig
from .conversion.checkpoint import Checkpoint, ConversionError, check_layout


class ModelFolderError(ValueError):
    """A model folder that cannot be used as it is: the message names the problem and the fix."""


def model_classes() -> dict:
    """model_type -> (config class, causal LM class) of the models samba-hf runs."""
    from .configuration_sambay import SambaYConfig
    from .modeling_samba import SambaForCausalLM
    from .modeling_sambay import SambaYForCausalLM

    return {"samba": (SambaConfig, SambaForCausalLM), "phi4flash": (SambaYConfig, SambaYForCausalLM)}


def read_config(path: str | os.PathLike) -> PreTrainedConfig:
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise ModelFolderError(f"{str(path)!r} is not a model folder (no config.json in it)")
    try:
        fields = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ModelFolderError(f"cannot read {file} as JSON ({error}); restore it from the model's source")
    if not isinstance(fields, dict):
        raise ModelFolderError(f"{file} holds a JSON {type(fields).__name__}, not an object of config fields")
    model_type = fields.get("model_type")
    if model_type not in model_classes():
        raise ModelFolderError(
            f"{str(path)!r} holds a {model_type!r} model, not a Samba model; convert it into one first "
            "(samba-hf convert mamba | mistral | llama | fla | lit-gpt)"
        )
    try:
        return model_classes()[model_type][0].from_pretrained(path)
    except (TypeError, ValueError) as error:
        raise ModelFolderError(f"{file}: {str(error).strip().splitlines()[0]}") from None


def check_weights(path: str | os.PathLike, config: SambaConfig) -> None:
    """The folder's tensors are exactly those `config` implies, with the same shapes (read from the file headers).
    A folder of torchao-quantized weights (`quantization_config` in config.json) stores a quantized layer's weight
    as `<layer>._weight_qdata` (the weight's shape) beside its scale and zero point."""
    from .conversion.writer import expected_tensors

    checkpoint = Checkpoint(path)
    expected, quantized = expected_tensors(config), set()
    if getattr(config, "quantization_config", None):
        present = set(checkpoint.keys())
        for name in [name for name in expected if name.endswith(".weight")]:
            layer = name.removesuffix(".weight")
            if f"{layer}._weight_qdata" in present:
                expected[f"{layer}._weight_qdata"] = expected.pop(name)
                quantized.add(layer)
    tied_head = config.tie_word_embeddings  # a tied head is not stored; a copy of it may be

    def ignored(name: str) -> bool:
        layer, _, part = name.rpartition(".")
        return (tied_head and name == "lm_head.weight") or (
            layer in quantized and part in ("_weight_scale", "_weight_zero_point")
        )

    try:
        check_layout(
            checkpoint,
            expected,
            "samba-hf",
            ignored=ignored,
            header=f"the weights in {path} do not match its config.json:",
            likely_cause="the weights and config.json come from different models, or the files are incomplete.",
        )
    except ConversionError as error:
        raise ModelFolderError(str(error)) from None


def quantization_method(config) -> str | None:
    """The `quant_method` of a folder's config.json (its weights were saved quantized: "torchao", ...), or None."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    return getattr(method, "value", method)  # (a loaded model's config holds transformers' enum)


def check_finite(model: torch.nn.Module, path) -> None:
    # named_parameters lists a tied head once (state_dict would read the embedding matrix twice)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        for part in plain_parts(tensor):
            if part.is_floating_point() and not bool(torch.isfinite(part).all()):
                raise ModelFolderError(
                    f"{name} in {path} holds NaN or inf values: the weights are damaged (a diverged or interrupted "
                    "training run?); use another checkpoint"
                )


def plain_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a weight is stored as: itself, or a quantized tensor subclass's own (torchao's int8 values,
    scales and zero points), which the subclass does not compute on directly."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [part for name in names for part in plain_parts(getattr(tensor, name))]


VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether a folder holds a tokenizer vocabulary of its own (one of `VOCABULARY_FILES`)."""
    return any((Path(path) / name).is_file() for name in VOCABULARY_FILES)


def check_tokenizer(path: str | os.PathLike) -> None:
    path = Path(path)
    if not has_tokenizer(path):
        try:  # the released Phi-4-mini-flash-reasoning names another Hub repository's tokenizer here
            elsewhere = json.loads((path / "config.json").read_text()).get("auto_map", {}).get("AutoTokenizer")
        except (OSError, ValueError, AttributeError):
            elsewhere = None
        where = f" (its config.json names the Hub tokenizer {elsewhere!r}: download that one)" if elsewhere else ""
        raise ModelFolderError(
            f"{str(path)!r} has no tokenizer vocabulary (none of {', '.join(VOCABULARY_FILES)}){where}; "
            "pass --tokenizer with a tokenizer folder or Hub name, or add one with tokenizer.save_pretrained(folder)"
        )


def check_generation_config(path: str | os.PathLike) -> None:
    """A generation_config.json that transformers cannot read is dropped by `from_pretrained` without a word (the
    model then decodes with other settings than its folder says): refuse it instead."""
    from transformers import GenerationConfig

    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return
    try:
        GenerationConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelFolderError(
            f"{str(file)!r} cannot be read ({reason}); fix it, or remove it to decode with the settings of config.json"
        ) from None


def load_model(path: str | os.PathLike, dtype: torch.dtype | str = "auto", config: SambaConfig | None = None):
    """`SambaForCausalLM` / `SambaYForCausalLM.from_pretrained(path)` after the checks above, and with finite weights
    (`config`: the folder's, when `read_config` has already read it)."""
    config = config or read_config(path)
    check_weights(path, config)
    if quantization_method(config) == "torchao" and importlib.util.find_spec("torchao") is None:
        raise ModelFolderError(
            f"the weights in {path} are torchao-quantized (quantization_config in its config.json), and torchao is "
            "not installed: pip install 'samba-hf[quantize]' (or pip install torchao)"
        )
    try:
        model = model_classes()[config.model_type][1].from_pretrained(path, config=config, dtype=dtype)
    except (OSError, RuntimeError, ValueError) as error:  # the checks above leave only unreadable tensor data
        raise ModelFolderError(f"cannot load the weights in {path}: {str(error).strip().splitlines()[0]}") from None
    check_finite(model, path)
    return model


def tokenizer_for(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None):
    """The tokenizer to run the model folder (or Hub name) `path` with: its own, or `tokenizer` (a folder, a Hub
    name or a SentencePiece .model file), completed from a local model folder with what its tokenizer_config.json /
    chat_template.jinja define and the tokenizer lacks: the added tokens (each at the model's id, or
    ModelFolderError) and the chat template."""
    from transformers import AddedToken, AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(path) if tokenizer is None else load_tokenizer(tokenizer)
    folder = Path(path)
    if tokenizer is None or not folder.is_dir():
        return loaded
    settings = {}
    if (folder / "tokenizer_config.json").is_file():
        try:
            settings = json.loads((folder / "tokenizer_config.json").read_text())
        except (OSError, ValueError) as error:
            raise ModelFolderError(
                f"{str(folder / 'tokenizer_config.json')!r} is not readable JSON ({error}); fix or remove it"
            )
    vocabulary = loaded.get_vocab()
    for token_id, entry in sorted(settings.get("added_tokens_decoder", {}).items(), key=lambda item: int(item[0])):
        content = entry["content"]
        if content not in vocabulary:  # appended: it lands at the model's id only if the ids below are all taken
            loaded.add_tokens(
                [
                    AddedToken(
                        content,
                        special=entry.get("special", False),
                        lstrip=entry.get("lstrip", False),
                        rstrip=entry.get("rstrip", False),
                        normalized=entry.get("normalized", False),
                    )
                ],
                special_tokens=entry.get("special", False),
            )
        if loaded.convert_tokens_to_ids(content) != int(token_id):
            raise ModelFolderError(
                f"the tokenizer {str(tokenizer)!r} has {content!r} at id {loaded.convert_tokens_to_ids(content)}, but "
                f"the model folder's tokenizer_config.json puts it at {token_id}: it is not this model's tokenizer; "
                "pass the one the model was trained with"
            )
    template = (
        (folder / "chat_template.jinja").read_text()
        if (folder / "chat_template.jinja").is_file()
        else (settings.get("chat_template"))
    )
    if loaded.chat_template is None and isinstance(template, str):
        loaded.chat_template = template
    return loaded


def load_tokenizer(tokenizer: str | os.PathLike):
    """A tokenizer folder or Hub name through AutoTokenizer; a SentencePiece .model file as `convert` reads one
    (`tokenizer_from_sentencepiece`: it encodes as SentencePiece does, adding no BOS or EOS)."""
    from transformers import AutoTokenizer

    path = Path(tokenizer)
    if path.is_file() and path.suffix == ".model":
        from .conversion.sentencepiece_tokenizer import tokenizer_from_sentencepiece

        return tokenizer_from_sentencepiece(path)
    if path.suffix == ".model" and not path.exists():
        raise ModelFolderError(
            f"no such file: {str(tokenizer)!r} (--tokenizer takes a tokenizer folder, a Hub name "
            "or a SentencePiece .model file)"
        )
    if path.is_file():
        raise ModelFolderError(
            f"{str(tokenizer)!r} is a file but not a SentencePiece .model; --tokenizer takes a "
            "tokenizer folder (tokenizer.json, tokenizer_config.json, ...), a Hub name or a "
            "SentencePiece .model file"
        )
    return AutoTokenizer.from_pretrained(tokenizer)


def end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template closes a message with (`<|end|>` for Phi, `<|im_end|>` for ChatML), so
    that generation stops at the end of the reply; None when the template closes it with plain text."""
    marker = "\x00samba-hf\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
    )
    after = tokenizer(text.split(marker, 1)[1], add_special_tokens=False).input_ids
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return after[0] if after and after[0] in special else None
