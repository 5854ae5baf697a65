"""Exported programs against eager PyTorch on this CPU (#49), batch 1, greedy.

    python benchmarks/export_speed.py --out benchmarks/results/export_speed.json [--new-tokens 128] [--repeats 3]
                                      [--models default,113m] [--no-transformers-exporters]

Needs the export extra (`pip install 'samba-hf[export]'`: ExecuTorch, ONNX Runtime) and torchao. Medians of
`--repeats` alternated rounds, `--new-tokens` new tokens each:
- default: the embedded default model (float32) after the README's prompt ("Samba is a hybrid model that"):
  - eager `model.generate` (transformers' loop, samba-hf's CPU kernels), tokens/s of the whole call;
  - the `.pte` of `samba-hf export executorch`, float32 and `--quantize 8da4w`, through ExecuTorch's own
    `TextLLMRunner` (what an app runs): its statistics (prompt and generated tokens/s), the file's size; whether the
    float32 program's text is eager's greedy text; for 8da4w, how often its next token is float32's when fed
    float32's greedy text (teacher-forced agreement), and the first position where its own greedy text differs;
  - transformers' exporters (`export_for_generation`: prefill + decode programs; DynamoExporter, OnnxExporter)
    driven by `samba_hf.exported_generation.generate_exported`: tokens/s of the whole call, and whether its tokens
    are eager's;
- 113m: the ~113M Samba of run_benchmarks.py (random weights, window 2048), a 14-token random prompt: eager generate
  against the float32 and 8da4w `.pte` called token by token from Python (ExecuTorch's `Method.execute`), the
  decoding calls timed.
"""

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from vllm_serving import run_record, write_json  # noqa: E402

PROMPT = "Samba is a hybrid model that"


def eager_rate(model, ids, new_tokens) -> tuple[float, torch.Tensor]:
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    start = time.perf_counter()
    with torch.no_grad():
        tokens = model.generate(ids, **options)
    return new_tokens / (time.perf_counter() - start), tokens


def runner_rates(runner, config) -> tuple[float, float, str]:
    pieces, stats = [], []
    runner.reset()
    runner.generate(PROMPT, config, token_callback=pieces.append, stats_callback=stats.append)
    s = stats[-1]
    prompt = s.num_prompt_tokens / max(s.prompt_eval_end_ms - s.inference_start_ms, 1) * 1e3
    generated = (s.num_generated_tokens - 1) / max(s.inference_end_ms - s.prompt_eval_end_ms, 1) * 1e3
    return prompt, generated, "".join(pieces)


def method_rate(method, ids, new_tokens) -> tuple[float, list[int]]:
    """Greedy through a .pte's forward from Python: the prompt in one call, then one token per call (timed)."""
    tokens = [int(method.execute([ids, torch.tensor([0])])[0][0, -1].argmax())]
    start = time.perf_counter()
    for i in range(new_tokens - 1):
        step = method.execute([torch.tensor([[tokens[-1]]]), torch.tensor([ids.shape[1] + i])])[0]
        tokens.append(int(step[0, -1].argmax()))
    return (new_tokens - 1) / (time.perf_counter() - start), tokens


def teacher_forced_agreement(method, text: torch.Tensor, prompt_length: int) -> float:
    """How often the program's next token is `text`'s, fed `text` (prompt, then one token per call)."""
    calls = [(text[:, :prompt_length], 0)] + [(text[:, i : i + 1], i) for i in range(prompt_length, text.shape[1] - 1)]
    hits = 0
    for (tokens, position), target in zip(calls, text[0, prompt_length:].tolist()):
        hits += int(method.execute([tokens, torch.tensor([position])])[0][0, -1].argmax()) == target
    return hits / len(calls)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def default_model(args, work: Path) -> dict:
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    from executorch.runtime import Runtime
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from samba_hf.cli import default_model_path
    from samba_hf.on_device import export_executorch, quantize_8da4w

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    programs, result = {}, {}
    for kind in ("float32", "8da4w"):
        start = time.perf_counter()
        source = model if kind == "float32" else quantize_8da4w(copy.deepcopy(model))
        programs[kind] = export_executorch(source, work / f"default-{kind}.pte")
        result[kind] = {"pte_bytes": programs[kind].stat().st_size, "export_seconds": time.perf_counter() - start}
    runners = {kind: TextLLMRunner(str(pte), f"{path}/tokenizer.json") for kind, pte in programs.items()}
    config = GenerationConfig(echo=False, max_new_tokens=args.new_tokens, temperature=0.0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4)  # warm-up (the C kernels load)
    rates = {"eager": [], **{kind: ([], []) for kind in programs}}
    texts = {}
    for _ in range(args.repeats):
        rate, expected = eager_rate(model, ids, args.new_tokens)
        rates["eager"].append(rate)
        for kind, runner in runners.items():
            prompt, generated, texts[kind] = runner_rates(runner, config)
            rates[kind][0].append(prompt)
            rates[kind][1].append(generated)
    eager_text = tokenizer.decode(expected[0, ids.shape[1] :])
    result["eager_generate_tokens_per_s"] = statistics.median(rates["eager"])
    for kind in programs:
        result[kind]["runner_prompt_tokens_per_s"] = statistics.median(rates[kind][0])
        result[kind]["runner_generated_tokens_per_s"] = statistics.median(rates[kind][1])
        result[kind]["same_text_as_eager"] = texts[kind] == eager_text
    method = Runtime.get().load_program(str(programs["8da4w"])).load_method("forward")
    result["8da4w"]["teacher_forced_agreement_with_float32"] = teacher_forced_agreement(method, expected, ids.shape[1])
    _, own = method_rate(method, ids, args.new_tokens)
    result["8da4w"]["first_greedy_token_that_differs"] = first_difference(own, expected[0, ids.shape[1] :].tolist())
    if args.transformers_exporters:
        result["transformers_exporters"] = transformers_exporters(model, ids, expected, args)
    return result


