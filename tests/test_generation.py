"""Every generate() mode on the hybrid cache, each checked against a recomputation without cache.

The tiny model has a window of 8 and sequences run several windows past it, so the rolling KV buffer, the Mamba
states and their reordering (beams) all matter.
"""

import threading

import pytest
import torch
from conftest import cache_kwarg, held_bytes, returned_cache, tiny_model
from transformers import (
    AutoTokenizer,
    DynamicCache,
    StaticCache,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
    pipeline,
)
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionLayer

import samba_hf
from samba_hf.cli import default_model_path

NEW = 30  # tokens generated: almost 4 windows of 8


def no_cache_greedy(model, ids, steps):
    """Greedy decoding by a full forward over the whole sequence at every step."""
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(5))


def gen(model, ids, **kwargs):
    kwargs.setdefault("pad_token_id", 0)
    kwargs.setdefault("eos_token_id", None)
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=kwargs.pop("max_new_tokens", NEW), **kwargs
    )


def test_greedy_equals_no_cache_recomputation(model, prompt):
    assert torch.equal(gen(model, prompt, do_sample=False), no_cache_greedy(model, prompt, NEW))


@pytest.mark.parametrize(
    "options",
    [
        dict(do_sample=True),
        dict(do_sample=True, top_k=5, temperature=0.7),
        dict(do_sample=True, top_p=0.8, temperature=1.3, num_return_sequences=3),
    ],
)
def test_sampling_with_a_seed_equals_the_no_cache_run(model, prompt, options):
    torch.manual_seed(42)
    cached = gen(model, prompt, **options)
    torch.manual_seed(42)
    uncached = gen(model, prompt, use_cache=False, **options)
    assert torch.equal(cached, uncached)
    assert cached.shape[0] == prompt.shape[0] * options.get("num_return_sequences", 1)
    torch.manual_seed(43)
    assert not torch.equal(gen(model, prompt, **options), cached)  # the seed matters: it is really sampling


@pytest.mark.parametrize(
    "options",
    [
        dict(num_beams=3),
        dict(num_beams=4, num_return_sequences=2, length_penalty=0.5, early_stopping=True),
        dict(num_beams=3, do_sample=True),
    ],
)
def test_beam_search_reorders_mamba_states_and_kv_buffers(model, prompt, options):
    torch.manual_seed(7)
    cached = gen(model, prompt, output_scores=True, return_dict_in_generate=True, **options)
    torch.manual_seed(7)
    uncached = gen(model, prompt, use_cache=False, output_scores=True, return_dict_in_generate=True, **options)
    assert torch.equal(cached.sequences, uncached.sequences)
    assert torch.allclose(cached.sequences_scores, uncached.sequences_scores, atol=1e-4)


def assert_left_padded_rows_equal_their_own_runs(model, new_tokens=NEW):
    """Greedy on a left-padded batch of three prompts (13, 4, 9 tokens) gives each row what it gives alone."""
    seqs = [torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (13, 4, 9)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq) :], mask[row, width - len(seq) :] = seq, 1
    batched = model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    for row, seq in enumerate(seqs):
        alone = gen(model, seq[None], do_sample=False, max_new_tokens=new_tokens)
        assert torch.equal(batched[row, width - len(seq) :], alone[0])


def test_left_padded_batch_rows_equal_their_own_runs(model):
    assert_left_padded_rows_equal_their_own_runs(model)


@pytest.mark.parametrize("chunk", [1, 3, 8, 11])
def test_chunked_prefill_equals_unchunked(model, chunk):
    long_prompt = torch.randint(3, 97, (2, 37), generator=torch.Generator().manual_seed(9))
    plain = gen(model, long_prompt, do_sample=False, max_new_tokens=12)
    assert torch.equal(gen(model, long_prompt, do_sample=False, max_new_tokens=12, prefill_chunk_size=chunk), plain)


def test_continue_from_the_cache_of_an_earlier_generate(model, prompt):
    first = gen(model, prompt, do_sample=False, max_new_tokens=12, return_dict_in_generate=True)
    cache = returned_cache(first)
    # the cache holds everything but the last generated token: generate continues from there
    second = model.generate(
        first.sequences,
        attention_mask=torch.ones_like(first.sequences),
        **cache_kwarg(cache),
        max_new_tokens=15,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert torch.equal(second, no_cache_greedy(model, prompt, 27))


def test_continue_from_the_cache_of_a_forward(model, prompt):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt[:, :-1], cache=cache, use_cache=True)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        **cache_kwarg(cache),
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert torch.equal(out, no_cache_greedy(model, prompt, NEW))


