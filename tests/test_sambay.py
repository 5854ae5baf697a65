"""SambaY (Phi-4-mini-flash-reasoning's architecture): the released layout, exact logits against the float64
re-implementation of the released math in `sambay_reference.py`, the released folder loading unchanged, the cache
and every generate mode against recomputation, training, and save / remote code."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DynamicCache

from samba_hf import SambaYConfig, SambaYForCausalLM

from sambay_reference import random_weights, reference_logits
from test_save_load import assert_loads_without_the_package

RELEASE = Path(__file__).resolve().parents[2] / "shared" / "design" / "sambay"

# Every switch of the release, tiny: L=8 (self-decoder 0-3, memory 4, full 5, GMU 6, cross 7), GQA 8/4, window 4.
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, sliding_window=4, layer_norm_eps=1e-5, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, mamba_d_state=8)


def tiny_model(seed=0, dtype=torch.float32, **overrides) -> tuple[SambaYForCausalLM, dict]:
    """A model holding `random_weights` (the released names), and those weights in float64."""
    fields = {**TINY, **overrides}
    weights = random_weights(fields, seed=seed)
    model = SambaYForCausalLM(SambaYConfig(**fields)).eval()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # the head is tied to the embeddings
    return model.to(dtype), weights


def ids(batch=2, length=20, seed=0, vocab=64):
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- the released layout


@pytest.mark.skipif(not RELEASE.is_dir(), reason=f"the released config and index are not at {RELEASE}")
def test_the_released_config_builds_exactly_the_released_tensors():
    config = SambaYConfig.from_dict(json.loads((RELEASE / "config.json").read_text()))
    index = json.loads((RELEASE / "model.safetensors.index.json").read_text())["weight_map"]
    with torch.device("meta"):
        model = SambaYForCausalLM(config)
    assert set(model.state_dict()) - {"lm_head.weight"} == set(index)
    assert sum(p.numel() for p in model.parameters()) == 3_852_562_944
    assert config.block_types[16:18] == ["memory", "full_attention"]
    assert model.config._attn_implementation != "flash_attention_2"  # the json's request is not binding


# ---------------------------------------------------------------- exact against the float64 reference


@pytest.mark.parametrize("layers", [8, 12])
def test_logits_equal_the_float64_reference(layers):
    model, weights = tiny_model(num_hidden_layers=layers)
    x = ids()
    with torch.no_grad():
        ours = model(x).logits.double()
    expected = reference_logits(weights, {**TINY, "num_hidden_layers": layers}, x)
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_eager_and_sdpa_agree():
    model, _ = tiny_model()
    x = ids()
    with torch.no_grad():
        sdpa = model(x).logits
        model.config._attn_implementation = "eager"
        eager = model(x).logits
    torch.testing.assert_close(eager, sdpa, rtol=1e-5, atol=1e-5)


def release_folder(folder: Path, seed=0) -> dict:
    """A folder laid out as the release: its config.json fields (flash-attention asked for, remote code and a Hub
    tokenizer in auto_map), bf16 tensors with A_log and lambda_* in float32, two shards with an index, no lm_head."""
    weights = random_weights(TINY, seed=seed)
    folder.mkdir()
    config = {**json.loads((RELEASE / "config.json").read_text()), **TINY} if RELEASE.is_dir() else {
        **TINY, "model_type": "phi4flash", "_attn_implementation": "flash_attention_2", "mb_per_layer": 2,
        "auto_map": {"AutoConfig": "configuration_phi4flash.Phi4FlashConfig",
                     "AutoModelForCausalLM": "modeling_phi4flash.Phi4FlashForCausalLM",
                     "AutoTokenizer": "Xenova/gpt-4o"}, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    stored = {k: v.float() if k.endswith(("A_log", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")) else
              v.to(torch.bfloat16) for k, v in weights.items()}
    names = sorted(stored)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for file, keys in shards.items():
        save_file({k: stored[k].contiguous() for k in keys}, folder / file, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in stored.values())},
             "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return stored


def test_the_released_folder_loads_unchanged_without_remote_code(tmp_path):
    stored = release_folder(tmp_path / "release")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "release")  # no trust_remote_code: samba_hf's class
    assert type(model) is SambaYForCausalLM and model.dtype == torch.bfloat16
    assert model.model.layers[0].attn.A_log.dtype == torch.float32
    assert model.model.layers[1].attn.inner_cross_attn.lambda_q1.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight
    as_stored = AutoModelForCausalLM.from_pretrained(tmp_path / "release", dtype=torch.float32)
    x = ids()
    with torch.no_grad():
        ours = as_stored(x).logits.double()
    expected = reference_logits({k: v.double() for k, v in stored.items()}, TINY, x)
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()


# ---------------------------------------------------------------- the cache and generate


def greedy_without_cache(model, prompt, steps):
    x = prompt
    with torch.no_grad():
        for _ in range(steps):
            x = torch.cat([x, model(x, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return x


@pytest.mark.parametrize("prompt_length", [2, 3, 9])  # shorter than the window (the release's bug), and longer
def test_greedy_generate_equals_recomputation(prompt_length):
    model, _ = tiny_model()
    prompt = ids(1, prompt_length)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                         pad_token_id=0)
    assert torch.equal(out, greedy_without_cache(model, prompt, 16))


def test_logits_of_a_decode_step_equal_the_full_forward_past_the_window():
    model, _ = tiny_model()
    x = ids(1, 14)
    with torch.no_grad():
        full = model(x).logits
        cache = DynamicCache(config=model.config)
        steps = [model(x[:, :2], past_key_values=cache).logits]
        steps += [model(x[:, t : t + 1], past_key_values=cache).logits for t in range(2, 14)]
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5 * full.abs().max()  # float32 rounding only


def test_chunked_prefill_and_left_padding_and_beams():
    model, _ = tiny_model()
    prompt = ids(1, 11)
    plain = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    chunked = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, prefill_chunk_size=3)
    assert torch.equal(plain, chunked)
    short = ids(1, 6, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1), prompt])
    mask = (torch.arange(11) >= torch.tensor([[5], [0]])).long()
    both = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(both[1:], plain)
    assert torch.equal(both[:1, 5:], model.generate(short, max_new_tokens=6, do_sample=False, pad_token_id=0))
    beams = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    assert beams.shape == (1, 17)
    with torch.no_grad():  # the best beam's score is the no-cache log-likelihood of its tokens
        scores = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0,
                                output_scores=True, return_dict_in_generate=True, length_penalty=0.0)
        logp = torch.log_softmax(model(scores.sequences).logits[:, 10:-1].double(), -1)
        total = logp.gather(-1, scores.sequences[:, 11:, None]).sum()
    assert scores.sequences_scores[0].item() == pytest.approx(total.item(), abs=1e-4)


def cross_decoder_positions(model) -> list[int]:
    """Records how many positions each cross-decoder layer (GMU and cross-attention) runs on."""
    seen = []
    start = model.config.block_types.index("full_attention") + 1
    for layer in model.model.layers[start:]:
        layer.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[1]))
    return seen


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_logits_to_keep_runs_the_cross_decoder_on_the_kept_positions_only(implementation):
    """YOCO's prefill saving: with logits_to_keep=k the cross-decoder (stateless) runs on the last k positions; the
    logits equal the full forward's, with padding, from a cache, and through chunked inference."""
    model, _ = tiny_model()
    model.config._attn_implementation = implementation
    seen = cross_decoder_positions(model)
    x = ids(2, 13)
    mask = (torch.arange(13) >= torch.tensor([[4], [0]])).long()
    with torch.no_grad():
        full = model(x, attention_mask=mask).logits
        for keep in (1, 3, 13, 20):
            seen.clear()
            kept = model(x, attention_mask=mask, logits_to_keep=keep).logits
            torch.testing.assert_close(kept, full[:, -keep:], rtol=1e-5, atol=1e-5)
            assert seen == [min(keep, 13)] * 2  # L=8: one GMU and one cross-attention layer
        # continuing from a cache: a 5-token piece after 8 cached positions
        cache = DynamicCache(config=model.config)
        model(x[:, :8], attention_mask=mask[:, :8], past_key_values=cache)
        seen.clear()
        step = model(x[:, 8:], attention_mask=mask, past_key_values=cache, logits_to_keep=2).logits
        torch.testing.assert_close(step, full[:, -2:], rtol=1e-5, atol=1e-5)
        assert seen == [2, 2]
        # chunked inference (chunks of 4): the chunks before the last kept positions skip the cross-decoder
        model.config.inference_chunk_size = 4
        seen.clear()
        chunked = model(x, logits_to_keep=6).logits
        assert seen == [1, 1, 4, 4, 1, 1]  # positions 7-12 kept: chunk 0-3 skips it, 4-7 runs 1, 8-11 4, 12 1
        model.config.inference_chunk_size = 4096
        torch.testing.assert_close(chunked, model(x).logits[:, -6:], rtol=1e-5, atol=1e-5)


