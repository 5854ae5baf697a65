"""Rebuild the embedded default model that `samba-hf generate` runs when no --model is given.

    python examples/build_random_default.py [--out src/samba_hf/default_model]

The `tiny` preset with seeded random weights (torch.manual_seed(0)) and a byte-level tokenizer (256 byte tokens,
no merges, plus <s>, </s>, <pad>): a few hundred KB that exercise the whole stack. Untrained, so what it generates
is noise; a trained model replaces it later (the Training issue).
"""

import argparse
import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast

import samba_hf

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "src", "samba_hf", "default_model")


def byte_to_char() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (what `pre_tokenizers.ByteLevel` emits):
    printable Latin-1 bytes stand for themselves, the other bytes for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    table = byte_to_char()
    vocab = {table[b]: b for b in range(256)}  # token id = byte value
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>", "<pad>"])  # ids 256, 257, 258
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()

    tokenizer = byte_level_tokenizer()
    config = samba_hf.SambaConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = samba_hf.SambaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        max_new_tokens=64,
    )
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    # The package itself provides the code: no remote-code copies inside the package.
    for name in os.listdir(args.out):
        if name.endswith(".py"):
            os.remove(os.path.join(args.out, name))
    config_path = os.path.join(args.out, "config.json")
    with open(config_path) as f:
        saved = json.load(f)
    saved.pop("auto_map", None)
    with open(config_path, "w") as f:
        json.dump(saved, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"wrote {sorted(os.listdir(args.out))} to {os.path.abspath(args.out)}")


if __name__ == "__main__":
    main()
