"""The compiled CPU scan (`cpu_kernels_samba.selective_scan_cpu`): its backward against float64 autograd of the
recurrence written out step by step (`test_reference_models.float64_recurrence`), its thread split, padding, the whole
model against the PyTorch scan, and the fallback where no compiler is found. The forward against float64 is in
test_reference_models.py (both scans)."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import tiny_model
from test_reference_models import float64_recurrence

from samba_hf import cpu_kernels_samba, ssm_samba


def require_compiled_scan():
    """Skip where there is no C compiler at all; where there is one, the scan must have built."""
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler on this machine: the PyTorch scan runs instead")
    assert cpu_kernels_samba._cpu_scan_library() is not None, "the compiled CPU scan did not build"


@pytest.fixture(autouse=True)
def compiled(request):
    if "tmp_path" not in request.fixturenames:  # the subprocess tests check the build and the fallback themselves
        require_compiled_scan()


def inputs(batch=2, seq_len=150, d_inner=37, d_state=5, seed=0):
    """d_inner 37: two whole blocks of 16 channels and a partial one; 150 steps: three backward segments of 64."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        u=torch.randn(batch, seq_len, d_inner, generator=g),
        dt=torch.nn.functional.softplus(torch.randn(batch, seq_len, d_inner, generator=g) - 2),
        A=-torch.exp(torch.randn(d_inner, d_state, generator=g)),
        B=torch.randn(batch, seq_len, d_state, generator=g),
        C=torch.randn(batch, seq_len, d_state, generator=g),
        D=torch.randn(d_inner, generator=g),
        z=torch.randn(batch, seq_len, d_inner, generator=g),
        h0=torch.randn(batch, d_inner, d_state, generator=g),
    )


@pytest.mark.parametrize("seq_len", [1, 64, 150])
@pytest.mark.parametrize("optional", [("D", "z", "h0"), ()], ids=["with-D-z-h0", "without"])
def test_gradients_match_float64_autograd(optional, seq_len):
    x = inputs(seq_len=seq_len)
    for name in ("D", "z", "h0"):
        if name not in optional:
            x[name] = None
    ours = {k: v.clone().requires_grad_() for k, v in x.items() if v is not None}
    ref = {k: v.double().requires_grad_() for k, v in x.items() if v is not None}
    y, h = cpu_kernels_samba.selective_scan_cpu(**ours)
    ref_inputs = {**ref, "h0": ref.pop("h0", torch.zeros(2, 37, 5, dtype=torch.float64))}
    y_ref, h_ref = float64_recurrence(**{k: ref_inputs.get(k) for k in ("u", "dt", "A", "B", "C", "D", "z", "h0")})
    g = torch.Generator().manual_seed(1)
    grad_y, grad_h = torch.randn(y.shape, generator=g), torch.randn(h.shape, generator=g)
    ((y * grad_y).sum() + (h * grad_h).sum()).backward()
    ((y_ref * grad_y.double()).sum() + (h_ref * grad_h.double()).sum()).backward()
    ref_grads = {**{k: v.grad for k, v in ref.items()}, "h0": ref_inputs["h0"].grad}
    for name, tensor in ours.items():
        expected = ref_grads[name]
        scale = expected.abs().max().item()
        assert (tensor.grad.double() - expected).abs().max().item() <= 1e-5 * scale, name


