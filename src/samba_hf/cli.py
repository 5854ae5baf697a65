"""The `samba-hf` commands (generate, convert, export, eval); parsing, the model-free checks and the entry point are in
`samba_hf_cli`, which imports this module once a command runs (this one never imports it back).

Mistakes a user can make (a missing or damaged folder, a folder that is not a Samba model, weights that do not match
their config, no tokenizer, a prompt the model cannot take, a device that is not there, a checkpoint that does not
match its config, an output that cannot be written) end with one `samba-hf: error:` line and exit status 1, never a
traceback; no model runs or is written with weights that did not come from its files.
"""

import contextlib
import importlib.util
import os
import statistics
import sys
import time
from importlib import resources

from transformers import TextStreamer
from transformers.utils import logging


class UserError(Exception):
    """A mistake of the user's found while a command runs; `samba_hf_cli.main` says it in one line (exit status 1)."""


logging.disable_progress_bar()  # the commands print their own progress

# What `--compile` says before it compiles (the times docs/cli.md measured)
COMPILE_TIME_NOTE = (
    "about a minute on a 2-core CPU for the embedded model the first time, ~15 s once inductor's "
    "cache holds it; longer for deeper models"
)

DEFAULT_MODEL_NOTE = (
    "embedded default model: a 5.9M-parameter Samba trained for 18 minutes on a CPU on Python's documentation "
    "(examples/train_tiny.py): it writes documentation-flavoured English; pass --model for a real checkpoint"
)


EMBEDDED_MODELS = {"default": "default_model", "passkey": "passkey_model"}
PASSKEY_MODEL_NOTE = (
    "embedded passkey model: a 5.9M-parameter Samba trained at 512 tokens and fine-tuned on 512-token passkey "
    "prompts (examples/long_context.py, docs/long-context.md); pass --model to evaluate another model"
)


