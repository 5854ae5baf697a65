"""The hybrid cache: continuing from it gives the same logits as one pass, and it stays bounded."""

import pytest
import torch
from conftest import returned_cache, tiny_model
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionLayer

from samba_hf.cache_samba import CACHE_NAME, ForwardCache

LAYOUTS = {
    "samba": None,  # Mamba on even, sliding attention on odd layers
    "mamba_full_hybrid": ["linear_attention", "full_attention", "linear_attention", "sliding_attention"],
    "attention_first": ["sliding_attention", "linear_attention", "full_attention", "linear_attention"],
}


def run_in_chunks(model, ids, sizes, attention_mask=None):
    cache = DynamicCache(config=model.config)
    logits, start = [], 0
    for size in sizes:
        chunk = ids[:, start : start + size]
        mask = None if attention_mask is None else attention_mask[:, : start + size]
        out = model(chunk, attention_mask=mask, cache=cache, use_cache=True)
        assert returned_cache(out) is cache
        logits.append(out.logits)
        start += size
    assert start == ids.shape[1]
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("sizes", [[1] * 30, [3, 5, 1, 9, 12], [8, 8, 8, 6], [17, 13], [2, 25, 1, 1, 1]])
def test_chunked_with_cache_equals_one_pass(layout, sizes):
    model = tiny_model(layer_types=LAYOUTS[layout])
    ids = torch.randint(3, model.config.vocab_size, (2, 30))
    with torch.no_grad():
        full = model(ids).logits
        chunked, _ = run_in_chunks(model, ids, sizes)
    assert (full - chunked).abs().max().item() <= 1e-4


def test_cache_has_one_state_per_mamba_layer_and_a_bounded_window():
    model = tiny_model()
    c = model.config
    d_inner = c.mamba_expand * c.hidden_size
    ids = torch.randint(3, c.vocab_size, (3, 4 * c.sliding_window))
    cache = DynamicCache(config=c)
    with torch.no_grad():
        model(ids[:, :5], cache=cache, use_cache=True)
        for t in range(5, ids.shape[1]):  # decode token by token, checking every layer after each step
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
            for i, layer in enumerate(cache.layers):
                if c.layer_types[i] == "linear_attention":
                    assert isinstance(layer, LinearAttentionLayer)
                    assert layer.conv_states[0].shape == (3, d_inner, c.mamba_d_conv)
                    assert layer.recurrent_states[0].shape == (3, d_inner, c.mamba_d_state)
                    assert layer.recurrent_states[0].dtype == torch.float32
                else:
                    assert isinstance(layer, DynamicSlidingWindowLayer)
                    assert layer.keys.shape == (3, c.num_key_value_heads, min(t + 1, c.sliding_window - 1), c.head_dim)
    assert cache.get_seq_length() == ids.shape[1]


def test_forward_with_use_cache_returns_the_hybrid_cache():
    model = tiny_model()
    out = model(torch.randint(3, 97, (1, 20)), use_cache=True)
    kinds = [type(layer).__name__ for layer in returned_cache(out).layers]
    # transformers' layers: the Mamba one able to go back to a recorded token, the window written in place
    assert kinds == ["SambaMambaLayer", "SambaSlidingWindowLayer"] * 2
    assert all(isinstance(layer, LinearAttentionLayer) for layer in returned_cache(out).layers[::2])
    assert returned_cache(model(torch.randint(3, 97, (1, 4)), use_cache=False)) is None


def test_the_cache_is_taken_under_either_name():
    """transformers 5.24 passes the cache as `cache`, 5.23 (and users' code) as `past_key_values`: the same tokens
    either way, on whichever transformers is installed, and the old name read off an output gives the same cache;
    one cache under both names is refused. (The other tests use the installed transformers' names.)"""
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 20))
    with torch.no_grad():
        full = model(ids).logits
        for name in ("cache", "past_key_values"):
            cache = DynamicCache(config=model.config)
            first = model(ids[:, :13], use_cache=True, **{name: cache}).logits
            out = model(ids[:, 13:], use_cache=True, **{name: cache})
            assert (torch.cat([first, out.logits], 1) - full).abs().max().item() <= 1e-4, name
            assert out.past_key_values is cache is returned_cache(out)  # 5.24 logs the old name's deprecation once
        with pytest.raises(ValueError, match="Pass the cache once, as `cache` or as `past_key_values`, not as both"):
            model(ids, cache=DynamicCache(config=model.config), past_key_values=DynamicCache(config=model.config))


def test_all_mamba_model_continues_from_its_cache():
    model = tiny_model(layer_types=["linear_attention"] * 2, num_hidden_layers=2)
    ids = torch.randint(3, 97, (1, 21))
    with torch.no_grad():
        chunked, _ = run_in_chunks(model, ids, [10, 1, 10])
        assert (model(ids).logits - chunked).abs().max().item() <= 1e-4


