"""ExecuTorch (XNNPACK) and ONNX Runtime programs of samba-hf's models, from transformers' own exporters (#49), in an
environment of their own (.ci/run's export stage installs executorch, onnx, onnxscript and onnxruntime and sets
SAMBA_HF_TEST_EXPORT_BACKENDS; elsewhere the file is skipped where they are missing): a forward program at lengths
other than the traced one against eager, and ONNX's prefill + decode programs giving eager's greedy tokens past the
window (`samba_hf.exported_generation`)."""

import os

import pytest
import torch
from test_export import layout

from samba_hf.exported_generation import generate_exported

if not os.environ.get("SAMBA_HF_TEST_EXPORT_BACKENDS"):
    pytest.importorskip("executorch")
    pytest.importorskip("onnxruntime")


def exporter_and_config(backend: str):
    if backend == "executorch":
        from transformers.exporters import ExecutorchConfig, ExecutorchExporter

        return ExecutorchExporter(), ExecutorchConfig(dynamic=True)
    from transformers.exporters import OnnxConfig, OnnxExporter

    return OnnxExporter(), OnnxConfig(dynamic=True)


def prompt(model, length: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))


@pytest.mark.parametrize("backend, name", [("executorch", "samba"), ("onnx", "samba"), ("onnx", "sambay")])
def test_a_forward_program_runs_at_other_lengths_with_eagers_logits(backend, name):
    model = layout(name)
    exporter, config = exporter_and_config(backend)
    exported = exporter.export(model, {"input_ids": prompt(model, 8)}, config)
    for length in (8, 19, 40):  # past the window
        ids = prompt(model, length)
        with torch.no_grad():
            expected = model(ids).logits
        torch.testing.assert_close(exported(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["samba", "megatron"])
@pytest.mark.parametrize("backend", ["onnx"])  # (ExecuTorch's dynamic dims are bounded where a dynamic cache grows)
def test_generation_programs_give_eagers_greedy_tokens_past_the_window(backend, name):
    model = layout(name)
    exporter, config = exporter_and_config(backend)
    ids = prompt(model, 8)
    exported = exporter.export_for_generation(
        model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, config
    )
    for length in (8, 13):
        ids = prompt(model, length)
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None)
        assert torch.equal(generate_exported(exported, model.config, ids, 64), expected)