def default_model_path(name: str = "default") -> str:
    """The folder of a model that ships with samba-hf: "default" (what `generate` runs) or "passkey" (the Samba
    fine-tuned for passkey retrieval at 512 tokens, what `eval passkey` runs)."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"no embedded model {name!r}; there are {', '.join(map(repr, EMBEDDED_MODELS))}")
    return str(resources.files("samba_hf") / EMBEDDED_MODELS[name])


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
            raise UserError(
                f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} CUDA GPU(s)"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device {name!r} is not available here; use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"device {name!r} is not supported by samba-hf generate; use cpu, cuda or mps")
    return device


def resolve_dtype(name: str, device):
    """The dtype `--dtype` names; `auto`: `auto_dtype(device)`. Whatever the dtype, the model keeps A_log / D, the
    scan and the SSM state in float32."""
    import torch

    if name == "auto":
        return auto_dtype(device)[0]
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def chosen_dtype(name: str, device):
    """`resolve_dtype`, saying on stderr what `auto` chose and why."""
    if name != "auto":
        return resolve_dtype(name, device)
    dtype, why = auto_dtype(device)
    print(f"samba-hf: --dtype auto: {str(dtype).removeprefix('torch.')}, as {why}", file=sys.stderr)
    return dtype


def auto_dtype(device) -> tuple:
    """(dtype, why) for `--dtype auto`, decided from what the machine is, never from a timing, so that the same
    command on the same machine gives the same text every time: bfloat16 on CUDA; on a CPU bfloat16 where it
    multiplies bfloat16 natively (`cpu_native_bfloat16`), else float32."""
    import torch

    if device.type == "cuda":
        return torch.bfloat16, "a CUDA device"
    if device.type == "cpu":
        native = cpu_native_bfloat16()
        if native:
            return torch.bfloat16, f"this CPU multiplies bfloat16 natively ({native})"
        return torch.float32, "this CPU has no native bfloat16 products (AVX512-BF16, AMX or Arm BF16)"
    return torch.float32, f"a {device.type} device"


def cpu_native_bfloat16() -> str | None:
    """The instruction set extension that makes bfloat16 products native on this CPU, or None: AVX512-BF16 or AMX on
    x86, the BF16 extension on Arm. Without one PyTorch emulates bf16 products, several times slower than float32
    (benchmarks/results/HISTORY.md); with one, bf16 reads half the bytes of float32 per weight."""
    import platform

    import torch

    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        if torch.cpu._is_amx_tile_supported():
            return "AMX"
        return "AVX512-BF16" if torch.cpu._is_avx512_bf16_supported() else None
    if machine in ("aarch64", "arm64"):
        try:
            with open("/proc/cpuinfo") as info:
                features = {word for line in info if line.lower().startswith("features") for word in line.split()}
        except OSError:
            return None
        return "Arm BF16" if "bf16" in features else None
    return None


def load(
    model_arg: str | None,
    tokenizer_arg: str | None,
    device,
    dtype,
    any_model: bool = False,
    default: str = "default",
    flag: str = "--model",
    kernels: str = "auto",
):
    """(tokenizer, model) for generate / eval: a local folder is checked in full first (`samba_hf.model_folder`).
    `any_model`: any causal LM transformers loads (eval), not only Samba / SambaY (generate). `flag`: the option that
    named the folder, for the errors. `kernels`: `--kernels`, the kernel switch (`set_kernel_implementation`)."""
    from .model_folder import (
        ModelFolderError,
        check_generation_config,
        check_tokenizer,
        load_model,
        model_classes,
        read_config,
        tokenizer_for,
    )

    path = model_arg or default_model_path(default)
    local = os.path.isdir(path)
    if not local and (not _looks_like_hub_name(path) or os.path.exists(path)):
        raise _not_a_model_folder(path, flag)  # a path (not an "org/name" Hub id) that is not a folder
    samba_folder = local and (not any_model or _folder_model_type(path) in model_classes())
    try:
        config = read_config(path) if samba_folder else None  # what is wrong with config.json is said first
        if local and tokenizer_arg is None:
            check_tokenizer(path)
        if local:
            check_generation_config(path)
    except ModelFolderError as error:
        raise UserError(str(error))
    try:
        tokenizer = tokenizer_for(path, tokenizer_arg)
    except ModelFolderError as error:
        raise UserError(str(error))
    except (OSError, ValueError, ImportError) as error:
        raise UserError(f"cannot load the tokenizer from {tokenizer_arg or path!r}: {_first_line(error)}")
    try:
        model = load_model(path, dtype, config) if samba_folder else _load_other(path, dtype)
    except ModelFolderError as error:
        raise UserError(str(error))
    except (OSError, ValueError, KeyError) as error:
        raise UserError(f"cannot load model {path!r}: {_first_line(error)}")
    if not any_model and getattr(model.config, "model_type", None) not in ("samba", "phi4flash"):
        raise UserError(f"{path!r} is a {model.config.model_type!r} model, not a Samba (or SambaY) model")
    if len(tokenizer) > model.config.vocab_size:
        raise UserError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {model.config.vocab_size}: "
            "they do not belong together; pass the model's own tokenizer with --tokenizer"
        )
    model = model.to(device).eval()
    if kernels != "auto":
        if not hasattr(model, "set_kernel_implementation"):
            raise UserError(f"--kernels {kernels} chooses samba-hf's kernels; {path!r} is not a samba-hf model")
        try:
            model.set_kernel_implementation(kernels)
        except ValueError as error:
            raise UserError(f"--kernels {kernels}: {error}")
    return tokenizer, model


def _not_a_model_folder(path: str, flag: str) -> UserError:
    return UserError(
        f"no such model folder: {path!r}"
        if not os.path.exists(path)
        else f"{path!r} is a file; {flag} takes a model folder (config.json, weights, tokenizer)"
    )


def quantize_int8(model, path: str | None):
    """--quantize int8: every samba-hf linear layer's weight as torchao's int8 weight-only weight (int8 values and a
    float32 scale per row); the embeddings and the output layer stay as loaded. Refused for a folder saved
    quantized (`path`)."""
    from .model_folder import quantization_method

    if (method := quantization_method(model.config)) is not None:
        raise UserError(
            f"--quantize int8: the weights in {path} are {method}-quantized already (quantization_config in its "
            "config.json), and they run as they are: leave out --quantize"
        )
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise UserError("--quantize int8 needs torchao: pip install 'samba-hf[quantize]' (or pip install torchao)")
    from .linear_samba import SambaLinear

    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda module, name: isinstance(module, SambaLinear))


def _folder_model_type(path: str) -> str | None:
    import json

    try:
        return json.loads(open(os.path.join(path, "config.json"), encoding="utf-8").read()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # read_config says what is wrong with it


def _load_other(path: str, dtype):
    """Any causal LM through AutoModelForCausalLM, refused when a weight did not come from its files."""
    from transformers import AutoModelForCausalLM

    from .model_folder import ModelFolderError, check_finite

    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelFolderError(f"{path!r} is not a model folder (no config.json in it)")
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    missing = info.get("missing_keys") or []
    if missing:
        shown = ", ".join(sorted(missing)[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelFolderError(
            f"the weights in {path} lack {shown}: the files are incomplete or belong to another "
            "model; nothing was run with made-up weights"
        )
    check_finite(model, path)
    return model


def compiler_missing(device) -> str | None:
    """Why torch.compile cannot build a decoding step for `device`, or None. On a CPU inductor compiles C++ with the
    compiler its config names (`$CXX`, else g++); without one the first compiled step fails deep inside inductor.
    Asked with inductor's own lookup (cached, one `--version` call) before anything compiles."""
    if device.type != "cpu":
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # a torch without this helper: let the compile itself try
        return None
    try:
        get_cpp_compiler()
    except Exception as error:  # inductor's InvalidCxxCompiler, or whatever its lookup raises on a broken install
        return _first_line(error)
    return None


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


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
    if args.model is not None and args.model.endswith(".pte"):
        return generate_from_pte(args)
    import torch

    device = resolve_device(args.device)
    dtype = chosen_dtype(args.dtype, device)
    tokenizer, model = load(args.model, args.tokenizer, device, dtype, kernels=args.kernels)
    if args.quantize:
        quantize_int8(model, args.model)
    if args.model is None:
        print(f"samba-hf: {DEFAULT_MODEL_NOTE}", file=sys.stderr)

    text, stop_ids = chat_prompt(tokenizer, model, args.prompt, args.system) if args.chat else (args.prompt, None)
    input_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    if input_ids.shape[1] == 0:
        raise UserError("the prompt is empty; give some text to continue")
    limit = max_prompt_tokens(model.config)
    if limit is not None and input_ids.shape[1] + args.max_new_tokens > limit:
        raise UserError(
            f"the prompt has {input_ids.shape[1]} tokens and {args.max_new_tokens} more were asked for, but this "
            f"model's full-attention layers take at most {limit} positions; shorten the prompt or --max-new-tokens"
        )

    options = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, pad_token_id=tokenizer.pad_token_id)
    if args.do_sample:
        if args.seed is not None:
            torch.manual_seed(args.seed)
        options.update(
            temperature=1.0 if args.temperature is None else args.temperature,
            top_k=50 if args.top_k is None else args.top_k,
            top_p=1.0 if args.top_p is None else args.top_p,
        )
    if args.prefill_chunk_size is not None and input_ids.shape[1] > args.prefill_chunk_size:
        options["prefill_chunk_size"] = args.prefill_chunk_size
    if stop_ids is not None:
        options["eos_token_id"] = stop_ids
    if args.prompt_lookup is not None:
        options["prompt_lookup_num_tokens"] = args.prompt_lookup
    if args.assistant is not None:
        main_tokenizer = args.tokenizer or args.model or default_model_path()
        assistant = load_assistant(args.assistant, tokenizer, main_tokenizer, device, dtype)
        check_assistant(args.assistant, assistant, model, input_ids.shape[1], args.max_new_tokens)
        options["assistant_model"] = assistant
    compiled = args.compile
    if compiled and (missing := compiler_missing(device)):
        print(
            f"samba-hf: --compile: torch.compile finds no working C++ compiler here ({missing}); decoding without "
            "compiling, the same text at eager speed (install g++, or set CXX to a C++ compiler)",
            file=sys.stderr,
        )
        compiled = False
    if compiled:
        from transformers import CompileConfig

        compile_config = CompileConfig(fullgraph=True)
        compile_config._compile_all_devices = True  # generate compiles only on accelerators unless told
        options.update(cache_implementation="static", compile_config=compile_config)
        print(
            f"samba-hf: --compile: compiling the decoding step after the first token ({COMPILE_TIME_NOTE}); the "
            "summary gives the time it took",
            file=sys.stderr,
        )
        if dtype != torch.float32:  # measured in docs/cli.md
            name = str(dtype).removeprefix("torch.")
            print(
                f"samba-hf: --compile in {name}: the static cache and the compiled step round {name} differently "
                "from the uncompiled run, so the text can part from it after some tokens; --dtype float32 gives the "
                "same text",
                file=sys.stderr,
            )

    if not args.chat:  # a continuation follows its prompt; a chat reply stands alone
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    streamer = TimedStreamer(tokenizer, skip_prompt=True, skip_special_tokens=args.chat)
    start = time.perf_counter()
    with torch.inference_mode(), _assisted_generation_notice_off(args.assistant is not None):
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer, **options)
    elapsed = time.perf_counter() - start
    new_tokens = output.shape[1] - input_ids.shape[1]
    rate = f"{new_tokens / elapsed:.1f} tokens/s"
    if compiled and new_tokens > 2:  # the first steps compile (again when the window fills): say both
        # compiling: each step's time beyond the median (the first step, and the recompile when the window fills)
        steps = [b - a for a, b in zip(streamer.times[1:], streamer.times[2:])]
        step = statistics.median(steps[1:])
        rate = (
            f"{1 / step:.1f} tokens/s per step (median) after compiling, which took "
            f"{sum(steps) - step * len(steps):.0f} s"
        )
    print(
        f"samba-hf: {new_tokens} new tokens from a {input_ids.shape[1]}-token prompt in {elapsed:.2f} s "
        f"({rate}, {device.type}, {str(dtype).removeprefix('torch.')})",
        file=sys.stderr,
    )
    return 0