@pytest.mark.parametrize("layout", ["samba", "mamba_full_hybrid"])
def test_left_padded_rows_equal_the_sequences_run_alone(layout):
    model = tiny_model(layer_types=LAYOUTS[layout])
    lengths = [23, 9, 16]
    seqs = [torch.randint(3, 97, (n,)) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq) :] = seq
        mask[row, width - len(seq) :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, position_ids=position_ids).logits
        for row, seq in enumerate(seqs):
            alone = model(seq[None]).logits[0]
            assert (batched[row, width - len(seq) :] - alone).abs().max().item() <= 1e-4


def test_left_padded_batch_continues_from_cache():
    """Prefill a left-padded batch, then decode: each row matches its own unpadded run."""
    model = tiny_model()
    seqs = [torch.randint(3, 97, (n,)) for n in (14, 6)]
    ids = torch.zeros(2, 14, dtype=torch.long)
    mask = torch.zeros(2, 14, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, 14 - len(seq) :], mask[row, 14 - len(seq) :] = seq, 1
    nxt = torch.randint(3, 97, (2, 5))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        model(ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        steps = []
        for t in range(5):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            pos = pos[:, -1:] + 1
            steps.append(
                model(nxt[:, t : t + 1], attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits
            )
        decoded = torch.cat(steps, dim=1)
        for row, seq in enumerate(seqs):
            alone = model(torch.cat([seq, nxt[row]])[None]).logits[0, -5:]
            assert (decoded[row] - alone).abs().max().item() <= 1e-4


def test_inference_chunks_on_a_gpu_are_at_least_64k_tokens():
    """On a GPU each chunk after the first costs the Mamba scan a continuation from the cache (measured on an H200:
    with mamba-ssm, 8K took 3.7x the time of 4K), so there the chunks are at least 65536 tokens; the CPU keeps
    `inference_chunk_size`. (The input's device is all the rule reads: a stand-in says CUDA here.)"""
    from types import SimpleNamespace

    model = tiny_model(seed=2)
    assert model.config.inference_chunk_size == 4096
    with torch.no_grad():

        def chunk(length, cuda):
            no_cache = ForwardCache(None, model.config)
            return model.model._inference_chunk(
                SimpleNamespace(shape=(1, length, 32), is_cuda=cuda), None, no_cache, {}
            )

        assert chunk(10_000, cuda=False) == 4096
        assert chunk(10_000, cuda=True) == 0  # one pass
        assert chunk(100_000, cuda=True) == 65536
    model.config.inference_chunk_size = 0
    with torch.no_grad():
        assert chunk(100_000, cuda=True) == 0  # 0 still turns chunking off


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_inference_chunking_equals_one_pass(layout, monkeypatch):
    model = tiny_model(layer_types=LAYOUTS[layout])
    ids = torch.randint(3, 97, (2, 45))
    with torch.no_grad():
        model.config.inference_chunk_size = 0
        whole = model(ids, use_cache=True)
        model.config.inference_chunk_size = 7
        calls = []
        original = type(model.model)._run_layers
        monkeypatch.setattr(
            type(model.model), "_run_layers", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
        )
        chunked = model(ids, use_cache=True)
        assert len(calls) == 7  # 45 tokens in chunks of 7
        assert (whole.logits - chunked.logits).abs().max() <= 1e-4
        nxt = torch.randint(3, 97, (2, 1))
        a = model(nxt, cache=returned_cache(whole), use_cache=True).logits
        b = model(nxt, cache=returned_cache(chunked), use_cache=True).logits
        assert (a - b).abs().max() <= 1e-4
        assert returned_cache(model(ids, use_cache=False)) is None
    calls.clear()
    model(ids)  # with autograd on, never chunked (the training graph stays one piece)
    assert len(calls) == 1


@pytest.mark.parametrize("window", [8, 40])  # room (window / 16) of 1 and of 2 positions
def test_the_in_place_window_returns_what_transformers_layer_returns_without_copying_the_window(window, monkeypatch):
    """SambaSlidingWindowLayer against transformers' DynamicSlidingWindowLayer, fed the same keys/values: a prompt,
    then 3 windows of one-token steps with a beam reordering and a two-token step among them. Every step returns the
    same tensors; a one-token step writes into the layer's buffer and returns a view of it. New buffers: at the
    first step, after the reordering and after a step longer than the room."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from samba_hf.cache_samba import SambaSlidingWindowLayer, window_slack

    g, slack = torch.Generator().manual_seed(0), window_slack(window)
    ours, theirs = SambaSlidingWindowLayer(sliding_window=window), DynamicSlidingWindowLayer(sliding_window=window)
    seeds = []
    seed = SambaSlidingWindowLayer._seed
    monkeypatch.setattr(SambaSlidingWindowLayer, "_seed", lambda self: (seeds.append(self.keys.shape[-2]), seed(self)))

    def kv(n):
        return torch.randn(3, 2, n, 4, generator=g), torch.randn(3, 2, n, 4, generator=g)

    prompt, reorder_at, long_step_at = 5, 2 * window, 2 * window + 4
    steps = [prompt] + [1] * (long_step_at - 1) + [slack + 1] + [1] * window
    for i, n in enumerate(steps):
        k, v = kv(n)
        got, expected = ours.update(k, v), theirs.update(k, v)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert ours.get_seq_length() == theirs.get_seq_length() and ours.get_mask_sizes(1) == theirs.get_mask_sizes(1)
        if n == 1:
            assert got[0]._base is ours._buffer[0] and got[1]._base is ours._buffer[1]  # views, not copies
            assert ours._buffer[0].shape[-2] == window - 1 + slack
        if i == reorder_at:  # beams reordered between steps, as generate does
            order = torch.tensor([2, 0, 1])
            for layer in (ours, theirs):
                layer.keys, layer.values = layer.keys[order], layer.values[order]
    assert seeds == [prompt, window - 1, window - 1]  # the first step, after the reordering, after the long step


# A prompt of 6 and 10 new tokens write 15 positions (the last token is never fed back); the tiny window is 8.
# layout -> (config overrides, a max_cache_len one too small, the smallest that works, the layer the error names)
STATIC_ROOM = {
    "sliding window 8": (dict(), 7, 8, r"layer 1 \(sliding-window attention\)"),
    "sliding window 64": (dict(sliding_window=64), 14, 15, r"layer 1 \(sliding-window attention\)"),
    "full attention": (
        dict(layer_types=["linear_attention", "full_attention"] * 2),
        14,
        15,
        r"layer 1 \(full attention\)",
    ),
}


@pytest.mark.parametrize("layout", list(STATIC_ROOM))
def test_generate_refuses_a_static_cache_too_small_for_the_prompt_and_new_tokens(layout):
    """A sliding layer needs min(15, window) positions, a full-attention layer all 15: one fewer used to give other
    tokens without an error (sliding), or an IndexError from inside transformers (full, as for Llama). The cache goes
    under the installed transformers' name for it (`generate` of 5.23 knows only `past_key_values`)."""
    overrides, too_small, needed, layer = STATIC_ROOM[layout]
    model, ids = tiny_model(**overrides), torch.randint(3, 97, (1, 6))
    options = dict(max_new_tokens=10, do_sample=False)
    with pytest.raises(
        ValueError,
        match=rf"^The StaticCache keeps {too_small} positions at {layer}, but this generate "
        rf"needs {needed}: it writes 15 \(the prompt and max_new_tokens.*"
        r"StaticCache\(config=model.config, max_cache_len=15\)",
    ):
        model.generate(ids, **{CACHE_NAME: StaticCache(config=model.config, max_cache_len=too_small)}, **options)
    enough = StaticCache(config=model.config, max_cache_len=needed)
    assert torch.equal(model.generate(ids, **{CACHE_NAME: enough}, **options), model.generate(ids, **options))


@pytest.mark.skipif(
    CACHE_NAME == "past_key_values",
    reason="transformers 5.23's generate asks a static cache of "
    "Mamba layers only for a sequence length, which it does not keep, and fails",
)
def test_a_static_cache_of_any_size_is_enough_for_mamba_layers():
    model, ids = tiny_model(layer_types=["linear_attention"] * 4), torch.randint(3, 97, (1, 6))
    options = dict(max_new_tokens=10, do_sample=False)
    smallest = StaticCache(config=model.config, max_cache_len=1)
    assert torch.equal(model.generate(ids, **{CACHE_NAME: smallest}, **options), model.generate(ids, **options))


def test_a_recording_window_is_written_in_place_with_transformers_contents():
    """While assisted decoding records, a check of drafted tokens is written into the window's buffer (no copy of
    the window per check) and every position is kept until `crop`, as transformers' `DynamicSlidingWindowLayer`
    keeps them: through prompt, steps, recorded checks taken back in part, whole or not at all, two recorded checks
    in a row and crops of 0, the keys and values each update returns and the layer holds equal transformers'."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from samba_hf.cache_samba import SambaSlidingWindowLayer

    torch.manual_seed(0)
    window = 32  # slack 2: a buffer of 33 positions
    ours, theirs = SambaSlidingWindowLayer(sliding_window=window), DynamicSlidingWindowLayer(sliding_window=window)
    writes = []
    plan = [("update", 40), ("update", 1), ("record", None), ("update", 2), ("crop", -1), ("update", 2), ("crop", 0)]
    plan += [("update", 2), ("crop", -2), ("update", 1), ("update", 2), ("crop", -2), ("stop", None)]
    plan += [("update", 1)] * 5
    for op, n in plan:
        if op == "record":
            ours.activate_past_recording(), theirs.activate_past_recording()
        elif op == "stop":
            ours.record_past = theirs.record_past = False
        elif op == "crop":
            ours.crop(n), theirs.crop(n)
        else:
            k, v = torch.randn(2, 1, 2, n, 4)
            buffer = getattr(ours, "_buffer", (None,))[0]
            got, expected = ours.update(k, v), theirs.update(k, v)
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), (op, n)
            writes.append(buffer is not None and ours._buffer[0] is buffer)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values), (op, n)
        assert ours.cumulative_length == theirs.cumulative_length
    assert sum(writes[2:]) >= 6  # the steps and checks after the first wrote into one buffer
