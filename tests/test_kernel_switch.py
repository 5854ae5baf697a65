"""The kernel switch (`kernel_implementation`; docs/model.md, "Choosing the kernels") on the CPU: each path it offers
runs where it is chosen (the calls are counted) and gives the numbers of the others; what is unknown, or cannot run
here, is one error that names the choices. Its CUDA paths are tested under Triton's interpreter in
tests/test_kernels.py."""

import json

import pytest
import torch
from conftest import returned_cache, tiny_model
from test_cli import one_line_error
from test_mamba2 import tiny_mamba2
from test_sambay import tiny_model as tiny_sambay
from transformers import AutoModelForCausalLM

import samba_hf_cli
from samba_hf import cpu_kernels_samba, linear_samba, ssm_samba
from samba_hf.kernels_samba import KERNEL_IMPLEMENTATIONS, resolve_kernel_implementation
from samba_hf.linear_samba import SambaLinear

CHOICES = "'auto', 'pytorch', 'samba', 'mamba_ssm'"


def counted(monkeypatch) -> dict:
    """Count the calls of each CPU path from here on: the scans, the conv's multiply-adds and its module, the
    matrix-vector kernel."""
    calls = {}

    def count(owner, name):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    for name in ("selective_scan_cpu", "selective_scan_pytorch", "ssd_scan_pytorch", "depthwise_causal_conv"):
        count(ssm_samba, name)
    count(linear_samba, "gemv_cpu")
    count(torch.nn.Conv1d, "forward")
    return calls