def load_assistant(path: str, tokenizer, main_tokenizer: str, device, dtype):
    """The model that drafts tokens for `--assistant`: any causal LM transformers loads (samba-hf's too), with the
    main model's tokenizer (drafts are token ids). A folder without a tokenizer of its own is read with the main
    model's (`main_tokenizer`, where it came from)."""
    from .model_folder import has_tokenizer

    own = not os.path.isdir(path) or has_tokenizer(path)
    try:
        assistant_tokenizer, assistant = load(
            path, None if own else main_tokenizer, device, dtype, any_model=True, flag="--assistant"
        )
    except UserError as error:
        raise UserError(f"--assistant: {error}") from None
    if assistant_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError(
            f"--assistant {path!r} has another tokenizer than the model (their vocabularies differ): its drafts are "
            "token ids, so it needs the model's own; use --prompt-lookup otherwise"
        )
    return assistant


def check_assistant(path: str, assistant, model, prompt_tokens: int, new_tokens: int):
    """What transformers would find out only while generating, asked before: the assistant's vocabulary size (its
    logits are compared with the model's id by id) and the positions it takes."""
    config = assistant.config.get_text_config()
    size, main_size = config.vocab_size, model.config.vocab_size
    if size != main_size:
        raise UserError(
            f"--assistant {path!r} has a vocabulary of {size} entries and the model {main_size}: transformers takes "
            "an assistant only with the model's vocabulary size (drafts are compared id by id); use one trained with "
            "the model's tokenizer and embedding size, or --prompt-lookup"
        )
    if getattr(config, "model_type", None) in ("samba", "phi4flash"):
        limit = max_prompt_tokens(config)
    else:  # (transformers' models: learned positions end there, rotary ones were trained to there)
        limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and prompt_tokens + new_tokens > limit:
        raise UserError(
            f"--assistant {path!r} takes at most {limit} positions, and the prompt has {prompt_tokens} tokens with "
            f"{new_tokens} more asked for: shorten the prompt or --max-new-tokens, or use --prompt-lookup"
        )