@pytest.mark.parametrize("optional", [("D", "z", "h0"), ()], ids=["with-D-z-h0", "without"])
def test_under_torch_compile_the_scan_is_one_operator_with_the_same_values_and_gradients(optional):
    """fullgraph=True: dynamo keeps the C scan as `torch.ops.samba_hf.selective_scan_cpu` (it cannot trace ctypes),
    forward and backward equal the eager scan's."""
    x = {k: (v if k in optional or k in "uAdtBC" else None) for k, v in inputs(seq_len=70).items()}
    eager = {k: v.clone().requires_grad_() for k, v in x.items() if v is not None}
    compiled = {k: v.clone().requires_grad_() for k, v in x.items() if v is not None}

    def loss(**tensors):
        y, h = ssm_samba.selective_scan(**tensors)
        return (y * y.detach().sign()).sum() + h.square().sum()

    graph_ops = []

    def backend(gm, example_inputs):
        graph_ops.extend(str(node.target) for node in gm.graph.nodes)
        return gm

    loss(**eager).backward()
    torch.compile(loss, fullgraph=True, backend="aot_eager")(**compiled).backward()
    for name in eager:
        assert torch.allclose(compiled[name].grad, eager[name].grad, rtol=1e-6, atol=1e-6), name
    torch.compile(loss, fullgraph=True, backend=backend)(**compiled)
    assert "samba_hf.selective_scan_cpu.default" in graph_ops
    with torch.no_grad():
        y, h = torch.compile(ssm_samba.selective_scan, fullgraph=True)(**x)
        y_eager, h_eager = ssm_samba.selective_scan(**x)
    assert torch.equal(y, y_eager) and torch.equal(h, h_eager)


def test_the_scan_operator_passes_torch_opcheck():
    """Schema, fake (meta) implementation and autograd registration, as torch.library checks them."""
    x = inputs(seq_len=70)
    args = [x[k] for k in ("u", "dt", "A", "B", "C", "D", "z", "h0")]
    torch.library.opcheck(torch.ops.samba_hf.selective_scan_cpu, (*args, False))
    torch.library.opcheck(torch.ops.samba_hf.selective_scan_cpu, (*[a.clone().requires_grad_() for a in args], True))
    torch.library.opcheck(torch.ops.samba_hf.selective_scan_cpu, (*args[:5], None, None, None, False))


def test_only_the_inputs_that_need_a_gradient_get_one():
    x = inputs()
    x["dt"].requires_grad_()
    y, _ = cpu_kernels_samba.selective_scan_cpu(**x)
    (grad,) = torch.autograd.grad(y.sum(), [x["dt"]])
    assert grad.shape == x["dt"].shape and torch.isfinite(grad).all()
    assert all(v.grad is None for k, v in x.items() if k != "dt")


def test_threads_split_channels_without_changing_results(monkeypatch):
    x = {k: v.requires_grad_() for k, v in inputs().items()}
    results = []
    for threads in (1, 3):
        monkeypatch.setattr(cpu_kernels_samba, "_scan_threads", lambda *shape, n=threads: n)
        y, h = cpu_kernels_samba.selective_scan_cpu(**x)
        grads = torch.autograd.grad(y.square().sum() + h.sum(), list(x.values()))
        results.append((y, h, grads))
    (y1, h1, g1), (y3, h3, g3) = results
    assert torch.equal(y1, y3) and torch.equal(h1, h3)  # each channel's steps are the same whatever the split
    for a, b in zip(g1, g3):  # B and C sum the per-thread slices in another order
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seq_len", [2, 9, 16])
def test_a_recording_forward_keeps_every_state_in_one_call_with_the_one_token_steps_numbers(seq_len, monkeypatch):
    """A check of drafted tokens keeps the state after each token (for `crop`): on a CPU one call of the C scan keeps
    them all (`selective_scan_cpu_states`), where it ran one call per token. Each state and output equals, bit for
    bit, what one-token steps from the state before give (what plain decoding computes), and the float64
    recurrence to float32 rounding."""
    x = inputs(seq_len=seq_len)
    per_token = {name: x[name] for name in ("u", "dt", "B", "C", "z")}
    calls = []
    states_call = cpu_kernels_samba._cpu_scan_library().samba_scan_forward_states
    monkeypatch.setattr(
        cpu_kernels_samba._cpu_scan_library(),
        "samba_scan_forward_states",
        lambda *a: calls.append(1) or states_call(*a),
        raising=False,
    )
    with torch.no_grad():
        y, last, states = ssm_samba.scan_keeping_states(
            ssm_samba.selective_scan, x["h0"], per_token, A=x["A"], D=x["D"], kernel="auto"
        )
        assert len(calls) == 1 and len(states) == seq_len
        h = x["h0"]
        for t in range(seq_len):
            step = {name: value[:, t : t + 1] for name, value in per_token.items()}
            y_t, h = ssm_samba.selective_scan(**step, A=x["A"], D=x["D"], h0=h)
            assert torch.equal(y[:, t : t + 1], y_t) and torch.equal(states[t], h), t
    assert torch.equal(last, h)
    expected_y, expected_h = float64_recurrence(**x)
    torch.testing.assert_close(y.double(), expected_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last.double(), expected_h, rtol=1e-4, atol=1e-4)