def test_cache_bytes_grow_by_one_layers_keys_and_values_per_token():
    model, _ = tiny_model()
    config = model.config
    x = ids(2, 30)
    with torch.no_grad():
        cache = model(x, use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in layer_tensors(layer))
    assert held == model.cache_nbytes(batch_size=2, seq_len=30)
    per_token = model.cache_nbytes(2, 31) - model.cache_nbytes(2, 30)
    assert per_token == 2 * 2 * config.num_key_value_heads * config.head_dim * 4  # batch 2, k and v, float32


def layer_tensors(layer):
    tensors = [getattr(layer, name, None) for name in ("keys", "values")]
    for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
        tensors += list(states.values()) if isinstance(states, dict) else [states]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


# ---------------------------------------------------------------- training, saving


def test_backward_reaches_every_parameter_and_checkpointing_gives_the_same_gradients():
    model, _ = tiny_model()
    model.train()
    x = ids(2, 12)
    model(x, labels=x).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), [n for n, g in grads.items() if g is None]
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model(x, labels=x).loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_save_pretrained_loads_with_and_without_samba_hf(tmp_path):
    model, _ = tiny_model(seed=4)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "phi4flash"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_sambay.SambaYForCausalLM"
    assert config["auto_map"]["AutoModel"] == "modeling_sambay.SambaYModel"
    assert {"modeling_sambay.py", "configuration_sambay.py", "modeling_samba.py", "ssm_samba.py"} <= {
        p.name for p in tmp_path.iterdir()}
    x = ids(2, 15)
    with torch.no_grad():
        torch.save({"ids": x, "logits": model(x).logits}, tmp_path / "expected.pt")
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(x).logits, model(x).logits)
    assert_loads_without_the_package(tmp_path, "SambaYForCausalLM")


