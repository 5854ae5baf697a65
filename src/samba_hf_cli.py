"""The `samba-hf` command line: argument parsing and the checks that need no model.

    samba-hf generate "prompt" [--model PATH_OR_NAME] [--tokenizer PATH_OR_NAME] [--max-new-tokens N] [--do-sample]
                               [--temperature T] [--top-k K] [--top-p P] [--seed S]
                               [--dtype auto|float32|bfloat16|float16] [--device auto|cpu|cuda|cuda:N|mps]
                               [--prefill-chunk-size N] [--compile] [--chat [--system TEXT]]
                               [--prompt-lookup N | --assistant FOLDER]
    samba-hf convert {lit-gpt,fla,mamba,mistral,llama,megatron} SRC OUT [--config NAME_OR_JSON] [--force-config]
                     [--tokenizer PATH] [--dtype float32|bfloat16|float16] [--max-shard-size 5GB]
                     [--verify | --no-verify] [--push-to-hub REPO] [--force]
    samba-hf export {lit-gpt,megatron,executorch} SRC OUT [--force]
                    [--max-seq-len N] [--max-context-len N] [--quantize 8da4w]      (executorch)
    samba-hf eval passkey [--lengths N,N,..] [--depths D,D,..] [--trials N] [COMMON]
    samba-hf eval phonebook [--lengths N,N,..] [--trials N] [COMMON]
    samba-hf eval perplexity [--text FILE] [--max-tokens N] [--bucket N] [COMMON]
        COMMON: [--model PATH_OR_NAME] [--tokenizer PATH_OR_NAME] [--seed S] [--out DIR [--force]]
                [--prefill-chunk-size N] [--dtype auto|float32|bfloat16|float16] [--device auto|cpu|cuda|cuda:N|mps]

This module imports only the standard library, so `samba-hf --help` and mistakes in the arguments answer at once;
torch, transformers and the model come in with `samba_hf.cli`, which runs the commands. Every user mistake ends
with one `samba-hf: error: ...` line and exit status 1; Ctrl-C (130) and SIGTERM (143) stop a command cleanly (a
conversion removes its partial output).
"""

import argparse
import math
import signal
import sys
import threading

MAX_PROMPT_LOOKUP = 64  # drafted tokens per check (`--prompt-lookup`)


class UserError(Exception):
    """A mistake on the command line or in the files it names: printed as one line, exit status 1."""


class Terminated(KeyboardInterrupt):
    """SIGTERM / SIGHUP, raised where the program is, so it unwinds (and cleans up) as for Ctrl-C."""


