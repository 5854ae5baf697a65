"""The kernel adapters of `ssm_samba`, checked on CPU with stand-ins that follow the documented calling conventions
of mamba-ssm (channels-first layout, in-place state update) and causal-conv1d (weight (d, width), in-place conv state). What the real kernels compute is checked by
`tests/test_gpu.py` on a machine with a GPU and mamba-ssm."""

import pytest
import torch

from samba_hf import ssm_samba

from conftest import tiny_model
from test_reference_models import float64_recurrence


def fake_selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                           return_last_state=False):
    # mamba-ssm layout: u, delta, z (b, d, l); B, C (b, n, l); dtypes: delta, B, C as u
    assert u.dtype == delta.dtype == B.dtype == C.dtype and A.dtype == torch.float32
    assert delta_bias is None and not delta_softplus
    b, d, _ = u.shape
    y, h = float64_recurrence(u.transpose(1, 2), delta.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2),
                              D if D is not None else torch.zeros(d), z.transpose(1, 2), torch.zeros(b, d, A.shape[1]))
    y = y.transpose(1, 2).to(u.dtype)
    return (y, h.float()) if return_last_state else y


def fake_selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    # one token: state (b, d, n) updated in place; x, dt, z (b, d); B, C (b, n)
    assert dt_bias is None and not dt_softplus
    y, h = float64_recurrence(x[:, None], dt[:, None], A, B[:, None], C[:, None], D, z[:, None], state)
    state.copy_(h)
    return y[:, 0].to(x.dtype)


def fake_causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                          final_states_out=None, activation=None):
    # x (b, d, l), weight (d, width): zero left padding, output (b, d, l)
    assert x.is_contiguous() and weight.dim() == 2 and activation is None
    width = weight.shape[1]
    padded = torch.nn.functional.pad(x.double(), (width - 1, 0))
    out = sum(padded[..., k : k + x.shape[-1]] * weight[:, k, None].double() for k in range(width))
    return (out + (0 if bias is None else bias.double()[:, None])).to(x.dtype)


def fake_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    # x (b, d); conv_state (b, d, state_len >= width - 1) shifted left in place by one, x written last
    width = weight.shape[1]
    assert conv_state.shape[-1] >= width - 1 and activation is None
    conv_state.copy_(torch.cat([conv_state[..., 1:], x[..., None]], dim=-1))
    out = (conv_state[..., -width:].double() * weight.double()).sum(-1)
    return (out + (0 if bias is None else bias.double())).to(x.dtype)


@pytest.fixture
def fake_kernels(monkeypatch):
    calls = {"scan": 0, "step": 0, "conv": 0, "conv_step": 0}

    def counting(kind, fn):
        def wrapped(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(ssm_samba, "_KERNELS", (counting("scan", fake_selective_scan_fn),
                                                counting("step", fake_selective_state_update)))
    monkeypatch.setattr(ssm_samba, "_CONV_KERNELS", (counting("conv", fake_causal_conv1d_fn),
                                                     counting("conv_step", fake_causal_conv1d_update)))
    monkeypatch.setattr(ssm_samba, "_kernel_device", lambda tensor: True)
    return calls


def test_model_routes_prefill_and_decode_through_the_kernels(fake_kernels):
    model = tiny_model(seed=3)
    ids = torch.randint(3, 97, (2, 20))
    with torch.no_grad():
        kernel_full = model(ids).logits
        assert fake_kernels["scan"] == fake_kernels["conv"] == 2  # one call per Mamba layer
        out = model(ids[:, :12], use_cache=True)
        steps = [out.logits]
        for t in range(12, 20):
            steps.append(model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True).logits)
        assert fake_kernels["step"] == fake_kernels["conv_step"] == 2 * 8
        # a multi-token continuation from a cached state cannot use selective_scan_fn: PyTorch path
        before = fake_kernels["scan"]
        model(ids[:, :3], past_key_values=out.past_key_values, use_cache=True)
        assert fake_kernels["scan"] == before
    ssm_samba._kernel_device = lambda tensor: False  # monkeypatch restores it
    with torch.no_grad():
        pytorch_full = model(ids).logits
    assert (kernel_full - pytorch_full).abs().max() <= 1e-4
    assert (torch.cat(steps, dim=1) - pytorch_full).abs().max() <= 1e-4


def test_bf16_inputs_reach_the_kernel_in_one_dtype(fake_kernels):
    u = torch.randn(1, 6, 4).bfloat16()
    dt = torch.full((1, 6, 4), 0.1)  # float32, as the mixer computes it
    y, h = ssm_samba.selective_scan(u, dt, -torch.ones(4, 3), torch.randn(1, 6, 3), torch.randn(1, 6, 3),
                                    torch.ones(4), torch.randn(1, 6, 4).bfloat16())
    assert fake_kernels["scan"] == 1 and y.dtype == torch.bfloat16 and h.dtype == torch.float32


def test_adapter_wrapped_conv_skips_the_conv_kernel(fake_kernels):
    class WrappedConv(torch.nn.Conv1d):  # what an adapter library's wrapper looks like to the dispatch
        def forward(self, x):
            return super().forward(x) + 1.0

    model = tiny_model(seed=5)
    ids = torch.randint(3, 97, (1, 12))
    with torch.no_grad():
        base = model(ids).logits
        for layer in model.model.layers:
            if layer.layer_type == "linear_attention":
                plain = layer.mamba.conv1d
                wrapped = WrappedConv(plain.in_channels, plain.out_channels, plain.kernel_size[0],
                                      groups=plain.groups, padding=plain.padding[0])
                wrapped.load_state_dict(plain.state_dict())
                layer.mamba.conv1d = wrapped
        conv_calls = fake_kernels["conv"]
        wrapped_out = model(ids).logits
    assert fake_kernels["conv"] == conv_calls  # the module ran, not the kernel
    assert not torch.allclose(base, wrapped_out)
