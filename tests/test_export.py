"""Export (#49) through transformers' own exporters, torch.export's here (ExecuTorch and ONNX run in their own
environment: tests/export_backends/): while exporting, every part takes its PyTorch path, the scans are one `scan`
operator over the tokens (so a program runs at any length), nothing depends on data, and a cache keeps one
structure. Checked on every layout: a forward program at lengths other than the traced one against eager, and the
prefill + decode programs of `export_for_generation` giving eager's greedy tokens past the window."""

import pytest
import torch
from conftest import tiny_model
from test_mamba2 import float64_ssd, ssd_inputs, tiny_mamba2
from test_reference_models import float64_recurrence
from test_sambay import tiny_model as tiny_sambay
from transformers.exporters import DynamoConfig, DynamoExporter

from samba_hf import ssm_samba
from samba_hf.exported_generation import generate_exported

LAYOUTS = ["samba", "megatron", "samba2", "sambay"]


def layout(name: str):
    if name == "samba":
        return tiny_model(seed=1)
    if name in ("megatron", "samba2"):  # the Mamba-2-Hybrid layout; Samba with Mamba-2
        return tiny_mamba2(name, seed=3)
    return tiny_sambay(seed=5)[0]


def scan_inputs(batch=2, seq_len=23, d_inner=6, d_state=4, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "u": torch.randn(batch, seq_len, d_inner, generator=g),
        "dt": torch.rand(batch, seq_len, d_inner, generator=g) * 0.5,
        "A": -torch.rand(d_inner, d_state, generator=g) * 2,
        "B": torch.randn(batch, seq_len, d_state, generator=g),
        "C": torch.randn(batch, seq_len, d_state, generator=g),
        "D": torch.randn(d_inner, generator=g),
        "z": torch.randn(batch, seq_len, d_inner, generator=g),
        "h0": torch.randn(batch, d_inner, d_state, generator=g),
    }


@pytest.mark.parametrize("from_state", [False, True])
def test_the_scan_over_time_equals_the_pytorch_scan_and_float64(from_state):
    x = scan_inputs()
    if not from_state:
        x["h0"] = None
    y, h = ssm_samba.selective_scan_over_time(**x)
    y_pt, h_pt = ssm_samba.selective_scan_pytorch(**x)
    zero = torch.zeros(2, 6, 4)
    y64, h64 = float64_recurrence(**{**x, "h0": zero if x["h0"] is None else x["h0"]})
    torch.testing.assert_close(y, y_pt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_pt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), y64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h.double(), h64, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("from_state", [False, True])
def test_the_ssd_scan_over_time_equals_the_chunked_scan_and_float64(from_state):
    x, dt, A, B, C, D, h0 = ssd_inputs()
    h0 = h0 if from_state else None
    y, last = ssm_samba.ssd_scan_over_time(x, dt, A, B, C, D, h0)
    y_chunked, last_chunked = ssm_samba.ssd_scan_pytorch(x, dt, A, B, C, D, h0, chunk_size=8)
    y64, last64 = float64_ssd(x, dt, A, B, C, D, torch.zeros_like(last) if h0 is None else h0)
    torch.testing.assert_close(y, y_chunked, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, last_chunked, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y.double(), y64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last.double(), last64, rtol=1e-4, atol=1e-4)


class _Scan(torch.nn.Module):
    def forward(self, u, dt, A, B, C, D, z, h0):
        return ssm_samba.selective_scan(u, dt, A, B, C, D, z, h0)  # "auto": the C scan in eager, not while exporting


