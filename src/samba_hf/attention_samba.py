"""How samba-hf's attention layers attend: which attention runs, decided once per forward when the mask is built,
and the sliding-window paths.

`ALL_ATTENTION_FUNCTIONS` is transformers' attention interface with samba-hf's variants registered on this instance
alone (as transformers prescribes for a model's own variants; other models in the process are untouched): its own
"eager" and "sdpa" (on a GPU a call with fewer queries than keys runs with cuDNN's sdpa off, `sdpa_backends`; on a
CPU one bfloat16 query attends in float32) and the two sliding-window paths below. A layer looks its attention up
there once, by the name its mask gives (`attention_implementation`): `sliding_window_mask` builds a mask that
names samba-hf's own path, or leaves transformers' mask and the configured implementation:

    sliding layer, input longer than the window,   "samba_sliding_flex": flex_attention on the band
    eager or sdpa, no attention weights asked,     (`SlidingWindowFlexMask`), on a GPU, outside torch.compile, no
    no cache or a DynamicCache (or a ready-made    attention dropout, where `flex_attention_works` found it right
    mask that lost its window)                     in this dtype; otherwise "samba_sliding_blockwise": block by
                                                   block through sdpa (`SlidingWindowBlocks`), no (queries x keys)
                                                   mask
    an on-device program's layer (`on_device`)     "samba_slots": its buffer's slots by position (`SlotMask`),
                                                   grouped heads shared, in plain products
    everything else                                transformers' mask, and `config._attn_implementation`

Where flex_attention fails, or a new shape would pass torch.compile's recompile limit, the block-wise path runs,
said once. SambaY's differential attention looks up the same interface, and keeps a call of its own where its values
are twice as wide as its keys (`modeling_sambay`).

Part of the remote code of a saved model: imports only torch and transformers.
"""

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers.cache_utils import Cache, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface
from transformers.utils import is_torch_greater_or_equal, logging

from .cache_samba import sliding_cache_length
from .kernels_samba import exporting

logger = logging.get_logger(__name__)

# Attention implementations without a window of their own: a long sliding-window input is computed block by block
# (or, on a GPU, through flex_attention).
BLOCKWISE_IMPLEMENTATIONS = ("eager", "sdpa")


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
    """Softmax attention with an additive 4D mask (the window is in the mask).
    Returns (batch, seq, heads, head_dim)."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


@dataclass
class SlidingWindowBlocks:
    """A long input's mask for the sliding layers on the block-wise path: which keys are padding, and the window."""

    padding: torch.Tensor | None  # (batch, past + seq) bool, False for padding; None when nothing is padded
    window: int
    implementation = "samba_sliding_blockwise"  # the attention it is for (`ALL_ATTENTION_FUNCTIONS`)


# flex_attention's block of queries and of keys; a long input's lengths are padded up to `flex_length`.
FLEX_BLOCK_SIZE = 128


@dataclass
class SlidingWindowFlexMask:
    """A long input's mask for the sliding layers on the flex_attention path: the band as a `BlockMask` over the
    padded lengths (`flex_length`), and what the block-wise path takes instead if flex_attention fails here."""

    block_mask: BlockMask
    padding: torch.Tensor | None  # (batch, kv_len) bool: the keys that are not padding; None when all are
    window: int
    implementation = "samba_sliding_flex"


@dataclass
class SlotMask:
    """An on-device program's mask (`on_device`): which slots of a layer's key/value buffer each query sees, from the
    positions the slots hold. Its attention (`slot_attention`) shares each key/value head among its query heads by
    reshaping the queries, where transformers' paths copy the whole buffer once per query head."""

    visible: torch.Tensor  # (1, 1, q_len, slots) bool
    implementation = "samba_slots"


def slot_attention(module, query, key, value, attention_mask: SlotMask, scaling, dropout=0.0, **_):
    """Softmax attention of `query` (batch, heads, q_len, d) over `key`, `value` (batch, kv_heads, slots, d / dv), a
    query head h reading key head h // (heads / kv_heads), in batched products (what an on-device backend runs) ->
    ((batch, q_len, heads, dv), None). Slots no query sees hold finite numbers (zeros, or an earlier text's), so
    the mask is added."""
    batch, heads, q_len, _ = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    # batched products over (batch * kv_heads); a group's query heads are adjacent (h = kv * groups + g)
    query = query.reshape(batch * kv_heads, groups * q_len, -1) * scaling
    scores = torch.bmm(query, key.reshape(batch * kv_heads, slots, -1).transpose(1, 2))
    bias = torch.zeros(attention_mask.visible.shape, dtype=scores.dtype, device=scores.device)
    bias = bias.masked_fill(~attention_mask.visible, float("-inf"))  # (1, 1, q_len, slots)
    scores = scores.view(batch * kv_heads, groups, q_len, slots) + bias[0]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    probs = probs.view(batch * kv_heads, groups * q_len, slots)
    output = torch.bmm(probs, value.reshape(batch * kv_heads, slots, -1)).view(batch, heads, q_len, -1)
    return output.transpose(1, 2).contiguous(), None