@contextlib.contextmanager
def _assisted_generation_notice_off(assisted: bool):
    """transformers' assisted generation calls the assistant's generate with a generation_config and arguments beside
    it, then warns about that call of its own (transformers 5.24): a line the user can do nothing about, kept off
    while --assistant generates."""
    if not assisted:
        yield
        return
    import logging

    def not_that_notice(record) -> bool:
        return "Passing `generation_config` together with generation-related" not in record.getMessage()

    generation_logger = logging.getLogger("transformers.generation.utils")
    generation_logger.addFilter(not_that_notice)
    try:
        yield
    finally:
        generation_logger.removeFilter(not_that_notice)


class TimedStreamer(TextStreamer):
    """transformers' TextStreamer, noting when each put() arrives: the prompt, then one per decoding step."""

    def __init__(self, tokenizer, **options):
        super().__init__(tokenizer, **options)
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())
        super().put(value)


def chat_prompt(tokenizer, model, prompt: str, system: str | None) -> tuple[str, list[int] | None]:
    """The prompt as a user message (after an optional system message) in the tokenizer's chat template, ready for
    the reply; and the ids to stop at: the model's end-of-text ones and the template's end of turn."""
    from .model_folder import end_of_turn_id

    if tokenizer.chat_template is None:
        raise UserError(
            "the tokenizer has no chat template (neither it nor the model folder defines one); leave out --chat to "
            "continue the prompt as plain text, or pass a --tokenizer with a chat template"
        )
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        end = end_of_turn_id(tokenizer)
    except Exception as error:  # a template is a program of the tokenizer's author: any failure is theirs
        raise UserError(f"the tokenizer's chat template fails on this message: {_first_line(error)}")
    eos = model.generation_config.eos_token_id
    stop = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    stop += [end] if end is not None and end not in stop else []
    return text, stop or None


