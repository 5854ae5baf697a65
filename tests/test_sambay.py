"""SambaY (Phi-4-mini-flash-reasoning's architecture): the released layout, exact logits against the float64
re-implementation of the released math in `sambay_reference.py`, the released folder loading unchanged, the cache
and every generate mode against recomputation, training, and save / remote code."""

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import held_bytes, returned_cache
from safetensors.torch import save_file
from sambay_reference import random_weights, reference_logits
from test_generation import compiled_generate_equals_eager
from test_save_load import assert_loads_without_the_package
from transformers import AutoModelForCausalLM, DynamicCache

from samba_hf import SambaConfig, SambaYConfig, SambaYForCausalLM

# The release's config.json, model.safetensors.index.json, tokenizer_config.json and generation_config.json (no
# weights)
RELEASE = Path(__file__).resolve().parent / "data" / "sambay"

# Every switch of the release, tiny: L=8 (self-decoder 0-3, memory 4, full 5, GMU 6, cross 7), GQA 8/4, window 4.
TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    sliding_window=4,
    layer_norm_eps=1e-5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    mamba_d_state=8,
)


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
    # float32 logits of magnitude ~10: the two attention paths round differently, by ~1e-6 of that scale
    torch.testing.assert_close(eager, sdpa, rtol=1e-5, atol=1e-5 * sdpa.abs().max().item())


# The release's chat settings at tiny ids: its base vocabulary ends with <|endoftext|> (199999 -> 49), and its chat
# tokens follow (200018... -> 50...); generation stops on <|end|> (200020 -> 52) or <|endoftext|>.
def tiny_id(release_id: int) -> int:
    return 49 if release_id == 199999 else release_id - 200018 + 50