def check_generate_arguments(args) -> None:
    """What can be wrong with `generate`'s arguments without loading anything; checked before any output."""
    if args.model is not None and not args.model.strip():
        raise UserError(
            "--model is empty; give a model folder or Hub name, or leave --model out for the embedded default"
        )
    if args.tokenizer is not None and not args.tokenizer.strip():
        raise UserError("--tokenizer is empty; give a tokenizer folder or Hub name, or leave it out")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        byte = ord(args.prompt[error.start]) - 0xDC00  # undecodable bytes arrive as surrogates (PEP 383)
        where = f"byte 0x{byte:02x}" if 0 <= byte < 256 else "a lone surrogate"
        raise UserError(f"the prompt is not valid UTF-8 text ({where} at character {error.start}); pass UTF-8 text")
    if not args.prompt:
        raise UserError("the prompt is empty; give some text to continue")
    if args.system is not None and not args.chat:
        raise UserError("--system sets the system message of a chat: add --chat")
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if args.prefill_chunk_size is not None and args.prefill_chunk_size < 1:
        raise UserError("--prefill-chunk-size must be at least 1")
    sampling = {"--temperature": args.temperature, "--top-k": args.top_k, "--top-p": args.top_p, "--seed": args.seed}
    given = [flag for flag, value in sampling.items() if value is not None]
    if given and not args.do_sample:
        verb = "applies" if len(given) == 1 else "apply"
        raise UserError(f"{', '.join(given)} only {verb} when sampling: add --do-sample (greedy decoding ignores it)")
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature > 0):
        raise UserError(f"--temperature must be a finite number above 0, got {args.temperature}")
    if args.top_p is not None and not (0 < args.top_p <= 1):  # NaN fails too
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 0:
        raise UserError(f"--top-k must be 0 (no limit) or more, got {args.top_k}")
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise UserError(f"--seed must be between 0 and 2**64 - 1, got {args.seed}")
    if args.prompt_lookup is not None and args.prompt_lookup > MAX_PROMPT_LOOKUP:
        raise UserError(
            f"--prompt-lookup takes at most {MAX_PROMPT_LOOKUP} drafted tokens, got {args.prompt_lookup}: checking a "
            "draft costs about a token of the model's work per drafted token, and longer drafts are rarely "
            "accepted whole"
        )
    if args.prompt_lookup is not None and args.prompt_lookup < 1:
        raise UserError(
            f"--prompt-lookup is the number of tokens drafted from the prompt at each step: at least 1, got "
            f"{args.prompt_lookup}"
        )
    if args.assistant is not None and not args.assistant.strip():
        raise UserError(
            "--assistant is empty; give the folder of a smaller model with the same tokenizer, or leave it out"
        )
    if args.prompt_lookup is not None and args.assistant is not None:
        raise UserError("--prompt-lookup and --assistant are two ways to draft tokens: give one of them")
    if args.compile and (args.prompt_lookup is not None or args.assistant is not None):
        flag = "--prompt-lookup" if args.prompt_lookup is not None else "--assistant"
        raise UserError(
            f"{flag} verifies drafts on the dynamic cache, which --compile replaces by a static one: leave "
            "out one of them"
        )


def _positive_list(flag: str, text: str, kind=int) -> list:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated {'whole numbers' if kind is int else 'numbers'}, got {text!r}")
    if not values:
        raise UserError(
            f"{flag} is empty; give at least one value, e.g. {flag} {'1024,4096' if kind is int else '0,0.5,1'}"
        )
    return values


MAX_EVAL_TOKENS = 2**24  # 16M tokens: the prompt alone takes ~256 MB as ids; the paper's longest passkey is 256K


