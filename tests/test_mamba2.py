"""Mamba-2 layers: the SSD scan against the per-token recurrence, NVIDIA's Mamba-2-Hybrid layout against an
independent float64 forward of Megatron's math and transformers' NemotronH, every generate mode against
recomputation, packed sequences, training and LoRA, and the presets' parameter counts.

Layouts: "megatron" is the Mamba-2-Hybrid's kind of stack (one sub-layer per block: Mamba-2, NoPE full attention,
GELU MLP); "samba2" is a Samba whose Mamba layers are Mamba-2 (window 8, SwiGLU after every mixer).
"""

import pytest
import torch
from conftest import cache_kwarg, held_bytes, randomize_norms, returned_cache, tiny_config
from megatron_reference import megatron_logits, nemotron_h_logits, random_megatron_state, tiny_geometry
from test_generation import (
    assert_left_padded_rows_equal_their_own_runs,
    compiled_generate_equals_eager,
    gen,
    no_cache_greedy,
)
from transformers import DataCollatorWithFlattening, DynamicCache
from transformers.cache_utils import DummyLayer, LinearAttentionLayer

from samba_hf import SambaConfig, SambaForCausalLM, ssm_samba
from samba_hf.conversion import megatron
from samba_hf.training import LORA_TARGET_MODULES, lora_config

TOL = 1e-4
MAMBA2 = dict(mamba_version=2, mamba_d_state=8, mamba2_head_dim=8, mamba2_n_groups=2, mamba2_chunk_size=8)
LAYOUTS = {
    "megatron": dict(
        MAMBA2,
        hybrid_override_pattern="M-M*-M",
        use_rope=False,
        sliding_window=None,
        mlp_gated=False,
        mlp_hidden_act="gelu",
        tie_word_embeddings=False,
        intermediate_size=64,
    ),
    "samba2": dict(MAMBA2),
}


def tiny_mamba2(layout: str = "megatron", seed: int = 0, **overrides) -> SambaForCausalLM:
    torch.manual_seed(seed)
    model = SambaForCausalLM(tiny_config(**{**LAYOUTS[layout], **overrides})).eval()
    randomize_norms(model)
    with torch.no_grad():  # steps from 1e-3 to 1 and decays that matter: every part of the scan is exercised
        for name, param in model.named_parameters():
            if name.endswith("dt_bias"):
                param.copy_(torch.linspace(-6.0, 0.5, param.numel()))
    return model


def float64_ssd(x, dt, A, B, C, D, h0):
    """The Mamba-2 recurrence token by token, in float64: S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T; y_t = S_t C_t
    + D x_t. x (b, t, h, p); dt (b, t, h); B, C (b, t, g, n); h0 (b, h, p, n)."""
    heads, groups = x.shape[2], B.shape[2]
    x, dt, A, D, S = x.double(), dt.double(), A.double(), D.double(), h0.double()
    B = B.double().repeat_interleave(heads // groups, dim=2)
    C = C.double().repeat_interleave(heads // groups, dim=2)
    ys = []
    for t in range(x.shape[1]):
        step = dt[:, t, :, None, None]
        S = torch.exp(step * A[:, None, None]) * S + step * x[:, t, ..., None] * B[:, t, :, None, :]
        ys.append((S * C[:, t, :, None, :]).sum(-1) + D[:, None] * x[:, t])
    return torch.stack(ys, dim=1), S


def ssd_inputs(batch=2, length=37, heads=6, head_dim=4, groups=3, d_state=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, heads, head_dim, generator=g)
    dt = torch.exp(torch.empty(batch, length, heads).uniform_(-7, 1, generator=g))  # 1e-3 .. 2.7
    A = -torch.empty(heads).uniform_(1, 16, generator=g)
    B, C = (torch.randn(batch, length, groups, d_state, generator=g) for _ in range(2))
    D = torch.randn(heads, generator=g)
    h0 = torch.randn(batch, heads, head_dim, d_state, generator=g)
    return x, dt, A, B, C, D, h0


@pytest.mark.parametrize("length, chunk", [(1, 8), (7, 8), (16, 8), (37, 8), (37, 128), (37, 1)])
@pytest.mark.parametrize("from_state", [False, True])
def test_ssd_scan_equals_the_per_token_recurrence(length, chunk, from_state):
    x, dt, A, B, C, D, h0 = ssd_inputs(length=length)
    h0 = h0 if from_state else None
    y, last = ssm_samba.ssd_scan_pytorch(x, dt, A, B, C, D, h0, chunk_size=chunk)
    y_ref, last_ref = float64_ssd(x, dt, A, B, C, D, torch.zeros_like(last) if h0 is None else h0)
    scale = y_ref.abs().max()
    assert (y - y_ref).abs().max() <= TOL * scale
    assert (last - last_ref).abs().max() <= TOL * last_ref.abs().max()
    assert last.dtype == torch.float32


def test_ssd_scan_of_bfloat16_inputs_keeps_a_float32_state():
    x, dt, A, B, C, D, h0 = ssd_inputs()
    y, last = ssm_samba.ssd_scan_pytorch(x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), D, h0)
    y_ref, _ = float64_ssd(x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), D, h0)
    assert y.dtype == torch.bfloat16 and last.dtype == torch.float32
    assert (y.double() - y_ref).abs().max() <= 1e-2 * y_ref.abs().max()


