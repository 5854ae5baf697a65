"""Exported programs against eager PyTorch on this CPU (#49): the embedded default model, float32, batch 1.

    python benchmarks/export_speed.py --out benchmarks/results/export_speed.json [--new-tokens 128] [--repeats 3]

Needs the export extra (`pip install 'samba-hf[export]'`: ExecuTorch). For each, the same prompt (the README's,
"Samba is a hybrid model that"), greedy, `--new-tokens` tokens, medians of `--repeats` alternated rounds:
- eager: `model.generate` (transformers' loop, samba-hf's CPU kernels), tokens/s of the whole call;
- the `.pte` of `samba-hf export executorch` (XNNPACK) through ExecuTorch's own `TextLLMRunner` (what an app runs):
  its own statistics, prompt tokens/s and generated tokens/s, and the file's size;
- whether the runner's text equals eager's greedy text.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from vllm_serving import run_record  # noqa: E402

PROMPT = "Samba is a hybrid model that"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not args.out.parent.is_dir():
        parser.error(f"--out: the folder {args.out.parent} does not exist")
    if args.new_tokens < 2 or args.repeats < 1:
        parser.error("--new-tokens takes 2 or more, --repeats 1 or more")
    try:
        from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    except ImportError:
        parser.error("ExecuTorch is not installed: pip install 'samba-hf[export]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from samba_hf.cli import default_model_path
    from samba_hf.on_device import export_executorch

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    options = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None)
    with tempfile.TemporaryDirectory() as work:
        start = time.perf_counter()
        pte = export_executorch(model, Path(work) / "default.pte", max_seq_len=128)
        export_seconds = time.perf_counter() - start
        runner = TextLLMRunner(str(pte), f"{path}/tokenizer.json")
        config = GenerationConfig(echo=False, max_new_tokens=args.new_tokens, temperature=0.0)
        eager, prompt_rate, decode_rate = [], [], []
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4)  # warm-up (the C kernels load)
            for _ in range(args.repeats):
                start = time.perf_counter()
                expected = model.generate(ids, **options)[0, ids.shape[1] :]
                eager.append(args.new_tokens / (time.perf_counter() - start))
                pieces, stats = [], []
                runner.reset()
                runner.generate(PROMPT, config, token_callback=pieces.append, stats_callback=stats.append)
                s = stats[-1]
                prompt_rate.append(s.num_prompt_tokens / max(s.prompt_eval_end_ms - s.inference_start_ms, 1) * 1e3)
                decode_rate.append(
                    (s.num_generated_tokens - 1) / max(s.inference_end_ms - s.prompt_eval_end_ms, 1) * 1e3
                )
        result = {
            **run_record(),
            "pte_bytes": pte.stat().st_size,
            "export_seconds": export_seconds,
            "eager_generate_tokens_per_s": statistics.median(eager),
            "pte_runner_prompt_tokens_per_s": statistics.median(prompt_rate),
            "pte_runner_generated_tokens_per_s": statistics.median(decode_rate),
            "same_text": "".join(pieces) == tokenizer.decode(expected),
        }
    print(json.dumps(result, indent=1))
    partial = args.out.with_name(args.out.name + ".partial")  # whole or not at all
    partial.write_text(json.dumps(result, indent=1) + "\n")
    partial.replace(args.out)


if __name__ == "__main__":
    main()
