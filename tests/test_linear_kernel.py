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
from samba_hf.linear_samba import KERNEL_TOKENS, SambaLinear

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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checking_up_to_16_tokens_reads_the_weight_once_with_a_one_token_products_numbers(dtype, monkeypatch):
    """Drafts are checked as a product of a few tokens (8 drafts and the current one: 9): every count from 1 to
    MAX_TOKENS (token groups of 8 and a part, rows in blocks of 3 and a part: 37 rows), on one thread and on several,
    gives each token exactly what a product of that token alone gives, within float32 rounding of a float64 product."""
    torch.manual_seed(0)
    weight = torch.randn(37, 100).to(dtype)
    bias = torch.randn(37).to(dtype)
    library = cpu_kernels_samba._gemv_library()
    for tokens in range(1, MAX_TOKENS + 1):
        x = torch.randn(tokens, 100).to(dtype)
        alone = torch.cat([KERNEL(x[m : m + 1], weight, bias) for m in range(tokens)])
        for threaded in (False, True):
            monkeypatch.setattr(library, "threaded", threaded)
            assert torch.equal(KERNEL(x, weight, bias), alone), (tokens, threaded)
        expected = nn.functional.linear(x.double(), weight.double(), bias.double())
        rtol = 1e-5 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(alone.double(), expected, rtol=rtol, atol=1e-5 * expected.abs().max().item())


@requires_kernel
def test_the_kernel_splits_a_large_weight_over_torchs_threads_with_the_same_numbers(monkeypatch):
    """A weight past MIN_PARALLEL (2^16 values) is split over torch.get_num_threads() threads of torch's own OpenMP
    pool (the library binds to the libgomp torch loaded, with sentencepiece's own libgomp loaded beside it);
    1 thread or several, the same numbers."""
    import sentencepiece  # noqa: F401  (its wheel carries a second libgomp, under another name)

    library = cpu_kernels_samba._gemv_library()
    if not library.samba_gemv_has_openmp():
        pytest.skip("the kernel was built without OpenMP here")
    assert library.threaded and cpu_kernels_samba.gemv_threads() == torch.get_num_threads()
    torch.manual_seed(1)
    weight, x = torch.randn(1000, 300), torch.randn(9, 300)
    threads = torch.get_num_threads()
    results = []
    for count in (1, 2, 3):
        torch.set_num_threads(count)
        try:
            results.append(KERNEL(x, weight, None))
        finally:
            torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])
    torch.testing.assert_close(results[0].double(), x.double() @ weight.double().T, rtol=1e-5, atol=1e-4)


@requires_kernel
def test_bfloat16_products_of_more_than_8_tokens_take_pytorchs_product(monkeypatch):
    """Past KERNEL_TOKENS[bfloat16] (8) oneDNN's bf16 product is as fast as the kernel, and PyTorch's runs."""
    calls = []
    monkeypatch.setattr(linear_samba, "gemv_cpu", lambda *a: calls.append(a[0].shape[0]) or KERNEL(*a))
    layer = SambaLinear(32, 16)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            layer = layer.to(dtype)
            for tokens in (8, 9, 16):
                layer(torch.randn(tokens, 32).to(dtype))
    assert calls == [8, 9, 16, 8] and KERNEL_TOKENS[torch.bfloat16] == 8


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


def needs_torchao():
    """Skips a torchao test where torchao is missing; .ci/run's torchao stage installs it and sets
    SAMBA_HF_TEST_TORCHAO: no skip there."""
    if not os.environ.get("SAMBA_HF_TEST_TORCHAO"):
        pytest.importorskip("torchao")


def int8_default_model():
    """The embedded default in float32, its linear layers as torchao's int8 weight-only weights (transformers'
    TorchAoConfig)."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    from samba_hf.cli import default_model_path

    return AutoModelForCausalLM.from_pretrained(
        default_model_path(), dtype=torch.float32, quantization_config=TorchAoConfig(Int8WeightOnlyConfig())
    ).eval()


@pytest.fixture(scope="module")
def saved_int8(tmp_path_factory):
    """The int8 default model, and a folder it was saved to with the default's tokenizer."""
    needs_torchao()
    from transformers import AutoTokenizer

    from samba_hf.cli import default_model_path

    int8, folder = int8_default_model(), tmp_path_factory.mktemp("int8")
    int8.save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(folder)
    return int8, folder