def sliding_window_mask(
    config,
    inputs_embeds: torch.Tensor,
    attention_mask,
    cache: Cache | None,
    packed: bool,
    output_attentions: bool,
    training: bool,
) -> SlidingWindowBlocks | SlidingWindowFlexMask | None:
    """The sliding layers' mask where samba-hf computes a long input's sliding window itself, or None where
    transformers' mask builder's serves. Samba-hf's own: an input longer than the window, not `packed` (the
    block-wise path knows no document boundaries), without a 4D mask, in an implementation without a window of its
    own (eager, sdpa), with no attention weights asked for, and no cache or the dynamic one (static caches come with
    ready-made masks from generate). Then flex_attention's block mask where `takes_flex_attention`, else the
    block-wise path's."""
    if exporting():  # an exported program runs at any length: transformers' mask (the window in it) at every one
        return None
    if not (
        inputs_embeds.shape[1] > config.sliding_window
        and not packed
        and (attention_mask is None or attention_mask.ndim == 2)
        and config._attn_implementation in BLOCKWISE_IMPLEMENTATIONS
        and not output_attentions
        and (cache is None or type(cache) is DynamicCache)
    ):
        return None
    padding = None if attention_mask is None else attention_mask.bool()
    if takes_flex_attention(config, inputs_embeds, training):
        q_len = inputs_embeds.shape[1]
        kv_len = q_len + sliding_cache_length(cache, config)
        keys_padding = None if padding is None or bool(padding.all()) else padding[:, -kv_len:]
        flex_mask = sliding_window_block_mask(
            keys_padding, inputs_embeds.shape[0], q_len, kv_len, config.sliding_window, inputs_embeds.device
        )
        if flex_mask is not None:  # (None: past the compile limit, block-wise)
            return flex_mask
    return SlidingWindowBlocks(padding, config.sliding_window)


def takes_flex_attention(config, inputs_embeds: torch.Tensor, training: bool) -> bool:
    """Whether a long sliding-window input goes through flex_attention rather than block by block: on a GPU (on a
    CPU the block-wise path is the one without a compiler), not while torch.compile traces the forward (the
    block-wise path is plain torch), with flex_attention working there in the dtype attention runs in (autocast's,
    when on; `flex_attention_works`), and no attention dropout to apply (flex_attention has none)."""
    if not inputs_embeds.is_cuda or torch.compiler.is_compiling():
        return False
    if training and config.attention_dropout > 0:
        return False
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else inputs_embeds.dtype
    return flex_attention_works(inputs_embeds.device, dtype, config)


def ready_sliding_mask(config, inputs_embeds: torch.Tensor, mask):
    """A sliding layer's mask made elsewhere (generate's ready-made masks, transformers' builder) that cannot hold the
    window: none, or a 2D padding mask, for an input longer than the window in an implementation without a window of
    its own. The block-wise path's mask then, which holds it; any other mask as it is."""
    if (
        not exporting()
        and inputs_embeds.shape[1] > config.sliding_window
        and config._attn_implementation in BLOCKWISE_IMPLEMENTATIONS
        and (mask is None or (isinstance(mask, torch.Tensor) and mask.ndim == 2))
    ):
        return SlidingWindowBlocks(None if mask is None else mask.bool(), config.sliding_window)
    return mask


def attention_implementation(config, attention_mask) -> str:
    """The attention a layer runs with this mask: the path samba-hf's own mask names, else the configured one."""
    return getattr(attention_mask, "implementation", config._attn_implementation)


