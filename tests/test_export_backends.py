"""ExecuTorch (XNNPACK) and ONNX Runtime programs of samba-hf's models, from transformers' own exporters (#49), in an
environment of their own (.ci/run's export stage installs executorch, onnx, onnxscript and onnxruntime and sets
SAMBA_HF_TEST_EXPORT_BACKENDS; elsewhere the file is skipped where they are missing): a forward program at lengths
other than the traced one against eager, and ONNX's prefill + decode programs giving eager's greedy tokens past the
window (`samba_hf.exported_generation`)."""

import os

import pytest
import test_export
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


@pytest.mark.parametrize(
    "backend, name",
    [("executorch", "samba"), ("executorch", "sambay")] + [("onnx", name) for name in test_export.LAYOUTS],
)
def test_a_forward_program_runs_at_other_lengths_with_eagers_logits(backend, name):
    model = layout(name)
    exporter, config = exporter_and_config(backend)
    exported = exporter.export(model, {"input_ids": prompt(model, 8)}, config)
    for length in (8, 19, 40):  # past the window
        ids = prompt(model, length)
        with torch.no_grad():
            expected = model(ids).logits
        torch.testing.assert_close(exported(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", test_export.LAYOUTS)
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


@pytest.mark.parametrize("name", ["samba", "megatron", "sambay"])
def test_the_on_device_pte_gives_eagers_greedy_tokens(name, tmp_path):
    """`export_executorch`'s program in ExecuTorch's runtime, a call per token as its LLM runner makes them:
    eager's greedy tokens past the window, for prompts longer and shorter than the window, one text after another."""
    from executorch.runtime import Runtime
    from test_export import greedy_on_device

    from samba_hf.on_device import export_executorch

    model = layout(name)
    path = export_executorch(model, tmp_path / "model.pte", max_seq_len=32, max_context_len=96)
    assert [p.name for p in tmp_path.iterdir()] == ["model.pte"]  # (no partial file left beside it)
    program = Runtime.get().load_program(str(path))  # (kept: the method reads the program's memory)
    method = program.load_method("forward")
    for length in (13, 3):
        ids = prompt(model, length)
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None)
        assert torch.equal(greedy_on_device(lambda *inputs: method.execute(list(inputs))[0], ids, 64), expected)


def test_executorchs_own_llm_runner_generates_the_embedded_defaults_greedy_text(tmp_path, capfd):
    """ExecuTorch's TextLLMRunner (what its apps run) on the embedded default's program and its tokenizer.json: the
    text of eager greedy decoding, 48 tokens; and `samba-hf generate --model MODEL.pte` prints it."""
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from samba_hf.cli import default_model_path
    from samba_hf.on_device import export_executorch

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    path = export_executorch(model, tmp_path / "default.pte", max_seq_len=64)
    text = "Samba is a hybrid model that"
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=None)[0, ids.shape[1] :]
    pieces = []
    runner = TextLLMRunner(str(path), f"{default_model_path()}/tokenizer.json")
    runner.generate(
        text, GenerationConfig(echo=False, max_new_tokens=48, temperature=0.0), token_callback=pieces.append
    )
    assert "".join(pieces) == tokenizer.decode(expected)
    # the same through the command line (samba-hf generate --model MODEL.pte), which streams the runner's text
    from samba_hf_cli import main

    capfd.readouterr()
    argv = ["generate", text, "--model", str(path), "--tokenizer", default_model_path(), "--max-new-tokens", "48"]
    assert main(argv) == 0
    assert capfd.readouterr().out == text + tokenizer.decode(expected) + "\n"


def test_an_8da4w_pte_from_the_command_line_agrees_with_eager(tmp_path, capsys):
    """`samba-hf export executorch --quantize 8da4w` on the embedded default: a program under 40% of float32's
    size whose next token, fed eager float32's greedy text, is float32's at 85% of 128 positions or more (90% when
    measured) and its eager quantized model's (`quantize_8da4w`, torchao's own products) at 95% or more (99%)."""
    import copy

    from executorch.runtime import Runtime
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from samba_hf.cli import default_model_path
    from samba_hf.on_device import SambaOnDevice, quantize_8da4w
    from samba_hf_cli import main

    out = tmp_path / "default-8da4w.pte"
    assert main(["export", "executorch", default_model_path(), str(out), "--quantize", "8da4w"]) == 0
    assert "8da4w" in capsys.readouterr().err
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    ids = tokenizer("Samba is a hybrid model that", return_tensors="pt").input_ids
    with torch.no_grad():
        text = model.generate(ids, max_new_tokens=128, do_sample=False, eos_token_id=None)
        quantized = SambaOnDevice(quantize_8da4w(copy.deepcopy(model)), max_context_len=4096).eval()
    program = Runtime.get().load_program(str(out))
    method = program.load_method("forward")
    calls = [(ids, 0)] + [(text[:, i : i + 1], i) for i in range(ids.shape[1], text.shape[1] - 1)]
    to_float = to_quantized = 0
    with torch.no_grad():
        for (tokens, position), target in zip(calls, text[0, ids.shape[1] :].tolist()):
            token = int(method.execute([tokens, torch.tensor([position])])[0][0, -1].argmax())
            to_float += token == target
            to_quantized += token == int(quantized(tokens, torch.tensor([position]))[0, -1].argmax())
    assert to_float >= 0.85 * 128 and to_quantized >= 0.95 * 128, (to_float, to_quantized)
    float_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert out.stat().st_size < 0.4 * float_bytes  # (8.1 MB against 23.6: the embedding stays float32)


# The main suite's torch.export tests on the layouts it leaves to this stage (its time budget): the prefill + decode
# programs of SambaY, Samba with Mamba-2 and the Mamba-2-Hybrid layout; the on-device program of the same three.
@pytest.mark.parametrize("name", ["sambay", "samba2", "megatron"])
def test_torch_export_generation_programs_on_the_other_layouts(name):
    test_export.test_generation_programs_give_eagers_greedy_tokens_past_the_window(name)


@pytest.mark.parametrize("name", ["sambay", "samba2", "megatron"])
def test_torch_export_on_device_program_of_the_other_layouts(name):
    test_export.test_the_on_device_program_gives_eagers_greedy_tokens_in_eager_and_exported(name)


def test_an_interrupted_export_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C while the .pte is being put in place: no file under OUT, no partial file beside it."""
    import os

    from samba_hf.on_device import export_executorch

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_executorch(layout("samba"), tmp_path / "model.pte", max_seq_len=16, max_context_len=32)
    assert list(tmp_path.iterdir()) == []