@pytest.mark.parametrize("given", ["the prompt again", "fewer tokens", "only the new tokens, no mask"])
def test_a_stale_cache_continued_is_one_error(model, prompt, given):
    """A cache from an earlier generate holds the prompt and the tokens generated: continued with the prompt again
    (or fewer tokens, or new tokens without a mask covering the cache), transformers fed the prompt again on top of
    it (Llama alike: a continuation of nothing), or an empty input. One error instead; the cache is untouched."""
    first = gen(model, prompt, do_sample=False, max_new_tokens=6, return_dict_in_generate=True)
    cache = returned_cache(first)
    held = cache.get_seq_length()
    ids = {
        "the prompt again": prompt,
        "fewer tokens": prompt[:, :3],
        "only the new tokens, no mask": torch.full((2, 2), 5),
    }[given]
    message = rf"^The cache already holds {held} positions, and generate was given {ids.shape[1]} tokens: .* pass"
    with pytest.raises(ValueError, match=message):
        model.generate(ids, **cache_kwarg(cache), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert cache.get_seq_length() == held


def test_a_static_cache_reused_for_a_new_prompt_without_reset_is_one_error(model, prompt):
    """A StaticCache kept across calls holds the earlier text until `reset()`: a new prompt without it is refused,
    naming the reset; after it, the tokens are those of a fresh cache."""
    cache = StaticCache(config=model.config, max_cache_len=64)
    first = gen(model, prompt, do_sample=False, max_new_tokens=6, **cache_kwarg(cache))
    with pytest.raises(ValueError, match=r"call `cache.reset\(\)` on a StaticCache"):
        gen(model, prompt, do_sample=False, max_new_tokens=6, **cache_kwarg(cache))
    cache.reset()
    assert torch.equal(gen(model, prompt, do_sample=False, max_new_tokens=6, **cache_kwarg(cache)), first)


def test_only_the_new_tokens_with_a_mask_over_the_cache_continue_it(model, prompt):
    """transformers' other way to continue a cache: only the new tokens, with an attention mask of the whole text."""
    first = gen(model, prompt, do_sample=False, max_new_tokens=6, return_dict_in_generate=True)
    cache = returned_cache(first)
    new = first.sequences[:, cache.get_seq_length() :]
    out = model.generate(
        new,
        attention_mask=torch.ones_like(first.sequences),
        **cache_kwarg(cache),
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert torch.equal(torch.cat([first.sequences, out[:, new.shape[1] :]], 1), no_cache_greedy(model, prompt, 11))


def test_static_cache(model, prompt):
    assert torch.equal(
        gen(model, prompt, do_sample=False, cache_implementation="static"), no_cache_greedy(model, prompt, NEW)
    )


def compiled_generate_equals_eager(model, vocab: int, new_tokens: int = 20):
    """transformers' own switches (a static cache, `compile_config`) compile the decode step in one graph
    (fullgraph=True; on a GPU its default mode, "reduce-overhead", replays it as a CUDA graph); it recompiles a bounded
    number of times (the window filling), not once per token, and gives the eager dynamic cache's tokens, for a
    left-padded batch."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(3, vocab, (2, 6), generator=torch.Generator().manual_seed(1)).to(model.device)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], device=model.device)
    options = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # generate only auto-compiles on accelerators unless told
    out = model.generate(ids, cache_implementation="static", compile_config=compile_config, **options)
    assert getattr(model, "_compiled_call", None) is not None  # the decode step really ran compiled
    assert 1 <= counters["stats"]["unique_graphs"] <= 3
    assert torch.equal(out, model.generate(ids, **options))


def test_compiled_decode_step_with_static_cache_on_cpu():
    compiled_generate_equals_eager(tiny_model(seed=11), vocab=97)


class EveryStep(StoppingCriteria):
    """Calls `check(step)` after every decoding step; never stops."""

    def __init__(self, check):
        self.check, self.step = check, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.step += 1
        self.check(self.step, input_ids)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_cache_stays_bounded_while_generating(model):
    c = model.config
    steps = 3 * c.sliding_window + 5
    cache = DynamicCache(config=c)
    ids = torch.randint(3, 97, (2, 5))
    expected_bytes = model.cache_nbytes(batch_size=2)
    seen = []

    def check(step, input_ids):
        for kind, layer in zip(c.layer_types, cache.layers):
            if kind == "linear_attention":
                assert isinstance(layer, LinearAttentionLayer)
                assert layer.conv_states[0].shape == (2, c.mamba_d_inner, c.mamba_d_conv)
                assert layer.recurrent_states[0].shape == (2, c.mamba_d_inner, c.mamba_d_state)
            else:
                assert isinstance(layer, DynamicSlidingWindowLayer)
                assert layer.keys.shape[-2] <= c.sliding_window - 1 and layer.values.shape[-2] <= c.sliding_window - 1
        total = held_bytes(cache)  # storage, not views: the in-place window's room counts
        assert total <= expected_bytes
        seen.append(total)

    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        **cache_kwarg(cache),
        max_new_tokens=steps,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        stopping_criteria=StoppingCriteriaList([EveryStep(check)]),
    )
    assert len(seen) == steps
    assert seen[-1] == expected_bytes and seen[-10] == expected_bytes  # flat once the window is full


def test_cache_nbytes_against_a_full_attention_layout():
    samba = samba_hf.SambaConfig.from_preset("samba-421m")
    llama_like = samba_hf.SambaConfig.from_preset("samba-421m", layer_types=["full_attention"] * 12)
    with torch.device("meta"):
        samba_model, llama_model = samba_hf.SambaForCausalLM(samba), samba_hf.SambaForCausalLM(llama_like)
    # 6 Mamba layers: 3072 x (4 + 16) x 4 bytes; 6 SWA layers: 2 x 12 heads x (2047 kept + 128 of room) x 128 x 4 bytes
    assert samba_model.cache_nbytes(1) == 6 * 3072 * 20 * 4 + 6 * 2 * 12 * (2047 + 128) * 128 * 4
    assert samba_model.cache_nbytes(1, seq_len=65536) == samba_model.cache_nbytes(1)
    assert samba_model.cache_nbytes(1, seq_len=100) == samba_model.cache_nbytes(
        1
    )  # the buffers are whole from the start
    assert llama_model.cache_nbytes(1, seq_len=65536) == 12 * 2 * 12 * 65536 * 128 * 4
    with pytest.raises(ValueError, match="pass seq_len"):
        llama_model.cache_nbytes(1)


def test_stopping_eos_lists_and_padding(model, prompt):
    reference = gen(model, prompt, do_sample=False)
    eos_a, eos_b = int(reference[0, 14]), int(reference[1, 20])
    out = gen(model, prompt, do_sample=False, eos_token_id=[eos_a, eos_b], pad_token_id=96)
    for row, stop_at in ((0, 14), (1, 20)):
        first_eos = next(i for i in range(10, out.shape[1]) if int(out[row, i]) in (eos_a, eos_b))
        assert first_eos <= stop_at
        assert torch.equal(out[row, : first_eos + 1], reference[row, : first_eos + 1])
        assert (out[row, first_eos + 1 :] == 96).all()
    assert gen(model, prompt, do_sample=False, max_new_tokens=3).shape[1] == prompt.shape[1] + 3

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= prompt.shape[1] + 5)

    assert (
        gen(model, prompt, do_sample=False, stopping_criteria=StoppingCriteriaList([StopAfter()])).shape[1]
        == prompt.shape[1] + 5
    )


@pytest.fixture(scope="module")
def default_model_and_tokenizer():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_text_streamer_prints_what_generate_returns(default_model_and_tokenizer, capsys):
    model, tokenizer = default_model_and_tokenizer
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=20, do_sample=False, streamer=TextStreamer(tokenizer, skip_prompt=True))
    printed = capsys.readouterr().out
    assert printed.rstrip("\n") == tokenizer.decode(out[0, ids.shape[1] :])


def test_text_iterator_streamer(default_model_and_tokenizer):
    model, tokenizer = default_model_and_tokenizer
    ids = tokenizer("The Samba", return_tensors="pt").input_ids
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(out=model.generate(ids, max_new_tokens=16, do_sample=False, streamer=streamer))
    )
    thread.start()
    pieces = list(streamer)
    thread.join()
    assert "".join(pieces) == tokenizer.decode(result["out"][0, ids.shape[1] :])


def test_eight_threads_generating_from_one_model_each_get_their_own_tokens(default_model_and_tokenizer):
    """One model shared by 8 threads, each greedy-decoding its own prompt (and one of them with prompt lookup) at the
    same time: each gets the tokens it gets alone. The CPU kernels and the kernel switch keep no per-call state on
    the model."""
    from concurrent.futures import ThreadPoolExecutor

    model, tokenizer = default_model_and_tokenizer
    prompts = [f"The {word} statement" for word in ("assert", "if", "for", "while", "with", "try", "raise", "return")]
    ids = [tokenizer(prompt, return_tensors="pt").input_ids for prompt in prompts]
    modes = [{}] * 7 + [dict(prompt_lookup_num_tokens=3)]

    def run(i):
        with torch.no_grad():
            return model.generate(ids[i], max_new_tokens=24, do_sample=False, eos_token_id=None, **modes[i])

    alone = [run(i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, range(8)))
    for i in range(8):
        assert torch.equal(together[i], alone[i]), prompts[i]


def test_text_generation_pipeline(default_model_and_tokenizer):
    model, tokenizer = default_model_and_tokenizer
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    result = generator("Hello", max_new_tokens=10, do_sample=False)
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    expected = tokenizer.decode(model.generate(ids, max_new_tokens=10, do_sample=False)[0])
    assert result[0]["generated_text"] == expected