def convert(args) -> int:
    from .conversion import ConversionError, command_line
    from .conversion import convert as run_conversion

    try:
        result = run_conversion(
            args.source,
            args.src,
            args.out,
            config=args.config,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            verify_parity=args.verify,
            push_to_hub=args.push_to_hub,
            force=args.force,
            force_config=args.force_config,
            command=command_line(args.argv),
        )
    except ConversionError as error:
        raise UserError(str(error))
    for line in result["cleaned"]:
        print(f"samba-hf: {line}", file=sys.stderr)
    print(f"samba-hf: wrote {result['out']} (config: {result['config_origin']})", file=sys.stderr)
    if result["tokenizer"] is None:
        print(
            "samba-hf: no tokenizer written (the source has none beside it); pass --tokenizer to add one",
            file=sys.stderr,
        )
    print(f"samba-hf: parity: {result['parity'] or 'not verified (pass --verify)'}", file=sys.stderr)
    if args.push_to_hub:
        print(f"samba-hf: pushed to https://huggingface.co/{args.push_to_hub}", file=sys.stderr)
    return 0


def export(args) -> int:
    if args.target == "executorch":
        return export_executorch_program(args)
    for flag, value in (("--max-seq-len", args.max_seq_len), ("--max-context-len", args.max_context_len)):
        if value is not None:
            raise UserError(f"{flag} is for export executorch; export {args.target} writes weights, not a program")
    if args.quantize is not None:
        raise UserError(f"--quantize is for export executorch; export {args.target} writes the weights as they are")
    from .conversion import ConversionError, export_lit_gpt, export_megatron

    try:
        run = export_megatron if args.target == "megatron" else export_lit_gpt
        result = run(args.src, args.out, force=args.force)
    except ConversionError as error:
        raise UserError(str(error))
    for line in result["cleaned"] + result.get("notes", []):
        print(f"samba-hf: {line}", file=sys.stderr)
    if args.target == "megatron":
        tracker = f"; wrote {result['tracker']}" if result["tracker"] else ""
        print(
            f"samba-hf: wrote {result['out']} (Megatron-LM's released Mamba layout, bfloat16{tracker})",
            file=sys.stderr,
        )
        return 0
    name = result["official_name"]
    hint = f"--model_name {name}" if name else "a lit_gpt Config with the sizes in the source config.json"
    print(
        f"samba-hf: wrote {result['out']} (official layout; load it in microsoft/Samba with {hint})", file=sys.stderr
    )
    return 0


# generate's options a .pte (samba-hf export executorch) cannot take: its program is fixed when written
PTE_FIXED = {
    "--chat": "chat",
    "--prompt-lookup": "prompt_lookup",
    "--assistant": "assistant",
    "--compile": "compile",
    "--quantize": "quantize",
    "--top-k": "top_k",
    "--top-p": "top_p",
    "--seed": "seed",
}