def test_a_torchao_int8_model_reads_its_int8_weights_in_the_kernel_and_agrees_with_float32(monkeypatch):
    """torchao's int8 weight-only weights (transformers' TorchAoConfig) are tensor subclasses that say float32: the C
    kernel must never read them as floats (it crashed the process so). The kernel reads their int8 values with one
    scale per row instead. The embedded default, quantized, generates; every product the kernel takes gets a plain
    tensor (the int8 values) and a scale; teacher-forced on float32's own greedy text (256 tokens), the top-1 token
    agrees with float32's at 99% of the positions or more."""
    needs_torchao()
    from transformers import AutoModelForCausalLM

    from samba_hf.cli import default_model_path

    read = []

    def counted(x, weight, bias, scale=None):
        read.append((type(weight), weight.dtype, scale is not None))
        return KERNEL(x, weight, bias, scale)

    monkeypatch.setattr(linear_samba, "gemv_cpu", counted)
    full = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    int8 = int8_default_model()
    quantized = [m for m in int8.modules() if isinstance(m, SambaLinear) and type(m.weight) is not nn.Parameter]
    assert quantized, "torchao quantized no linear layer"
    ids = torch.tensor([[1, 450, 496, 1735]])
    with torch.no_grad():
        text = full.generate(ids, max_new_tokens=256, min_new_tokens=256, do_sample=False, eos_token_id=None)
        read.clear()
        int8.generate(ids, max_new_tokens=8, do_sample=False)
        assert read and all(kind in (nn.Parameter, torch.Tensor) for kind, _, _ in read), set(read)
        assert (torch.Tensor, torch.int8, True) in read  # the int8 values, with their scales
        top = [model(text).logits[0, ids.shape[1] - 1 : -1].argmax(-1) for model in (full, int8)]
    assert (top[0] == top[1]).float().mean() >= 0.99


def test_a_torchao_int8_model_saves_and_reloads_as_int8(saved_int8):
    """save_pretrained writes the int8 values and scales (under half of float32's bytes here, the tied embedding
    staying float32); from_pretrained, installed or from the folder's own code, gives back the same int8 weights,
    and logits equal to the quantized model's before saving."""
    from transformers import AutoModelForCausalLM

    int8, folder = saved_int8
    full_bytes = 4 * sum(p.numel() for p in int8.parameters())
    assert (folder / "model.safetensors").stat().st_size < full_bytes / 2
    ids = torch.tensor([[1, 450, 496, 1735, 13, 7]])
    with torch.no_grad():
        expected = int8(ids).logits
    for remote in (False, True):
        again = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote).eval()
        assert again.config.quantization_config is not None
        pairs = [
            (m.weight, dict(again.named_modules())[name].weight)
            for name, m in int8.named_modules()
            if isinstance(m, SambaLinear) and type(m.weight) is not nn.Parameter
        ]
        assert pairs
        for before, after in pairs:
            assert type(after) is type(before)
            assert torch.equal(after.qdata, before.qdata) and torch.equal(after.scale, before.scale)
        with torch.no_grad():
            assert torch.equal(again(ids).logits, expected)


def test_the_cli_generates_from_a_torchao_int8_folder_and_refuses_to_quantize_it_again(saved_int8, capsys):
    """`samba-hf generate --model FOLDER` on a folder saved torchao-quantized: its weights pass the folder checks
    (read as the layers' weights) and the text is the quantized model's own greedy text. `--quantize int8` on it is
    one line (torchao failed on a view of its own int8 weights, a traceback)."""
    from test_cli import one_line_error
    from transformers import AutoTokenizer

    from samba_hf_cli import main

    int8, folder = saved_int8
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = "The assert statement"
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        expected = int8.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    argv = ["generate", prompt, "--model", str(folder), "--max-new-tokens", "6", "--dtype", "float32"]
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip("\n") == prompt + tokenizer.decode(expected[0, ids.shape[1] :])
    one_line_error(capsys, [*argv, "--quantize", "int8"], "are torchao-quantized already", "leave out --quantize")


