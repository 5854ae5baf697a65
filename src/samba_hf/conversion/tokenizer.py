"""The tokenizer that goes with a converted model: a SentencePiece `tokenizer.model` or an HF tokenizer folder."""

import shutil
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, LlamaTokenizer, PreTrainedTokenizerBase

from .checkpoint import ConversionError

# Any one of these lets AutoTokenizer build a tokenizer from a folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str | Path, add_bos: bool | None) -> PreTrainedTokenizerBase:
    """`add_bos=False` forces a tokenizer that adds no BOS (the official Samba checkpoints were trained without
    one); None keeps the tokenizer's own setting."""
    from .sentencepiece_tokenizer import read_sentencepiece

    path = Path(path)
    options = {} if add_bos is None else {"add_bos_token": add_bos}
    if path.is_file() and path.suffix == ".model":
        read_sentencepiece(path)  # a damaged file is said as such (transformers would go on to guess other formats)
    try:
        if path.is_file() and path.suffix == ".model":  # SentencePiece (the Llama-2 tokenizer of the official runs)
            with tempfile.TemporaryDirectory() as folder:
                shutil.copy(path, Path(folder) / "tokenizer.model")
                return LlamaTokenizer.from_pretrained(folder, add_eos_token=False, **options)
        if path.is_dir():
            return AutoTokenizer.from_pretrained(path, **options)
    except Exception as error:
        raise ConversionError(
            f"cannot load the tokenizer {path} "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). "
            "A SentencePiece file needs `pip install sentencepiece protobuf` (or `pip install samba-hf[convert]`)."
        ) from None
    raise ConversionError(f"--tokenizer {path}: give a SentencePiece tokenizer.model file or a tokenizer folder.")


def check_fits(tokenizer: PreTrainedTokenizerBase, vocab_size: int):
    """A tokenizer with more tokens than the model has embeddings is another model's."""
    if len(tokenizer) > vocab_size:
        raise ConversionError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab_size}: wrong tokenizer?"
        )


def checked_tokenizer(path: str | Path, vocab_size: int, add_bos: bool | None) -> PreTrainedTokenizerBase:
    """The tokenizer to write with a converted model, loaded and checked before anything is written."""
    tokenizer = load_tokenizer(path, add_bos)
    check_fits(tokenizer, vocab_size)
    ids = tokenizer("Samba").input_ids
    if add_bos is False and tokenizer.bos_token_id is not None and ids and ids[0] == tokenizer.bos_token_id:
        raise ConversionError(f"the tokenizer {path} still adds a BOS token; the model was trained without one.")
    return tokenizer