def test_kernels_that_need_one_head_size_attend_to_each_half_of_the_values():
    """flash-attention takes values no wider than queries: differential attention then attends to each half of the
    paired values (the release's four calls). Checked with an implementation that refuses wider values and
    otherwise computes as sdpa."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def one_head_size(module, query, key, value, attention_mask, **kwargs):
        assert value.shape[-1] == query.shape[-1], "values wider than queries"
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("one_head_size", one_head_size)
    AttentionMaskInterface.register("one_head_size", sdpa_mask)
    model, _ = tiny_model()
    x = ids(2, 13)
    with torch.no_grad():
        expected = model(x).logits
        model.config._attn_implementation = "one_head_size"
        torch.testing.assert_close(model(x).logits, expected, rtol=1e-5, atol=1e-5)
        cache = DynamicCache(config=model.config)
        steps = [model(x[:, :7], cache=cache).logits]
        steps += [model(x[:, t : t + 1], cache=cache).logits for t in range(7, 13)]
    assert (torch.cat(steps, 1) - expected).abs().max() <= 1e-5 * expected.abs().max()  # float32 rounding only


def release_tokenizer_settings(folder: Path, generation_config=True):
    """The release's tokenizer_config.json (chat template, added tokens), special_tokens_map.json and
    generation_config.json, with the ids moved into the tiny vocabulary; no vocabulary files (as the release)."""
    settings = json.loads((RELEASE / "tokenizer_config.json").read_text())
    generation = json.loads((RELEASE / "generation_config.json").read_text())
    settings["added_tokens_decoder"] = {
        str(tiny_id(int(i))): entry for i, entry in settings["added_tokens_decoder"].items()
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    if generation_config:
        generation.update(
            {
                key: [tiny_id(i) for i in value] if isinstance(value, list) else tiny_id(value)
                for key, value in generation.items()
                if key.endswith("token_id")
            }
        )
        (folder / "generation_config.json").write_text(json.dumps(generation))


def release_folder(folder: Path, seed=0, favour: int | None = None, generation_config=True) -> dict:
    """A folder laid out as the release: its config.json fields (flash-attention asked for, remote code and a Hub
    tokenizer in auto_map), bf16 tensors with A_log and lambda_* in float32, two shards with an index, no lm_head,
    its tokenizer settings without a vocabulary. `favour`: a token id the model then predicts after anything."""
    weights = random_weights(TINY, seed=seed)
    if favour is not None:  # logits = (0 * h + b) . E^T, b along E[favour]: that token wins everywhere
        weights["model.final_layernorm.weight"] = torch.zeros_like(weights["model.final_layernorm.weight"])
        weights["model.final_layernorm.bias"] = 4 * weights["model.embed_tokens.weight"][favour]
    folder.mkdir()
    config = {**json.loads((RELEASE / "config.json").read_text()), **TINY}
    (folder / "config.json").write_text(json.dumps(config))
    stored = {
        k: v.float()
        if k.endswith(("A_log", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"))
        else v.to(torch.bfloat16)
        for k, v in weights.items()
    }
    names = sorted(stored)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, keys in shards.items():
        save_file({k: stored[k].contiguous() for k in keys}, folder / file, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in stored.values())},
        "weight_map": {k: file for file, keys in shards.items() for k in keys},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    release_tokenizer_settings(folder, generation_config)
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


def test_bfloat16_follows_the_released_numerics(tmp_path):
    """Loaded in bf16 as released: the residual stream turns float32 at the first Mamba layer and stays float32;
    q/k/v enter attention in bf16; A_log, the lambdas and the SSM state stay float32 (the release keeps its cached
    state in bf16: here it stays float32); the logits stay within bf16 rounding of the float64 reference."""
    stored = release_folder(tmp_path / "release")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "release", dtype=torch.bfloat16).eval()
    residual, attention = [], []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda module, args, output: residual.append(output[0].dtype))
        if hasattr(layer.attn, "inner_cross_attn"):
            layer.attn.inner_cross_attn.register_forward_pre_hook(
                lambda module, args: attention.append({t.dtype for t in args[:3]})
            )
    x = ids()
    with torch.no_grad():
        out = model(x, use_cache=True)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert residual == [torch.float32] * 8  # layer 0 is Mamba: float32 from its output on
    assert attention == [{torch.bfloat16}] * 4
    assert {layer.attn.A_log.dtype for layer in model.model.layers if hasattr(layer.attn, "A_log")} == {torch.float32}
    assert {
        s.dtype
        for layer in returned_cache(out).layers
        for s in layer_tensors(layer)
        if s.ndim == 3 and s.shape[-1] == TINY["mamba_d_state"]
    } == {torch.float32}
    expected = reference_logits({k: v.double() for k, v in stored.items()}, TINY, x)
    error = (out.logits.double() - expected).abs().max() / expected.abs().max()
    assert error <= 4e-2, error  # 2.9% here: bf16 keeps 8 bits of mantissa (0.4% per rounding), dozens of roundings


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
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False, pad_token_id=0
    )
    assert torch.equal(out, greedy_without_cache(model, prompt, 16))


def test_compiled_decode_step_equals_eager():
    compiled_generate_equals_eager(tiny_model()[0], vocab=64)


def test_logits_of_a_decode_step_equal_the_full_forward_past_the_window():
    model, _ = tiny_model()
    x = ids(1, 14)
    with torch.no_grad():
        full = model(x).logits
        cache = DynamicCache(config=model.config)
        steps = [model(x[:, :2], cache=cache).logits]
        steps += [model(x[:, t : t + 1], cache=cache).logits for t in range(2, 14)]
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
        scores = model.generate(
            prompt,
            max_new_tokens=6,
            num_beams=3,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
            length_penalty=0.0,
        )
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
        model(x[:, :8], attention_mask=mask[:, :8], cache=cache)
        seen.clear()
        step = model(x[:, 8:], attention_mask=mask, cache=cache, logits_to_keep=2).logits
        torch.testing.assert_close(step, full[:, -2:], rtol=1e-5, atol=1e-5)
        assert seen == [2, 2]
        # chunked inference (chunks of 4): the chunks before the last kept positions skip the cross-decoder
        model.config.inference_chunk_size = 4
        seen.clear()
        chunked = model(x, logits_to_keep=6).logits
        assert seen == [1, 1, 4, 4, 1, 1]  # positions 7-12 kept: chunk 0-3 skips it, 4-7 runs 1, 8-11 4, 12 1
        model.config.inference_chunk_size = 4096
        # chunks of 4 run the attention over other shapes: float32 rounding of ~1e-6 of the logits' scale (~10)
        torch.testing.assert_close(chunked, model(x).logits[:, -6:], rtol=1e-5, atol=2e-5)


def test_cache_bytes_grow_by_one_layers_keys_and_values_per_token():
    model, _ = tiny_model()
    config = model.config
    x = ids(2, 30)
    with torch.no_grad():
        cache = returned_cache(model(x, use_cache=True))
        model(x[:, :1], cache=cache, use_cache=True)  # one decoding step
    assert held_bytes(cache) == model.cache_nbytes(batch_size=2, seq_len=31)
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
    model.activation_checkpointing_enable()
    model(x, labels=x).loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_documents_train_as_if_run_one_by_one(implementation):
    """Samba's packing carries over: position_ids restarting inside a row keep attention (sliding, full, cross) and
    the Mamba conv and scan within each document; the GMU reads the memory at its own position."""
    from transformers import DataCollatorWithFlattening

    model, _ = tiny_model(seed=2)
    model.config._attn_implementation = implementation
    model.train()
    docs = [ids(1, n, seed=n)[0] for n in (5, 11, 3, 9)]  # 11 and 9 > the window of 4
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
    packed = model(**batch).loss
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = sum(torch.nn.functional.cross_entropy(model(d[None]).logits[0, :-1], d[1:], reduction="sum") for d in docs)
    alone = total / sum(len(d) - 1 for d in docs)
    alone.backward()
    assert abs(packed.item() - alone.item()) <= 1e-5
    for name, param in model.named_parameters():  # float32 sums in another order: 1e-5 of each gradient's scale
        scale = max(1.0, param.grad.abs().max().item())
        assert (packed_grads[name] - param.grad).abs().max() <= 1e-5 * scale, name


def test_save_pretrained_loads_with_and_without_samba_hf(tmp_path):
    model, _ = tiny_model(seed=4)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "phi4flash"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_sambay.SambaYForCausalLM"
    assert config["auto_map"]["AutoModel"] == "modeling_sambay.SambaYModel"
    assert {"modeling_sambay.py", "configuration_sambay.py", "modeling_samba.py", "ssm_samba.py"} <= {
        p.name for p in tmp_path.iterdir()
    }
    x = ids(2, 15)
    with torch.no_grad():
        torch.save({"ids": x, "logits": model(x).logits}, tmp_path / "expected.pt")
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(x).logits, model(x).logits)
    assert_loads_without_the_package(tmp_path, "SambaYForCausalLM")


def test_the_cli_says_the_released_folder_has_no_tokenizer_and_runs_with_one(tmp_path, capsys):
    from samba_hf.cli import default_model_path
    from samba_hf_cli import main

    release_folder(tmp_path / "release")
    assert main(["generate", "The assert", "--model", str(tmp_path / "release")]) == 1
    err = capsys.readouterr().err
    assert "names the Hub tokenizer 'Xenova/gpt-4o'" in err
    assert "has no tokenizer vocabulary" in err and "--tokenizer" in err
    assert (
        main(["generate", "The assert", "--model", str(tmp_path / "release"), "--tokenizer", default_model_path()])
        == 1
    )  # 4096 tokens: <|endoftext|> cannot be at the model's id 49
    assert "has '<|endoftext|>' at id" in capsys.readouterr().err
    word_tokenizer(tmp_path / "words")
    assert (
        main(
            [
                "generate",
                "the assert",
                "--model",
                str(tmp_path / "release"),
                "--tokenizer",
                str(tmp_path / "words"),
                "--max-new-tokens",
                "5",
            ]
        )
        == 0
    )
    assert "new tokens from a 2-token prompt" in capsys.readouterr().err


def word_tokenizer(folder, end_of_text="<|endoftext|>"):
    """A word-level tokenizer for the tiny vocabulary: 49 words, then the end-of-text token at 49, as the release's
    base tokenizer (o200k) ends with <|endoftext|> before the chat tokens, which it lacks."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>"] + [f"w{i}" for i in range(43)] + ["the", "assert", "is", "a", "of", end_of_text]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token=end_of_text,
        eos_token=end_of_text,
        pad_token=end_of_text,
    ).save_pretrained(folder)