def test_an_exported_scan_is_one_operator_and_runs_at_any_length():
    x = scan_inputs(seq_len=7)
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    per_token = {0: None, 1: tokens}
    shapes = {"u": per_token, "dt": per_token, "A": None, "B": per_token, "C": per_token, "D": None, "z": per_token}
    program = torch.export.export(_Scan(), (), x, dynamic_shapes={**shapes, "h0": None})
    code = program.graph_module.code
    assert "higher_order.scan" in code and "samba_hf" not in code  # no operator of samba-hf's own
    for seq_len in (1, 7, 40):
        x = scan_inputs(seq_len=seq_len, seed=seq_len)
        y, h = program.module()(**x)
        y_pt, h_pt = ssm_samba.selective_scan_pytorch(**x)
        torch.testing.assert_close(y, y_pt, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h, h_pt, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name", ["samba", "sambay"]
)  # (the Mamba-2 layouts' prefill programs: below, in the export stage)
def test_a_forward_program_runs_at_other_lengths_with_eagers_logits(name):
    model = layout(name)
    ids = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    exported = DynamoExporter().export(model, {"input_ids": ids}, DynamoConfig(dynamic=True))
    assert "samba_hf" not in exported.program.graph_module.code
    for length in (8, 19, 40):  # past the window (8; SambaY's 4)
        ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected = model(ids).logits
        torch.testing.assert_close(exported(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)  # other sums


@pytest.mark.parametrize("name", ["samba"])  # (the other layouts: tests/test_export_backends.py, the export stage)
def test_generation_programs_give_eagers_greedy_tokens_past_the_window(name):
    model = layout(name)
    ids = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    exported = DynamoExporter().export_for_generation(model, inputs, DynamoConfig(dynamic=True))
    for length in (8, 13):  # the traced prompt's length and another
        ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None)
        assert torch.equal(generate_exported(exported, model.config, ids, 64), expected)


def test_generate_exported_names_what_is_wrong():
    model = layout("samba")
    ids = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    forward_only = DynamoExporter().export(model, {"input_ids": ids}, DynamoConfig(dynamic=True))
    with pytest.raises(ValueError, match="no decode, prefill component: export it with export_for_generation"):
        generate_exported(forward_only, model.config, ids, 4)
    with pytest.raises(ValueError, match=r"one sequence, input_ids of shape \(1, length\)"):
        generate_exported(forward_only, model.config, ids.expand(2, -1), 4)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        generate_exported(forward_only, model.config, ids, 0)


def greedy_on_device(program, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy tokens from a `SambaOnDevice` program (or its exported module): the prompt in one call, then a token
    per call, as ExecuTorch's LLM runner calls it."""
    with torch.no_grad():
        tokens = [program(ids, torch.tensor([0]))[0, -1].argmax()]
        for i in range(new_tokens - 1):
            tokens.append(program(tokens[-1].view(1, 1), torch.tensor([ids.shape[1] + i]))[0, -1].argmax())
    return torch.cat([ids[0], torch.stack(tokens)])[None]


@pytest.mark.parametrize("name", ["samba"])  # (SambaY, Samba with Mamba-2, Mamba-2-Hybrid: the export stage)
def test_the_on_device_program_gives_eagers_greedy_tokens_in_eager_and_exported(name):
    """The state in fixed buffers (`SambaOnDevice`; SambaY's shared keys and values included): eager's 64 greedy
    tokens past the window, for prompts longer and shorter than the window, one text after another in the same
    program (a call at position 0 starts a new one); the same from its torch.export program, traced once at 8
    tokens."""
    from samba_hf.on_device import SambaOnDevice

    model = layout(name)
    program = SambaOnDevice(model, max_context_len=96, max_seq_len=16).eval()
    tokens = torch.export.Dim("tokens", min=1, max=16)
    example = (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    with torch.no_grad():
        exported = torch.export.export(
            program, example, dynamic_shapes=({1: tokens}, None), prefer_deferred_runtime_asserts_over_guards=True
        )
    assert "samba_hf" not in exported.graph_module.code
    for length in (13, 3, 8):  # longer than the window (8), shorter, equal
        ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None)
        assert torch.equal(greedy_on_device(program, ids, 64), expected)
        assert torch.equal(greedy_on_device(exported.module(), ids, 64), expected)


def test_the_on_device_program_refuses_calls_beyond_its_sizes_in_one_line():
    from samba_hf.on_device import SambaOnDevice

    program = SambaOnDevice(layout("megatron"), max_context_len=32, max_seq_len=8).eval()
    with pytest.raises(ValueError, match=r"1 to max_seq_len=8 tokens, \(1, seq\), not \(1, 9\): give a longer"):
        program(torch.zeros(1, 9, dtype=torch.long), torch.tensor([0]))
    with pytest.raises(ValueError, match="position 32 is past max_context_len=32.*with a larger max_context_len"):
        program(torch.zeros(1, 1, dtype=torch.long), torch.tensor([32]))


@pytest.mark.parametrize("values_width", [1, 2])  # SambaY's differential attention reads values twice as wide
def test_slot_attention_equals_transformers_eager_attention(values_width):
    """The on-device attention (grouped heads shared by reshaping the queries, the mask added) against transformers'
    eager attention (every key/value head copied per query head, `repeat_kv`) under the same mask."""
    from types import SimpleNamespace

    from transformers.models.llama.modeling_llama import eager_attention_forward

    from samba_hf.attention_samba import SlotMask, slot_attention

    g = torch.Generator().manual_seed(0)
    query, key = torch.randn(1, 6, 5, 8, generator=g), torch.randn(1, 2, 11, 8, generator=g)
    value = torch.randn(1, 2, 11, 8 * values_width, generator=g)
    visible = torch.rand(1, 1, 5, 11, generator=g) > 0.4
    visible[..., 0] = True  # (every query sees a slot)
    module = SimpleNamespace(num_key_value_groups=3, training=False)
    expected, _ = eager_attention_forward(
        module, query, key, value, torch.zeros(visible.shape).masked_fill(~visible, float("-inf")), scaling=0.3
    )
    output, _ = slot_attention(module, query, key, value, SlotMask(visible), scaling=0.3)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["export", "executorch", "DEFAULT", "model.onnx"], ["an ExecuTorch program is a .pte file"]),
        (["export", "executorch", "DEFAULT", "/no/such/folder/model.pte"], ["the folder '/no/such/folder' does not"]),
        (["export", "executorch", "DEFAULT", "EXISTING"], ["exists: pass --force to replace it"]),
        (["export", "executorch", "DEFAULT", "model.pte", "--max-seq-len", "0"], ["--max-seq-len takes 1 to 65536"]),
        (["export", "executorch", "/no/such/model", "model.pte"], ["no such model folder"]),
        (
            ["export", "executorch", "DEFAULT", "model.pte", "--max-seq-len", "64", "--max-context-len", "32"],
            ["--max-context-len takes 64 (--max-seq-len) to"],
        ),
        (
            ["export", "lit-gpt", "DEFAULT", "model.pth", "--quantize", "8da4w"],
            ["--quantize is for export executorch"],
        ),
        (
            ["export", "megatron", "DEFAULT", "out.pt", "--max-seq-len", "64"],
            ["--max-seq-len is for export executorch"],
        ),
    ],
)
def test_export_executorch_mistakes_are_one_line_and_write_nothing(argv, fragments, capsys, tmp_path, monkeypatch):
    from test_cli import one_line_error

    from samba_hf.cli import default_model_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing.pte").write_bytes(b"not ours")
    argv = [default_model_path() if a == "DEFAULT" else "existing.pte" if a == "EXISTING" else a for a in argv]
    one_line_error(capsys, argv, *fragments)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.pte"]
    assert (tmp_path / "existing.pte").read_bytes() == b"not ours"


