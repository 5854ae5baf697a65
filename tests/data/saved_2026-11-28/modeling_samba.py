"""Samba: Mamba layers interleaved with sliding-window attention, each followed by a SwiGLU MLP.

Ren et al., "Samba: Simple Hybrid State Space Models for Efficient Unlimited Context Language Modeling", ICLR 2025.

One forward, as data sees it:
    input_ids -> embed_tokens -> for each layer: x += mixer(input_layernorm(x)); x += mlp(post_attention_layernorm(x))
              -> norm -> lm_head (last `logits_to_keep` positions only)
where the mixer is a `SambaMambaMixer` ("linear_attention" layers; a `SambaMamba2Mixer` with `mamba_version=2`) or a
`SambaAttention` ("sliding_attention" / "full_attention" layers). Layouts with "mlp" layers (NVIDIA's
Mamba-2-Hybrid, Megatron's one-sub-layer blocks) run x += mixer(input_layernorm(x)) or x += mlp(input_layernorm(x)).
Decoding state lives in transformers' own hybrid `DynamicCache(config=...)`: one conv window and one SSM state per
Mamba layer, at most `sliding_window - 1` key/value positions per sliding layer (`SambaSlidingWindowLayer`, written in
place).

This file is also the remote code of a saved model: it imports only torch, transformers and its siblings.
"""