def check_eval_arguments(args) -> None:
    """What can be wrong with `eval`'s arguments without loading anything."""
    for flag, value in (("--model", args.model), ("--tokenizer", args.tokenizer), ("--out", args.out)):
        if value is not None and not value.strip():
            raise UserError(f"{flag} is empty; give a value or leave {flag} out")
    if args.task in ("passkey", "phonebook"):
        args.lengths = _positive_list("--lengths", args.lengths)
        if min(args.lengths) < 1:
            raise UserError(f"--lengths must be token counts of at least 1, got {min(args.lengths)}")
        if max(args.lengths) > MAX_EVAL_TOKENS:
            raise UserError(
                f"--lengths {max(args.lengths)} is more than the {MAX_EVAL_TOKENS:,} tokens (2^24) samba-hf "
                "eval builds a prompt of; pass lengths up to that"
            )
        if args.trials < 1:
            raise UserError("--trials must be at least 1")
    if args.task == "passkey":
        args.depths = _positive_list("--depths", args.depths, float)
        if not all(0 <= d <= 1 for d in args.depths):  # NaN fails too
            raise UserError(f"--depths are fractions of the filler before the key, from 0 to 1; got {args.depths}")
    if args.task == "perplexity":
        if args.bucket < 1:
            raise UserError("--bucket must be at least 1 token")
        if args.max_tokens is not None and args.max_tokens < 2:
            raise UserError("--max-tokens must be at least 2 (the first token is not scored)")
    if args.prefill_chunk_size < 1:
        raise UserError("--prefill-chunk-size must be at least 1")
    if not 0 <= args.seed < 2**64:  # torch.manual_seed's range, as generate's --seed
        raise UserError(f"--seed must be between 0 and 2**64 - 1, got {args.seed}")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, each option's default added where its help does not say it already (and where there is one
    to say: not for a flag that is off, nor for an option left out unless given)."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not action.option_strings or unset or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse, with its errors in the form of every other: one `samba-hf: error:` line, exit status 1; the help
    shows the defaults (`HelpFormatter`), in every command's parser too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=HelpFormatter, **kwargs)

    def error(self, message):
        print(f"samba-hf: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(1)


# samba_hf.kernels_samba.KERNEL_IMPLEMENTATIONS (this module imports no torch; a test holds the two equal)
KERNEL_CHOICES = ("auto", "pytorch", "samba", "mamba_ssm")


def add_kernels_option(command: argparse.ArgumentParser):
    """--kernels, the kernel switch, for the commands that run a model."""
    command.add_argument(
        "--kernels",
        default="auto",
        choices=KERNEL_CHOICES,
        help="which code runs the Mamba scan, the conv and the linear layers (samba-hf's models; docs/model.md, "
        "'Choosing the kernels'): auto (the fastest installed), pytorch, samba (samba-hf's own kernels), mamba_ssm "
        "(mamba-ssm's and causal-conv1d's, on CUDA)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="samba-hf",
        description="Samba language models on transformers.",
        epilog=(
            "Without --model, generate and eval phonebook / perplexity run the embedded default model (a "
            "5.9M-parameter Samba that writes documentation-flavoured English) and eval passkey a passkey-tuned one; "
            "`samba-hf COMMAND --help` lists a command's options with their defaults."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="continue a prompt, streaming the tokens as they come")
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument(
        "--model",
        default=None,
        help="a Samba model folder or Hub name (default: the embedded model), or a .pte written by samba-hf export "
        "executorch (run by ExecuTorch's LLM runner; give --tokenizer)",
    )
    gen.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer folder, Hub name or SentencePiece .model file (default: the one in the model folder)",
    )
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="the most tokens to generate after the prompt (fewer if the model ends its text)",
    )
    gen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=None, help="with --do-sample (default 1.0)")
    gen.add_argument("--top-k", type=int, default=None, help="with --do-sample (default 50; 0 = no limit)")
    gen.add_argument("--top-p", type=float, default=None, help="with --do-sample (default 1.0)")
    gen.add_argument("--seed", type=int, default=None, help="with --do-sample: same seed, same tokens")
    gen.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA, and on CPUs that multiply it natively and faster; else float32",
    )
    gen.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda, cuda:N, mps")
    add_kernels_option(gen)
    gen.add_argument(
        "--quantize",
        default=None,
        choices=["int8"],
        help="int8: the linear layers' weights as int8 with a scale per row (torchao's int8 weight-only; pip install "
        "'samba-hf[quantize]'), a quarter of float32's bytes; on a CPU with AVX-512 (float32 or bfloat16), "
        "samba-hf's kernel reads them (docs/speed.md)",
    )
    gen.add_argument(
        "--prefill-chunk-size",
        type=int,
        default=8192,
        help="prompts longer than this are read in chunks of this many tokens (bounded memory)",
    )
    gen.add_argument(
        "--compile",
        action="store_true",
        help="decode with a static cache and a torch.compile'd step (transformers' cache_implementation="
        "'static' and compile_config): faster steps after compiling (about a minute for the "
        "embedded model on 2 CPU cores); the same text in float32, in bfloat16 it can part after "
        "some tokens (docs/cli.md)",
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message: format it with the tokenizer's chat template, print only "
        "the reply and stop at the end of its turn (e.g. <|end|> for Phi-4-mini-flash-reasoning)",
    )
    gen.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message before the prompt")
    gen.add_argument(
        "--prompt-lookup",
        type=int,
        default=None,
        metavar="N",
        help="speculative decoding: draft N tokens (1 to 64) at a time from n-grams of the prompt and the text so "
        "far, verified in one forward (the same greedy text; faster where the text repeats its input)",
    )
    gen.add_argument(
        "--assistant",
        default=None,
        metavar="FOLDER",
        help="speculative decoding: draft tokens with this smaller model (samba-hf's or any transformers "
        "causal LM with the same tokenizer), verified in one forward",
    )
    gen.set_defaults(command_name="generate", check=check_generate_arguments)

    conv = commands.add_parser("convert", help="turn a checkpoint of another implementation into a samba-hf folder")
    conv.add_argument(
        "source",
        choices=["lit-gpt", "fla", "mamba", "mistral", "llama", "megatron"],
        help="lit-gpt: the official microsoft/Samba code; megatron: NVIDIA's Megatron-LM Mamba-2(-Hybrid) "
        "checkpoints; fla: flash-linear-attention; mamba/mistral/"
        "llama: transformers' folders",
    )
    conv.add_argument(
        "src",
        help="the checkpoint: a .pth file (lit-gpt), a Megatron folder as downloaded or its .pt, or a model folder",
    )
    conv.add_argument("out", help="the folder to write (must not exist or be empty, unless --force)")
    conv.add_argument(
        "--config",
        default=None,
        help="lit-gpt: an official config name (default: the model_name a training checkpoint records) "
        "or a SambaConfig JSON; other sources: optional, read from the source's config.json",
    )
    conv.add_argument(
        "--force-config",
        action="store_true",
        help="lit-gpt: use --config even where it contradicts the model_name the checkpoint records",
    )
    conv.add_argument(
        "--tokenizer", default=None, help="a SentencePiece .model or a tokenizer folder (default: the source folder's)"
    )
    conv.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the written weights (default: the source's); Mamba A_log and D (Mamba-2: and "
        "dt_bias) stay float32",
    )
    conv.add_argument("--max-shard-size", default="5GB", help="the largest weight file to write, e.g. 2GB or 500MB")
    conv.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare logits with a reference forward of the source (default: on up to 1B parameters)",
    )
    conv.add_argument("--push-to-hub", default=None, metavar="REPO", help="upload the folder to this Hub repo")
    conv.add_argument(
        "--force",
        action="store_true",
        help="replace OUT when it is an earlier samba-hf output (never a folder holding other files)",
    )
    conv.set_defaults(command_name="convert", check=None)

    exp = commands.add_parser(
        "export", help="write a samba-hf folder in another implementation's format, or as an ExecuTorch program"
    )
    exp.add_argument(
        "target",
        choices=["lit-gpt", "megatron", "executorch"],
        help="lit-gpt: the official microsoft/Samba state dict; megatron: Megatron-LM's model_optim_rng.pt "
        "in the released Mamba layout (bfloat16); executorch: a .pte for ExecuTorch's LLM runner (XNNPACK, "
        "float32 or --quantize 8da4w; needs pip install 'samba-hf[export]')",
    )
    exp.add_argument("src", help="a samba-hf model folder")
    exp.add_argument(
        "out",
        help="the file to write: lit-gpt, a .pth ({'model': state_dict}, as the official eval.py "
        "loads); megatron, e.g. DIR/release/mp_rank_00/model_optim_rng.pt; executorch, a .pte",
    )
    exp.add_argument("--force", action="store_true", help="replace OUT when it is an earlier export")
    exp.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        metavar="N",
        help="executorch: the most tokens one call of the program takes (a longer prompt goes in several; "
        "default 128)",
    )
    exp.add_argument(
        "--max-context-len",
        type=int,
        default=None,
        metavar="N",
        help="executorch: the longest text, for layouts with full-attention layers (SambaY, the Mamba-2-Hybrid "
        "layout), whose keys and values the program holds for every position (default 4096); Samba's own layouts "
        "take any length",
    )
    exp.add_argument(
        "--quantize",
        choices=["8da4w"],
        default=None,
        help="executorch: 8da4w, the linear layers with 8-bit dynamic activations and 4-bit weights in groups of "
        "32 (torchao; the embedding stays float32)",
    )
    exp.set_defaults(command_name="export", check=None)

    ev = commands.add_parser("eval", help="long-context evaluations of any causal LM: passkey, phonebook, perplexity")
    tasks = ev.add_subparsers(dest="task", required=True)
    helps = {
        "passkey": "find a 5-digit key hidden at a depth of repeated filler text (the Samba paper's Figure 3)",
        "phonebook": "look up one name's number in a phonebook of the given length",
        "perplexity": "perplexity per position bucket of one long text, read in one pass through the cache",
    }
    for task, text in helps.items():
        t = tasks.add_parser(task, help=text, description=text)
        t.add_argument(
            "--model",
            default=None,
            help="a model folder or Hub name, any causal LM transformers loads (default: the embedded "
            + ("passkey-tuned Samba)" if task == "passkey" else "default Samba)"),
        )
        t.add_argument(
            "--tokenizer",
            default=None,
            help="a tokenizer folder, Hub name or SentencePiece .model file (default: the model folder's)",
        )
        if task == "passkey":
            t.add_argument("--lengths", default="512,2048,8192,32768", help="prompt lengths in tokens")
            t.add_argument("--depths", default="0,0.5,1", help="where the key sits: 0 = first, 1 = last")
            t.add_argument("--trials", type=int, default=2, help="prompts (keys) per length and depth")
        elif task == "phonebook":
            t.add_argument("--lengths", default="256,512,1024,2048", help="prompt lengths in tokens")
            t.add_argument("--trials", type=int, default=5, help="phonebooks per length")
        else:
            t.add_argument(
                "--text",
                default=None,
                metavar="FILE",
                help="a UTF-8 text file (default: Python's own documentation topics, pydoc_data)",
            )
            t.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
            t.add_argument("--bucket", type=int, default=512, help="tokens per position bucket")
        t.add_argument("--seed", type=int, default=0, help="the same seed gives the same prompts")
        t.add_argument(
            "--out", default=None, metavar="DIR", help=f"write {task}.json and {task}.png into DIR (created if needed)"
        )
        t.add_argument("--force", action="store_true", help=f"replace {task}.json / {task}.png in --out")
        t.add_argument(
            "--prefill-chunk-size",
            type=int,
            default=2048,
            help="long prompts go through the cache this many tokens at a time (bounded memory)",
        )
        t.add_argument(
            "--dtype",
            default="float32",
            choices=["auto", "float32", "bfloat16", "float16"],
            help="float32: the same scores on every machine; auto: as generate's --dtype",
        )
        t.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda, cuda:N, mps")
        add_kernels_option(t)
        t.set_defaults(command_name="eval", check=check_eval_arguments)
    return parser


def _terminate(signum, frame):
    raise Terminated(signal.Signals(signum).name)


def one_line(message: str) -> str:
    return " ".join(line.strip() for line in str(message).strip().splitlines())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()  # signals can only be caught there
    previous = (
        {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)} if in_main_thread else {}
    )
    try:
        if args.check is not None:
            args.check(args)
        from samba_hf import cli  # torch, transformers and the model: only now

        try:
            return cli.COMMANDS[args.command_name](args)
        except cli.UserError as error:  # a mistake found while the command ran: said the same way
            raise UserError(str(error)) from None
    except UserError as error:
        print(f"samba-hf: error: {one_line(error)}", file=sys.stderr)
        return 1
    except OSError as error:  # the file system said no: permissions, a full disk, a path that is not there
        print(f"samba-hf: error: {one_line(error)}", file=sys.stderr)
        return 1
    except Terminated as signal_name:
        print(f"\nsamba-hf: stopped by {signal_name}", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("\nsamba-hf: interrupted", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
