"""Shared helpers: tiny Samba configs and models, built on the fly (no downloads)."""

import os
import shutil
import subprocess

import pytest
import torch

from samba_hf import SambaConfig, SambaForCausalLM
from samba_hf.cache_samba import CACHE_NAME


def tiny_config(**overrides) -> SambaConfig:
    """A Samba small enough for CPU tests: window 8 so short sequences run several windows past it."""
    base = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=8,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if overrides.get("hybrid_override_pattern") is not None:
        del base["num_hidden_layers"]  # the pattern gives the layer count
    base.update(overrides)
    return SambaConfig(**base)


def tiny_model(seed: int = 0, **overrides) -> SambaForCausalLM:
    torch.manual_seed(seed)
    model = SambaForCausalLM(tiny_config(**overrides)).eval()
    randomize_norms(model)
    return model


@torch.no_grad()
def randomize_norms(model):
    """Norm weights start at 1; make them non-trivial so a mix-up of norms cannot go unnoticed."""
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            param.uniform_(0.5, 1.5)


def returned_cache(output):
    """The cache a forward or `generate(..., return_dict_in_generate=True)` returned, read under the installed
    transformers' field name: `cache` from 5.24 on (which warns on `past_key_values`), `past_key_values` in 5.23."""
    return getattr(output, CACHE_NAME)


def cache_kwarg(cache) -> dict:
    """`generate`'s keyword argument for a cache to continue from: `cache` from transformers 5.24 on (which warns on
    `past_key_values`), `past_key_values` in 5.23 (which does not know `cache`). A forward of samba-hf's models takes
    either name, so the tests pass `cache=` there."""
    return {CACHE_NAME: cache}


def counted_chunked_ssd(monkeypatch, skip_check: bool = True) -> list:
    """Count the chunked SSD's launches (`ssm_samba`'s kernels' `ssd_chunked_triton`, as loaded or as a test left
    them): one entry per call, its x's length. skip_check: its check before a compiled variant's first prompt is
    taken as passed (tests/test_kernels.py tests the check itself), so that only the calls made for the inputs are
    counted."""
    from samba_hf import ssm_samba

    if skip_check:
        monkeypatch.setattr(ssm_samba, "_check_chunked_ssd", lambda *args: None)
    monkeypatch.setattr(ssm_samba, "_CHUNKED_SSD_CHECKED", set())  # (skipped checks must not pass for later tests)
    kernels = ssm_samba.load_kernels()
    calls, real = [], kernels.ssd_chunked_triton
    monkeypatch.setattr(
        ssm_samba,
        "_KERNELS",
        kernels._replace(ssd_chunked_triton=lambda x, *rest: calls.append(x.shape[1]) or real(x, *rest)),
    )
    return calls


def held_bytes(cache) -> int:
    """Bytes of storage a cache's tensors hold: a view counts its whole storage, each storage once."""
    storages = {}
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            tensors += list(states.values()) if isinstance(states, dict) else []
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(1234)
    yield


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MB file system of its own (tmpfs), where mounting is allowed (root on Linux); skipped elsewhere."""

    disk = tmp_path / "disk"
    disk.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]
    if shutil.which("mount") is None or subprocess.run(command, capture_output=True).returncode:
        pytest.skip("cannot mount a small file system here")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)  # (lazy: a file a failed test left open)


def fill_disk(disk, leave: int) -> int:
    """Fills `disk` (the full_disk fixture's file system) with a file named "filler", but for `leave` bytes; its free
    blocks then."""
    stat = os.statvfs(disk)
    (disk / "filler").write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - leave))
    return os.statvfs(disk).f_bfree