def test_a_zero_step_leaves_the_state_untouched():
    x, dt, A, B, C, D, h0 = ssd_inputs(length=5)
    dt[:, 2] = 0.0
    _, with_gap = ssm_samba.ssd_scan_pytorch(x, dt, A, B, C, D, h0)
    keep = [0, 1, 3, 4]
    _, without = ssm_samba.ssd_scan_pytorch(x[:, keep], dt[:, keep], A, B[:, keep], C[:, keep], D, h0)
    assert (with_gap - without).abs().max() <= 1e-5


def test_the_scan_never_builds_a_tokens_by_state_tensor():
    """The largest tensor any operation of the scan produces stays far below (tokens x heads x head_dim x d_state):
    it is O(chunk x chunk x heads) and O(heads x head_dim x d_state) whatever the length, besides the output."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.largest = max(self.largest, tensor.numel())
            return out

    x, dt, A, B, C, D, h0 = ssd_inputs(batch=1, length=2048, heads=4, head_dim=8, groups=2, d_state=16)
    with LargestOutput() as watch:
        ssm_samba.ssd_scan_pytorch(x, dt, A, B, C, D, h0, chunk_size=64)
    assert watch.largest == x.numel()  # the output; the full state history would be 16 times larger


def test_presets_build_the_released_parameter_counts():
    with torch.device("meta"):
        hybrid = SambaForCausalLM(SambaConfig.from_preset("mamba2-hybrid-8b"))
        pure = SambaForCausalLM(SambaConfig.from_preset("mamba2-8b"))
    assert sum(p.numel() for p in hybrid.parameters()) == 8_654_517_248
    assert sum(p.numel() for p in pure.parameters()) == 8_236_999_680
    assert hybrid.config.hybrid_pattern == "M-M-M--M-M*-M-M-M-M--M*-M-M-M-M-M*--M-M-M-M-M*-M--M-M-M-"
    assert [type(layer.mamba).__name__ for layer in pure.model.layers] == ["SambaMamba2Mixer"] * 56
    layer = hybrid.model.layers[1]
    assert layer.layer_type == "mlp" and not hasattr(layer, "post_attention_layernorm")
    assert not hasattr(layer.mlp, "gate_proj") and type(layer.mlp.act_fn).__name__ == "GELUActivation"


def test_config_reads_a_megatron_pattern_and_says_what_is_wrong():
    config = tiny_config(**LAYOUTS["megatron"])
    assert config.layer_types == [
        "linear_attention",
        "mlp",
        "linear_attention",
        "full_attention",
        "mlp",
        "linear_attention",
    ]
    assert config.num_hidden_layers == 6 and not config.mixer_mlp
    assert "hybrid_override_pattern" not in config.to_dict()  # an input only: layer_types is what is stored
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        tiny_config(hybrid_override_pattern="M+M")
    with pytest.raises(ValueError, match="must split evenly into `mamba2_n_groups`"):
        tiny_config(**{**MAMBA2, "mamba2_n_groups": 3})
    with pytest.raises(ValueError, match="multiple of `mamba2_head_dim`"):
        tiny_config(**{**MAMBA2, "mamba2_head_dim": 7})
    with pytest.raises(ValueError, match='"mlp" layers but `intermediate_size` is 0'):
        tiny_config(hybrid_override_pattern="M-", intermediate_size=0)
    with pytest.raises(ValueError, match="`mamba_version` must be 1"):
        tiny_config(mamba_version=3)


def in_memory_checkpoint(tensors: dict, args: dict) -> megatron.MegatronCheckpoint:
    """A MegatronCheckpoint of these tensors (or meta tensors) and args, without a file."""
    checkpoint = megatron.MegatronCheckpoint.__new__(megatron.MegatronCheckpoint)
    checkpoint.path = checkpoint.source = "(in memory)"
    checkpoint._tensors, checkpoint._safetensors, checkpoint.hparams = dict(tensors), {}, {}
    checkpoint._shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    checkpoint.args = args
    return checkpoint


def megatron_model(state, pattern, geometry):
    """A samba-hf model holding a Megatron state dict, through the converter's own mapping."""
    checkpoint = in_memory_checkpoint(
        state,
        {
            "num_attention_heads": geometry["num_attention_heads"],
            "group_query_attention": True,
            "num_query_groups": geometry["num_query_groups"],
            "kv_channels": geometry["kv_channels"],
            "mamba_num_groups": geometry["mamba_num_groups"],
            "mamba_state_dim": geometry["mamba_state_dim"],
            "hybrid_override_pattern": pattern,
        },
    )
    config, tensors = megatron.plan(checkpoint)
    config.mamba2_chunk_size = geometry["mamba_chunk_size"]
    model = SambaForCausalLM(config).eval()
    model.load_state_dict({name: produce() for name, produce in tensors.items()}, strict=True)
    return model