def test_the_cli_says_the_released_folder_has_no_tokenizer_and_runs_with_one(tmp_path, capsys):
    from samba_hf.cli import default_model_path, main

    release_folder(tmp_path / "release")
    assert main(["generate", "The assert", "--model", str(tmp_path / "release")]) == 1
    err = capsys.readouterr().err
    if RELEASE.is_dir():
        assert "names the Hub tokenizer 'Xenova/gpt-4o'" in err
    assert "has no tokenizer files" in err and "--tokenizer" in err
    assert main(["generate", "The assert", "--model", str(tmp_path / "release"), "--tokenizer",
                 default_model_path()]) == 1  # 4096 tokens do not fit the tiny model's 64
    assert "the tokenizer has 4096 tokens but the model's vocabulary has 64" in capsys.readouterr().err
    word_tokenizer(tmp_path / "words")
    assert main(["generate", "the assert", "--model", str(tmp_path / "release"), "--tokenizer",
                 str(tmp_path / "words"), "--max-new-tokens", "5"]) == 0
    assert "5 new tokens from a 2-token prompt" in capsys.readouterr().err


def word_tokenizer(folder):
    """A word-level tokenizer of 60 words, for the tiny vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(55)] + ["the", "assert", "is", "a", "of"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<unk>").save_pretrained(folder)


@pytest.mark.parametrize("target", ["Wqkv", "out_proj", "in_proj", "x_proj", "dt_proj", "fc1", "fc2"])
def test_lora_on_every_projection_changes_training_and_cached_decoding(target):
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_model(seed=5)
    x = ids(1, 9)
    with torch.no_grad():
        base = model(x).logits
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=[target], init_lora_weights=False))
    adapted_layers = {name.split(".")[4] for name, _ in peft_model.named_modules() if name.endswith(f"{target}.lora_A")}
    assert adapted_layers, target
    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(x).logits
    assert (adapted - base).abs().max() > 1e-3, target  # the adapter is applied
    out = peft_model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_without_cache(peft_model, x, 6))
    peft_model.train()
    peft_model(x, labels=x).loss.backward()
    trained = [p for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trained and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained)


def test_trainer_lowers_the_loss(tmp_path):
    from transformers import Trainer, TrainingArguments

    model, _ = tiny_model(seed=6)
    sequence = ids(1, 16, seed=7)[0]
    data = [{"input_ids": sequence, "labels": sequence}] * 8
    args = TrainingArguments(tmp_path, max_steps=12, per_device_train_batch_size=4, learning_rate=5e-3,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("fields, fragment", [
    ({"num_hidden_layers": 6}, "`num_hidden_layers` must be a multiple of 4"),
    ({"num_key_value_heads": 3, "num_attention_heads": 9, "hidden_size": 36}, "must be even"),
    ({"hidden_size": 30}, "must be a multiple of `num_attention_heads`"),
    ({"mb_per_layer": 3}, "`mb_per_layer` must be 2"),
    ({"layer_types": ["full_attention"] * 8}, "leave it unset"),
    ({"sliding_window": 0}, "`sliding_window` must be a positive integer"),
    ({"hidden_size": "32"}, "`hidden_size` must be a positive integer"),
    ({"layer_norm_eps": -1.0}, "`layer_norm_eps` must be > 0"),
])
def test_configs_the_model_cannot_build_name_the_field(fields, fragment):
    with pytest.raises(ValueError, match="SambaYConfig: .*" + fragment.replace("(", r"\(").replace(")", r"\)")):
        SambaYConfig(**{**TINY, **fields})
