"""Bad configs and bad forward inputs fail with a ValueError that names the field or the problem and the fix,
instead of a TypeError / IndexError deep in transformers or torch, or a silently different result."""

import json
import math
import re
import typing

import pytest
import torch
from conftest import tiny_config, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, EncoderDecoderCache, StaticCache

from samba_hf import SambaConfig, SambaForCausalLM, SambaYConfig, SambaYForCausalLM

# What the error says each typed field of SambaConfig must be, and values of the wrong type for it.
TYPED_FIELDS = {
    **dict.fromkeys(
        [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "max_position_embeddings",
            "mamba_d_state",
            "mamba_d_conv",
            "mamba_expand",
            "inference_chunk_size",
            "mamba_version",
            "mamba2_head_dim",
            "mamba2_n_groups",
            "mamba2_chunk_size",
        ],
        "an int",
    ),
    **dict.fromkeys(
        ["num_hidden_layers", "num_key_value_heads", "head_dim", "sliding_window", "pad_token_id", "bos_token_id"],
        "an int or None",
    ),
    "eos_token_id": "an int, a list of ints or None",
    "mamba_dt_rank": 'a positive int or "auto"',
    **dict.fromkeys(
        [
            "initializer_range",
            "rms_norm_eps",
            "attention_dropout",
            "mamba_dt_min",
            "mamba_dt_max",
            "mamba_dt_init_floor",
            "mamba_dt_scale",
        ],
        "a finite number",
    ),
    **dict.fromkeys(
        [
            "use_cache",
            "tie_word_embeddings",
            "use_rope",
            "attention_bias",
            "mamba_conv_bias",
            "mamba_proj_bias",
            "mlp_gated",
        ],
        "true or false",
    ),
}
WRONG_VALUES = {
    "an int": ["8", 8.0, True],
    "an int or None": ["8", 8.0, True],
    "an int, a list of ints or None": ["2", 2.0, [2, "3"]],
    'a positive int or "auto"': ["8", 8.0, True],
    "a finite number": ["0.5", True, None],
    "true or false": ["true", 1, None],
}
FLOAT_FIELDS = [field for field, kind in TYPED_FIELDS.items() if kind == "a finite number"]


def raises(message):
    return pytest.raises(ValueError, match=message)


def test_every_int_float_and_bool_field_is_type_checked():
    """A string in each int / float / bool field of SambaConfig (as a hand-edited config.json may have) is named."""
    scalar = (int, float, bool)
    for field, annotation in SambaConfig.__annotations__.items():
        if any(t in scalar for t in typing.get_args(annotation) or (annotation,)):
            assert field in TYPED_FIELDS, f"{field} has no type check in this test"
    for field in TYPED_FIELDS:
        with raises(rf"^SambaConfig: `{field}` must be"):
            tiny_config(**{field: "x"})


@pytest.mark.parametrize(
    "field, value", [(field, value) for field, kind in TYPED_FIELDS.items() for value in WRONG_VALUES[kind]]
)
def test_wrong_type_names_the_field_and_what_it_must_be(field, value):
    with raises(rf"^SambaConfig: `{field}` must be {re.escape(TYPED_FIELDS[field])}(?!\w)"):
        tiny_config(**{field: value})


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads"])
def test_types_are_checked_before_the_head_dim_division(field):
    with raises(rf"^SambaConfig: `{field}` must be an int"):
        tiny_config(head_dim=None, **{field: "4"})


def test_unknown_hidden_act():
    with raises(r"^SambaConfig: `hidden_act` must name an activation of transformers' ACT2FN.*'swishy'"):
        tiny_config(hidden_act="swishy")


def test_unknown_rope_type():
    with raises(r'^SambaConfig: `rope_parameters\["rope_type"\]` must be "default" or one of .*\'yarn\'.*\'bogus\''):
        tiny_config(rope_parameters={"rope_type": "bogus", "rope_theta": 10000.0})


@pytest.mark.parametrize("value", [-0.1, 1, 1.5])
def test_attention_dropout_outside_zero_one(value):
    with raises(r"^SambaConfig: `attention_dropout` must be in \[0, 1\)"):
        tiny_config(attention_dropout=value)