@pytest.mark.parametrize("pattern", ["M-M*-M", "M*-M-", "MMM"])
def test_megatron_layouts_equal_the_float64_reference_and_nemotron_h(pattern):
    geometry = tiny_geometry()
    state = random_megatron_state(pattern, geometry, seed=1)
    model = megatron_model(state, pattern, geometry)
    ids = torch.randint(0, geometry["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(2))  # 3 chunks
    with torch.no_grad():
        ours = model(ids).logits.double()
    reference = megatron_logits(state, pattern, geometry, ids)
    assert reference.abs().max() > 1
    assert (ours - reference).abs().max() <= TOL * reference.abs().max()
    nemotron = nemotron_h_logits(state, pattern, geometry, ids)
    assert (ours - nemotron).abs().max() <= TOL * reference.abs().max()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model(request):
    return tiny_mamba2(request.param, seed=11)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(5))


def test_cached_decoding_equals_the_full_forward(model):
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :13], use_cache=True)
        steps, cache = [out.logits], returned_cache(out)
        steps += [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(13, 20)]
        steps.append(model(ids[:, 20:], cache=cache, use_cache=True).logits)  # a piece from the cache
    assert (torch.cat(steps, dim=1) - full).abs().max() <= TOL * full.abs().max()


def test_greedy_and_sampling_equal_recomputation(model, prompt):
    assert torch.equal(gen(model, prompt, do_sample=False), no_cache_greedy(model, prompt, 30))
    torch.manual_seed(42)
    cached = gen(model, prompt, do_sample=True, top_k=5)
    torch.manual_seed(42)
    assert torch.equal(cached, gen(model, prompt, do_sample=True, top_k=5, use_cache=False))


def test_static_cache_equals_recomputation(model, prompt):
    assert torch.equal(
        gen(model, prompt, do_sample=False, cache_implementation="static"), no_cache_greedy(model, prompt, 30)
    )


def test_compiled_decode_step_equals_eager(model):
    compiled_generate_equals_eager(model, vocab=97)


def test_beam_search_reorders_the_mamba2_states(model, prompt):
    cached = gen(model, prompt, num_beams=3, num_return_sequences=2, output_scores=True, return_dict_in_generate=True)
    uncached = gen(
        model,
        prompt,
        num_beams=3,
        num_return_sequences=2,
        output_scores=True,
        return_dict_in_generate=True,
        use_cache=False,
    )
    assert torch.equal(cached.sequences, uncached.sequences)
    assert torch.allclose(cached.sequences_scores, uncached.sequences_scores, atol=1e-4)


def test_left_padding_neither_feeds_nor_decays_the_state(model):
    assert_left_padded_rows_equal_their_own_runs(model, new_tokens=20)


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_equals_unchunked(model, chunk):
    long_prompt = torch.randint(3, 97, (2, 37), generator=torch.Generator().manual_seed(9))
    plain = gen(model, long_prompt, do_sample=False, max_new_tokens=10)
    assert torch.equal(gen(model, long_prompt, do_sample=False, max_new_tokens=10, prefill_chunk_size=chunk), plain)