def test_a_tokenizer_from_elsewhere_gets_the_folders_chat_tokens_and_template(tmp_path):
    from samba_hf.model_folder import ModelFolderError, end_of_turn_id, tokenizer_for

    release_folder(tmp_path / "release")
    word_tokenizer(tmp_path / "words")
    tokenizer = tokenizer_for(tmp_path / "release", tmp_path / "words")
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "a"}, {"role": "user", "content": "the assert"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|system|>a<|end|><|user|>the assert<|end|><|assistant|>"
    assert tokenizer(text, add_special_tokens=False).input_ids == [54, 47, 52, 53, 44, 45, 52, 51]
    assert end_of_turn_id(tokenizer) == 52  # <|end|>
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "release").generation_config.eos_token_id == [52, 49]
    word_tokenizer(tmp_path / "other", end_of_text="</s>")  # its own end token at 49: the chat tokens land one off
    with pytest.raises(
        ModelFolderError,
        match="has '<\\|endoftext\\|>' at id 50, but the model folder's "
        "tokenizer_config.json puts it at 49: it is not this model's tokenizer",
    ):
        tokenizer_for(tmp_path / "release", tmp_path / "other")


def test_the_cli_chats_in_the_release_format_and_stops_at_the_end_of_the_turn(tmp_path, capsys):
    """A model that always predicts <|end|> (52): with --chat the reply ends at once; as a plain continuation it
    runs to --max-new-tokens (this folder has no generation_config.json: the template's end of turn is the stop)."""
    from samba_hf_cli import main

    release_folder(tmp_path / "release", favour=52, generation_config=False)
    word_tokenizer(tmp_path / "words")
    run = [
        "generate",
        "the assert",
        "--model",
        str(tmp_path / "release"),
        "--tokenizer",
        str(tmp_path / "words"),
        "--max-new-tokens",
        "4",
    ]
    assert main(run) == 0
    out, err = capsys.readouterr()
    assert out.startswith("the assert") and out.count("<|end|>") == 4 and "4 new tokens from a 2-token prompt" in err
    assert main(run + ["--chat", "--system", "a"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "" and "1 new tokens from a 8-token prompt" in err  # reply: <|end|>, not printed
    assert main(["generate", "x", "--system", "a"]) == 1
    assert "--system sets the system message of a chat: add --chat" in capsys.readouterr().err
    word_tokenizer(tmp_path / "plain")
    (tmp_path / "release" / "tokenizer_config.json").unlink()  # no template anywhere
    assert (
        main(
            [
                "generate",
                "the assert",
                "--model",
                str(tmp_path / "release"),
                "--tokenizer",
                str(tmp_path / "plain"),
                "--chat",
            ]
        )
        == 1
    )
    assert "the tokenizer has no chat template" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["Wqkv", "out_proj", "in_proj", "x_proj", "dt_proj", "fc1", "fc2"])
def test_lora_on_every_projection_changes_training_and_cached_decoding(target):
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_model(seed=5)
    x = ids(1, 9)
    with torch.no_grad():
        base = model(x).logits
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=[target], init_lora_weights=False))
    adapted_layers = {
        name.split(".")[4] for name, _ in peft_model.named_modules() if name.endswith(f"{target}.lora_A")
    }
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
    args = TrainingArguments(
        tmp_path,
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"num_hidden_layers": 6}, "`num_hidden_layers` must be a multiple of 4"),
        ({"num_key_value_heads": 3, "num_attention_heads": 9, "hidden_size": 36}, "must be even"),
        ({"hidden_size": 30}, "must be a multiple of `num_attention_heads`"),
        ({"mb_per_layer": 3}, "`mb_per_layer` must be 2"),
        ({"layer_types": ["full_attention"] * 8}, "leave it unset"),
        ({"sliding_window": 0}, "`sliding_window` must be a positive integer"),
        (
            {"hidden_size": "32"},
            "`hidden_size` must be an int, got '32' (str); set it to such a value (default: 2560)",
        ),
        ({"layer_norm_eps": -1.0}, "`layer_norm_eps` must be > 0"),
    ],
)
def test_configs_the_model_cannot_build_name_the_field(fields, fragment):
    with pytest.raises(ValueError, match="SambaYConfig: .*" + re.escape(fragment)):
        SambaYConfig(**{**TINY, **fields})


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"mamba_dt_rank": "bogus"}, '`mamba_dt_rank` must be a positive int or "auto"'),
        ({"mamba_dt_rank": 0}, '`mamba_dt_rank` must be a positive int or "auto"'),
        ({"inference_chunk_size": -1}, "`inference_chunk_size` must be an integer >= 0 (0 turns chunking off)"),
        ({"hidden_act": "bogus_act"}, "`hidden_act` must name an activation of transformers' ACT2FN"),
        ({"attention_dropout": "x"}, "`attention_dropout` must be a finite number, got 'x' (str)"),
        ({"mamba_dt_min": 0.5, "mamba_dt_max": 0.1}, "need 0 < `mamba_dt_min` (0.5) <= `mamba_dt_max` (0.1)"),
        ({"tie_word_embeddings": "yes"}, "`tie_word_embeddings` must be true or false (a bool)"),
        ({"eos_token_id": "end"}, "`eos_token_id` must be an int, a list of ints or None"),
    ],
)
def test_samba_and_sambay_configs_refuse_a_shared_field_the_same_way(fields, fragment):
    """The fields both configs have are checked by one mechanism (configuration_samba's check_field_types and
    check_shared_fields): the same value gets the same message, naming the class, the field and the fix."""
    messages = []
    for config_class, base in ((SambaYConfig, TINY), (SambaConfig, {})):
        with pytest.raises(ValueError, match=re.escape(fragment)) as error:
            config_class(**{**base, **fields})
        assert str(error.value).startswith(f"{config_class.__name__}: ")
        messages.append(str(error.value).split(": ", 1)[1].split("; set it to such a value")[0])
    assert messages[0] == messages[1]