def transformers_exporters(model, ids, expected, args) -> dict:
    from transformers.exporters import DynamoConfig, DynamoExporter, OnnxConfig, OnnxExporter

    from samba_hf.exported_generation import generate_exported

    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    result = {}
    for name, exporter, config in (
        ("torch.export", DynamoExporter(), DynamoConfig(dynamic=True)),
        ("onnxruntime", OnnxExporter(), OnnxConfig(dynamic=True)),
    ):
        start = time.perf_counter()
        programs = exporter.export_for_generation(model, inputs, config)
        export_seconds = time.perf_counter() - start
        rates = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = generate_exported(programs, model.config, ids, args.new_tokens)
            rates.append(args.new_tokens / (time.perf_counter() - start))
        result[name] = {
            "export_seconds": export_seconds,
            "generate_exported_tokens_per_s": statistics.median(rates),
            "same_tokens_as_eager": torch.equal(tokens, expected),
        }
    return result


def samba_113m(args, work: Path) -> dict:
    from executorch.runtime import Runtime
    from run_benchmarks import build

    from samba_hf.on_device import export_executorch, quantize_8da4w

    model = build("samba", "cpu", torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(0))
    result = {"parameters": sum(p.numel() for p in model.parameters())}
    programs = {}
    for kind in ("float32", "8da4w"):
        start = time.perf_counter()
        source = model if kind == "float32" else quantize_8da4w(copy.deepcopy(model))
        pte = export_executorch(source, work / f"113m-{kind}.pte")
        result[kind] = {"pte_bytes": pte.stat().st_size, "export_seconds": time.perf_counter() - start}
        programs[kind] = Runtime.get().load_program(str(pte))
    methods = {kind: program.load_method("forward") for kind, program in programs.items()}
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4)
    rates = {"eager": [], **{kind: [] for kind in methods}}
    for _ in range(args.repeats):
        rate, expected = eager_rate(model, ids, args.new_tokens)
        rates["eager"].append(rate)
        for kind, method in methods.items():
            rate, tokens = method_rate(method, ids, args.new_tokens)
            rates[kind].append(rate)
            result[kind]["same_tokens_as_eager"] = tokens == expected[0, ids.shape[1] :].tolist()
    result["eager_generate_tokens_per_s"] = statistics.median(rates["eager"])
    for kind in methods:
        result[kind]["method_generated_tokens_per_s"] = statistics.median(rates[kind])
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="default,113m")
    parser.add_argument("--no-transformers-exporters", dest="transformers_exporters", action="store_false")
    args = parser.parse_args()
    if not args.out.parent.is_dir():
        parser.error(f"--out: the folder {args.out.parent} does not exist")
    if args.new_tokens < 2 or args.repeats < 1:
        parser.error("--new-tokens takes 2 or more, --repeats 1 or more")
    models = args.models.split(",")
    if not set(models) <= {"default", "113m"}:
        parser.error(f"--models takes default and 113m, got {args.models!r}")
    try:
        import executorch  # noqa: F401
        import torchao  # noqa: F401
    except ImportError:
        parser.error("ExecuTorch and torchao are needed: pip install 'samba-hf[export]' torchao")
    result = run_record()
    with tempfile.TemporaryDirectory() as work:
        if "default" in models:
            result["default"] = default_model(args, Path(work))
        if "113m" in models:
            result["113m"] = samba_113m(args, Path(work))
    print(json.dumps(result, indent=1))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