def generate_from_pte(args) -> int:
    """`samba-hf generate PROMPT --model MODEL.pte --tokenizer FOLDER`: ExecuTorch's own LLM runner on a program of
    `samba-hf export executorch`, greedy (or sampled at --temperature), the text streamed as `generate` streams it."""
    given = [flag for flag, name in PTE_FIXED.items() if getattr(args, name, None) not in (None, False)]
    given += [
        f"--{name} {getattr(args, name)}"
        for name in ("dtype", "device", "kernels")
        if getattr(args, name) not in ("auto", "cpu")
    ]
    if given:
        raise UserError(
            f"{', '.join(given)}: a .pte runs as it was exported (float32, on the CPU, greedy or sampled at "
            "--temperature); leave that out, or give the model's folder instead of its .pte"
        )
    if not os.path.isfile(args.model):
        raise UserError(f"no such file: {args.model!r} (a .pte written by samba-hf export executorch)")
    tokenizer = args.tokenizer
    if tokenizer is None:
        raise UserError("a .pte holds no tokenizer: pass --tokenizer, the model's folder (or its tokenizer.json)")
    if os.path.isdir(tokenizer):
        tokenizer = os.path.join(tokenizer, "tokenizer.json")
    if not os.path.isfile(tokenizer):
        raise UserError(f"no tokenizer.json at {args.tokenizer!r}: pass the model's folder or its tokenizer.json")
    try:
        from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    except ImportError:
        raise UserError("a .pte runs in ExecuTorch: pip install 'samba-hf[export]' (or pip install executorch)")
    temperature = (args.temperature if args.temperature is not None else 1.0) if args.do_sample else 0.0
    config = GenerationConfig(echo=False, max_new_tokens=args.max_new_tokens, temperature=temperature)
    stats = []
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    sys.stderr.flush()
    # the runner prints its logs, every token and its statistics itself (C's stdout and stderr): quiet while it
    # loads and runs, the text streamed to the real stdout through its callback
    out, err, quiet = os.dup(1), os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    try:
        try:
            runner = TextLLMRunner(args.model, tokenizer)
        except RuntimeError as error:
            raise UserError(f"ExecuTorch cannot load {args.model!r} with {tokenizer!r}: {_first_line(error)}")
        try:
            runner.generate(
                args.prompt,
                config,
                token_callback=lambda piece: os.write(out, piece.encode()),
                stats_callback=stats.append,
            )
        except RuntimeError as error:
            raise UserError(f"ExecuTorch could not run {args.model!r}: {_first_line(error)}")
    finally:
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in (out, err, quiet):
            os.close(fd)
    sys.stdout.write("\n")
    if stats:
        s = stats[-1]
        seconds = max(s.inference_end_ms - s.inference_start_ms, 1) / 1e3
        print(
            f"samba-hf: {s.num_generated_tokens} new tokens from a {s.num_prompt_tokens}-token prompt in "
            f"{seconds:.2f} s ({s.num_generated_tokens / seconds:.1f} tokens/s, ExecuTorch)",
            file=sys.stderr,
        )
    return 0


def export_executorch_program(args) -> int:
    """`samba-hf export executorch SRC OUT.pte`: the model as a program for ExecuTorch's LLM runner
    (`on_device.export_executorch`), float32 or quantized (`on_device.quantize_8da4w`), written whole or not at
    all."""
    out = os.path.abspath(args.out)
    if not out.endswith(".pte"):
        raise UserError(f"{args.out!r}: an ExecuTorch program is a .pte file; name OUT so, e.g. model.pte")
    if not os.path.isdir(os.path.dirname(out)):
        raise UserError(f"the folder {os.path.dirname(out)!r} does not exist: create it, or write OUT elsewhere")
    if os.path.isdir(out):
        raise UserError(f"{args.out!r} is a folder; OUT is the .pte file to write")
    if os.path.exists(out) and not args.force:
        raise UserError(f"{args.out!r} exists: pass --force to replace it")
    max_seq_len = 128 if args.max_seq_len is None else args.max_seq_len
    if not 1 <= max_seq_len <= 65536:
        raise UserError(f"--max-seq-len takes 1 to 65536 tokens, got {max_seq_len}")
    if args.max_context_len is not None and not max_seq_len <= args.max_context_len <= 2**24:
        raise UserError(
            f"--max-context-len takes {max_seq_len} (--max-seq-len) to {2**24} positions, got {args.max_context_len}"
        )
    if not os.path.isdir(args.src):  # (before ExecuTorch is looked for; `load` reads the folder after)
        raise _not_a_model_folder(args.src, "SRC")
    try:
        import executorch  # noqa: F401
    except ImportError:
        raise UserError(
            "export executorch needs ExecuTorch: pip install 'samba-hf[export]' (or pip install executorch)"
        )
    if args.quantize is not None and importlib.util.find_spec("torchao") is None:
        raise UserError(f"--quantize {args.quantize} needs torchao: pip install torchao")
    import torch

    from .on_device import export_executorch, quantize_8da4w

    _, model = load(args.src, None, torch.device("cpu"), torch.float32, flag="SRC")
    if args.max_context_len is not None and "full_attention" not in model.config.layer_types:
        raise UserError(
            f"--max-context-len: {args.src!r} has no full-attention layer (its program takes texts of any length); "
            "leave it out"
        )
    if args.quantize == "8da4w":
        quantize_8da4w(model)
    from pathlib import Path

    from .conversion import ConversionError
    from .conversion.writer import os_errors

    try:
        with os_errors(Path(out)):  # (a full or read-only file system: one line; the partial file is gone)
            export_executorch(model, out, max_seq_len=max_seq_len, max_context_len=args.max_context_len)
    except ConversionError as error:
        raise UserError(str(error))
    size = os.path.getsize(out) / 2**20
    what = "float32" if args.quantize is None else args.quantize
    print(
        f"samba-hf: wrote {args.out} ({size:.1f} MiB, {what}; for ExecuTorch's LLM runner, with the folder's "
        "tokenizer.json)",
        file=sys.stderr,
    )
    return 0