def test_continue_from_the_cache_of_an_earlier_generate(model, prompt):
    first = gen(model, prompt, do_sample=False, max_new_tokens=12, return_dict_in_generate=True)
    second = model.generate(
        first.sequences,
        attention_mask=torch.ones_like(first.sequences),
        **cache_kwarg(returned_cache(first)),
        max_new_tokens=15,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert torch.equal(second, no_cache_greedy(model, prompt, 27))


def test_cache_holds_one_conv_window_and_one_float32_state_per_mamba2_layer(model, prompt):
    c = model.config
    cache = DynamicCache(config=c)
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
        model(prompt[:, :1], cache=cache, use_cache=True)  # one decoding step
    for kind, layer in zip(c.layer_types, cache.layers):
        if kind == "linear_attention":
            assert isinstance(layer, LinearAttentionLayer)
            conv, state = layer.conv_states[0], layer.recurrent_states[0]
            assert conv.shape == (2, c.mamba_d_inner + 2 * c.mamba2_n_groups * c.mamba_d_state, c.mamba_d_conv)
            assert state.shape == (2, c.mamba2_num_heads, c.mamba2_head_dim, c.mamba_d_state)
            assert state.dtype == torch.float32
        elif kind == "mlp":
            assert isinstance(layer, DummyLayer)
    assert held_bytes(cache) == model.cache_nbytes(batch_size=2, seq_len=prompt.shape[1] + 1)
    samba = SambaForCausalLM(tiny_config()).eval()  # a Samba (Mamba-1) model's cache, filled
    with torch.no_grad():
        wrong = returned_cache(samba(prompt, use_cache=True))
        with pytest.raises(ValueError, match="past_key_values (has 4 layers|was built for another config)"):
            model(prompt, cache=wrong, use_cache=True)


def test_packed_documents_train_as_if_run_one_by_one():
    model = tiny_mamba2("megatron", seed=3).train()
    docs = [torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11, 3, 19)]
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
    packed = model(**batch).loss
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = sum(torch.nn.functional.cross_entropy(model(d[None]).logits[0, :-1], d[1:], reduction="sum") for d in docs)
    alone = total / sum(len(d) - 1 for d in docs)
    alone.backward()
    assert abs(packed.item() - alone.item()) <= 1e-5
    for name, param in model.named_parameters():
        assert (packed_grads[name] - param.grad).abs().max() <= 1e-5 * max(1.0, param.grad.abs().max()), name


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(3, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    grads = []
    for checkpointing in (False, True):
        model = tiny_mamba2("megatron", seed=4).train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(grads[0][n] is not None and (grads[0][n] - grads[1][n]).abs().max() <= 1e-6 for n in grads[0])
    assert (
        grads[0]["model.layers.0.mamba.A_log"].abs().sum() > 0
        and grads[0]["model.layers.0.mamba.dt_bias"].abs().sum() > 0
    )


def test_trainer_lowers_the_loss_on_padded_batches(tmp_path):
    from test_trainer import arguments, examples, tokenizer
    from transformers import DataCollatorForLanguageModeling, Trainer

    model = tiny_mamba2("megatron", seed=8).train()
    data = examples(16) * 4  # the same 16 sequences, seen several times: the loss must fall
    collator = DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path, max_steps=12, learning_rate=3e-3),
        train_dataset=data,
        data_collator=collator,
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("target", ["in_proj", "out_proj", "q_proj", "o_proj", "up_proj", "down_proj"])
def test_lora_on_each_projection_changes_prefill_and_cached_decoding(target):
    from peft import get_peft_model

    assert target in LORA_TARGET_MODULES
    torch.manual_seed(0)
    model = get_peft_model(
        tiny_mamba2("megatron"), lora_config(r=4, lora_alpha=32, target_modules=[target], init_lora_weights=False)
    ).eval()
    ids = torch.randint(3, 97, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        out = model(input_ids=ids[:, :-3], use_cache=True)
        steps = [
            model(input_ids=ids[:, t : t + 1], cache=returned_cache(out), use_cache=True).logits for t in range(11, 14)
        ]
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert (full - base).abs().max() > 1e-3
    assert (torch.cat(steps, dim=1) - full[:, -3:]).abs().max() <= TOL * full.abs().max()


def test_a_saved_mamba2_hybrid_loads_without_samba_hf(tmp_path):
    from test_save_load import assert_loads_without_the_package

    model = tiny_mamba2("megatron", seed=6)
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 97, (1, 20))
    with torch.no_grad():
        torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "expected.pt")
    assert_loads_without_the_package(tmp_path)