def _sdpa_grouped_on_cpu(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa for grouped key/value heads under a mask, where it copies every key and value once per
    query head (`repeat_kv`) before calling torch (it shares them only without a mask, or for one query): torch's sdpa
    shares them itself (`enable_gqa`), with the same numbers. On a CPU a check of 9 drafted tokens over a 1K cache
    spent most of its attention time in those copies. None where the call is not that case."""
    if (
        query.device.type != "cpu"
        or exporting()  # (transformers' path: what exporters lower)
        or not _SDPA_TAKES_GQA
        or getattr(module, "num_key_value_groups", 1) == 1
        or query.shape[2] == 1  # (transformers packs the query heads of one key head then: no copy)
        or not isinstance(attention_mask, torch.Tensor)
        or kwargs.get("output_attentions")
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or (module.training and dropout)
    ):
        return None
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


_SDPA_TAKES_GQA = is_torch_greater_or_equal("2.5")  # enable_gqa came in torch 2.5


def _transformers_attention(attention: Callable) -> Callable:
    """`attention` (eager or sdpa) as samba-hf calls it: on a GPU, with cuDNN's sdpa off for fewer queries than keys
    (`sdpa_backends`); on a CPU, one bfloat16 query attends in float32 (sdpa takes several times longer for it
    than for one float32 query), and sdpa over grouped key/value heads under a mask shares them instead of copying
    them (`_sdpa_grouped_on_cpu`). Shapes as transformers' attention functions."""

    def attend(module, query, key, value, attention_mask, **kwargs):
        if attention is sdpa_attention_forward:
            grouped = _sdpa_grouped_on_cpu(module, query, key, value, attention_mask, **kwargs)
            if grouped is not None:
                return grouped
        dtype = None
        if (
            query.device.type == "cpu"
            and query.dtype == torch.bfloat16
            and query.shape[2] == 1
            and (
                attention_mask is None
                or (isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool)
            )
            and not kwargs.get("output_attentions")
            and not module.training
        ):
            dtype, query, key, value = query.dtype, query.float(), key.float(), value.float()
        with sdpa_backends(query.device, query.shape[2], key.shape[2]):
            output, weights = attention(module, query, key, value, attention_mask, **kwargs)
        return (output if dtype is None else output.to(dtype)), weights

    return attend


def _blockwise_attention(module, query, key, value, attention_mask: SlidingWindowBlocks, scaling, dropout=0.0, **_):
    padding = None if attention_mask.padding is None else attention_mask.padding[:, -key.shape[2] :].bool()
    output = sliding_window_attention_blockwise(
        module, query, key, value, padding, attention_mask.window, scaling, dropout
    )
    return output, None


def _flex_attention(module, query, key, value, attention_mask: SlidingWindowFlexMask, scaling, **_):
    return sliding_window_attention_flex(module, query, key, value, attention_mask, scaling), None


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
            query[:, :, start:end],
            key[:, :, k_lo:k_hi],
            value[:, :, k_lo:k_hi],
            attn_mask=mask,
            dropout_p=dropout,
            scale=scaling,
        )
    return output.transpose(1, 2).contiguous()