def evaluate(args) -> int:
    """`samba-hf eval passkey | phonebook | perplexity`: a table on stdout; JSON and a plot in --out if given."""
    import random

    import torch

    from . import evaluation

    outputs = _eval_outputs(args)  # refused before anything is loaded or run
    device = resolve_device(args.device)
    dtype = chosen_dtype(args.dtype, device)
    default = "passkey" if args.task == "passkey" else "default"
    tokenizer, model = load(
        args.model, args.tokenizer, device, dtype, any_model=True, default=default, kernels=args.kernels
    )
    if args.model is None:
        print(f"samba-hf: {PASSKEY_MODEL_NOTE if default == 'passkey' else DEFAULT_MODEL_NOTE}", file=sys.stderr)
    name = args.model or f"embedded {default} model"
    torch.manual_seed(args.seed)
    chunk = args.prefill_chunk_size

    if args.task in ("passkey", "phonebook"):
        for length in args.lengths:  # a length too short for the prompt is said before anything runs
            try:
                if args.task == "passkey":
                    evaluation.passkey_prompt(tokenizer, length, 0.5, "1" * 5)
                else:
                    evaluation.phonebook_prompt(tokenizer, length, random.Random(0))
            except ValueError as error:
                raise UserError(f"--lengths {length}: {error}")
        _note_positions(model, max(args.lengths))
        _say_the_work(args)
    progress = dict(progress=True, say=_say, progress_after=evaluation.PROGRESS_AFTER_S)
    if args.task == "passkey":
        result = evaluation.passkey_eval(
            model, tokenizer, args.lengths, args.depths, args.trials, args.seed, prefill_chunk_size=chunk, **progress
        )
        print(f"passkey accuracy of {name} ({args.trials} trials per cell); rows: depth, columns: length")
        print("depth  " + "".join(f"{n:>8}" for n in args.lengths))
        for depth in args.depths:
            cells = {c["length"]: c["accuracy"] for c in result["cells"] if c["depth"] == depth}
            print(f"{depth:<7.2f}" + "".join(f"{cells[n]:>8.0%}" for n in args.lengths))
    elif args.task == "phonebook":
        result = evaluation.phonebook_eval(
            model, tokenizer, args.lengths, args.trials, args.seed, prefill_chunk_size=chunk, **progress
        )
        print(f"phonebook accuracy of {name} ({args.trials} trials per length)")
        for row in result["rows"]:
            print(f"{row['length']:>8} tokens  {row['accuracy']:>5.0%}")
        if not any(row["accuracy"] for row in result["rows"]):  # chance, for a 10-digit number, is nil
            print(f"samba-hf: note: {_untaught_phonebook(args.model)}", file=sys.stderr)
    else:
        ids = _perplexity_ids(args, tokenizer)
        _note_positions(model, ids.numel())
        result = evaluation.perplexity_by_position(model, ids, args.bucket, chunk, progress=True)
        print(
            f"perplexity of {name} on {args.text or 'Python documentation topics'} ({ids.numel():,} tokens) by "
            "position"
        )
        for bucket in result["buckets"]:
            print(f"{bucket['start']:>8} - {bucket['end']:<8} {bucket['perplexity']:>10.2f}")
    result.update(model=name, command="samba-hf " + " ".join(args.argv))
    if outputs:
        _write_results(result, args, outputs)
    return 0


def _say(line: str) -> None:
    """A `samba-hf:` line on stderr that leaves the progress bars whole."""
    from tqdm.auto import tqdm

    tqdm.write(f"samba-hf: {line}", file=sys.stderr)


