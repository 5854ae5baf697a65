"""The decoding cache of the Samba family: transformers' hybrid `DynamicCache(config=...)`, with what samba-hf adds.

- `SambaSlidingWindowLayer`: the sliding-window key/value layer, written in place; `SambaMambaLayer`: the Mamba
  layer (conv window and SSM state), which can be taken back to an earlier token. `use_samba_layers` puts them into a
  fresh cache.
- `ForwardCache`: the cache as one forward uses it, made and checked in one call (under either argument name:
  `cache` in transformers >= 5.24, `past_key_values` in 5.23; `CACHE_NAME` is the installed one), and what the
  forward asks of it: its past length, its contents, the tokens that record for a rollback (assisted generation:
  while transformers' `activate_past_recording` is on, a forward records what `crop` needs; `record_states`).
- What a cache holds, read from shapes only (for the input checks): `cache_layer_kind`, `cache_layer_shape`,
  `past_length`, `sliding_cache_length`.
- Sizes and room: `cache_nbytes` (the bytes a cache holds at a length), `check_static_cache_room`.

Part of the remote code of a saved model: imports only torch and transformers.
"""

import contextlib

import torch
from torch import nn
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    DynamicCache,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    StaticLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast

ATTENTION_TYPES = ("sliding_attention", "full_attention")

# transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache` (in the models, the mask
# builders and the outputs); 5.23 has the old name. samba-hf's forwards take either, and hand on the installed one.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def has_attention_layers(config) -> bool:
    """Whether the layout has attention layers, whose cache counts positions (Mamba and MLP layers count none)."""
    return any(kind in ATTENTION_TYPES for kind in config.layer_types)


def check_cache_type(cache):
    """One TypeError, naming what is taken, for a cache argument that is no cache of a decoder: a string, a tuple, an
    `EncoderDecoderCache` (an encoder-decoder model's pair of caches), any other object. Where it comes from, forward
    or generate, transformers would fail on a missing attribute."""
    if isinstance(cache, Cache) and not isinstance(cache, EncoderDecoderCache):
        return
    given = "an EncoderDecoderCache (for encoder-decoder models)" if isinstance(cache, Cache) else type(cache).__name__
    raise TypeError(
        f"The cache (`cache=` or `past_key_values=`) must be a transformers Cache built for this model, "
        f"`DynamicCache(config=model.config)` or `StaticCache(config=model.config, max_cache_len=...)`, or None for a "
        f"new one; got {given}."
    )


def check_cache_continues(cache: Cache | None, given: int, config):
    """One ValueError for a cache that already holds as many positions as the tokens `generate` was given (a cache
    from an earlier call, continued with its prompt again, or with only the new tokens and no longer mask):
    transformers would feed all of them again on top of the cache, or nothing. Caches of layouts without attention
    layers count no positions, and are not checked. (A cache of another kind was refused before, by
    `check_cache_type`.)"""
    if cache is None or not has_attention_layers(config):
        return
    held = cache.get_seq_length()
    if held >= given:
        raise ValueError(
            f"The cache already holds {held} positions, and generate was given {given} tokens: a cache continues "
            f"the text it was built from, so pass that whole text followed by the new tokens ({held + 1} or more "
            "in all; or only the new ones with an attention_mask covering the whole text), or start from this prompt "
            "with a new cache (leave it out, pass a new `DynamicCache(config=model.config)`, or call "
            "`cache.reset()` on a StaticCache)."
        )


