"""Loss, gradients, gradient checkpointing and the outputs a transformers user asks for."""

import pytest
import torch
import torch.nn.functional as F
from conftest import returned_cache, tiny_model
from transformers.masking_utils import create_recurrent_attention_mask, create_sliding_window_causal_mask


def test_loss_is_the_shifted_cross_entropy():
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 12))
    labels = ids.clone()
    labels[0, :4] = -100
    out = model(ids, labels=labels)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 97), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, expected, atol=1e-6)


def test_gradients_reach_every_parameter():
    model = tiny_model(
        layer_types=["linear_attention", "sliding_attention", "full_attention", "linear_attention"]
    ).train()
    ids = torch.randint(3, 97, (2, 20))
    model(ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().sum() > 0, name
        assert torch.isfinite(param.grad).all(), name


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(3, 97, (2, 20))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(seed=3).train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            assert model.model.layers[0].gradient_checkpointing
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


def test_the_old_checkpointing_names_still_switch_it_on(tmp_path):
    """transformers 5.24 renamed gradient checkpointing to activation checkpointing (the tests use the new names,
    which 5.23 has too); the old ones, deprecated, still switch it on for samba-hf's models."""
    import warnings

    from transformers import TrainingArguments

    model = tiny_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecation of the old names
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        arguments = TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True, report_to=[])
    assert all(layer.gradient_checkpointing for layer in model.model.layers) and arguments.activation_checkpointing


def test_tied_embeddings_by_default_and_untied_on_request():
    model = tiny_model()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = tiny_model(tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_logits_to_keep():
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 15))
    with torch.no_grad():
        full = model(ids).logits
        assert torch.allclose(model(ids, logits_to_keep=1).logits, full[:, -1:], atol=1e-6)
        assert torch.allclose(model(ids, logits_to_keep=4).logits, full[:, -4:], atol=1e-6)
        assert torch.allclose(model(ids, logits_to_keep=torch.tensor([0, 7])).logits, full[:, [0, 7]], atol=1e-6)


def test_tuple_outputs_hidden_states_and_attentions():
    model = tiny_model()
    model.set_attn_implementation("eager")
    ids = torch.randint(3, 97, (1, 10))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, output_attentions=True)
        as_tuple = model(ids, labels=ids, return_dict=False)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert torch.equal(out.hidden_states[0], model.model.embed_tokens(ids))
    # only the attention layers have attention weights: (batch, heads, query, key), windowed
    assert len(out.attentions) == 2
    attn = out.attentions[0]
    assert attn.shape == (1, 4, 10, 10)
    window = model.config.sliding_window
    assert attn[0, :, 9, : 10 - window].abs().max() == 0 and attn[0, :, 9, 10 - window :].min() > 0
    assert isinstance(as_tuple, tuple) and as_tuple[0].ndim == 0 and torch.allclose(as_tuple[1], out.logits, atol=1e-5)


def test_inputs_embeds_equal_input_ids():
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 9))
    with torch.no_grad():
        a = model(ids).logits
        b = model(inputs_embeds=model.model.embed_tokens(ids)).logits
    assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model()


def test_mask_dict_from_generate_is_accepted():
    """generate() may hand the per-layer-type masks over ready-made, keyed by layer type."""
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0
    embeds = model.model.embed_tokens(ids)
    masks = {
        "linear_attention": create_recurrent_attention_mask(model.config, embeds, mask),
        "sliding_attention": create_sliding_window_causal_mask(model.config, embeds, mask, None),
    }
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).logits
        given = model(ids, attention_mask=masks).logits
        unwindowed = model(ids, attention_mask={**masks, "sliding_attention": None}).logits
    real = mask.bool()  # outputs at padded positions are meaningless: compare the real tokens
    assert torch.allclose(plain[real], given[real], atol=1e-5)
    assert not torch.allclose(plain[real], unwindowed[real], atol=1e-3)  # the dict is really what the layers use


def test_bf16_forward_keeps_mamba_numerics_in_float32():
    model = tiny_model().to(torch.bfloat16)
    ids = torch.randint(3, 97, (1, 16))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()
    assert returned_cache(out).layers[0].recurrent_states[0].dtype == torch.float32
    ref = tiny_model()
    with torch.no_grad():
        assert (ref(ids).logits - out.logits.float()).abs().max() < 0.1


def test_attention_implementations_agree():
    ids = torch.randint(3, 97, (2, 30))
    logits = {}
    for impl in ("eager", "sdpa", "flex_attention"):
        model = tiny_model(seed=5)
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(ids).logits
    assert (logits["eager"] - logits["sdpa"]).abs().max() <= 1e-4
    assert (logits["eager"] - logits["flex_attention"]).abs().max() <= 1e-4


def test_init_follows_the_official_recipe():
    model = tiny_model()
    c = model.config
    mixer = model.model.layers[0].mamba
    assert torch.allclose(mixer.A_log[3], torch.log(torch.arange(1, c.mamba_d_state + 1, dtype=torch.float32)))
    assert torch.equal(mixer.D, torch.ones_like(mixer.D))
    dt = F.softplus(mixer.dt_proj.bias)
    assert dt.min() >= c.mamba_dt_init_floor * 0.999 and dt.max() <= c.mamba_dt_max * 1.001
    # residual outputs are scaled down by sqrt(2 * num_layers) relative to their fan-in default
    bound = (1 / c.hidden_size) ** 0.5 / (2 * c.num_hidden_layers) ** 0.5
    assert model.model.layers[1].self_attn.o_proj.weight.abs().max() <= bound * 1.0001
    assert model.model.layers[1].self_attn.q_proj.weight.abs().max() > bound
    assert abs(model.model.embed_tokens.weight.std().item() - c.initializer_range) < 0.005
