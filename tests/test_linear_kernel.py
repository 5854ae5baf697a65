"""`SambaLinear`'s C matrix-vector kernel (`cpu_kernels_samba.gemv_cpu`) against `nn.Linear`, where it runs and where
it must not, under torch.compile, and the fallback when it is turned off."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_model
from torch import nn

from samba_hf import cpu_kernels_samba, linear_samba
from samba_hf.cpu_kernels_samba import MAX_TOKENS
from samba_hf.linear_samba import SambaLinear

requires_kernel = pytest.mark.skipif(
    not cpu_kernels_samba.gemv_available(), reason="no AVX-512 or no C compiler: nn.Linear runs everywhere"
)


def reference(layer: SambaLinear, x: torch.Tensor) -> torch.Tensor:
    """float64 product of the same (rounded) numbers."""
    bias = None if layer.bias is None else layer.bias.double()
    return nn.functional.linear(x.double(), layer.weight.double(), bias)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (3,), (2, 4)], ids=["one-token", "batch-2", "3-rows", "8-rows"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_equals_a_float64_product(dtype, shape, bias, monkeypatch):
    """in_features 100 and 70: whole blocks of 32 (bf16) / 16 (fp32) values and a tail; out 37: odd."""
    calls = []
    monkeypatch.setattr(linear_samba, "gemv_cpu", lambda *a: calls.append(1) or KERNEL(*a))
    for in_features in (100, 70):
        torch.manual_seed(0)
        layer = SambaLinear(in_features, 37, bias=bias).to(dtype)
        x = torch.randn(*shape, in_features).to(dtype)
        with torch.no_grad():
            y = layer(x)
        assert y.dtype == dtype and y.shape == (*shape, 37)
        expected = reference(layer, x)
        # float32 sums: ~1e-6 of the scale; bf16 output rounding: 2^-8 of each value
        rtol = 1e-5 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(y.double(), expected, rtol=rtol, atol=1e-5 * expected.abs().max().item())
    assert len(calls) == 2  # the kernel ran, not nn.Linear


KERNEL = cpu_kernels_samba.gemv_cpu


@requires_kernel
@pytest.mark.parametrize("case", ["autograd", "too-many-tokens", "no-tokens", "float16", "mixed-dtypes"])
def test_nn_linear_runs_where_the_kernel_must_not(case, monkeypatch):
    monkeypatch.setattr(linear_samba, "gemv_cpu", lambda *a: pytest.fail("the kernel ran"))
    layer, x = SambaLinear(16, 8), torch.randn(1, 16)
    if case == "too-many-tokens":
        x = torch.randn(MAX_TOKENS + 1, 16)
    elif case == "no-tokens":
        x = torch.randn(0, 16)
    elif case == "float16":
        layer, x = layer.half(), x.half()
    elif case == "mixed-dtypes":
        x = x.double()
        layer.weight.data = layer.weight.data.double()
        layer.bias.data = layer.bias.data.float()
        with pytest.raises(RuntimeError):  # nn.Linear's own error for mismatched dtypes
            layer(x)
        return
    y = layer(x)  # with autograd: the gradient must flow through nn.Linear
    if case == "autograd":
        y.sum().backward()
        assert layer.weight.grad is not None


@requires_kernel
def test_under_torch_compile_the_kernel_is_one_operator():
    layer = SambaLinear(64, 24)
    x = torch.randn(1, 1, 64)
    graph_ops = []

    def backend(gm, example_inputs):
        graph_ops.extend(str(node.target) for node in gm.graph.nodes)
        return gm

    with torch.no_grad():
        compiled = torch.compile(layer, fullgraph=True, backend=backend)(x)
        assert torch.equal(compiled, layer(x))
    assert "samba_hf.gemv_cpu.default" in graph_ops
    torch.library.opcheck(torch.ops.samba_hf.gemv_cpu, (x, layer.weight.detach(), layer.bias.detach()))


@requires_kernel
def test_a_decoding_step_through_the_kernel_equals_nn_linear(monkeypatch):
    """The whole model: cached decoding with the kernel against the same steps through nn.Linear."""
    model = tiny_model(seed=3)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    options = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        kernel = model.generate(ids, **options)
        monkeypatch.setattr(cpu_kernels_samba, "_CPU_GEMV", False)
        monkeypatch.setattr(linear_samba, "gemv_available", lambda: False)
        plain = model.generate(ids, **options)
    assert torch.equal(kernel.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(kernel.scores), torch.stack(plain.scores), rtol=1e-5, atol=1e-5)


def test_the_environment_variable_turns_the_kernel_off():
    code = "from samba_hf import cpu_kernels_samba; print(cpu_kernels_samba._gemv_library() is None)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SAMBA_HF_GEMV": "pytorch"},
    )
    assert result.returncode == 0 and result.stdout.split() == ["True"], result.stderr