def window_slack(sliding_window: int) -> int:
    """Positions a `SambaSlidingWindowLayer` keeps beyond the `sliding_window - 1` it must: one 16th of the window."""
    return max(1, sliding_window // 16)


class SambaSlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window key/value cache layer, written in place.

    `DynamicSlidingWindowLayer` concatenates (copies) the whole window on every step. Here the kept
    `sliding_window - 1` positions sit at the front of a buffer with `window_slack` free positions after them; a step
    writes its new positions there and returns a view of [kept | new]. When the room is used up the kept positions
    move back to the front: one copy of the window every `window_slack` steps instead of one per step, for 1/16 of
    the window more memory. The buffer is allocated whole at the first decoding step (as a static cache's), which
    also lets go of the prompt's keys and values that transformers' layer keeps a view of. Whatever replaced `keys` /
    `values` meanwhile (beam reordering, cropping, batch selection) is taken as the new contents. While assisted
    decoding records, a check of drafted tokens is written the same way and the layer keeps every position until
    `crop`, as transformers' layer does (its `crop` then runs on the views, and the layer reads back where they
    are). A step of more new positions than the slack (a prompt, a long chunk), or recorded positions that outgrow
    the buffer, go through transformers' path."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[-2]
        window = self.sliding_window - 1
        if self.record_past:
            self._kept_recording = True
        elif getattr(self, "_kept_recording", False):  # recording turned off without a `crop`: let go of what it kept
            self._kept_recording = False
            if self.keys.shape[-2] > window:
                self.keys = self.keys[..., -window:, :].contiguous()
                self.values = self.values[..., -window:, :].contiguous()
        if torch.compiler.is_exporting():  # a program's cache keeps one structure: transformers' layer (as exporters
            return super().update(key_states, value_states, *args, **kwargs)  # trace it), never the buffer
        if not self.is_initialized or new > window_slack(self.sliding_window):
            visible = super().update(key_states, value_states, *args, **kwargs)
            # the kept window as a tensor of its own, not a view into this forward's keys: it lets go of them, and a
            # decoding step traced from this cache (transformers' export_for_generation) sees the layout an
            # exported prompt's cache has
            self.keys, self.values = self.keys.contiguous(), self.values.contiguous()
            return visible
        if not self._in_place():  # first step, or replaced from outside
            if self.keys.shape[-2] + new > self.sliding_window - 1 + window_slack(self.sliding_window):
                return super().update(key_states, value_states, *args, **kwargs)  # (recorded, not yet cropped)
            self._seed()
        keys, values = self._buffer  # (batch, heads, sliding_window - 1 + slack, head_dim)
        if self._end + new > keys.shape[-2]:  # the room is used up: move the kept positions to the front
            kept = self._end - self._start
            if kept + new > keys.shape[-2]:  # recorded positions fill the buffer: transformers' path
                return super().update(key_states, value_states, *args, **kwargs)
            keys[..., :kept, :] = keys[..., self._start : self._end, :].clone()
            values[..., :kept, :] = values[..., self._start : self._end, :].clone()
            self._start, self._end = 0, kept
        keys[..., self._end : self._end + new, :] = key_states
        values[..., self._end : self._end + new, :] = value_states
        first = max(self._start, self._end - (self.sliding_window - 1))  # the window before the new positions
        visible = (keys[..., first : self._end + new, :], values[..., first : self._end + new, :])
        self._end += new
        if not self.record_past:  # (recording keeps every position until `crop`)
            self._start = max(self._start, self._end - (self.sliding_window - 1))
        self.keys, self.values = keys[..., self._start : self._end, :], values[..., self._start : self._end, :]
        self._kept = (self.keys, self.values)
        self.cumulative_length += new
        return visible

    def crop(self, tokens_to_remove: int):
        """transformers' crop, on the views of the buffer where the layer is written in place."""
        self._kept_recording = False
        in_place = self._in_place()
        super().crop(tokens_to_remove)
        buffer = self._buffer[0] if in_place else None
        if in_place and self.keys.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
            self._start = (self.keys.storage_offset() - buffer.storage_offset()) // buffer.stride(-2)
            self._end = self._start + self.keys.shape[-2]
            self._kept = (self.keys, self.values)

    def _in_place(self) -> bool:
        """Whether `keys` / `values` are still the views of the buffer this layer last wrote."""
        kept = getattr(self, "_kept", (None, None))
        return self.is_initialized and self.keys is kept[0] and self.values is kept[1]

    def _seed(self):
        """A fresh buffer, `sliding_window - 1 + window_slack` positions long, holding the current `keys` / `values`
        at its front."""
        batch, heads, length, head_dim = self.keys.shape
        positions = self.sliding_window - 1 + window_slack(self.sliding_window)
        self._buffer = (
            self.keys.new_empty(batch, heads, positions, head_dim),
            self.values.new_empty(batch, heads, positions, self.values.shape[-1]),
        )
        self._buffer[0][..., :length, :] = self.keys
        self._buffer[1][..., :length, :] = self.values
        self._start, self._end = 0, length


class SambaMambaLayer(LinearAttentionLayer):
    """transformers' Mamba cache layer (one conv window and one SSM state), which can also be taken back to an earlier
    token: while it records (`activate_past_recording`, which assisted generation turns on), the mixer hands it the
    SSM state after each token it records (`record_states`), and `crop(-n)` puts back the state of n tokens before the
    last. transformers' layer keeps the conv window's inputs while recording and crops them itself. Each `crop` lets
    go of what was recorded: k + 1 states at most between two crops for a k-token draft (one more in a verification
    that starts with the prompt, `ForwardCache.tokens_to_record`)."""

    @property
    def keys(self):
        """(A Mamba layer holds a convolution window and an SSM state, no keys or values: what iterates a cache as
        key/value pairs, such as `EncoderDecoderCache(cache)`, gets this instead of a bare missing attribute.)"""
        raise AttributeError(
            "A Samba cache's Mamba layer holds recurrent states, not keys and values: a Samba cache cannot be read "
            "as key/value pairs (as `EncoderDecoderCache(cache)` or a legacy tuple would); Samba is a decoder, so "
            "pass the cache itself to the model or to generate."
        )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorded: list[torch.Tensor] = []  # the SSM state after each recorded token, oldest first

    @property
    def is_croppable(self) -> bool:
        return True

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        kept = self.conv_states[state_idx]
        if not self.record_past and kept is not None and kept.shape[-1] > self.conv_kernel_size[state_idx]:
            # recording was turned off without a `crop`: what it kept beyond the window is let go, as a crop(0) would
            self.conv_states[state_idx] = kept[..., -self.conv_kernel_size[state_idx] :].contiguous()
            self.recorded = []
        window = super().update_conv_state(conv_states, state_idx, **kwargs)
        if self.record_past and self.conv_states[state_idx].shape[-1] < self.conv_kernel_size[state_idx]:
            # a first forward while recording keeps its inputs unpadded: pad them, so that `crop` always finds the
            # window it cuts from (the positions before the first token are zeros to the conv anyway)
            short = self.conv_states[state_idx]
            self.conv_states[state_idx] = nn.functional.pad(
                short, (self.conv_kernel_size[state_idx] - short.shape[-1], 0)
            )
        return window

    def record_states(self, states: list[torch.Tensor], before: torch.Tensor | None):
        """Keep `states`, the SSM states after each of this forward's recorded tokens, in order; the first recording
        forward since a `crop` also keeps `before`, the state its first recorded token started from (None: zeros),
        so that every token it recorded can be taken back."""
        if not self.recorded:
            self.recorded.append(torch.zeros_like(states[0]) if before is None else before.clone())
        self.recorded.extend(states)

    def crop(self, tokens_to_remove: int):
        """Take the layer back by `-tokens_to_remove` tokens (0: keep all), and let go of what was recorded."""
        back = -tokens_to_remove
        if self.record_past and back >= max(len(self.recorded), 1):
            raise RuntimeError(
                f"`crop({tokens_to_remove})` takes a Mamba layer back {back} tokens, but it recorded the states of "
                f"only the last {max(len(self.recorded) - 1, 0)}: a `crop` lets go of what was recorded before it, "
                "and a recording forward keeps `logits_to_keep` + 1 of its tokens, so ask for the logits of every "
                "token you may go back to."
            )
        super().crop(tokens_to_remove)  # the conv window; raises where nothing was recorded, or for a positive count
        if back:
            self.recurrent_states[0].copy_(self.recorded[-1 - back])
        self.recorded = []

    def reset(self):
        super().reset()
        self.recorded = []


def use_samba_layers(cache: Cache):
    """Fresh layers of a cache become samba-hf's: a `DynamicCache`'s sliding-window layers `SambaSlidingWindowLayer`s
    (same contents and behaviour, no copy of the window per step), any cache's Mamba layers `SambaMambaLayer`s (which
    can be taken back while recording). Layers already holding states, and other layers, are left as they are; a
    layer's recording switch is kept."""
    layers = getattr(cache, "layers", [])
    for i, layer in enumerate(layers):
        if type(layer) is DynamicSlidingWindowLayer and not layer.is_initialized:
            layers[i] = SambaSlidingWindowLayer(sliding_window=layer.sliding_window)
        elif type(layer) is LinearAttentionLayer and not any(layer.is_conv_states_initialized.values()):
            layers[i] = SambaMambaLayer(number_of_states=layer.number_of_states)
        else:
            continue
        layers[i].record_past = layer.record_past


def record_states(cache: Cache, layer_idx: int, states: list[torch.Tensor], before: torch.Tensor | None = None):
    """Hand a recording Mamba layer the SSM states after each token its forward recorded, and the state the first of
    them started from."""
    layer = cache.layers[layer_idx]
    if not isinstance(layer, SambaMambaLayer):
        raise TypeError(
            f"layer {layer_idx} of the cache is a {type(layer).__name__}, which cannot take its SSM state back: pass "
            "`DynamicCache(config=model.config)` (samba-hf's forward makes its Mamba layers rollback-capable)."
        )
    layer.record_states(states, before)


def stop_recording(cache: Cache | None):
    """Turn a cache's recording off (what transformers' assisted decoding leaves on), letting go of what it kept: the
    Mamba layers' conv inputs beyond the window and their states (`crop(0)`); the attention layers keep their window
    again from their next update."""
    for layer in getattr(cache, "layers", ()):
        if getattr(layer, "record_past", False):
            if isinstance(layer, LinearAttentionCacheLayerMixin) and all(layer.is_conv_states_initialized.values()):
                layer.crop(0)
                for i, window in layer.conv_states.items():  # (crop leaves a view of the longer inputs)
                    layer.conv_states[i] = window.contiguous()
            layer.record_past = False


class ForwardCache:
    """The cache as one forward of a Samba model uses it, made and checked in one call (`prepare`): `cache` is the
    transformers Cache the layers get (None: no cache), and what the forward asks of it is asked here: how many
    positions came before, whether it holds anything, whether it can take the input in pieces, and which last tokens
    record for a rollback."""

    def __init__(self, cache: Cache | None, config):
        self.cache, self.config = cache, config

    @classmethod
    def prepare(cls, config, past_key_values: Cache | None, cache: Cache | None, use_cache: bool) -> "ForwardCache":
        """The cache given under either name (`cache`: what transformers >= 5.24 passes; `past_key_values`: 5.23),
        checked to be a cache (`check_cache_type`), or a new `DynamicCache(config=...)` where one is wanted; its fresh
        layers made samba-hf's (`use_samba_layers`)."""
        for given in (past_key_values, cache):
            if given is not None:
                check_cache_type(given)
        if past_key_values is not None and cache is not None and past_key_values is not cache:
            raise ValueError("Pass the cache once, as `cache` or as `past_key_values`, not as both.")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = DynamicCache(config=config)
        if cache is not None:
            use_samba_layers(cache)
        return cls(cache, config)

    @property
    def counts_positions(self) -> bool:
        """Whether the cache tracks a sequence length: a cache of Mamba (and MLP) layers only does not (asking it
        raises)."""
        return self.cache is not None and has_attention_layers(self.config)

    def past_length(self) -> int:
        """The positions before this input, for its position ids (0 where the cache counts none)."""
        return self.cache.get_seq_length() if self.counts_positions else 0

    def has_content(self) -> bool:
        if self.cache is None:
            return False
        return self.cache.get_seq_length() > 0 if self.counts_positions else self.cache.has_previous_state()

    def takes_pieces(self) -> bool:
        """Whether an input can go through this cache in pieces: none yet, or the dynamic one (a static cache comes
        from generate with its masks made for the whole input)."""
        return self.cache is None or type(self.cache) is DynamicCache

    def for_pieces(self) -> Cache:
        """The cache pieces of an input continue through: this one, or a new one for this forward alone."""
        return self.cache if self.cache is not None else DynamicCache(config=self.config)

    def is_recording(self) -> bool:
        """Whether any layer records (assisted generation's verification of a draft)."""
        return self.cache is not None and any(self.cache.is_recording_past(i) for i in range(len(self.cache.layers)))

    def tokens_to_record(self, attention_mask, length: int, keep_last: int | None) -> int:
        """In a forward of `length` tokens over a recording cache, how many last tokens record what `crop` needs,
        where not all: `keep_last` + 1. transformers asks for the logits of the draft and the token after it, and
        takes the cache back at most that far (by the draft, or by one token into an assistant's prompt); a draft
        checked together with the prompt then records k + 2 states for a k-token draft, not the whole prompt's. 0
        (every token records, or none) without `keep_last`, with padding, or on an input no longer than that."""
        if keep_last is None or not self.is_recording() or isinstance(attention_mask, dict):
            return 0
        if attention_mask is not None and not bool(attention_mask.all()):
            return 0
        return keep_last + 1 if keep_last + 1 < length else 0

    @contextlib.contextmanager
    def recording_paused(self):
        """The cache's layers record nothing inside (the part of a forward no `crop` can reach back to)."""
        layers = [layer for layer in getattr(self.cache, "layers", ()) if getattr(layer, "record_past", False)]
        for layer in layers:
            layer.record_past = False
        try:
            yield
        finally:
            for layer in layers:
                layer.record_past = True


def cache_layer_kind(layer) -> str:
    """The kind of layer a cache layer was built for, named as in `config.layer_types` ("dummy": a layer that keeps
    nothing, for layers that read another layer's cache)."""
    if isinstance(layer, DummyLayer):
        return "dummy"
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        return "linear_attention"
    if isinstance(layer, CacheLayerMixin):
        return "sliding_attention" if getattr(layer, "is_sliding", False) else "full_attention"
    return type(layer).__name__


def cache_layer_shape(layer) -> tuple[int, tuple] | None:
    """(batch, widths) of what a cache layer holds, None while it holds nothing: widths are (d_inner, d_state,
    conv kernel) for a Mamba layer, (heads, head_dim, d_state, conv kernel) for a Mamba-2 layer, (kv heads,
    head_dim) for an attention layer. Reads shapes only."""
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        ssm = layer.recurrent_states.get(0)
        return None if ssm is None else (ssm.shape[0], (*ssm.shape[1:], layer.conv_kernel_size.get(0)))
    keys = getattr(layer, "keys", None)
    if not isinstance(keys, torch.Tensor) or keys.ndim != 4:
        return None
    return keys.shape[0], (keys.shape[1], keys.shape[3])


def past_length(cache: Cache | None, config) -> int | None:
    """The tokens a 2D mask must cover before the new ones, or None where the cache cannot say cheaply (Mamba
    layers only, or a static cache, whose masks generate makes itself)."""
    if cache is None:
        return 0
    if type(cache) is not DynamicCache:
        return None
    if has_attention_layers(config):
        return cache.get_seq_length()
    return None if cache.has_previous_state() else 0


def sliding_cache_length(cache: Cache | None, config) -> int:
    """How many positions the sliding layers' cache holds before this input (they all hold the same)."""
    if cache is None:
        return 0
    index = config.layer_types.index("sliding_attention")
    if index >= len(cache.layers) or not cache.layers[index].is_initialized:
        return 0
    return cache.layers[index].keys.shape[-2]


def cache_nbytes(config, batch_size: int, seq_len: int | None, element: int) -> int:
    """Bytes held by `DynamicCache(config=config)` once `seq_len` tokens have been seen, keys, values and conv
    windows in `element`-byte numbers (the SSM states are float32 whatever the dtype). Counted as storage, from the
    first decoding step on (after a prompt and before that step, a sliding layer still holds the prompt's keys and
    values, as transformers' layer does).

    - A Mamba layer: one conv window (batch, d_inner, d_conv) and one SSM state (batch, d_inner, d_state), whatever
      the length; a Mamba-2 layer's window covers x, B and C (batch, d_inner + 2 * groups * d_state, d_conv).
    - A sliding layer: a buffer of `sliding_window - 1 + window_slack` positions (allocated whole at the first
      decoding step).
    - A full-attention layer: all `seq_len` positions; `seq_len=None` ("any length") is an error where there is one.
    - "mlp" layers, and SambaY's cross-decoder (which reads the one full cache of layer L/2 + 1), keep nothing.
    """
    kv_per_position = 2 * batch_size * config.num_key_value_heads * config.head_dim * element
    conv_channels = config.mamba_d_inner
    if getattr(config, "mamba_version", 1) == 2:
        conv_channels += 2 * config.mamba2_n_groups * config.mamba_d_state

    def layer_bytes(kind: str) -> int:
        if kind in ("linear_attention", "mamba", "memory"):  # SambaY's Mamba layers are named by their block
            return batch_size * (
                conv_channels * config.mamba_d_conv * element + config.mamba_d_inner * config.mamba_d_state * 4
            )
        if kind == "sliding_attention":
            return kv_per_position * (config.sliding_window - 1 + window_slack(config.sliding_window))
        if kind == "full_attention":
            if seq_len is None:
                raise ValueError(
                    "this layout has a full-attention layer, whose cache grows with the length: pass seq_len"
                )
            return kv_per_position * seq_len
        return 0  # "mlp"; SambaY's GMU and cross-attention layers

    return sum(layer_bytes(kind) for kind in getattr(config, "block_types", None) or config.layer_types)


def check_static_cache_room(cache: Cache, config, positions: int):
    """A static cache given to generate must keep what each layer reads back of `positions` tokens: a
    full-attention layer all of them (too few: transformers fails writing past the end, as for Llama), a sliding
    layer `min(positions, sliding_window)` (too few: transformers' static sliding layer keeps, and attends to, only
    `max_cache_len` positions, and the tokens silently change), a Mamba layer nothing (its state has no length: any
    `max_cache_len` will do)."""
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, StaticLayer):
            continue
        needed = min(positions, config.sliding_window) if layer.is_sliding else positions
        if layer.max_cache_len < needed:
            kind, window = "full", ""
            if layer.is_sliding:
                kind, window = "sliding-window", f", of which the layer reads the last {config.sliding_window}"
            raise ValueError(
                f"The StaticCache keeps {layer.max_cache_len} positions at layer {i} ({kind} attention), but this "
                f"generate needs {needed}: it writes {positions} (the prompt and max_new_tokens, less the last "
                f"token, which is never fed back){window}. Build it with `StaticCache(config=model.config, "
                f'max_cache_len={positions})` or more, or pass `cache_implementation="static"`, which sizes it.'
            )
