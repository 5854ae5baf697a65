"""The `samba-hf` command line.

    samba-hf generate "prompt" [--model PATH_OR_NAME] [--max-new-tokens N] [--do-sample] [--temperature T]
                               [--top-k K] [--top-p P] [--seed S] [--dtype auto|float32|bfloat16|float16]
                               [--device auto|cpu|cuda|cuda:N|mps] [--prefill-chunk-size N]
    samba-hf convert {lit-gpt,fla,mamba,mistral,llama} SRC OUT [--config NAME_OR_JSON] [--tokenizer PATH]
                     [--dtype float32|bfloat16|float16] [--max-shard-size 5GB] [--verify | --no-verify]
                     [--push-to-hub REPO] [--force]
    samba-hf export lit-gpt SRC OUT [--force]

Without --model it runs the embedded default that ships inside the package. Mistakes a user can make (a missing
folder, a folder that is not a Samba model, a prompt the model cannot take, a device that is not there, a checkpoint
that does not match its config) end with a message on stderr and exit status 1, never a traceback.
"""

import argparse
import json
import os
import sys
import time
from importlib import resources

DEFAULT_MODEL_NOTE = (
    "embedded default model: a 5.9M-parameter Samba trained for 18 minutes on a CPU on Python's documentation "
    "(examples/train_tiny.py): it writes documentation-flavoured English; pass --model for a real checkpoint"
)


class UserError(Exception):
    """A mistake on the command line: printed as one line, exit status 1."""


def default_model_path() -> str:
    return str(resources.files("samba_hf") / "default_model")


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {name!r}; use cpu, cuda, cuda:N or mps")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {name!r} is not available here (no CUDA GPU visible to torch); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device {name!r} is not available here; use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"device {name!r} is not supported by samba-hf generate; use cpu, cuda or mps")
    return device


