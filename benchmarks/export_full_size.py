"""Phi-4-mini-flash-reasoning's released layout at full size as a quantized on-device program (#49).

    python benchmarks/export_full_size.py --out benchmarks/results/export_full_size.json [--release-config PATH]
                                          [--max-context-len 4096] [--steps 8]

SambaY built from the release's config.json (tests/data/sambay/config.json, 3.85B parameters), random weights in
float32 (what the program computes in), then:
- `samba_hf.on_device.quantize_8da4w` (8-bit dynamic activations, 4-bit weights in groups of 32; the embedding
  stays float32);
- `samba_hf.on_device.export_executorch` (XNNPACK, `--max-context-len` positions for the full-attention layer);
- the .pte loaded in ExecuTorch's runtime: a 14-token prompt, then `--steps` one-token calls; tokens/s, and whether the
  prompt's next token is the eager quantized model's.
Records the peak resident memory after each phase (VmHWM: it only grows), the seconds of each, and the file's size.
The .pte is written to a temporary folder and removed. Needs the export extra and torchao.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run_benchmarks import peak_rss_mib  # noqa: E402
from vllm_serving import run_record, write_json  # noqa: E402

RELEASE_CONFIG = Path(__file__).resolve().parent.parent / "tests" / "data" / "sambay" / "config.json"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--release-config", type=Path, default=RELEASE_CONFIG)
    parser.add_argument("--max-context-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if not args.out.parent.is_dir():
        parser.error(f"--out: the folder {args.out.parent} does not exist")
    from executorch.runtime import Runtime

    from samba_hf import SambaYConfig, SambaYForCausalLM
    from samba_hf.on_device import export_executorch, quantize_8da4w

    record, phases = run_record(), {}

    def phase(name: str, start: float):
        phases[name] = {"seconds": round(time.perf_counter() - start, 1), "peak_rss_mib": round(peak_rss_mib())}
        print(name, phases[name], flush=True)

    start = time.perf_counter()
    torch.manual_seed(0)
    config = SambaYConfig.from_dict(json.loads(args.release_config.read_text()))
    model = SambaYForCausalLM(config).float().eval()
    parameters = sum(p.numel() for p in model.parameters())
    phase("build (float32)", start)
    start = time.perf_counter()
    quantize_8da4w(model)
    phase("quantize_8da4w", start)
    ids = torch.randint(0, config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as work:
        start = time.perf_counter()
        path = export_executorch(model, Path(work) / "phi4-mini-flash-8da4w.pte", max_context_len=args.max_context_len)
        phase("export_executorch", start)
        size = path.stat().st_size
        start = time.perf_counter()
        from samba_hf.on_device import SambaOnDevice

        with torch.no_grad():
            expected = int(SambaOnDevice(model, args.max_context_len)(ids, torch.tensor([0]))[0, -1].argmax())
        del model
        phase("eager quantized prompt", start)
        program = Runtime.get().load_program(str(path))
        method = program.load_method("forward")
        start = time.perf_counter()
        token = int(method.execute([ids, torch.tensor([0])])[0][0, -1].argmax())
        prompt_seconds = time.perf_counter() - start
        first = token
        start = time.perf_counter()
        for i in range(args.steps):
            token = int(method.execute([torch.tensor([[token]]), torch.tensor([14 + i])])[0][0, -1].argmax())
        step_seconds = (time.perf_counter() - start) / args.steps
        phase("run the .pte", start)
    result = {
        **record,
        "parameters": parameters,
        "max_context_len": args.max_context_len,
        "pte_bytes": size,
        "phases": phases,
        "pte_prompt_tokens_per_s": 14 / prompt_seconds,
        "pte_generated_tokens_per_s": 1 / step_seconds,
        "pte_first_token_is_eager_quantized": first == expected,
    }
    print(json.dumps(result, indent=1))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