def flex_length(length: int) -> int:
    """The length flex_attention runs a long input at: the next power of two (one block at least). Compiled for
    fixed shapes (with shapes left dynamic, torch 2.11's Triton template found no kernel for a cached continuation),
    so every prompt between two powers of two shares one compiled kernel; the padded blocks are masked out whole and
    skipped."""
    return max(FLEX_BLOCK_SIZE, 1 << (length - 1).bit_length())


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
    block_mask = create_block_mask(
        mask_mod,
        None if padding_mask is None else batch,
        None,
        q_padded,
        kv_padded,
        device=device,
        BLOCK_SIZE=FLEX_BLOCK_SIZE,
        _compile=device.type == "cuda",
    )
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
    shape = (
        query.device,
        query.dtype,
        query.shape[:2],
        key.shape[:2],
        query.shape[3],
        q_padded,
        kv_padded,
        torch.is_grad_enabled() and query.requires_grad,
    )
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
    `sliding_window_block_mask`: on a GPU one compiled kernel that skips the blocks outside the band. Shapes as
    there; a padded query that sees no key gets zeros. The inputs are padded to the mask's lengths (`flex_length`).
    Where flex_attention fails, this call and every later one of its kind (`flex_attention_works`) go block-wise,
    said once."""
    q_len, kv_len = query.shape[2], key.shape[2]
    q_padded, kv_padded = mask.block_mask.shape[-2:]
    attend = flex_attention_kernel(query, key, q_padded, kv_padded)
    if attend is None:
        return sliding_window_attention_blockwise(module, query, key, value, mask.padding, mask.window, scaling)
    padded = [
        nn.functional.pad(t, (0, 0, 0, n - t.shape[2]))
        for t, n in ((query, q_padded), (key, kv_padded), (value, kv_padded))
    ]
    try:
        output = attend(*padded, block_mask=mask.block_mask, scale=scaling, enable_gqa=module.num_key_value_groups > 1)
    except Exception as error:  # noqa: BLE001 - the compiler failing on a new shape must not end the forward
        _FLEX_ATTENTION_WORKS[
            flex_attention_key(query.device, query.dtype, query.shape[3], module.num_key_value_groups)
        ] = False
        logger.warning_once(
            f"samba-hf: flex_attention failed on {query.device} in {query.dtype} for {q_len} queries "
            f"over {kv_len} keys "
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
    torch.compile traces (`takes_flex_attention`)."""
    groups = config.num_attention_heads // config.num_key_value_heads
    key = flex_attention_key(device, dtype, config.head_dim, groups)
    if key not in _FLEX_ATTENTION_WORKS:
        module = SimpleNamespace(num_key_value_groups=groups)
        g = torch.Generator(device=device).manual_seed(0)
        past, length, window = 40, 300, 64
        q = torch.randn(2, 2 * groups, length, config.head_dim, generator=g, device=device).to(dtype)
        k, v = (
            torch.randn(2, 2, past + length, config.head_dim, generator=g, device=device).to(dtype) for _ in range(2)
        )
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
                        mask = sliding_window_block_mask(
                            padding, 2, length, past + length, window, torch.device(device)
                        )
                        out = sliding_window_attention_flex(module, *leaves, mask, scale)
                    else:
                        out = sliding_window_attention_blockwise(module, *leaves, padding, window, scale)
                    out = out[padding[:, past:]]  # the padded queries' outputs are anything finite
                    grads = torch.autograd.grad(out.float().sum(), leaves) if q.is_cuda else ()
                    outputs.append([out.float(), *(t.float() for t in grads)])
            # relative to each tensor's size: bf16 rounds a gradient of 20 to steps of 0.125
            difference = max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(*outputs))
            if not difference <= tolerance:
                problem = (
                    f"its values or gradients differ from the block-wise path's by {difference:.3g} of their size"
                )
        except Exception as error:  # noqa: BLE001 - any failure of the compiler or the kernel means: not here
            problem = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if problem is not None:
            logger.warning_once(
                f"samba-hf: flex_attention does not work on {device} in {dtype} ({problem}); long sliding-window "
                "inputs go through the block-wise sdpa path (slower per key, the more so the longer the input)."
            )
        _FLEX_ATTENTION_WORKS[key] = problem is None
    return _FLEX_ATTENTION_WORKS[key]


def sdpa_backends(device: torch.device, queries: int, keys: int):
    """The context an attention call of `queries` queries over `keys` keys runs in: on a GPU, for fewer queries than
    keys (a step over a cache, whose keys grow by a token each step) and outside torch.compile, sdpa without cuDNN's
    attention; otherwise sdpa's own choice. torch's sdpa takes cuDNN's attention first where it can, for a single
    query too, and cuDNN builds a graph for every new shape and keeps it (ATen's `cudnn/MHA.cpp` keys its graphs by
    the key length and the strides, without a bound): a cache growing by one token would build one graph per
    attention layer at every step and keep them all. Flash and memory-efficient attention have no cost per shape.
    Where a user has turned both of those off, their choice stands."""
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


# transformers' attention interface with samba-hf's variants on this instance alone, under transformers' own name for
# it (as its Doge model does; transformers lets `set_attn_implementation` switch models whose layers look their
# attention up in an `ALL_ATTENTION_FUNCTIONS`): the one place a layer looks its attention up.
ALL_ATTENTION_FUNCTIONS = AttentionInterface()
ALL_ATTENTION_FUNCTIONS["eager"] = _transformers_attention(eager_attention_forward)
ALL_ATTENTION_FUNCTIONS["sdpa"] = _transformers_attention(sdpa_attention_forward)
ALL_ATTENTION_FUNCTIONS["samba_sliding_blockwise"] = _blockwise_attention
ALL_ATTENTION_FUNCTIONS["samba_sliding_flex"] = _flex_attention
ALL_ATTENTION_FUNCTIONS["samba_slots"] = slot_attention