@pytest.mark.parametrize("value", [0, -1e-5, math.nan, math.inf])
def test_rms_norm_eps_must_be_positive_and_finite(value):
    with raises(r"^SambaConfig: `rms_norm_eps` must be"):
        tiny_config(rms_norm_eps=value)


@pytest.mark.parametrize("value", [0, -1])
def test_max_position_embeddings_below_one(value):
    with raises(r"^SambaConfig: `max_position_embeddings` must be a positive integer"):
        tiny_config(max_position_embeddings=value)


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_in_float_fields(field, value):
    with raises(rf"^SambaConfig: `{field}` must be a finite number"):
        tiny_config(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_attention_heads", "4"),
        ("use_rope", "false"),
        ("hidden_act", "gelu_fancy"),
        ("attention_dropout", 1.5),
        ("rope_parameters", {"rope_type": "bogus", "rope_theta": 10000.0}),
        ("rms_norm_eps", 0),
    ],
)
def test_bad_values_in_config_json_are_named_on_load(tmp_path, field, value):
    tiny_config().save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**fields, field: value}))
    message = rf"^SambaConfig: `{re.escape(field)}"
    for load in (
        SambaConfig.from_pretrained,
        AutoConfig.from_pretrained,
        AutoModelForCausalLM.from_pretrained,
        lambda folder: SambaConfig.from_dict({**fields, field: value}),
    ):
        with raises(message):
            load(tmp_path)


@pytest.mark.parametrize("pad", [97, 1000, -98])
def test_pad_token_id_outside_the_vocabulary_is_refused_when_the_model_is_built(tmp_path, pad):
    # as transformers' Llama (its nn.Embedding asserts on the padding row): the config takes it, the model does not
    message = rf"^SambaConfig: `pad_token_id` is {pad}, outside the vocabulary of 97 tokens \(ids 0..96\)"
    config = tiny_config(pad_token_id=pad)
    with raises(message):
        SambaForCausalLM(config)
    SambaForCausalLM(tiny_config()).save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**fields, "pad_token_id": pad}))
    with raises(message):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    with raises(r"^SambaYConfig: `pad_token_id` is 64, outside the vocabulary of 64 tokens"):
        SambaYForCausalLM(
            SambaYConfig(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                pad_token_id=64,
            )
        )


@pytest.mark.parametrize("pad", [None, 0, 96, -1, -97])
def test_pad_token_ids_llama_takes_are_taken(pad):
    SambaForCausalLM(tiny_config(pad_token_id=pad))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def ids():
    return torch.randint(3, 97, (2, 6))