def test_export_executorch_without_executorch_names_the_extra(capsys, tmp_path, monkeypatch):
    import sys

    from test_cli import one_line_error

    from samba_hf.cli import default_model_path

    monkeypatch.setitem(sys.modules, "executorch", None)  # (`import executorch` raises ImportError)
    one_line_error(
        capsys,
        ["export", "executorch", default_model_path(), str(tmp_path / "model.pte")],
        "needs ExecuTorch: pip install 'samba-hf[export]'",
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--model", "missing.pte"], ["no such file: 'missing.pte'"]),
        (["--model", "model.pte"], ["a .pte holds no tokenizer: pass --tokenizer"]),
        (["--model", "model.pte", "--tokenizer", "."], ["no tokenizer.json at '.'"]),
        (["--model", "model.pte", "--chat"], ["--chat: a .pte runs as it was exported"]),
        (["--model", "model.pte", "--dtype", "bfloat16"], ["--dtype bfloat16: a .pte runs as it was exported"]),
        (["--model", "model.pte", "--quantize", "int8"], ["--quantize: a .pte runs as it was exported"]),
        (["--model", "model.pte", "--kernels", "pytorch"], ["--kernels pytorch: a .pte runs as it was exported"]),
        (
            ["--model", "model.pte", "--tokenizer", "DEFAULT"],
            ["a .pte runs in ExecuTorch: pip install 'samba-hf[export]'"],
        ),
    ],
)
def test_generate_from_a_pte_mistakes_are_one_line(extra, fragments, capsys, tmp_path, monkeypatch):
    import sys

    from test_cli import one_line_error

    from samba_hf.cli import default_model_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "executorch", None)  # (where it is installed too: the last case's line)
    (tmp_path / "model.pte").write_bytes(b"a program")
    extra = [default_model_path() if a == "DEFAULT" else a for a in extra]
    one_line_error(capsys, ["generate", "Samba is", *extra], *fragments)