import contextlib
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    DynamicSlidingWindowLayer,
    DynamicCache,
    EncoderDecoderCache,
    LinearAttentionCacheLayerMixin,
    StaticLayer,
)
from transformers.generation import GenerationMixin
from transformers.masking_utils import (
    create_causal_mask,
    find_packed_sequence_indices,
    create_recurrent_attention_mask,
    create_sliding_window_causal_mask,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_samba import SambaConfig
from .linear_samba import SambaLinear
from .ssm_samba import causal_conv, selective_scan, ssd_scan

logger = logging.get_logger(__name__)

ATTENTION_TYPES = ("sliding_attention", "full_attention")

# The builder of each kind of layer's mask, keyed by layer type (see `SambaModel.forward`); "mlp" layers need none.
MASK_BUILDERS = {
    "linear_attention": create_recurrent_attention_mask,  # 2D padding mask (or None) for the Mamba mixer
    "sliding_attention": create_sliding_window_causal_mask,
    "full_attention": create_causal_mask,
}

# transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache` (in the models, the mask
# builders and the outputs); 5.23 has the old name. samba-hf's forwards take either, and hand on the installed one.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


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


def one_cache(past_key_values: Cache | None, cache: Cache | None) -> Cache | None:
    """The cache given under either name (`cache`: what transformers >= 5.24 passes; `past_key_values`: 5.23), each
    checked to be a cache first (`check_cache_type`)."""
    for given in (past_key_values, cache):
        if given is not None:
            check_cache_type(given)
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("Pass the cache once, as `cache` or as `past_key_values`, not as both.")
    return cache if cache is not None else past_key_values


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


# The shortest inference chunk on a GPU (see `SambaModel._inference_chunk`).
CUDA_MIN_INFERENCE_CHUNK = 65536


def window_slack(sliding_window: int) -> int:
    """Positions a `SambaSlidingWindowLayer` keeps beyond the `sliding_window - 1` it must: one 16th of the window."""
    return max(1, sliding_window // 16)


class SambaSlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window key/value cache layer, written in place. `DynamicSlidingWindowLayer` concatenates
    (copies) the whole window on every step; here the kept `sliding_window - 1` positions sit at the front of a
    buffer with `window_slack` free positions after them, a step writes its new positions there and returns a view
    of [kept | new]. When the room is used up the kept positions move back to the front: one copy of the window every
    `window_slack` steps instead of one per step, for 1/16 of the window more memory. The buffer is allocated whole
    at the first decoding step (as a static cache's). The first step also lets go of the prompt's keys and values, of which
    transformers' layer keeps a view. Whatever replaced `keys` / `values`
    meanwhile (beam reordering, cropping, batch selection) is taken as the new contents. A step of more new positions
    than the slack (a prompt, a long chunk), and assisted decoding's recorded past, go through transformers' path."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[-2]
        if not self.is_initialized or self.record_past or new > window_slack(self.sliding_window):
            return super().update(key_states, value_states, *args, **kwargs)
        kept = getattr(self, "_kept", (None, None))
        if self.keys is not kept[0] or self.values is not kept[1]:  # first step, or replaced from outside
            self._seed()
        keys, values = self._buffer  # (batch, heads, sliding_window - 1 + slack, head_dim)
        if self._end + new > keys.shape[-2]:  # the room is used up: move the kept positions to the front
            kept = self._end - self._start
            keys[..., :kept, :] = keys[..., self._start : self._end, :].clone()
            values[..., :kept, :] = values[..., self._start : self._end, :].clone()
            self._start, self._end = 0, kept
        keys[..., self._end : self._end + new, :] = key_states
        values[..., self._end : self._end + new, :] = value_states
        visible = (keys[..., self._start : self._end + new, :], values[..., self._start : self._end + new, :])
        self._end += new
        self._start = max(self._start, self._end - (self.sliding_window - 1))
        self.keys, self.values = keys[..., self._start : self._end, :], values[..., self._start : self._end, :]
        self._kept = (self.keys, self.values)
        self.cumulative_length += new
        return visible

    def _seed(self):
        """A fresh buffer, `sliding_window - 1 + window_slack` positions long, holding the current `keys` / `values`
        at its front."""
        batch, heads, length, head_dim = self.keys.shape
        positions = self.sliding_window - 1 + window_slack(self.sliding_window)
        self._buffer = (self.keys.new_empty(batch, heads, positions, head_dim),
                        self.values.new_empty(batch, heads, positions, self.values.shape[-1]))
        self._buffer[0][..., :length, :] = self.keys
        self._buffer[1][..., :length, :] = self.values
        self._start, self._end = 0, length


class SambaRMSNorm(nn.Module):
    """RMSNorm with a weight and no bias, computed in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class SambaRotaryEmbedding(nn.Module):
    """cos/sin of rotate-half RoPE for given positions, from transformers' rope utilities (so scaling types work)."""

    def __init__(self, config: SambaConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: SambaConfig, device=None, seq_len=None) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids (batch, seq) -> cos, sin (batch, seq, head_dim)
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """q, k (batch, heads, seq, head_dim); cos, sin (batch, seq, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, kv_heads, seq, head_dim) -> (batch, kv_heads * n_rep, seq, head_dim)."""
    if n_rep == 1:
        return hidden_states
    batch, kv_heads, seq_len, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None].expand(batch, kv_heads, n_rep, seq_len, head_dim)
    return hidden_states.reshape(batch, kv_heads * n_rep, seq_len, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    """Softmax attention with an additive 4D mask (the window is in the mask). Returns (batch, seq, heads, head_dim)."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


def sliding_window_attention_blockwise(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding_mask: torch.Tensor | None,
    window: int,
    scaling: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Sliding-window attention computed one block of queries at a time, never building an L x L mask:
    time and memory grow linearly with the length instead of quadratically.

    query (batch, heads, q_len, head_dim); key/value (batch, kv_heads, kv_len, head_dim) where the first
    kv_len - q_len keys are cached positions just before the queries; padding_mask (batch, kv_len) bool (False =
    padding) or None. A query at index i sees the keys at indices i - window + 1 .. i. Returns (batch, q_len, heads,
    head_dim), like the attention interface.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    past = kv_len - q_len
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    output = torch.empty_like(query)
    # Query blocks smaller than the window: each computes window + block - 1 scores per query instead of window
    # needed, so 512 wastes at most a fifth of the work at window 2048 while keeping each sdpa call large.
    block = min(window, 512)
    for start in range(0, q_len, block):
        end = min(start + block, q_len)
        k_lo, k_hi = max(0, past + start - window + 1), past + end
        # key j is visible to query i iff 0 <= (past + i) - j < window: a band of the (q_block, k_block) grid
        offset = past + start - k_lo
        mask = torch.ones(end - start, k_hi - k_lo, dtype=torch.bool, device=query.device)
        mask = mask.tril(diagonal=offset).triu(diagonal=offset - window + 1)[None, None]
        if padding_mask is not None:
            mask = mask & padding_mask[:, None, None, k_lo:k_hi]
            mask = mask | ~mask.any(-1, keepdim=True)  # a padded query that sees nothing: any finite output will do
        output[:, :, start:end] = nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, k_lo:k_hi], value[:, :, k_lo:k_hi], attn_mask=mask,
            dropout_p=dropout, scale=scaling,
        )
    return output.transpose(1, 2).contiguous()


# flex_attention's block of queries and of keys; a long input's lengths are padded up to `flex_length`.
FLEX_BLOCK_SIZE = 128


def flex_length(length: int) -> int:
    """The length flex_attention runs a long input at: the next power of two (one block at least). Compiled for
    fixed shapes (with shapes left dynamic, torch 2.11's Triton template found no kernel for a cached continuation on
    an H100), so every prompt between two powers of two shares one compiled kernel; the padded blocks are masked out
    whole and skipped."""
    return max(FLEX_BLOCK_SIZE, 1 << (length - 1).bit_length())


@dataclass
class SlidingWindowFlexMask:
    """A long input's mask for the sliding layers on the flex_attention path: the band as a `BlockMask` over the
    padded lengths (`flex_length`), and what the block-wise path takes instead if flex_attention fails here."""

    block_mask: BlockMask
    padding: torch.Tensor | None  # (batch, kv_len) bool: the keys that are not padding; None when all are
    window: int


_FLEX_MASK_SHAPES: set = set()  # the shapes the block mask builder was compiled for in this process


def within_recompile_limit(compiled: set, shape: tuple, what: str) -> bool:
    """Whether `what` may be compiled for `shape` (recorded in `compiled`, this process's shapes so far): not when
    that would pass torch.compile's recompile limit, past which torch runs it uncompiled (said once)."""
    limit = getattr(torch._dynamo.config, "recompile_limit", 8)
    if shape not in compiled and len(compiled) >= limit:
        logger.warning_once(
            f"samba-hf: {what} has been compiled for {limit} shapes (torch.compile's recompile limit); sliding-window "
            "inputs of other lengths or batch sizes go through the block-wise sdpa path."
        )
        return False
    compiled.add(shape)
    return True


def sliding_window_block_mask(
    padding_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, window: int, device: torch.device
) -> SlidingWindowFlexMask | None:
    """The sliding-window band of `sliding_window_attention_blockwise` for flex_attention: query i (at position
    kv_len - q_len + i) sees key j iff 0 <= (kv_len - q_len + i) - j < window and key j is not padding; the padded
    queries and keys up to `flex_length` see nothing. padding_mask (batch, kv_len) bool or None. Built once per
    forward for all sliding layers (on a GPU by compiled code, as transformers' flex masks are); the lengths are
    tensors, so that one compiled mask builder serves every length of a bucket. None where a new shape would pass
    torch.compile's recompile limit (past it the builder runs uncompiled and materialises the whole mask): the
    block-wise path then runs, said once."""
    from torch.nn.attention.flex_attention import create_block_mask

    q_padded, kv_padded = flex_length(q_len), flex_length(kv_len)
    shape = (device, None if padding_mask is None else batch, q_padded, kv_padded)
    if device.type == "cuda" and not within_recompile_limit(_FLEX_MASK_SHAPES, shape, "flex_attention's block mask"):
        return None
    past, queries, keys = (torch.tensor(n, device=device) for n in (kv_len - q_len, q_len, kv_len))
    padded_keys = None if padding_mask is None else nn.functional.pad(padding_mask, (0, kv_padded - kv_len))

    def band(b, h, q_idx, kv_idx):
        distance = q_idx + past - kv_idx
        return (distance >= 0) & (distance < window) & (q_idx < queries) & (kv_idx < keys)

    def band_and_padding(b, h, q_idx, kv_idx):
        return band(b, h, q_idx, kv_idx) & padded_keys[b, kv_idx]

    mask_mod = band if padding_mask is None else band_and_padding
    block_mask = create_block_mask(mask_mod, None if padding_mask is None else batch, None, q_padded, kv_padded,
                                   device=device, BLOCK_SIZE=FLEX_BLOCK_SIZE, _compile=device.type == "cuda")
    return SlidingWindowFlexMask(block_mask, padding_mask, window)


_COMPILED_FLEX_ATTENTION = None
_FLEX_SHAPES: set = set()  # the shapes flex_attention was compiled for in this process


def flex_attention_kernel(query: torch.Tensor, key: torch.Tensor, q_padded: int, kv_padded: int) -> Callable | None:
    """flex_attention as this call runs it: on a GPU compiled for fixed shapes, or None where a new shape would pass
    torch.compile's recompile limit (past it torch runs flex_attention uncompiled, materialising every score: the
    block-wise path is far better); uncompiled on a CPU and inside a compiled model."""
    from torch.nn.attention.flex_attention import flex_attention

    global _COMPILED_FLEX_ATTENTION
    if not query.is_cuda or torch.compiler.is_compiling():
        return flex_attention
    shape = (query.device, query.dtype, query.shape[:2], key.shape[:2], query.shape[3], q_padded, kv_padded,
             torch.is_grad_enabled() and query.requires_grad)
    if not within_recompile_limit(_FLEX_SHAPES, shape, "flex_attention"):
        return None
    if _COMPILED_FLEX_ATTENTION is None:
        _COMPILED_FLEX_ATTENTION = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX_ATTENTION


def sliding_window_attention_flex(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: SlidingWindowFlexMask,
    scaling: float,
) -> torch.Tensor:
    """The same attention as `sliding_window_attention_blockwise`, through torch's flex_attention with the band of
    `sliding_window_block_mask`: on a GPU one compiled kernel that skips the blocks outside the band (on an H100
    4.5x the block-wise path's keys per second at 32K; docs/speed.md). Shapes as there; a padded query that sees no
    key gets zeros. The inputs are padded to the mask's lengths (`flex_length`). Where flex_attention fails, this
    call and every later one of its kind (`flex_attention_works`) go block-wise, said once."""
    q_len, kv_len = query.shape[2], key.shape[2]
    q_padded, kv_padded = mask.block_mask.shape[-2:]
    attend = flex_attention_kernel(query, key, q_padded, kv_padded)
    if attend is None:
        return sliding_window_attention_blockwise(module, query, key, value, mask.padding, mask.window, scaling)
    padded = [nn.functional.pad(t, (0, 0, 0, n - t.shape[2])) for t, n in
              ((query, q_padded), (key, kv_padded), (value, kv_padded))]
    try:
        output = attend(*padded, block_mask=mask.block_mask, scale=scaling, enable_gqa=module.num_key_value_groups > 1)
    except Exception as error:  # noqa: BLE001 - the compiler failing on a new shape must not end the forward
        _FLEX_ATTENTION_WORKS[flex_attention_key(query.device, query.dtype, query.shape[3],
                                                 module.num_key_value_groups)] = False
        logger.warning_once(
            f"samba-hf: flex_attention failed on {query.device} in {query.dtype} for {q_len} queries over {kv_len} keys "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); long sliding-window "
            "inputs go through the block-wise sdpa path from here on."
        )
        return sliding_window_attention_blockwise(module, query, key, value, mask.padding, mask.window, scaling)
    return output[:, :, :q_len].transpose(1, 2).contiguous()


def flex_attention_key(device: torch.device, dtype: torch.dtype, head_dim: int, groups: int) -> tuple:
    """What `flex_attention_works` decides for: the device, the dtype and the heads' shape."""
    return str(device), dtype, head_dim, groups


_FLEX_ATTENTION_WORKS: dict = {}


def flex_attention_works(device: torch.device, dtype: torch.dtype, config) -> bool:
    """Whether flex_attention compiles and runs right here: tried once per device, dtype and head shape on a small
    sliding-window problem of the kinds the model runs (padded keys after a cached past, and a backward) against the
    block-wise path. If it does not, that is said once and the block-wise path runs. Never called while
    torch.compile traces (`SambaModel._flex_sliding`)."""
    from types import SimpleNamespace

    groups = config.num_attention_heads // config.num_key_value_heads
    key = flex_attention_key(device, dtype, config.head_dim, groups)
    if key not in _FLEX_ATTENTION_WORKS:
        module = SimpleNamespace(num_key_value_groups=groups)
        g = torch.Generator(device=device).manual_seed(0)
        past, length, window = 40, 300, 64
        q = torch.randn(2, 2 * groups, length, config.head_dim, generator=g, device=device).to(dtype)
        k, v = (torch.randn(2, 2, past + length, config.head_dim, generator=g, device=device).to(dtype)
                for _ in range(2))
        padding = torch.ones(2, past + length, dtype=torch.bool, device=device)
        padding[1, :100] = False  # the second row left-padded
        scale, tolerance = config.head_dim**-0.5, (1e-3 if dtype == torch.float32 else 3e-2)
        problem = None
        try:
            with torch.enable_grad():
                outputs = []
                for attend in ("flex", "block-wise"):
                    # (flex_attention has no backward on a CPU, where the model never takes it: tests only)
                    leaves = [t.detach().requires_grad_(q.is_cuda) for t in (q, k, v)]
                    if attend == "flex":
                        mask = sliding_window_block_mask(padding, 2, length, past + length, window, torch.device(device))
                        out = sliding_window_attention_flex(module, *leaves, mask, scale)
                    else:
                        out = sliding_window_attention_blockwise(module, *leaves, padding, window, scale)
                    out = out[padding[:, past:]]  # the padded queries' outputs are anything finite
                    grads = torch.autograd.grad(out.float().sum(), leaves) if q.is_cuda else ()
                    outputs.append([out.float(), *(t.float() for t in grads)])
            # relative to each tensor's size: bf16 rounds a gradient of 20 to steps of 0.125
            difference = max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(*outputs))
            if not difference <= tolerance:
                problem = f"its values or gradients differ from the block-wise path's by {difference:.3g} of their size"
        except Exception as error:  # noqa: BLE001 - any failure of the compiler or the kernel means: not here
            problem = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if problem is not None:
            logger.warning_once(
                f"samba-hf: flex_attention does not work on {device} in {dtype} ({problem}); long sliding-window "
                "inputs go through the block-wise sdpa path (on an H200 3x slower per key at 4K, 5x at 32K)."
            )
        _FLEX_ATTENTION_WORKS[key] = problem is None
    return _FLEX_ATTENTION_WORKS[key]


# Attention implementations for which a long sliding-window prefill is computed block by block (or, on a GPU,
# through flex_attention: `SambaModel._flex_sliding`).
BLOCKWISE_IMPLEMENTATIONS = ("eager", "sdpa")


def sdpa_backends(device: torch.device, queries: int, keys: int):
    """The context an attention call of `queries` queries over `keys` keys runs in: on a GPU, for fewer queries than
    keys (a step over a cache, whose keys grow by a token each step) and outside torch.compile, sdpa without cuDNN's
    attention; otherwise sdpa's own choice. torch's sdpa takes cuDNN's attention first where it can (on an H100 with
    torch 2.11, for a single query too: the decoding profile of 2026-11-26), and cuDNN builds a graph for every new
    shape and keeps it (ATen's `cudnn/MHA.cpp` keys its graphs by the key length and the strides, without a bound): a
    cache growing by one token would build one graph per attention layer at every step and keep them all. Flash and
    memory-efficient attention have no cost per shape. Where a user has turned both of those off, their choice
    stands."""
    cuda = torch.backends.cuda
    if device.type != "cuda" or queries >= keys or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    if not (cuda.flash_sdp_enabled() or cuda.mem_efficient_sdp_enabled()):
        return contextlib.nullcontext()
    return _cudnn_attention_off()


_CUDNN_OFF_LOCK = threading.Lock()
_CUDNN_OFF_DEPTH = 0  # how many `_cudnn_attention_off` contexts are open, in all threads
_CUDNN_WAS_ENABLED = True  # cuDNN's sdpa switch as the first of them found it


@contextlib.contextmanager
def _cudnn_attention_off():
    """cuDNN's sdpa switch off while any of these contexts is open, in any thread (the switch is the process's, not
    a thread's), and as it was found once the last one closes."""
    global _CUDNN_OFF_DEPTH, _CUDNN_WAS_ENABLED
    with _CUDNN_OFF_LOCK:
        if _CUDNN_OFF_DEPTH == 0:
            _CUDNN_WAS_ENABLED = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _CUDNN_OFF_DEPTH += 1
    try:
        yield
    finally:
        with _CUDNN_OFF_LOCK:
            _CUDNN_OFF_DEPTH -= 1
            if _CUDNN_OFF_DEPTH == 0:
                torch.backends.cuda.enable_cudnn_sdp(_CUDNN_WAS_ENABLED)


class SambaAttention(nn.Module):
    """Multi-head (GQA-capable) causal attention with RoPE; sliding-window for "sliding_attention" layers."""

    def __init__(self, config: SambaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None
        bias = config.attention_bias
        self.q_proj = SambaLinear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = SambaLinear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = SambaLinear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = SambaLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.o_proj.is_residual_output = True  # scaled down at init, see SambaPreTrainedModel._init_weights

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        # (batch, heads, seq, head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        if position_embeddings is not None:  # None when config.use_rope is False
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        if self._bfloat16_decode_on_cpu(query_states, attention_mask, kwargs):
            # PyTorch's CPU sdpa takes ~5x longer for one bfloat16 query than for one float32 query
            dtype = query_states.dtype
            query_states, key_states, value_states = query_states.float(), key_states.float(), value_states.float()
        else:
            dtype = None

        if self.sliding_window is not None and isinstance(attention_mask, SlidingWindowFlexMask):  # see _mask_mapping
            attn_output = sliding_window_attention_flex(
                self, query_states, key_states, value_states, attention_mask, self.scaling
            )
            return self.o_proj(attn_output.reshape(*input_shape, -1)), None

        if self._is_blockwise(query_states, attention_mask):
            padding = None if attention_mask is None else attention_mask[:, -key_states.shape[2] :]
            attn_output = sliding_window_attention_blockwise(
                self, query_states, key_states, value_states, padding, self.sliding_window, self.scaling,
                dropout=0.0 if not self.training else self.attention_dropout,
            )
            return self.o_proj(attn_output.reshape(*input_shape, -1)), None

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        with sdpa_backends(query_states.device, query_states.shape[2], key_states.shape[2]):
            attn_output, attn_weights = attention_interface(
                self,
                query_states,
                key_states,
                value_states,
                attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
                sliding_window=self.sliding_window,  # flash-attention reads the window here, the others from the mask
                **kwargs,
            )
        if dtype is not None:
            attn_output = attn_output.to(dtype)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def _bfloat16_decode_on_cpu(self, query: torch.Tensor, attention_mask, kwargs) -> bool:
        """One bfloat16 query per sequence on CPU, through sdpa or eager, with a boolean mask or none, no attention
        weights asked for: attend in float32 (faster there, and no less exact)."""
        return (
            query.device.type == "cpu"
            and query.dtype == torch.bfloat16
            and query.shape[2] == 1
            and self.config._attn_implementation in ("sdpa", "eager")
            and (attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool))
            and not kwargs.get("output_attentions")
            and not self.training
        )

    def _is_blockwise(self, query: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
        """SambaModel hands a sliding layer a 2D padding mask (or None) instead of a 4D mask when the prompt is
        longer than the window and the implementation has no window of its own (see `SambaModel.forward`)."""
        return (
            self.sliding_window is not None
            and query.shape[2] > self.sliding_window
            and self.config._attn_implementation in BLOCKWISE_IMPLEMENTATIONS
            and (attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2))
        )


class PackedDocuments:
    """Where the documents of a packed batch lie (position_ids restarting at each document, as
    `DataCollatorWithFlattening` makes them): `unpack` lays them out one per row, right-padded, so a Mamba mixer
    runs each from a zero state and nothing crosses a boundary; `pack` puts the rows back in place."""

    def __init__(self, document_ids: torch.Tensor):
        # document_ids (batch, seq): index of each token's document within its row, 0, 0, 1, 1, 1, 2, ...
        self.shape = document_ids.shape
        row_offsets = (document_ids[:, -1] + 1).cumsum(0) - (document_ids[:, -1] + 1)
        flat = (document_ids + row_offsets[:, None]).reshape(-1)  # documents numbered through the whole batch
        lengths = torch.bincount(flat)
        starts = lengths.cumsum(0) - lengths
        offsets = torch.arange(flat.numel(), device=flat.device) - starts[flat]
        self.index = torch.zeros(lengths.numel(), int(lengths.max()), dtype=torch.long, device=flat.device)
        self.valid = torch.zeros_like(self.index, dtype=torch.bool)
        self.index[flat, offsets] = torch.arange(flat.numel(), device=flat.device)  # (documents, longest)
        self.valid[flat, offsets] = True

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])[self.index]  # (batch, seq, d) -> (documents, longest, d)

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        # the valid positions, read row by row, are the tokens in their original order
        return rows[self.valid].reshape(*self.shape, rows.shape[-1])