def _say_the_work(args) -> None:
    """What `eval passkey` / `eval phonebook` is about to run, before it runs: the prompts, the longest, the tokens."""

    def count(n: int, thing: str) -> str:
        return f"{n:,} {thing}{'s' if n != 1 else ''}"

    depths = len(args.depths) if args.task == "passkey" else 1
    shape = " x ".join(
        [count(len(args.lengths), "length")]
        + [count(depths, "depth")] * (args.task == "passkey")
        + [count(args.trials, "trial")]
    )
    print(
        f"samba-hf: {args.task}: {count(len(args.lengths) * depths * args.trials, 'prompt')} ({shape}), the "
        f"longest {max(args.lengths):,} tokens, up to {sum(args.lengths) * depths * args.trials:,} tokens in all",
        file=sys.stderr,
    )


def _untaught_phonebook(model_arg: str | None) -> str:
    """What a score of 0% at every length says about the model."""
    if model_arg is None:
        return (
            "0% at every length, as expected: the embedded default model was never trained for phonebook lookup "
            "(it writes documentation-flavoured English); pass --model to evaluate a model that was"
        )
    return (
        "0% at every length: the model found no number at all, as one never trained for phonebook lookup does "
        "(guessing a 10-digit number right has no chance to speak of)"
    )


def _eval_outputs(args) -> tuple | None:
    """The (json, png) paths in --out, refused when they exist (unless --force) or cannot be made."""
    if args.out is None:
        return None
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(
            f"--out {args.out!r} is a file; give a folder to write {args.task}.json and {args.task}.png in"
        )
    paths = tuple(os.path.join(args.out, f"{args.task}.{ext}") for ext in ("json", "png"))
    taken = [p for p in paths if os.path.exists(p)]
    if taken and not args.force:
        raise UserError(f"{taken[0]} exists; pass --force to replace it, or another --out")
    return paths


def _write_results(result: dict, args, paths) -> None:
    """JSON, and the plot when matplotlib is there; each written to a temporary name and renamed when complete."""
    import json

    from . import evaluation

    os.makedirs(args.out, exist_ok=True)
    json_path, png_path = paths
    _atomic_write(json_path, lambda tmp: open(tmp, "w").write(json.dumps(result, indent=1) + "\n"))
    written = [json_path]
    plot = {
        "passkey": lambda p: evaluation.plot_passkey(result, p, f"passkey: {result['model']}"),
        "phonebook": lambda p: evaluation.plot_phonebook({result["model"]: result}, p),
        "perplexity": lambda p: evaluation.plot_perplexity({result["model"]: result}, p),
    }[args.task]
    try:
        _atomic_write(png_path, plot)
        written.append(png_path)
    except ImportError as error:
        print(f"samba-hf: no plot written: {error}", file=sys.stderr)
    print(f"samba-hf: wrote {' and '.join(written)}", file=sys.stderr)


def _atomic_write(path: str, write) -> None:
    base, ext = os.path.splitext(path)
    temporary = f"{base}.{os.getpid()}.partial{ext}"  # same extension: matplotlib picks the format from it
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _perplexity_ids(args, tokenizer):
    from .evaluation import default_text

    if args.text is None:
        text = default_text()
    else:
        if not os.path.isfile(args.text):
            raise UserError(
                f"--text {args.text!r}: no such file"
                if not os.path.exists(args.text)
                else f"--text {args.text!r} is not a file; give a UTF-8 text file"
            )
        try:
            text = open(args.text, encoding="utf-8").read()
        except UnicodeDecodeError as error:
            raise UserError(
                f"--text {args.text!r} is not UTF-8 text ({error.reason} at byte {error.start}); convert it to UTF-8"
            )
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    if ids.numel() < 2:
        raise UserError(f"the text has {ids.numel()} token(s); perplexity needs at least 2")
    return ids


def _note_positions(model, length: int) -> None:
    """Full attention past its trained positions is measured as asked, but said."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and length > limit and "samba" not in str(getattr(model.config, "model_type", "")):
        print(
            f"samba-hf: note: {length} tokens is past this model's max_position_embeddings ({limit}); measured "
            "there as asked",
            file=sys.stderr,
        )


COMMANDS = {"generate": generate, "convert": convert, "export": export, "eval": evaluate}

__all__ = ["COMMANDS", "UserError", "default_model_path"]