def filled_cache(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("low, high", [(-1, 5), (5, 97), (-100, 200)])
def test_ids_outside_the_vocabulary(model, low, high):
    ids = torch.full((2, 6), 5)
    ids[0, 0], ids[1, -1] = low, high
    with raises(rf"input_ids holds ids from {low} to {high}, but the vocabulary has 97 entries"):
        model(ids)


def test_empty_sequence(model, ids):
    with raises(r"input_ids must have shape \(batch, seq\) with batch >= 1 and seq >= 1, got \(2, 0\)"):
        model(ids[:, :0])


def test_empty_batch(model, ids):
    # transformers' Llama fails inside its attention ("cannot reshape tensor of 0 elements"); one clear error here
    with raises(r"input_ids must have shape \(batch, seq\) with batch >= 1 and seq >= 1, got \(0, 5\)"):
        model(torch.zeros(0, 5, dtype=torch.long))
    with raises(
        r"inputs_embeds must have shape \(batch, seq, hidden_size\) with batch >= 1 and seq >= 1, got "
        rf"\(0, 5, {model.config.hidden_size}\)"
    ):
        model(inputs_embeds=torch.zeros(0, 5, model.config.hidden_size))


@pytest.mark.parametrize("keep", [-1, -3])
def test_negative_logits_to_keep(model, ids, keep):
    # transformers' Llama reads -3 as slice(3, None), the last seq-3 positions: an accident, refused here
    with raises(
        rf"logits_to_keep must be 0 \(every position\), a count of last positions >= 1, or a 1D tensor of "
        rf"positions, got {keep}"
    ):
        model(ids, logits_to_keep=keep)
    assert model(ids, logits_to_keep=2).logits.shape[1] == 2


@pytest.mark.parametrize("shape", [(12,), (1, 2, 6)])
def test_input_ids_not_2d(model, ids, shape):
    with raises(r"input_ids must have shape \(batch, seq\).*input_ids\[None\]"):
        model(ids.reshape(shape))


@pytest.mark.parametrize("shape", [(3, 6), (1, 6), (2, 5), (2, 7), (6,)])
def test_attention_mask_of_the_wrong_shape(model, ids, shape):
    with raises(rf"attention_mask has shape {re.escape(str(shape))}, expected \(2, 6\)"):
        model(ids, attention_mask=torch.ones(shape, dtype=torch.long))


def test_attention_mask_must_cover_the_cached_tokens(model, ids):
    cache = filled_cache(model, ids)
    with raises(r"attention_mask has shape \(2, 1\), expected \(2, 7\).*the 6 cached ones included"):
        model(ids[:, :1], attention_mask=torch.ones(2, 1, dtype=torch.long), past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("value", [2, 0.5])
def test_attention_mask_values_other_than_zero_and_one(model, ids, value):
    mask = torch.ones(2, 6)
    mask[1, 3] = value
    with raises(rf"attention_mask must hold only 1 \(token\) and 0 \(padding\).*holds {value}"):
        model(ids, attention_mask=mask)


def test_bool_masks_and_ready_made_masks_are_accepted(model, ids):
    """Not an error case: bool 2D masks, 4D masks and generate's dict of masks go through as before."""
    with torch.no_grad():
        reference = model(ids).logits
        assert torch.equal(model(ids, attention_mask=torch.ones(2, 6, dtype=torch.bool)).logits, reference)
        causal = torch.full((6, 6), -torch.inf).triu(1)[None, None].expand(2, 1, 6, 6)
        masks = {"linear_attention": None, "sliding_attention": causal, "full_attention": causal}
        model(ids, attention_mask=causal)
        model(ids, attention_mask=masks)


def test_cache_for_another_layout(model, ids):
    other = tiny_config(layer_types=["sliding_attention", "linear_attention", "full_attention", "linear_attention"])
    with raises(r"past_key_values was built for another layout: its layers are \['sliding_attention'"):
        model(ids, past_key_values=DynamicCache(config=other), use_cache=True)


@pytest.mark.parametrize("layers", [2, 6])
def test_cache_with_another_number_of_layers(model, ids, layers):
    other = tiny_config(num_hidden_layers=layers)
    with raises(rf"past_key_values has {layers} layers but this model has 4.*DynamicCache\(config=model.config\)"):
        model(ids, past_key_values=DynamicCache(config=other), use_cache=True)


def test_cache_without_config_for_mamba_layers(model, ids):
    with raises(r"past_key_values was built without a config.*no conv and SSM states for the Mamba layers"):
        model(ids, past_key_values=DynamicCache(), use_cache=True)


def test_cache_with_a_smaller_sliding_window(model, ids):
    with raises(r"past_key_values keeps a sliding window of 4 tokens at layer 1, this model needs 8"):
        model(ids, past_key_values=DynamicCache(config=tiny_config(sliding_window=4)), use_cache=True)


def test_cache_of_another_batch_size(model, ids):
    cache = filled_cache(model, ids)
    with raises(r"past_key_values holds a batch of 2 sequences but the input has 1"):
        model(ids[:1, :1], past_key_values=cache, use_cache=True)


def test_cache_filled_by_a_model_of_other_widths(model, ids):
    cache = filled_cache(tiny_model(hidden_size=48), ids)
    with raises(r"past_key_values was built for another config: layer 0 \(linear_attention\) holds states of widths"):
        model(ids[:, :1], past_key_values=cache, use_cache=True)


FOREIGN_CACHES = {
    "a string": ("DynamicCache", "str"),
    "a tuple": (((torch.zeros(1), torch.zeros(1)),), "tuple"),
    "an EncoderDecoderCache": (
        EncoderDecoderCache(DynamicCache(), DynamicCache()),
        r"an EncoderDecoderCache \(for encoder-decoder models\)",
    ),
    "a tensor": (torch.zeros(2), "Tensor"),
    "an object": (object(), "object"),
}


@pytest.mark.parametrize("name", list(FOREIGN_CACHES))
@pytest.mark.parametrize("argument", ["cache", "past_key_values"])
def test_cache_that_is_not_a_cache(model, ids, argument, name):
    """One TypeError naming what is taken, from forward and from generate (where transformers fails on a missing
    attribute, `_is_user_defined` or `is_compileable`, or says only that a tuple is not supported)."""
    cache, given = FOREIGN_CACHES[name]
    message = (
        r"^The cache \(`cache=` or `past_key_values=`\) must be a transformers Cache built for this model, "
        rf"`DynamicCache\(config=model.config\)` or `StaticCache\(config=model.config, max_cache_len=...\)`, "
        rf"or None for a new one; got {given}\.$"
    )
    with pytest.raises(TypeError, match=message):
        model(ids, **{argument: cache}, use_cache=True)
    with pytest.raises(TypeError, match=message):
        model.generate(ids, **{argument: cache}, max_new_tokens=2, do_sample=False)


def test_an_encoder_decoder_cache_made_of_a_samba_cache(model, ids):
    """Samba is a decoder. transformers' EncoderDecoderCache reads a single cache as key/value pairs, and failed on
    a bare missing attribute (`'SambaMambaLayer' object has no attribute 'keys'`); it now says what the layer holds.
    Built from two caches, it is refused where forward and generate take it."""
    cache = DynamicCache(config=model.config)
    model(ids, cache=cache, use_cache=True)
    with pytest.raises(AttributeError, match=r"^A Samba cache's Mamba layer holds recurrent states, not keys and"):
        EncoderDecoderCache(cache)
    with pytest.raises(TypeError, match=r"got an EncoderDecoderCache \(for encoder-decoder models\)\.$"):
        model(ids[:, :1], cache=EncoderDecoderCache(cache, DynamicCache()))


@pytest.mark.parametrize("implementation", ["offloaded", "offloaded_static"])
def test_offloaded_cache_off_a_gpu(model, ids, implementation):
    # transformers' offloading synchronises CUDA streams: without CUDA it fails on "Torch not compiled with CUDA
    # enabled" (an AssertionError from inside torch), for Llama as for Samba
    with raises(
        rf"^cache_implementation='{implementation}' moves the cache between a CUDA GPU and the CPU, but this "
        r"model is on cpu: leave it out"
    ):
        model.generate(ids, cache_implementation=implementation, max_new_tokens=2, do_sample=False)


def test_inputs_embeds_of_an_integer_dtype(model, ids):
    embeds = torch.ones(2, 6, model.config.hidden_size, dtype=torch.long)
    with raises(
        r"^inputs_embeds must be floating point \(embedding vectors\), got dtype torch.int64: pass token ids "
        r"as `input_ids`"
    ):
        model(inputs_embeds=embeds)
    with raises(r"got dtype torch.int32"):
        model.generate(inputs_embeds=embeds.int(), max_new_tokens=2, do_sample=False)
    model(inputs_embeds=embeds.float())


def test_a_decoding_step_on_a_gpu_reads_no_values(model, ids):
    """The id and mask checks read values back to the host: on a CPU always; on a GPU (here a `meta` tensor, which
    is not on the CPU either) the prompt's are read but not a decoding step's, one token per sequence over a filled
    cache, where the read would wait for the GPU at every step (tests/test_gpu.py counts the synchronisations)."""
    cache = filled_cache(model, ids)
    step, prompt = ids[:, :1], ids
    from samba_hf.validation_samba import reads_values

    check = lambda tokens, cache: reads_values(tokens, cache, model.config)  # noqa: E731
    assert check(step, cache) and check(prompt, cache) and check(prompt, None)  # CPU: always
    gpu_step, gpu_prompt = step.to("meta"), prompt.to("meta")
    assert not check(gpu_step, cache)
    assert check(gpu_prompt, cache) and check(gpu_prompt, None) and check(gpu_step, None)
    assert check(gpu_step, DynamicCache(config=model.config))  # a one-token prompt into an empty cache
    assert check(gpu_step, StaticCache(config=model.config, max_cache_len=16))  # other caches: always read
    # and on a CPU the step's ids and mask are still checked
    bad = step.clone()
    bad[0, 0] = 97
    with raises(r"input_ids holds ids from \d+ to 97, but the vocabulary has 97 entries"):
        model(bad, past_key_values=cache, use_cache=True)
    mask = torch.ones(2, ids.shape[1] + 1, dtype=torch.long)
    mask[1, 0] = 2
    with raises(r"attention_mask must hold only 1 \(token\) and 0 \(padding\).*holds 2"):
        model(step, past_key_values=cache, attention_mask=mask, use_cache=True)


@pytest.mark.parametrize("layout", ["samba", "mamba2"])
def test_a_decoding_step_without_value_reads_runs_and_reads_nothing_back(monkeypatch, layout):
    """With the value reads off, as in a decoding step on a GPU, a step (with generate's 2D mask, and without) gives
    the logits it gives on a CPU, and nothing of samba-hf's in it reads a tensor's value back to the host (`item`,
    `bool`, `tolist`): each would be a synchronisation per step on a GPU. (transformers' causal-mask builder reads
    whether a 2D mask is all ones, for a full-attention layer, as it does for its own models.)"""
    import traceback

    from test_mamba2 import tiny_mamba2
    from torch.utils._python_dispatch import TorchDispatchMode

    from samba_hf import validation_samba

    model = tiny_model(seed=2) if layout == "samba" else tiny_mamba2("megatron", seed=2)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    reads = []

    class ValueReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default) and not any(
                "masking_utils" in frame.filename for frame in traceback.extract_stack()
            ):
                reads.append(str(func))
            return func(*args, **(kwargs or {}))

    def step(mask):
        cache = filled_cache(model, ids[:, :11])
        with torch.no_grad():
            return model(ids[:, 11:], past_key_values=cache, attention_mask=mask, use_cache=True).logits

    for mask in (None, torch.ones(2, 12, dtype=torch.long)):
        expected = step(mask)
        with monkeypatch.context() as patch:
            patch.setattr(validation_samba, "reads_values", lambda tokens, cache, config: False)
            tolist = torch.Tensor.tolist
            patch.setattr(torch.Tensor, "tolist", lambda t: reads.append("tolist") or tolist(t))
            cache = filled_cache(model, ids[:, :11])
            with ValueReads(), torch.no_grad():
                got = model(ids[:, 11:], past_key_values=cache, attention_mask=mask, use_cache=True).logits
        assert reads == [], reads
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda ids: ids.float(), r"labels must hold token ids \(integers, -100 where no loss is wanted\), got dtype"),
        (lambda ids: ids[:, :4], r"labels has shape \(2, 4\) but the input has \(batch, seq\) \(2, 6\)"),
        (lambda ids: ids.masked_fill(ids > 50, -5), r"labels holds -5, neither a token id of the vocabulary"),
        (lambda ids: ids + 200, r"labels holds \d+, neither a token id of the vocabulary \(0..96\) nor -100"),
    ],
)
def test_labels_that_are_not_token_ids_of_the_input(model, ids, make, message):
    """Float labels, labels of another length and ids outside the vocabulary: one error naming the labels (torch's
    own messages name neither them nor the fix)."""
    ids[0, 0] = 60  # (a value the third case changes)
    with raises(message):
        model(ids, labels=make(ids))


def test_int32_labels_give_int64_labels_loss(model, ids):
    labels = ids.masked_fill(ids < 10, -100)
    with torch.no_grad():
        expected = model(ids, labels=labels).loss
        assert torch.equal(model(ids, labels=labels.int()).loss, expected)


def test_inputs_embeds_of_another_dtype_or_not_finite(model, ids):
    embeds = model.get_input_embeddings()(ids).detach()
    with raises(r"inputs_embeds is torch.float64 but the model's embeddings are torch.float32: convert them"):
        model(inputs_embeds=embeds.double())
    for bad in (math.nan, math.inf):
        broken = embeds.clone()
        broken[1, 3, 0] = bad
        with raises(r"inputs_embeds holds NaN or inf: the model would return NaN logits"):
            model(inputs_embeds=broken)