def prompt_and_steps(model, ids) -> torch.Tensor:
    """Logits of a padded prompt, then of two one-token steps from its cache (where the C matrix-vector kernel
    serves), concatenated."""
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        cache, logits = returned_cache(out), [out.logits]
        for step in range(2):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(ids[:, -1 - step :][:, :1], attention_mask=mask, cache=cache, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("kind", ["samba", "mamba2"])
def test_each_choice_runs_its_own_cpu_path_and_gives_the_same_numbers(monkeypatch, kind):
    model = tiny_model(seed=2) if kind == "samba" else tiny_mamba2("megatron", seed=2)
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    scan = "selective_scan_cpu" if kind == "samba" else "ssd_scan_pytorch"  # Mamba-2's CPU scan is its chunked one
    reference_scan = "selective_scan_pytorch" if kind == "samba" else "ssd_scan_pytorch"
    gemv = cpu_kernels_samba.gemv_available()  # on CPUs with AVX-512 and a C compiler
    expected = {
        "auto": {scan, "depthwise_causal_conv", *["gemv_cpu"] * gemv},
        "samba": {scan, "depthwise_causal_conv", *["gemv_cpu"] * gemv},
        "pytorch": {reference_scan, "forward"},
        "{'scan': 'pytorch'}": {reference_scan, "depthwise_causal_conv", *["gemv_cpu"] * gemv},
        "{'conv': 'pytorch', 'linear': 'pytorch'}": {scan, "forward"},
    }
    logits = {}
    for choice in ("auto", "samba", "pytorch", {"scan": "pytorch"}, {"conv": "pytorch", "linear": "pytorch"}):
        model.set_kernel_implementation(choice)
        assert model.config.kernel_implementation == choice
        calls = counted(monkeypatch)
        logits[str(choice)] = prompt_and_steps(model, ids)
        monkeypatch.undo()
        assert set(calls) == expected[str(choice)], (choice, calls)
    for choice, got in logits.items():
        torch.testing.assert_close(got, logits["pytorch"], rtol=0, atol=2e-5, msg=choice)


def test_the_switch_reaches_every_layer_of_samba_and_sambay():
    for model in (tiny_model(seed=1), tiny_sambay(seed=1)[0]):
        model.set_kernel_implementation({"scan": "pytorch", "linear": "pytorch"})
        mixers = [m for m in model.modules() if isinstance(m, ssm_samba_mixer())]
        linears = [m for m in model.modules() if isinstance(m, SambaLinear)]
        assert mixers and linears
        assert {(m.scan_kernel, m.conv_kernel) for m in mixers} == {("pytorch", "auto")}
        assert {m.kernel for m in linears} == {"pytorch"}


def ssm_samba_mixer():
    from samba_hf.modeling_samba import SambaStateSpaceMixer

    return SambaStateSpaceMixer


def test_unknown_choices_are_one_error_naming_the_choices():
    from samba_hf import SambaConfig

    with pytest.raises(ValueError, match=f"SambaConfig: kernel_implementation is 'fast', which is none of {CHOICES}"):
        SambaConfig(kernel_implementation="fast")
    with pytest.raises(ValueError, match=r"kernel_implementation\['scan'\] is 'fast'"):
        SambaConfig(kernel_implementation={"scan": "fast"})
    with pytest.raises(ValueError, match="has no part 'scn': the parts are 'scan', 'conv', 'linear'"):
        SambaConfig(kernel_implementation={"scn": "pytorch"})
    with pytest.raises(ValueError, match="must be one of"):
        resolve_kernel_implementation(2)
    model = tiny_model()
    model.set_kernel_implementation("pytorch")
    with pytest.raises(ValueError, match=CHOICES):
        model.set_kernel_implementation("triton")
    assert model.config.kernel_implementation == "pytorch"  # a refused choice changes nothing
    assert model.model.layers[0].mamba.scan_kernel == "pytorch"


@pytest.mark.parametrize("choice", ["mamba_ssm", {"conv": "mamba_ssm"}])
def test_a_choice_this_device_cannot_run_is_refused_when_set_and_when_called(choice):
    model = tiny_model()
    with pytest.raises(ValueError, match=f"run on CUDA tensors only, and this one is on cpu.*{CHOICES}"):
        model.set_kernel_implementation(choice)
    assert model.config.kernel_implementation == "auto"
    # a layer told so anyway (a model moved off the device it was checked for) refuses at the call, not silently
    model.model.layers[0].mamba.choose_kernels(resolve_kernel_implementation(choice))
    with pytest.raises(ValueError, match="run on CUDA tensors only"):
        model(torch.tensor([[5, 6, 7]]))


def test_from_pretrained_takes_the_choice_and_checks_it_and_save_keeps_it_out(tmp_path):
    model = tiny_model(seed=4)
    model.set_kernel_implementation("pytorch")
    model.save_pretrained(tmp_path)
    assert "kernel_implementation" not in json.loads((tmp_path / "config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, kernel_implementation={"scan": "pytorch"})
    assert loaded.config.kernel_implementation == {"scan": "pytorch"}
    assert loaded.model.layers[0].mamba.scan_kernel == "pytorch" and loaded.lm_head.kernel == "auto"
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.kernel_implementation == "auto"
    with pytest.raises(ValueError, match="run on CUDA tensors only"):
        AutoModelForCausalLM.from_pretrained(tmp_path, kernel_implementation="mamba_ssm")
    with pytest.raises(ValueError, match=CHOICES):
        AutoModelForCausalLM.from_pretrained(tmp_path, kernel_implementation="fast")


def test_a_tensor_subclass_weight_never_reaches_the_c_kernel(monkeypatch):
    """A quantized weight (torchao's is a tensor subclass that says float32) would be read as floats by the C kernel:
    only a plain tensor goes there."""

    class Subclass(torch.Tensor):
        pass

    layer = SambaLinear(16, 8, bias=False).eval()
    plain = SambaLinear(16, 8, bias=False).eval()
    plain.weight = torch.nn.Parameter(layer.weight.detach().clone())
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone().as_subclass(Subclass))
    calls = counted(monkeypatch)
    x = torch.randn(1, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x).as_subclass(torch.Tensor), plain(x), rtol=0, atol=1e-6)
    assert calls.get("gemv_cpu", 0) == (1 if cpu_kernels_samba.gemv_available() else 0)  # the plain layer's call


def test_the_cli_takes_kernels_and_says_in_one_line_what_cannot_run(capsys):
    assert samba_hf_cli.KERNEL_CHOICES == KERNEL_IMPLEMENTATIONS
    argv = ["generate", "Samba is", "--max-new-tokens", "6", "--dtype", "float32"]
    texts = []
    for kernels in ("auto", "pytorch"):
        assert samba_hf_cli.main([*argv, "--kernels", kernels]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("Samba is")
    one_line_error(capsys, [*argv, "--kernels", "mamba_ssm"], "--kernels mamba_ssm:", "CUDA tensors only", CHOICES)
    with pytest.raises(SystemExit) as exit_:  # argparse's refusal, in samba-hf's one-line form
        samba_hf_cli.main([*argv, "--kernels", "fast"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"samba-hf: error: argument --kernels: invalid choice: 'fast' (choose from {CHOICES}) "
        "(see `samba-hf generate --help`)"
    ]
