"""PEFT LoRA on every projection, on every path the model can take; merge, save/load, disable, generate."""

import pytest
import torch
from conftest import returned_cache, tiny_model
from peft import PeftModel, get_peft_model
from transformers import DynamicCache

from samba_hf.training import LORA_TARGET_MODULES, lora_config

IDS = torch.randint(3, 97, (2, 14), generator=torch.Generator().manual_seed(0))


def adapted(target, seed=0):
    """The tiny model with a LoRA adapter on `target` only, initialised non-zero so it changes the output."""
    torch.manual_seed(seed)
    config = lora_config(r=4, lora_alpha=32, target_modules=[target], init_lora_weights=False)
    return get_peft_model(tiny_model(seed=seed), config)


def decode_logits(model, ids):
    """Prefill all but the last 3 tokens, then decode them one by one through the cache."""
    out = model(input_ids=ids[:, :-3], use_cache=True)
    cache, steps = returned_cache(out), []
    assert isinstance(cache, DynamicCache)
    for t in range(ids.shape[1] - 3, ids.shape[1]):
        out = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
        steps.append(out.logits)
    return torch.cat(steps, dim=1)


def differs(a, b):
    return (a - b).abs().max().item() > 1e-4


@pytest.mark.parametrize("target", LORA_TARGET_MODULES)
def test_an_adapter_on_each_target_changes_every_path(target):
    model = adapted(target)
    wrapped = [n for n, m in model.named_modules() if n.endswith(target) and hasattr(m, "lora_A")]
    assert wrapped, f"no module named {target} was adapted"
    with torch.no_grad():
        model.eval()
        evaluated = model(input_ids=IDS).logits
        decoded = decode_logits(model, IDS)
        with model.disable_adapter():
            base_eval = model(input_ids=IDS).logits
            base_decoded = decode_logits(model, IDS)
    assert differs(evaluated, base_eval)
    assert differs(decoded, base_decoded)
    assert (decoded - evaluated[:, -3:]).abs().max() <= 1e-4  # cached decoding is the same model
    model.train()
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    with model.disable_adapter():
        assert abs(model(input_ids=IDS, labels=IDS).loss.item() - loss.item()) > 1e-5


def test_merge_and_unload_gives_the_adapted_logits():
    model = get_peft_model(tiny_model(seed=1), lora_config(r=4, init_lora_weights=False)).eval()
    with torch.no_grad():
        adapted_logits = model(input_ids=IDS).logits
        merged = model.merge_and_unload()
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        assert (merged(input_ids=IDS).logits - adapted_logits).abs().max() <= 1e-4


def test_all_linear_works_and_the_conv_is_refused():
    model = get_peft_model(tiny_model(seed=2), lora_config(r=4, target_modules="all-linear"))
    adapted_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert set(LORA_TARGET_MODULES) <= adapted_names and "lm_head" not in adapted_names
    with pytest.raises(ValueError, match="depthwise conv.*modules_to_save"):
        lora_config(target_modules=["in_proj", "conv1d"])


def test_adapter_saves_loads_and_disables(tmp_path):
    base = tiny_model(seed=3).eval()
    with torch.no_grad():
        base_logits = base(input_ids=IDS).logits
    model = get_peft_model(base, lora_config(r=4, init_lora_weights=False)).eval()
    with torch.no_grad():
        adapted_logits = model(input_ids=IDS).logits
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_model(seed=3).eval(), tmp_path)
    with torch.no_grad():
        assert (reloaded(input_ids=IDS).logits - adapted_logits).abs().max() <= 1e-6
        with reloaded.disable_adapter():
            assert (reloaded(input_ids=IDS).logits - base_logits).abs().max() <= 1e-6


def test_generate_with_an_adapter_uses_the_hybrid_cache():
    model = get_peft_model(tiny_model(seed=4), lora_config(r=4, init_lora_weights=False)).eval()
    prompt = IDS[:1, :6]
    out = model.generate(
        input_ids=prompt,
        max_new_tokens=8,
        do_sample=False,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    cache = returned_cache(out)
    assert isinstance(cache, DynamicCache) and cache.get_recurrent_state(0) is not None
    ids = out.sequences
    with torch.no_grad():  # greedy tokens equal the argmax of a full forward of the adapted model
        logits = model(input_ids=ids).logits
    assert torch.equal(logits[0, 5:-1].argmax(-1), ids[0, 6:])
    with model.disable_adapter():
        base = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert not torch.equal(base, ids)