class SambaMambaMixer(nn.Module):
    """The Mamba (selective SSM) mixer, as in mamba-ssm's `Mamba` and the official Samba code.

    in_proj -> (x, z); x: causal depthwise conv (continuing from the cached window) -> SiLU -> x_proj -> (dt, B, C);
    dt_proj + softplus; selective scan (float32, from the cached SSM state); y * silu(z); out_proj.
    Every projection is called as a module, so adapters (LoRA) wrapping them take effect.
    """

    def __init__(self, config: SambaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.mamba_d_inner
        self.ssm_state_size = config.mamba_d_state
        self.conv_kernel_size = config.mamba_d_conv
        self.time_step_rank = config.mamba_dt_rank
        self.act = ACT2FN[config.hidden_act]

        self.in_proj = SambaLinear(self.hidden_size, 2 * self.intermediate_size, bias=config.mamba_proj_bias)
        self.conv1d = nn.Conv1d(
            self.intermediate_size,
            self.intermediate_size,
            kernel_size=self.conv_kernel_size,
            groups=self.intermediate_size,
            padding=self.conv_kernel_size - 1,
            bias=config.mamba_conv_bias,
        )
        self.x_proj = SambaLinear(self.intermediate_size, self.time_step_rank + 2 * self.ssm_state_size, bias=False)
        self.dt_proj = SambaLinear(self.time_step_rank, self.intermediate_size, bias=True)
        # S4D-real initialisation: A = -[1, 2, ..., N] for every channel, stored as log(-A).
        A = torch.arange(1, self.ssm_state_size + 1, dtype=torch.float32).expand(self.intermediate_size, -1)
        self.A_log = nn.Parameter(torch.log(A).contiguous())
        self.D = nn.Parameter(torch.ones(self.intermediate_size))
        self.out_proj = SambaLinear(self.intermediate_size, self.hidden_size, bias=config.mamba_proj_bias)
        self.out_proj.is_residual_output = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        documents: PackedDocuments | None = None,
        return_memory: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # hidden_states (batch, seq, hidden); attention_mask (batch, seq): 1 for tokens, 0 for padding, or None.
        # return_memory: also return the scan output before the gate, (batch, seq, d_inner) (SambaY's memory layer).
        if documents is not None:  # packed sequences: the conv and the scan restart at each document
            out = self(documents.unpack(hidden_states), attention_mask=documents.valid, return_memory=return_memory)
            return tuple(map(documents.pack, out)) if return_memory else documents.pack(out)
        seq_len = hidden_states.shape[1]
        mask = attention_mask[:, :, None].to(hidden_states.dtype) if attention_mask is not None else None
        # Read the SSM state before the conv update below marks the layer as having a previous state.
        ssm_state = past_key_values.get_recurrent_state(self.layer_idx) if past_key_values is not None else None

        x, z = self.in_proj(hidden_states).chunk(2, dim=-1)  # (batch, seq, d_inner) each
        if mask is not None:
            x = x * mask
        # Causal depthwise conv over [cached window, new inputs]; keep the outputs of the new positions.
        x = x.transpose(1, 2)  # (batch, d_inner, seq)
        if past_key_values is not None:
            x = past_key_values.update_conv_state(x, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        x = self.act(causal_conv(self.conv1d, x, seq_len)).transpose(1, 2)  # (batch, seq, d_inner)
        if mask is not None:
            x = x * mask

        dt, B, C = self.x_proj(x).split([self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
        dt = nn.functional.softplus(self.dt_proj(dt).float())  # (batch, seq, d_inner), float32
        if mask is not None:
            dt = dt * mask  # a zero step leaves the state as it was: padding neither decays nor feeds it
        A = self.decay_rates()  # (d_inner, d_state)
        y, ssm_state = selective_scan(x, dt, A, B, C, self.D, None if return_memory else z, ssm_state)
        if past_key_values is not None:
            past_key_values.update_recurrent_state(ssm_state, self.layer_idx)
        if return_memory:
            return self.out_proj(y * self.act(z)), y
        return self.out_proj(y)


    def decay_rates(self) -> torch.Tensor:
        """A = -exp(A_log), float32. Without autograd it is kept between calls while A_log is unchanged (same storage,
        same version): a decoding step would otherwise spend about 0.1 ms per layer on d_inner x d_state exps."""
        A_log = self.A_log
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return -torch.exp(A_log.float())
        key = (A_log.data_ptr(), A_log._version, A_log.device, A_log.dtype)
        if getattr(self, "_decay_key", None) != key:
            self._decay, self._decay_key = -torch.exp(A_log.float()), key
        return self._decay


class SambaGatedRMSNorm(nn.Module):
    """Mamba-2's output norm: RMSNorm of y * silu(z) over groups of `group_size` channels (one per group of heads),
    times a weight; in float32, returned in y's dtype."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.float() * nn.functional.silu(gate.float())
        grouped = hidden_states.view(*hidden_states.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * grouped.view(hidden_states.shape)).to(input_dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, group_size={self.group_size}, eps={self.variance_epsilon}"


class SambaMamba2Mixer(nn.Module):
    """The Mamba-2 (SSD) mixer, as in mamba-ssm's `Mamba2` and Megatron-LM's `MambaMixer` (Dao & Gu, 2024).

    in_proj -> (z, xBC, dt); xBC: causal depthwise conv with bias (continuing from the cached window) -> SiLU ->
    (x, B, C); dt + dt_bias, softplus; SSD over heads of `mamba2_head_dim` channels, one A per head, B and C shared by
    the heads of a group (float32, from the cached state, no clamp on dt); + D x; gated group RMSNorm with z; out_proj.
    Every projection is called as a module, so adapters (LoRA) wrapping them take effect.
    """

    def __init__(self, config: SambaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate_size = config.mamba_d_inner
        self.ssm_state_size = config.mamba_d_state
        self.conv_kernel_size = config.mamba_d_conv
        self.head_dim = config.mamba2_head_dim
        self.num_heads = config.mamba2_num_heads
        self.n_groups = config.mamba2_n_groups
        self.chunk_size = config.mamba2_chunk_size
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.ssm_state_size  # x, B, C
        self.act = ACT2FN[config.hidden_act]

        self.in_proj = SambaLinear(
            config.hidden_size, self.intermediate_size + self.conv_dim + self.num_heads, bias=config.mamba_proj_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            padding=self.conv_kernel_size - 1,
            bias=config.mamba_conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = SambaGatedRMSNorm(self.intermediate_size, self.intermediate_size // self.n_groups, config.rms_norm_eps)
        self.out_proj = SambaLinear(self.intermediate_size, config.hidden_size, bias=config.mamba_proj_bias)
        self.out_proj.is_residual_output = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        documents: PackedDocuments | None = None,
    ) -> torch.Tensor:
        # hidden_states (batch, seq, hidden); attention_mask (batch, seq): 1 for tokens, 0 for padding, or None.
        if documents is not None:  # packed sequences: the conv and the scan restart at each document
            return documents.pack(self(documents.unpack(hidden_states), attention_mask=documents.valid))
        batch, seq_len, _ = hidden_states.shape
        mask = attention_mask[:, :, None].to(hidden_states.dtype) if attention_mask is not None else None
        # Read the SSM state before the conv update below marks the layer as having a previous state.
        ssm_state = past_key_values.get_recurrent_state(self.layer_idx) if past_key_values is not None else None

        z, xBC, dt = self.in_proj(hidden_states).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        if mask is not None:
            xBC = xBC * mask
        xBC = xBC.transpose(1, 2)  # (batch, conv_dim, seq)
        if past_key_values is not None:
            xBC = past_key_values.update_conv_state(xBC, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        xBC = self.act(causal_conv(self.conv1d, xBC, seq_len)).transpose(1, 2)  # (batch, seq, conv_dim)
        x, B, C = xBC.split([self.intermediate_size, *2 * [self.n_groups * self.ssm_state_size]], dim=-1)

        dt = nn.functional.softplus(dt.float() + self.dt_bias.float())  # (batch, seq, heads), float32
        if mask is not None:
            dt = dt * mask  # a zero step leaves the state as it was: padding neither decays nor feeds it
        A = -torch.exp(self.A_log.float())  # (heads,)
        groups = (batch, seq_len, self.n_groups, self.ssm_state_size)
        y, ssm_state = ssd_scan(
            x.reshape(batch, seq_len, self.num_heads, self.head_dim), dt, A, B.reshape(groups), C.reshape(groups),
            self.D, ssm_state, self.chunk_size,
        )
        if past_key_values is not None:
            past_key_values.update_recurrent_state(ssm_state, self.layer_idx)
        return self.out_proj(self.norm(y.reshape(batch, seq_len, self.intermediate_size), z))


class SambaMLP(nn.Module):
    """SwiGLU, down_proj(silu(gate_proj(x)) * up_proj(x)) (official w1 = gate, w2 = up, w3 = down); or, with
    `config.mlp_gated=False`, down_proj(act(up_proj(x))) (Megatron's linear_fc1 = up, linear_fc2 = down)."""

    def __init__(self, config: SambaConfig):
        super().__init__()
        if config.mlp_gated:
            self.gate_proj = SambaLinear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = SambaLinear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = SambaLinear(config.intermediate_size, config.hidden_size, bias=False)
        self.down_proj.is_residual_output = True
        self.act_fn = ACT2FN[config.mlp_hidden_act or config.hidden_act]
        self.gated = config.mlp_gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.down_proj(self.act_fn(self.up_proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SambaDecoderLayer(GradientCheckpointingLayer):
    """x += mixer(input_layernorm(x)); x += mlp(post_attention_layernorm(x)) (no MLP when `config.mixer_mlp` is
    False). An "mlp" layer is x += mlp(input_layernorm(x)) alone."""

    def __init__(self, config: SambaConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = SambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = None
        if self.layer_type == "mlp":
            self.mlp = SambaMLP(config)
            return
        if self.layer_type == "linear_attention":
            self.mamba = (SambaMamba2Mixer if config.mamba_version == 2 else SambaMambaMixer)(config, layer_idx)
        else:
            self.self_attn = SambaAttention(config, layer_idx)
        if config.mixer_mlp:
            self.post_attention_layernorm = SambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp = SambaMLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        documents: PackedDocuments | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.layer_type == "mlp":
            return residual + self.mlp(hidden_states)
        if self.layer_type == "linear_attention":
            hidden_states = self.mamba(
                hidden_states, attention_mask=attention_mask, past_key_values=past_key_values, documents=documents
            )
        else:
            hidden_states, _ = self.self_attn(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                **kwargs,
            )
        hidden_states = residual + hidden_states
        if self.mlp is not None:
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


class SambaPreTrainedModel(PreTrainedModel):
    config: SambaConfig
    config_class = SambaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SambaDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _keep_in_fp32_modules_strict = ["A_log", "mamba.D", "dt_bias"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _is_stateful = True
    _can_record_outputs = {"hidden_states": SambaDecoderLayer, "attentions": SambaAttention}
    _auto_model_entry = "modeling_samba.SambaModel"  # the base model, for `auto_map["AutoModel"]` in saved folders

    def __init__(self, config, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        # Refused where transformers' Llama refuses it, when the model is built (its nn.Embedding asserts on the
        # padding row); the same range: -vocab_size..vocab_size - 1 (negative ids count from the end) or None.
        pad, vocab = config.pad_token_id, config.vocab_size
        if pad is not None and not -vocab <= pad < vocab:
            raise ValueError(
                f"{type(config).__name__}: `pad_token_id` is {pad}, outside the vocabulary of {vocab} tokens (ids "
                f"0..{vocab - 1}): set it to a token of the vocabulary (the tokenizer's pad or eos token), or to None."
            )

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, plus what tools that never import samba_hf need: an `auto_map` entry for
        `AutoModel` too (transformers writes only the saved class's), and a model card with Hub metadata when the
        folder has no README.md (one that is there is never replaced). Saving shards where an earlier save left one
        model.safetensors (or the reverse) removes the earlier one, as transformers removes earlier shards: otherwise
        `from_pretrained` would load the earlier weights."""
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), "AutoModel": self._auto_model_entry}
        single, index = (os.path.join(save_directory, name)
                         for name in ("model.safetensors", "model.safetensors.index.json"))

        def stamp(path):  # what tells a file this call wrote from the one that was there
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                return None
            return stat.st_mtime_ns, stat.st_ino, stat.st_size

        before = {path: stamp(path) for path in (single, index)}
        # A model sharded by FSDP2 is an instance of a class torch made (`FSDPSambaForCausalLM`, in torch's
        # _fsdp_init.py): named as it is, the folder's remote code would be torch's FSDP files. Save the model's class.
        made, saved_class = type(self), next(c for c in type(self).__mro__ if not c.__module__.startswith("torch."))
        named = made.__module__, made.__name__, made.__qualname__
        made.__module__, made.__name__, made.__qualname__ = (saved_class.__module__, saved_class.__name__,
                                                             saved_class.__qualname__)
        try:
            super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            made.__module__, made.__name__, made.__qualname__ = named
        if kwargs.get("is_main_process", True):
            written = [path for path in (single, index) if stamp(path) not in (None, before[path])]
            if len(written) == 1:  # the other one, if there, is an earlier save's
                earlier = index if written[0] == single else single
                if os.path.isfile(earlier):
                    os.remove(earlier)
            try:
                with open(f"{save_directory}/README.md", "x") as card:  # "x": only where there is none
                    card.write(model_card(self.config, "Samba model", "Saved with samba-hf's `save_pretrained`."))
            except FileExistsError:
                pass

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """transformers' load-time FSDP2 (`from_pretrained(distributed_config=DistributedConfig(fsdp_size=N))`: each
        SambaDecoderLayer a unit, from the config's `base_model_fsdp_plan`), with one change under
        `fsdp_mixed_precision`. Its bf16 policy casts every parameter of a unit, so A_log, D and dt_bias would be
        all-gathered and used in bf16 (FSDP2 allows one dtype per unit). Each Mamba mixer's own parameters therefore
        become a unit of their own with a float32 policy, its projections and conv a bf16 unit inside it: A_log, D and
        dt_bias stay float32 in the forward, the backward and the gradient reduction (two more all-gathers per Mamba
        layer). Only on a pure FSDP mesh (no tensor, pipeline or expert parallelism)."""
        config = distributed_config
        if (mesh_manager is not None and config is not None and config.fsdp_mixed_precision and config.dp_size > 1
                and config.tp_size == config.pp_size == config.ep_size == 1):
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            from transformers.distributed.fsdp import _get_fsdp_policy_kwargs

            mesh = mesh_manager.get_mesh(("dp_replicate", "fsdp") if config.dp_replicate_size > 1 else "fsdp")
            policy = _get_fsdp_policy_kwargs(config)  # transformers' own: bf16 parameters, float32 reduction
            float32 = {**policy, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                   reduce_dtype=torch.float32,
                                                                   cast_forward_inputs=False)}
            for module in model.modules():
                if isinstance(module, (SambaMambaMixer, SambaMamba2Mixer)):
                    # one unit for the children: causal_conv reads conv1d.weight without calling the module (CPU
                    # and kernel paths), so it must be gathered with in_proj, which runs first
                    children = [child for child in module.children() if next(child.parameters(), None) is not None]
                    fully_shard(children, mesh=mesh, reshard_after_forward=True, **policy)
                    fully_shard(module, mesh=mesh, reshard_after_forward=True, **float32)
        return super().maybe_distribute_model(model, distributed_config, mesh_manager)

    @torch.no_grad()
    def _init_weights(self, module):
        """The official recipe (mamba-ssm `Mamba` + Samba's `GPT._init_weights` with `mamba_init`).

        Embeddings N(0, initializer_range); linear layers keep PyTorch's default (kaiming-uniform) with zero biases;
        the residual-output projections (o_proj, down_proj, mamba.out_proj) are divided by
        sqrt(residuals_per_layer * num_hidden_layers); Mamba: dt_proj uniform(+-dt_rank^-0.5 * dt_scale), its bias
        the inverse softplus of log-uniform steps in [dt_min, dt_max], A_log = log(1..N), D = 1. Mamba-2 (mamba-ssm
        `Mamba2`): dt_bias the same inverse softplus per head, A_log = log(uniform(1, 16)) per head, D = 1.
        """
        config = self.config
        if isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=config.initializer_range)
        elif isinstance(module, (nn.Linear, nn.Conv1d)):
            init.kaiming_uniform_(module.weight, a=math.sqrt(5))
            if getattr(module, "is_residual_output", False):
                residuals_per_layer = 2 if config.mixer_mlp else 1
                init.copy_(module.weight, module.weight / math.sqrt(residuals_per_layer * config.num_hidden_layers))
            if module.bias is not None:
                fan_in = module.weight[0].numel()
                bound = 1 / math.sqrt(fan_in) if isinstance(module, nn.Conv1d) else 0.0
                init.uniform_(module.bias, -bound, bound)
        elif isinstance(module, (SambaRMSNorm, SambaGatedRMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, SambaRotaryEmbedding):
            super()._init_weights(module)  # refills the non-persistent inv_freq buffers
        elif isinstance(module, SambaMambaMixer):
            init.copy_(module.A_log, torch.log(torch.arange(1, module.ssm_state_size + 1, dtype=torch.float32))
                       .expand(module.intermediate_size, -1))
            init.ones_(module.D)
            dt_std = module.time_step_rank**-0.5 * config.mamba_dt_scale
            init.uniform_(module.dt_proj.weight, -dt_std, dt_std)
            log_min, log_max = math.log(config.mamba_dt_min), math.log(config.mamba_dt_max)
            dt = torch.exp(torch.rand(module.intermediate_size) * (log_max - log_min) + log_min)
            dt = dt.clamp(min=config.mamba_dt_init_floor)
            init.copy_(module.dt_proj.bias, dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        elif isinstance(module, SambaMamba2Mixer):
            init.copy_(module.A_log, torch.log(torch.empty(module.num_heads).uniform_(1, 16)))
            init.ones_(module.D)
            log_min, log_max = math.log(config.mamba_dt_min), math.log(config.mamba_dt_max)
            dt = torch.exp(torch.rand(module.num_heads) * (log_max - log_min) + log_min)
            dt = dt.clamp(min=config.mamba_dt_init_floor)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))


class SambaModel(SambaPreTrainedModel):
    def __init__(self, config: SambaConfig):
        super().__init__(config)
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)  # no padding row, as the official code
        self.layers = nn.ModuleList([SambaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = SambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = SambaRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        keep_last: int | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        r"""
        keep_last (`int`, *optional*): return the last hidden states for only that many final positions (None: all).
            The cache still takes every position; a model whose top layers keep no state (SambaY's cross-decoder)
            runs them on those positions only.
        """
        past_key_values = one_cache(past_key_values, cache)
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if not torch.compiler.is_compiling():  # the checks read tensor values on the host: they would break graphs
            self._check_inputs(input_ids, inputs_embeds, attention_mask, past_key_values)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        documents = self._packed_documents(position_ids, attention_mask, past_key_values, inputs_embeds.shape[0])
        if documents is not None:  # a packed (training) batch: nothing to continue from it, so no cache; the mask
            use_cache, past_key_values, attention_mask = False, None, None  # builders find the documents themselves
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if past_key_values is not None:
            self._write_windows_in_place(past_key_values)
        if position_ids is None:
            past_seen_tokens = past_key_values.get_seq_length() if self._has_attention_cache(past_key_values) else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # packed documents go through in one piece (their boundaries were found once, above)
        chunk = self._inference_chunk(inputs_embeds, attention_mask, past_key_values, kwargs) if documents is None else 0
        if chunk:
            # Long inference input: go through the cache a chunk at a time (exactly equal, tested; the activations
            # of a chunk stay in the CPU caches and memory stays bounded by the chunk, not the prompt).
            chunk_cache = past_key_values if past_key_values is not None else DynamicCache(config=self.config)
            length = inputs_embeds.shape[1]
            first_kept = length - min(keep_last, length) if keep_last is not None else 0
            hidden_states = torch.cat(
                [
                    self._run_layers(
                        inputs_embeds[:, s : s + chunk], None, position_ids[:, s : s + chunk], chunk_cache,
                        kwargs,
                        keep_last=max(0, min(s + chunk, length) - max(s, first_kept)),  # of this chunk's positions
                    )
                    for s in range(0, length, chunk)
                ],
                dim=1,
            )
        else:
            hidden_states = self._run_layers(
                inputs_embeds, attention_mask, position_ids, past_key_values, kwargs, documents=documents,
                keep_last=keep_last,
            )
        if keep_last is not None:
            hidden_states = hidden_states[:, hidden_states.shape[1] - min(keep_last, hidden_states.shape[1]) :]
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states, **{CACHE_NAME: past_key_values if use_cache else None}
        )

    @staticmethod
    def _write_windows_in_place(cache):
        """Fresh sliding-window layers of a `DynamicCache` become `SambaSlidingWindowLayer`s (same contents and
        behaviour, no copy of the window per step); layers already holding states, and other caches, are left as
        they are."""
        layers = getattr(cache, "layers", [])
        for i, layer in enumerate(layers):
            if type(layer) is DynamicSlidingWindowLayer and not layer.is_initialized:
                layers[i] = SambaSlidingWindowLayer(sliding_window=layer.sliding_window)

    def _check_inputs(self, input_ids, inputs_embeds, attention_mask, past_key_values):
        """Raise a ValueError that names the problem and the fix for inputs that would otherwise fail deep in torch
        or silently change the result. Cheap: shapes, and one look at the ids and at a 2D mask (small tensors);
        except in a decoding step on a GPU, where that look would stop the host until the GPU had caught up
        (`_reads_values`)."""
        if input_ids is not None:
            if input_ids.ndim != 2 or 0 in input_ids.shape:
                raise ValueError(
                    f"input_ids must have shape (batch, seq) with batch >= 1 and seq >= 1, got "
                    f"{tuple(input_ids.shape)}: pass at least one sequence of at least one token, and add the batch "
                    "dimension to a single sequence (`input_ids[None]`)."
                )
            if input_ids.dtype not in (torch.long, torch.int):
                raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}: use `.long()`.")
        elif inputs_embeds.ndim != 3 or 0 in inputs_embeds.shape[:2]:
            raise ValueError(
                f"inputs_embeds must have shape (batch, seq, hidden_size) with batch >= 1 and seq >= 1, got "
                f"{tuple(inputs_embeds.shape)}."
            )
        elif not inputs_embeds.is_floating_point():
            raise ValueError(
                f"inputs_embeds must be floating point (embedding vectors), got dtype {inputs_embeds.dtype}: pass "
                f"token ids as `input_ids`, or convert the vectors with `.to(model.dtype)`."
            )
        tokens = input_ids if input_ids is not None else inputs_embeds
        reads_values = self._reads_values(tokens, past_key_values)
        if input_ids is not None and reads_values:
            low, high = torch.stack(torch.aminmax(input_ids)).tolist()
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(
                    f"input_ids holds ids from {low} to {high}, but the vocabulary has {self.config.vocab_size} "
                    f"entries (ids 0..{self.config.vocab_size - 1}): the tokenizer does not match this model, or "
                    "padding/label values (-100) were passed as ids; resize the embeddings if tokens were added."
                )
        batch, length = tokens.shape[:2]
        if past_key_values is not None:
            self._check_cache(past_key_values, batch)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim != 4:  # 4D masks are taken as they are
            self._check_attention_mask(attention_mask, batch, length, past_key_values, reads_values)

    def _reads_values(self, tokens: torch.Tensor, past_key_values: Cache | None) -> bool:
        """Whether the checks may look at the ids' and the mask's values: always on a CPU; on a GPU, not in a
        decoding step (one token per sequence over a `DynamicCache` holding earlier ones), where reading a value back
        waits for the GPU to finish the step before and so stops the host running ahead (on an H100, 2026-11-26,
        samba-hf's decoding steps synchronised once each, transformers' models' not at all). A step's ids come from
        the model's own logits, and the prompt's were checked. (Other caches are always read: whether a static
        cache is empty cannot be told without reading it, and generate compiles its steps, where no check runs.)"""
        if tokens.device.type == "cpu" or tokens.shape[1] != 1 or type(past_key_values) is not DynamicCache:
            return True
        return self._past_length(past_key_values) == 0  # a one-token prompt into an empty cache is still checked

    def _check_cache(self, cache, batch: int):
        """`past_key_values` must have been built for this model (same layers, same kinds, same widths) and batch.
        Reads the layers' classes and their tensors' shapes only."""
        config = self.config
        fix = "pass `DynamicCache(config=model.config)` (or no cache), one per model and batch"
        if cache.layer_class_to_replicate is not None and "linear_attention" in config.layer_types:
            raise ValueError(
                "past_key_values was built without a config (e.g. `DynamicCache()`), so it has no conv and SSM states "
                f"for the Mamba layers: {fix}."
            )
        layers, n = cache.layers, config.num_hidden_layers
        if len(layers) > n or (cache.layer_class_to_replicate is None and len(layers) != n):
            raise ValueError(f"past_key_values has {len(layers)} layers but this model has {n}: {fix}.")
        kinds = [cache_layer_kind(layer) for layer in layers]
        sharing = getattr(config, "kv_sharing_modes", None) or ["own"] * n  # "reuse": no cache of its own
        expected = ["dummy" if mode == "reuse" or kind == "mlp" else kind for kind, mode in zip(config.layer_types, sharing)]
        # a full-attention cache keeps all a sliding layer needs (a `DynamicCache()` of an attention-only model)
        if any(k != t and (k, t) != ("full_attention", "sliding_attention") for k, t in zip(kinds, expected)):
            raise ValueError(
                f"past_key_values was built for another layout: its layers are {kinds}, this model's are "
                f"{expected}: {fix}."
            )
        for i, (kind, layer) in enumerate(zip(kinds, layers)):
            window = getattr(layer, "sliding_window", None)
            if kind == "sliding_attention" and isinstance(window, int) and window < config.sliding_window:
                raise ValueError(
                    f"past_key_values keeps a sliding window of {window} tokens at layer {i}, this model needs "
                    f"{config.sliding_window}: {fix}."
                )
            if (shape := cache_layer_shape(layer)) is None:
                continue
            if kind != "linear_attention":
                widths = (config.num_key_value_heads, config.head_dim)
            elif config.mamba_version == 2:
                widths = (config.mamba2_num_heads, config.mamba2_head_dim, config.mamba_d_state, config.mamba_d_conv)
            else:
                widths = (config.mamba_d_inner, config.mamba_d_state, config.mamba_d_conv)
            if shape[0] != batch:
                raise ValueError(
                    f"past_key_values holds a batch of {shape[0]} sequences but the input has {batch}: a cache "
                    "continues the batch it was filled with; start a new `DynamicCache(config=model.config)` for a "
                    "new batch (generate reorders it for beams itself)."
                )
            if shape[1] != widths:
                raise ValueError(
                    f"past_key_values was built for another config: layer {i} ({kind}) holds states of widths "
                    f"{shape[1]}, this model's are {widths}: {fix}."
                )

    def _check_attention_mask(self, mask: torch.Tensor, batch: int, length: int, past_key_values, reads_values=True):
        """A 2D mask has one row per sequence and one column per token, the cached ones included (as generate
        builds it), and holds 1 for tokens, 0 for padding (or True/False; the values where `reads_values`)."""
        past = self._past_length(past_key_values)
        if mask.ndim != 2 or mask.shape[0] != batch or (
            mask.shape[1] < length if past is None else mask.shape[1] != past + length
        ):
            expected = f"({batch}, >= {length})" if past is None else f"({batch}, {past + length})"
            cached = "" if past == 0 else f", the {'' if past is None else f'{past} '}cached ones included"
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)}, expected {expected}: one row per sequence and one "
                f"column per token{cached} (1 for tokens, 0 for padding); or pass a 4D mask."
            )
        if reads_values and mask.dtype != torch.bool and bool((other := (mask != 0) & (mask != 1)).any()):
            raise ValueError(
                f"attention_mask must hold only 1 (token) and 0 (padding), or be a bool mask; it holds "
                f"{mask[other][0].item()}: convert it with `(attention_mask > 0).long()` if it marks tokens with "
                "other values."
            )

    def _past_length(self, past_key_values: Cache | None) -> int | None:
        """The tokens a 2D mask must cover before the new ones, or None where the cache cannot say cheaply (Mamba
        layers only, or a static cache, whose masks generate makes itself)."""
        if past_key_values is None:
            return 0
        if type(past_key_values) is not DynamicCache:
            return None
        if self._has_attention_cache(past_key_values):
            return past_key_values.get_seq_length()
        return None if past_key_values.has_previous_state() else 0

    def _run_layers(
        self, inputs_embeds, attention_mask, position_ids, past_key_values, kwargs, documents=None, keep_last=None
    ) -> torch.Tensor:
        """The decoder layers over one piece of the input; every Samba layer keeps state, so all positions run
        (`keep_last` is applied by the caller)."""
        mask_mapping = self._mask_mapping(inputs_embeds, attention_mask, position_ids, past_key_values, kwargs, documents)
        hidden_states = inputs_embeds
        position_embeddings = None
        if self.config.use_rope and any(kind in ATTENTION_TYPES for kind in self.config.layer_types):
            position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)

        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=mask_mapping.get(decoder_layer.layer_type),  # "mlp" layers: none
                position_embeddings=position_embeddings,
                past_key_values=past_key_values,
                position_ids=position_ids,
                documents=documents,
                **kwargs,
            )
        return hidden_states

    def _mask_mapping(self, inputs_embeds, attention_mask, position_ids, past_key_values, kwargs, documents) -> dict:
        """One mask per kind of layer (`config.layer_types`), built once per forward; generate() may pass them
        ready-made as a dict."""
        if not isinstance(mask_mapping := attention_mask, dict):
            mask_kwargs = {
                "config": self.config,
                "inputs_embeds": inputs_embeds,
                "attention_mask": attention_mask,
                CACHE_NAME: past_key_values,
                "position_ids": position_ids,
            }
            # Each mask is sized against the cache of the first layer of its kind.
            mask_mapping = {
                kind: MASK_BUILDERS[kind](**mask_kwargs, layer_idx=self.config.layer_types.index(kind))
                for kind in set(self.config.layer_types) & set(MASK_BUILDERS)
                if not (
                    kind == "sliding_attention"
                    and documents is None  # the block-wise path knows no document boundaries
                    and (attention_mask is None or attention_mask.ndim == 2)  # a 4D mask is used as given
                    and self._blockwise_sliding(inputs_embeds, past_key_values, kwargs)
                )
            }
            if "sliding_attention" not in mask_mapping and "sliding_attention" in self.config.layer_types:
                # Long input: sliding layers go block by block from the 2D padding mask (no L x L mask is built),
                # or on a GPU through flex_attention with a block mask of the band.
                padding = None if attention_mask is None else attention_mask.bool()
                mask_mapping["sliding_attention"] = padding
                if self._flex_sliding(inputs_embeds):
                    q_len = inputs_embeds.shape[1]
                    kv_len = q_len + self._sliding_cache_length(past_key_values)
                    keys_padding = None if padding is None or bool(padding.all()) else padding[:, -kv_len:]
                    flex_mask = sliding_window_block_mask(
                        keys_padding, inputs_embeds.shape[0], q_len, kv_len, self.config.sliding_window,
                        inputs_embeds.device,
                    )
                    if flex_mask is not None:  # (None: past the compile limit, block-wise)
                        mask_mapping["sliding_attention"] = flex_mask
        return mask_mapping

    def _flex_sliding(self, inputs_embeds: torch.Tensor) -> bool:
        """Whether the long sliding-window input `_blockwise_sliding` chose goes through flex_attention instead: on a
        GPU (where it measured 3x the block-wise path per key at 4K, 5x at 32K, docs/speed.md; on a CPU the
        block-wise path is the one without a compiler), not while torch.compile traces this forward (the block-wise
        path is plain torch), with flex_attention working there in the dtype attention runs in (autocast's, when on;
        `flex_attention_works`), and no attention dropout to apply (flex_attention has none)."""
        if not inputs_embeds.is_cuda or torch.compiler.is_compiling():
            return False
        if self.training and self.config.attention_dropout > 0:
            return False
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else inputs_embeds.dtype
        return flex_attention_works(inputs_embeds.device, dtype, self.config)

    def _sliding_cache_length(self, past_key_values: Cache | None) -> int:
        """How many positions the sliding layers' cache holds before this input (they all hold the same)."""
        if past_key_values is None:
            return 0
        index = self.config.layer_types.index("sliding_attention")
        if index >= len(past_key_values.layers) or not past_key_values.layers[index].is_initialized:
            return 0
        return past_key_values.layers[index].keys.shape[-2]

    def _packed_documents(self, position_ids, attention_mask, past_key_values, batch_size) -> PackedDocuments | None:
        """Documents packed into one row (position_ids restart within a row, no padding), or None."""
        if position_ids is None or position_ids.shape[1] < 2 or isinstance(attention_mask, dict):
            return None
        if attention_mask is not None and not bool(attention_mask.all()):
            return None  # padding: position_ids repeat over padded positions, that is not packing (as transformers)
        document_ids = find_packed_sequence_indices(position_ids)
        if document_ids is None:
            return None
        if self._cache_has_content(past_key_values):
            raise ValueError(
                "Packed sequences (position_ids restarting inside a row) cannot continue from a cache: run packed "
                "batches without past_key_values, or pass one document per row."
            )
        return PackedDocuments(document_ids.expand(batch_size, -1))  # position_ids may come as (1, seq)

    def _inference_chunk(self, inputs_embeds, attention_mask, past_key_values, kwargs) -> int:
        """The chunk length to split this forward into, or 0. Only inference (no autograd) over an input longer than
        `config.inference_chunk_size`, without padding, per-layer outputs, packed sequences or a static cache. On a
        GPU the chunks are at least `CUDA_MIN_INFERENCE_CHUNK` tokens: they are there for a CPU's caches, and on an
        H200 each 4096-token chunk after the first cost Samba-1.3B's scan a continuation from the cached state
        (about 7 ms per Mamba layer with mamba-ssm: 8K took 3.7x the time of 4K), while memory stays bounded."""
        chunk = self.config.inference_chunk_size
        if chunk and inputs_embeds.is_cuda:
            chunk = max(chunk, CUDA_MIN_INFERENCE_CHUNK)
        if not chunk or inputs_embeds.shape[1] <= chunk or torch.is_grad_enabled():
            return 0
        if isinstance(attention_mask, dict) or (attention_mask is not None and not bool(attention_mask.all())):
            return 0
        if kwargs.get("output_attentions", self.config.output_attentions) or kwargs.get(
            "output_hidden_states", self.config.output_hidden_states
        ):
            return 0
        if past_key_values is not None and type(past_key_values) is not DynamicCache:
            return 0
        return chunk

    def _blockwise_sliding(self, inputs_embeds: torch.Tensor, past_key_values: Cache | None, kwargs: dict) -> bool:
        """Whether this forward computes its sliding-window layers block by block: inputs longer than the window,
        an implementation without a window of its own (eager, sdpa), no attention weights asked for, and no cache or
        the dynamic one (static caches come with ready-made masks from generate)."""
        return (
            inputs_embeds.shape[1] > self.config.sliding_window
            and self.config._attn_implementation in BLOCKWISE_IMPLEMENTATIONS
            and not kwargs.get("output_attentions", self.config.output_attentions)
            and (past_key_values is None or type(past_key_values) is DynamicCache)
        )

    def _cache_has_content(self, past_key_values: Cache | None) -> bool:
        if past_key_values is None:
            return False
        if self._has_attention_cache(past_key_values):
            return past_key_values.get_seq_length() > 0
        return past_key_values.has_previous_state()

    def _has_attention_cache(self, past_key_values: Cache | None) -> bool:
        # A cache of Mamba (and MLP) layers only tracks no sequence length (and asking it raises).
        return past_key_values is not None and any(kind in ATTENTION_TYPES for kind in self.config.layer_types)


class SambaForCausalLM(SambaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}  # with the final norm, one unit kept gathered for the backward

    def __init__(self, config: SambaConfig):
        super().__init__(config)
        self.model = SambaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = SambaLinear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        labels (`torch.LongTensor` of shape `(batch, seq)`, *optional*): targets for the next-token loss, shifted
            inside; -100 marks positions to ignore. With a 2D `attention_mask`, the label of a token that follows a
            padded position is ignored too (left padding gives the loss of the unpadded rows).
        logits_to_keep (`int` or `torch.Tensor`, defaults to 0): compute logits only for the last that many positions
            (0: all), or for the given 1D indices of the sequence dimension.

        Example:

        ```python
        >>> import torch, samba_hf
        >>> model = samba_hf.SambaForCausalLM(samba_hf.SambaConfig.from_preset("tiny"))
        >>> ids = torch.randint(0, 512, (1, 16))
        >>> out = model(ids, labels=ids)
        >>> out.loss, out.logits.shape
        ```"""
        if isinstance(logits_to_keep, int) and logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be 0 (every position), a count of last positions >= 1, or a 1D "
                             f"tensor of positions, got {logits_to_keep}")
        keep_last = logits_to_keep if isinstance(logits_to_keep, int) and logits_to_keep > 0 else None
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            cache=cache,  # SambaModel takes the one given (one_cache)
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            keep_last=keep_last,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = logits_to_keep if isinstance(logits_to_keep, torch.Tensor) else slice(None)  # 1D indices
        logits = self.lm_head(hidden_states[:, slice_indices, :])

        loss = None
        if labels is not None:
            if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2 and not bool(attention_mask.all()):
                # A token right after padding (the first of a left-padded row) has nothing to be predicted from, as
                # in an unpadded run: ignore its label, so padding on either side gives the unpadded loss.
                after_padding = nn.functional.pad(attention_mask[:, :-1] == 0, (1, 0), value=False)
                labels = labels.masked_fill(after_padding.to(labels.device), -100)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
    ):
        """transformers' cache set-up in `generate`, with Samba's checks of what it was asked for around it: a cache
        of a kind Samba takes (`check_cache_type`), an offloaded cache only on a CUDA device, and a static cache with
        room for what this call writes. `max_cache_length` is what transformers sizes its own static cache by: the
        prompt and the new tokens, less the last new token (never fed back)."""
        cache = model_kwargs.get(CACHE_NAME)
        if cache is not None:
            check_cache_type(cache)
        elif "offloaded" in str(generation_config.cache_implementation) and self.device.type != "cuda":
            # transformers' offloading synchronises CUDA streams: without CUDA it fails on an assertion inside torch
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} moves the cache between a CUDA GPU "
                f"and the CPU, but this model is on {self.device.type}: leave it out (off a GPU the cache is in main "
                "memory already), or move the model to a CUDA device."
            )
        super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
        if cache is not None:
            self._check_static_cache_room(cache, max_cache_length)

    def _check_static_cache_room(self, cache: Cache, positions: int):
        """A static cache given to generate must keep what each layer reads back of `positions` tokens: a
        full-attention layer all of them (too few: transformers fails writing past the end, as for Llama), a sliding
        layer `min(positions, sliding_window)` (too few: transformers' static sliding layer keeps, and attends to,
        only `max_cache_len` positions, and the tokens silently change), a Mamba layer nothing (its state has no
        length: any `max_cache_len` will do)."""
        for i, layer in enumerate(cache.layers):
            if not isinstance(layer, StaticLayer):
                continue
            needed = min(positions, self.config.sliding_window) if layer.is_sliding else positions
            if layer.max_cache_len < needed:
                kind, window = "full", ""
                if layer.is_sliding:
                    kind, window = "sliding-window", f", of which the layer reads the last {self.config.sliding_window}"
                raise ValueError(
                    f"The StaticCache keeps {layer.max_cache_len} positions at layer {i} ({kind} attention), but this "
                    f"generate needs {needed}: it writes {positions} (the prompt and max_new_tokens, less the last "
                    f"token, which is never fed back){window}. Build it with `StaticCache(config=model.config, "
                    f"max_cache_len={positions})` or more, or pass `cache_implementation=\"static\"`, which sizes it."
                )

    def cache_nbytes(self, batch_size: int = 1, seq_len: int | None = None, dtype: torch.dtype | None = None) -> int:
        """Bytes held by the generation cache (`DynamicCache(config=...)`) once `seq_len` tokens have been seen.

        Per Mamba layer: one conv window (batch, d_inner, d_conv) in the model dtype and one SSM state
        (batch, d_inner, d_state) in float32, whatever the length; per Mamba-2 layer the conv window covers x, B and C
        (batch, d_inner + 2 * groups * d_state, d_conv) and the state is (batch, heads, head_dim, d_state), float32.
        "mlp" layers keep nothing. Per sliding layer: a buffer of `sliding_window - 1 + window_slack` positions of
        keys and values, whatever the length (`SambaSlidingWindowLayer` allocates it whole at the first decoding
        step). Per full-attention layer: keys and values for all `seq_len` positions. Counted as storage, from the
        first decoding step on (after a prompt and before that step, a sliding layer still holds the prompt's keys
        and values, as transformers' layer does).
        `seq_len=None` means "any length past the window" (the size a Samba layout never exceeds); it is an error
        for layouts with full-attention layers, whose cache has no bound.
        """
        config = self.config
        element = torch.finfo(dtype or self.dtype).bits // 8
        kv_per_position = 2 * batch_size * config.num_key_value_heads * config.head_dim * element
        total = 0
        for kind in config.layer_types:
            if kind == "linear_attention":
                conv_channels = config.mamba_d_inner
                if config.mamba_version == 2:
                    conv_channels += 2 * config.mamba2_n_groups * config.mamba_d_state
                total += batch_size * (conv_channels * config.mamba_d_conv * element
                                       + config.mamba_d_inner * config.mamba_d_state * 4)
            elif kind == "mlp":
                continue
            elif kind == "sliding_attention":
                total += kv_per_position * (config.sliding_window - 1 + window_slack(config.sliding_window))
            elif seq_len is None:
                raise ValueError("this layout has full-attention layers, whose cache grows with length: pass seq_len")
            else:
                total += kv_per_position * seq_len
        return total


def hub_metadata(license: str = "unknown", base_model: str | None = None, extra_tags: list[str] = ()) -> str:
    """The YAML front matter of a Samba model card (Hub metadata), without the `---` lines."""
    from huggingface_hub import ModelCardData

    tags = ["samba", "mamba", "sliding-window-attention", "samba-hf", *extra_tags]
    return ModelCardData(
        library_name="transformers", license=license, tags=list(dict.fromkeys(tags)), pipeline_tag="text-generation",
        base_model=base_model,
    ).to_yaml()


def architecture(config: SambaConfig) -> str:
    """What the layout is, in words, for a model card."""
    if config.model_type != "samba":
        return ("SambaY (Phi-4-mini-flash-reasoning's architecture): a Samba self-decoder, then a YOCO cross-decoder "
                "with Gated Memory Units")
    if "mlp" in config.layer_types:
        mixers = "Mamba-2" if config.mamba_version == 2 else "Mamba"
        return (f"a hybrid of {mixers}, attention and MLP blocks of one sub-layer each (pattern "
                f"{config.hybrid_pattern}), as NVIDIA's Mamba-2-Hybrid (Waleffe et al., 2024)")
    mixers = "Mamba-2" if config.mamba_version == 2 else "Mamba"
    return (f"Samba (Ren et al., ICLR 2025): {mixers} and attention layers (pattern {config.hybrid_pattern}), each "
            "followed by an MLP" if config.mixer_mlp else f"{mixers} and attention layers (pattern "
            f"{config.hybrid_pattern}) without MLPs")


def model_card(config: SambaConfig, title: str, details: str, **metadata) -> str:
    """A README.md for a Samba folder: Hub metadata, what the model is, and how to load it with or without samba-hf."""
    layers = ", ".join(f"{config.layer_types.count(t)} {t}" for t in dict.fromkeys(config.layer_types))
    return f"""---
{hub_metadata(**metadata)}
---

# {title}

{details}

- Layers: {config.num_hidden_layers} ({layers}); hidden size {config.hidden_size}, vocabulary {config.vocab_size}.
- Architecture: {architecture(config)}, in the transformers implementation of samba-hf.

## Use

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO", trust_remote_code=True)  # or `import samba_hf` first
```

The folder carries its own modeling code (`modeling_samba.py`, `configuration_samba.py`, `ssm_samba.py`, `linear_samba.py`,
`triton_scan_samba.py`, `triton_conv_samba.py`), so
`trust_remote_code=True` works without the samba-hf package.
"""


__all__ = ["SambaForCausalLM", "SambaModel", "SambaPreTrainedModel"]