def test_zero_step_leaves_the_state_exactly_as_it_was():
    """Padding: dt = 0 neither decays nor feeds the state, bit for bit, so a padded row ends where it started."""
    x = inputs(seq_len=20)
    x["dt"][:, 5:] = 0.0
    _, h_full = cpu_kernels_samba.selective_scan_cpu(**x)
    _, h_five = cpu_kernels_samba.selective_scan_cpu(
        **{k: v[:, :5] if v.dim() == 3 and k != "h0" else v for k, v in x.items()}
    )
    assert torch.equal(h_full, h_five)


def test_model_matches_the_pytorch_scan(monkeypatch):
    """The whole model, forward and gradients, through the compiled scan and through the PyTorch one."""
    model = tiny_model(num_hidden_layers=4)
    ids = torch.randint(3, 97, (2, 40))
    runs = []
    for library in (cpu_kernels_samba._cpu_scan_library(), False):
        monkeypatch.setattr(cpu_kernels_samba, "_CPU_SCAN", library)
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        runs.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logits_c, grads_c), (logits_p, grads_p) = runs
    torch.testing.assert_close(logits_c, logits_p, rtol=1e-5, atol=1e-5)
    for name in grads_c:
        torch.testing.assert_close(grads_c[name], grads_p[name], rtol=1e-4, atol=1e-6, msg=name)


SNIPPET = """
import torch
from samba_hf import cpu_kernels_samba, ssm_samba
g = torch.Generator().manual_seed(0)
u = torch.randn(1, 9, 4, generator=g)
dt = torch.full((1, 9, 4), 0.1)
y, h = ssm_samba.selective_scan(
    u, dt, -torch.ones(4, 3), torch.randn(1, 9, 3, generator=g), torch.randn(1, 9, 3, generator=g)
)
print("library", cpu_kernels_samba._CPU_SCAN is not False)
print("finite", bool(torch.isfinite(y).all()))
"""


def run_snippet(tmp_path, **env):
    cache = tmp_path / "cache"
    result = subprocess.run(
        [sys.executable, "-c", SNIPPET],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SAMBA_HF_CACHE": str(cache), **env},
    )
    assert result.returncode == 0, result.stderr
    return result, cache


def test_no_compiler_falls_back_to_the_pytorch_scan(tmp_path):
    result, cache = run_snippet(tmp_path, CC=str(tmp_path / "no-such-compiler"))
    assert "library False" in result.stdout and "finite True" in result.stdout
    assert "the compiled CPU scan is unavailable" in result.stderr and "using the PyTorch scan" in result.stderr
    assert not cache.exists() or not any(cache.rglob("*.so"))


def test_environment_variable_selects_the_pytorch_scan(tmp_path):
    result, cache = run_snippet(tmp_path, SAMBA_HF_SCAN="pytorch")
    assert "library False" in result.stdout and not cache.exists()


