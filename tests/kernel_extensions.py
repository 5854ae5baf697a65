"""Stand-ins for the two compiled CUDA extensions that Triton's interpreter cannot run: mamba-ssm's
`selective_scan_cuda` and causal-conv1d's `causal_conv1d_cuda`. Each is built from the package's own reference
function (`selective_scan_ref`, `causal_conv1d_ref`, `causal_conv1d_update_ref`) and answers the extension's calls
with the argument order and in-place outputs the package's Python wrappers use, so those wrappers
(`selective_scan_fn`, `causal_conv1d_fn`, `causal_conv1d_update`) run for real on top. Nothing else of either
package is stood in: their Triton kernels run under the interpreter as they are.

`install()` puts both into sys.modules, for the rest of the process (causal-conv1d registers torch operators when it
is imported, so it is imported once, on top of the stand-in)."""

import sys
import types

import torch
import torch.nn.functional as F


def _selective_scan_ref():
    """mamba-ssm's reference scan, loaded without mamba_ssm/__init__ (see ssm_samba._import_mamba_ssm). Its module
    imports `selective_scan_cuda`, so this is called with the stand-in already in sys.modules."""
    from samba_hf.ssm_samba import _import_mamba_ssm

    return _import_mamba_ssm("ops.selective_scan_interface").selective_scan_ref


def selective_scan_cuda() -> types.ModuleType:
    module = types.ModuleType("selective_scan_cuda")

    def fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
        # u, delta (b, d, l); B, C (b, 1, n, l) as the wrapper passes them. Returns out, the chunk states x
        # (b, d, chunks, 2n) of which the wrapper reads x[:, :, -1, 1::2] as the last state, and out * silu(z).
        out, last = _selective_scan_ref()(
            u, delta, A, B, C, D, None, delta_bias, delta_softplus, return_last_state=True
        )
        x = torch.zeros(*last.shape[:2], 1, 2 * last.shape[-1], dtype=torch.float32)
        x[:, :, -1, 1::2] = last
        if z is None:
            return out, x
        return out, x, (out.float() * F.silu(z.float())).to(out.dtype)

    def bwd(u, delta, A, B, C, D, z, delta_bias, dout, x, out, dz, delta_softplus, recompute_out_z):
        inputs = [
            t.detach().requires_grad_() if t is not None else None for t in (u, delta, A, B, C, D, z, delta_bias)
        ]
        with torch.enable_grad():
            y = _selective_scan_ref()(*inputs, delta_softplus=delta_softplus)
            present = [t for t in inputs if t is not None]
            grads = iter(torch.autograd.grad(y, present, dout))
        du, ddelta, dA, dB, dC, dD, dz, ddelta_bias = (next(grads) if t is not None else None for t in inputs)
        return (du, ddelta, dA, dB, dC, dD, ddelta_bias, *([dz] if z is not None else []))

    module.fwd, module.bwd = fwd, bwd
    return module


def causal_conv1d_cuda() -> types.ModuleType:
    module = types.ModuleType("causal_conv1d_cuda")

    def activation(silu):
        return "silu" if silu else None

    def causal_conv1d_ref(*args, **kwargs):  # imported when called: the package imports this module first
        from causal_conv1d.causal_conv1d_interface import causal_conv1d_ref

        return causal_conv1d_ref(*args, **kwargs)

    def causal_conv1d_update_ref(*args, **kwargs):
        from causal_conv1d.causal_conv1d_interface import causal_conv1d_update_ref

        return causal_conv1d_update_ref(*args, **kwargs)

    def causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, out, final_states_out, silu):
        result = causal_conv1d_ref(
            x, weight, bias, initial_states, final_states_out is not None, final_states_out, activation(silu), seq_idx
        )
        out.copy_(result[0] if final_states_out is not None else result)

    def causal_conv1d_update(x, conv_state, weight, bias, out, silu, cache_seqlens, conv_state_indices):
        assert conv_state_indices is None
        out.copy_(causal_conv1d_update_ref(x, conv_state, weight, bias, activation(silu), cache_seqlens))

    def causal_conv1d_bwd(
        x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, dweight, dbias, dinitial_states, silu
    ):
        # written out (a custom operator runs below autograd): out[t] = bias + sum_k weight[:, k] x[t - (K - 1) + k]
        assert seq_idx is None and initial_states is None and not silu
        width = weight.shape[-1]
        padded = F.pad(x.float(), (width - 1, 0))
        windows = padded.unfold(-1, width, 1)  # (b, d, l, K)
        dweight.copy_(torch.einsum("bdl,bdlk->dk", dout.float(), windows))
        if dbias is not None:
            dbias.copy_(dout.float().sum((0, 2)))
        grad_padded = F.conv_transpose1d(dout.float(), weight.float()[:, None, :], groups=weight.shape[0])
        dx.copy_(grad_padded[..., width - 1 :])

    module.causal_conv1d_fwd = causal_conv1d_fwd
    module.causal_conv1d_update = causal_conv1d_update
    module.causal_conv1d_bwd = causal_conv1d_bwd
    return module


def install():
    sys.modules.setdefault("selective_scan_cuda", selective_scan_cuda())
    sys.modules.setdefault("causal_conv1d_cuda", causal_conv1d_cuda())