def resolve_dtype(name: str, device):
    import torch

    if name == "auto":  # bf16 matmuls are very slow on CPUs without bf16 units
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def check_model_folder(path: str) -> None:
    """A local folder must hold a Samba config.json; say what is wrong otherwise."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise UserError(f"{path!r} is not a model folder (no config.json in it)")
    try:
        with open(config_file) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {config_file!r}: {error}")
    if model_type != "samba":
        raise UserError(
            f"{path!r} holds a {model_type!r} model, not a Samba model; convert it first (samba-hf convert) "
            "or point --model at a Samba folder"
        )


def load(model_arg: str | None, device, dtype):
    import samba_hf  # noqa: F401  (registers "samba" with the Auto classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    path = model_arg or default_model_path()
    if os.path.isdir(path):
        check_model_folder(path)
    elif model_arg is not None and not _looks_like_hub_name(model_arg) and (os.sep in model_arg or model_arg.startswith(".")):
        # a path (not an "org/name" Hub id) that does not exist
        raise UserError(f"no such model folder: {model_arg!r}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"cannot load model {path!r}: {first_line}")
    if getattr(model.config, "model_type", None) != "samba":
        raise UserError(f"{path!r} is a {model.config.model_type!r} model, not a Samba model")
    return tokenizer, model.to(device).eval()


def _looks_like_hub_name(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith(("/", "."))


def max_prompt_tokens(config) -> int | None:
    """The longest prompt a model takes in one piece: unbounded for Mamba/sliding-window layouts (chunked prefill,
    bounded cache); `max_position_embeddings` when full-attention layers must hold every position."""
    if "full_attention" in config.layer_types:
        return config.max_position_embeddings
    return None


def generate(args) -> int:
    import torch
    from transformers import TextStreamer

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if args.prefill_chunk_size is not None and args.prefill_chunk_size < 1:
        raise UserError("--prefill-chunk-size must be at least 1")
    tokenizer, model = load(args.model, device, dtype)
    if args.model is None:
        print(f"samba-hf: {DEFAULT_MODEL_NOTE}", file=sys.stderr)

    input_ids = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    if input_ids.shape[1] == 0:
        raise UserError("the prompt is empty; give some text to continue")
    limit = max_prompt_tokens(model.config)
    if limit is not None and input_ids.shape[1] + args.max_new_tokens > limit:
        raise UserError(
            f"the prompt has {input_ids.shape[1]} tokens and {args.max_new_tokens} more were asked for, but this "
            f"model's full-attention layers take at most {limit} positions; shorten the prompt or --max-new-tokens"
        )

    if args.seed is not None:
        torch.manual_seed(args.seed)
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, pad_token_id=tokenizer.pad_token_id)
    if args.do_sample:
        options.update(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.prefill_chunk_size is not None and input_ids.shape[1] > args.prefill_chunk_size:
        options["prefill_chunk_size"] = args.prefill_chunk_size

    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    streamer = TextStreamer(tokenizer, skip_prompt=True)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer, **options)
    elapsed = time.perf_counter() - start
    new_tokens = output.shape[1] - input_ids.shape[1]
    print(
        f"samba-hf: {new_tokens} new tokens from a {input_ids.shape[1]}-token prompt in {elapsed:.2f} s "
        f"({new_tokens / elapsed:.1f} tokens/s, {device.type}, {str(dtype).removeprefix('torch.')})",
        file=sys.stderr,
    )
    return 0


def convert(args) -> int:
    from .conversion import ConversionError, command_line
    from .conversion import convert as run_conversion

    try:
        result = run_conversion(
            args.source, args.src, args.out, config=args.config, tokenizer=args.tokenizer, dtype=args.dtype,
            max_shard_size=args.max_shard_size, verify_parity=args.verify, push_to_hub=args.push_to_hub,
            force=args.force, command=command_line(args.argv),
        )
    except ConversionError as error:
        raise UserError(str(error))
    print(f"samba-hf: wrote {result['out']}", file=sys.stderr)
    print(f"samba-hf: parity: {result['parity'] or 'not verified (pass --verify)'}", file=sys.stderr)
    if args.push_to_hub:
        print(f"samba-hf: pushed to https://huggingface.co/{args.push_to_hub}", file=sys.stderr)
    return 0


def export(args) -> int:
    from .conversion import ConversionError, export_lit_gpt

    try:
        result = export_lit_gpt(args.src, args.out, force=args.force)
    except ConversionError as error:
        raise UserError(str(error))
    name = result["official_name"]
    hint = f"--model_name {name}" if name else "a lit_gpt Config with the sizes in the source config.json"
    print(f"samba-hf: wrote {result['out']} (official layout; load it in microsoft/Samba with {hint})", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="samba-hf", description="Samba language models on transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="continue a prompt, streaming the tokens as they come")
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("--model", default=None, help="a Samba model folder or Hub name (default: the embedded model)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same tokens)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="auto: float32 on CPU, bfloat16 on CUDA")
    gen.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda, cuda:N, mps")
    gen.add_argument("--prefill-chunk-size", type=int, default=8192,
                     help="prompts longer than this are read in chunks of this many tokens (bounded memory)")
    gen.set_defaults(run=generate)

    conv = commands.add_parser("convert", help="turn a checkpoint of another implementation into a samba-hf folder")
    conv.add_argument("source", choices=["lit-gpt", "fla", "mamba", "mistral", "llama"],
                      help="lit-gpt: the official microsoft/Samba code; fla: flash-linear-attention; mamba/mistral/"
                           "llama: transformers' folders")
    conv.add_argument("src", help="the checkpoint: a .pth file (lit-gpt) or a model folder")
    conv.add_argument("out", help="the folder to write (must not exist or be empty, unless --force)")
    conv.add_argument("--config", default=None,
                      help="lit-gpt: the official config name used for training (e.g. Samba_421M) or a SambaConfig "
                           "JSON; other sources: optional, read from the source's config.json")
    conv.add_argument("--tokenizer", default=None, help="a SentencePiece tokenizer.model or a tokenizer folder")
    conv.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                      help="dtype of the written weights (default: the source's); Mamba A_log and D stay float32")
    conv.add_argument("--max-shard-size", default="5GB")
    conv.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                      help="compare logits with a reference forward of the source (default: on up to 1B parameters)")
    conv.add_argument("--push-to-hub", default=None, metavar="REPO", help="upload the folder to this Hub repo")
    conv.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    conv.set_defaults(run=convert)

    exp = commands.add_parser("export", help="write a samba-hf folder back in another implementation's format")
    exp.add_argument("target", choices=["lit-gpt"], help="lit-gpt: the official microsoft/Samba state dict")
    exp.add_argument("src", help="a samba-hf model folder")
    exp.add_argument("out", help="the .pth file to write ({'model': state_dict}, as the official eval.py loads)")
    exp.add_argument("--force", action="store_true", help="replace an existing OUT")
    exp.set_defaults(run=export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return args.run(args)
    except UserError as error:
        print(f"samba-hf: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nsamba-hf: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