def test_the_kernel_testing_switch_without_the_interpreter_is_ignored_with_a_warning(tmp_path):
    """SAMBA_HF_INTERPRET_KERNELS=1 sends CPU tensors to the CUDA kernels only under TRITON_INTERPRET=1; alone it
    would send them where nothing runs them, so it is ignored, with one line saying so, and the CPU scan runs."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", SNIPPET + "print('switch', ssm_samba.INTERPRET_KERNELS)\n"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "SAMBA_HF_INTERPRET_KERNELS": "1", "SAMBA_HF_CACHE": str(tmp_path)},
    )
    assert result.returncode == 0 and "switch False" in result.stdout and "finite True" in result.stdout
    assert "SAMBA_HF_INTERPRET_KERNELS is set without TRITON_INTERPRET=1; ignored" in result.stderr


def test_build_leaves_one_library_in_the_cache_and_reuses_it(tmp_path):
    require_compiled_scan()
    result, cache = run_snippet(tmp_path)
    assert "library True" in result.stdout
    built = sorted(p.name for p in cache.iterdir())
    assert len(built) == 1 and built[0].startswith("selective_scan_") and built[0].endswith(".so")  # no temp dirs
    mtime = (cache / built[0]).stat().st_mtime_ns
    run_snippet(tmp_path)
    assert sorted(p.name for p in cache.iterdir()) == built and (cache / built[0]).stat().st_mtime_ns == mtime


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "kernel_size, length, seq_len", [(4, 10, 10), (4, 13, 10), (4, 2, 2), (4, 4, 1), (4, 3, 1), (3, 7, 1), (2, 9, 4)]
)
def test_depthwise_causal_conv_equals_conv1d(kernel_size, length, seq_len, dtype):
    """The CPU conv (K shifted multiply-adds over a strided window) against nn.Conv1d in float64: prompts (the window
    is the prompt), continuations (cached inputs first), one-token steps, windows shorter than the kernel."""
    d = 6
    conv = torch.nn.Conv1d(d, d, kernel_size, groups=d, padding=kernel_size - 1).to(dtype)
    window = torch.randn(2, length, d, dtype=dtype).transpose(1, 2)  # (batch, d, length), as the mixer hands it over
    out = ssm_samba.causal_conv(conv, window, seq_len)
    reference = torch.nn.functional.conv1d(
        window.double(), conv.weight.double(), conv.bias.double(), padding=kernel_size - 1, groups=d
    )[..., :length][..., -seq_len:]
    assert out.dtype == dtype and out.shape == (2, d, seq_len)
    assert out.transpose(1, 2).is_contiguous()  # no transposing copy needed on the way out
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    assert (out.double() - reference).abs().max().item() <= tolerance


def test_depthwise_causal_conv_gradients_match_conv1d():
    conv = torch.nn.Conv1d(5, 5, 4, groups=5, padding=3).double()
    x = torch.randn(2, 11, 5, dtype=torch.float64, requires_grad=True)
    out = ssm_samba.causal_conv(conv, x.transpose(1, 2), 8)
    grads = torch.autograd.grad(out.square().sum(), [x, conv.weight, conv.bias])
    ref = conv(x.transpose(1, 2))[..., :11][..., -8:]
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, conv.weight, conv.bias])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_wrapped_conv_runs_as_a_module():
    """An adapter around the conv (anything but a plain nn.Conv1d) is called, so its change takes effect."""

    class Doubled(torch.nn.Conv1d):
        def forward(self, x):
            return 2 * super().forward(x)

    conv = Doubled(4, 4, 4, groups=4, padding=3)
    plain = torch.nn.Conv1d(4, 4, 4, groups=4, padding=3)
    plain.load_state_dict(conv.state_dict())
    window = torch.randn(1, 4, 9)
    torch.testing.assert_close(ssm_samba.causal_conv(conv, window, 9), 2 * ssm_samba.causal_conv(plain, window, 9))


def test_unknown_scan_choice_is_named_and_the_compiled_scan_runs(tmp_path):
    require_compiled_scan()
    result, _ = run_snippet(tmp_path, SAMBA_HF_SCAN="pyorch")
    assert "library True" in result.stdout
    assert "SAMBA_HF_SCAN='pyorch' is not 'compiled' or 'pytorch'" in result.stderr