def test_torchao_int8_then_generate_never_crashes_the_process_on_avx512():
    """The case #50 found: on a CPU with AVX-512, `TorchAoConfig(Int8WeightOnlyConfig())` then `generate` ended the
    process with a segmentation fault (the C kernel read the int8 tensor subclass as float32). Run as the issue
    ran it, in a process of its own, so that a crash is this test's failure and not the suite's end."""
    needs_torchao()
    code = """if True:
        import torch
        from torchao.quantization import Int8WeightOnlyConfig
        from transformers import AutoModelForCausalLM, TorchAoConfig
        from samba_hf.cli import default_model_path
        from samba_hf import cpu_kernels_samba
        model = AutoModelForCausalLM.from_pretrained(
            default_model_path(), quantization_config=TorchAoConfig(Int8WeightOnlyConfig())
        )
        out = model.generate(torch.tensor([[1, 450, 496, 1735]]), max_new_tokens=16, do_sample=False)
        print(out.shape[1], cpu_kernels_samba.gemv_available())
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"exit status {result.returncode} (-11: a segmentation fault)\n{result.stderr}"
    assert result.stdout.split()[0] == "20"


@requires_kernel
def test_the_kernel_on_torchao_int8_weights_equals_a_float64_product_of_them():
    """1 to 16 tokens, rows in blocks of 3 and a part, a tail past whole blocks of 16 values: within float32
    rounding of float64's product of scale * q."""
    needs_torchao()
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    layer = nn.Sequential(SambaLinear(100, 37))
    quantize_(layer, Int8WeightOnlyConfig())
    q, scale = layer[0].weight.qdata, layer[0].weight.scale.reshape(-1)
    expected_weight = q.double() * scale.double()[:, None]
    for tokens in range(1, MAX_TOKENS + 1):
        x = torch.randn(tokens, 100)
        with torch.no_grad():
            y = layer(x)
        expected = x.double() @ expected_weight.T + layer[0].bias.double()
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_generate_quantize_int8_without_torchao_says_so_in_one_line(capsys, monkeypatch):
    """`samba-hf generate --quantize int8` where torchao is not installed: one line naming what to install."""
    from test_cli import one_line_error

    monkeypatch.setitem(sys.modules, "torchao", None)  # (`import torchao` raises ImportError)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    argv = ["generate", "Samba is", "--max-new-tokens", "4", "--quantize", "int8"]
    one_line_error(capsys, argv, "--quantize int8 needs torchao", "pip install 'samba-hf[quantize]'")


@requires_kernel
def test_generate_quantize_int8_with_torchao_generates_from_int8_weights(capsys, monkeypatch):
    """With torchao: every samba-hf linear layer of the embedded default is quantized (the output layer is not), the
    kernel reads their int8 values, and the text is float32's for its first tokens (the 99% teacher-forced agreement
    is tested above)."""
    needs_torchao()
    from samba_hf_cli import main

    scales = []
    monkeypatch.setattr(
        linear_samba, "gemv_cpu", lambda x, w, b, s=None: scales.append(s is not None) or KERNEL(x, w, b, s)
    )
    argv = ["generate", "Samba is a hybrid model that", "--max-new-tokens", "6", "--dtype", "float32"]
    assert main(argv) == 0
    full = capsys.readouterr().out
    assert main([*argv, "--quantize", "int8"]) == 0
    int8 = capsys.readouterr().out
    assert any(scales) and int8.split()[:8] == full.split()[:8]


def test_generate_quantize_takes_int8_only_and_says_so_in_one_line(capsys):
    """A format torchao could give but samba-hf's kernel does not read (int4) is argparse's refusal, in samba-hf's
    one-line form, naming the choice."""
    from samba_hf_cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "Samba is", "--quantize", "int4"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("samba-hf: error: argument --quantize: invalid choice: 'int4'"), err
