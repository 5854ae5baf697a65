"""The checks of a forward's inputs: one ValueError that names the problem and the fix, for inputs that would
otherwise fail deep in torch or silently change the result.

Cheap: shapes, and one look at the ids and at a 2D mask (small tensors); except in a decoding step on a GPU, where
that look would stop the host until the GPU had caught up (`reads_values`). Skipped while torch.compile traces (the
looks would break the graph).

Part of the remote code of a saved model: imports only torch and transformers.
"""

import torch
from transformers.cache_utils import Cache, DynamicCache

from .cache_samba import cache_layer_kind, cache_layer_shape, past_length


def check_inputs(config, input_ids, inputs_embeds, attention_mask, cache: Cache | None):
    """Exactly one of `input_ids` (batch, seq) and `inputs_embeds` (batch, seq, hidden), at least one token each;
    a cache built for this model and batch (`check_cache`); a 2D mask that covers the cached tokens and the new
    ones, of 1 and 0 (`check_attention_mask`; 4D masks are taken as they are)."""
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if torch.compiler.is_compiling():
        return
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
    values = reads_values(tokens, cache, config)
    if input_ids is not None and values:
        low, high = torch.stack(torch.aminmax(input_ids)).tolist()
        if low < 0 or high >= config.vocab_size:
            raise ValueError(
                f"input_ids holds ids from {low} to {high}, but the vocabulary has {config.vocab_size} "
                f"entries (ids 0..{config.vocab_size - 1}): the tokenizer does not match this model, or "
                "padding/label values (-100) were passed as ids; resize the embeddings if tokens were added."
            )
    batch, length = tokens.shape[:2]
    if cache is not None:
        check_cache(cache, config, batch)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim != 4:  # 4D masks are taken as they are
        check_attention_mask(attention_mask, batch, length, past_length(cache, config), values)


def check_labels(labels: torch.Tensor, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The next-token loss's targets: integer token ids of the input's (batch, seq) shape, each in the vocabulary or
    -100 (ignored); int32 ones are taken as int64, as `input_ids` are. Otherwise one ValueError (torch's own messages
    name neither the labels nor the fix; a negative id other than -100 would index out of range)."""
    if torch.compiler.is_compiling():
        return labels
    if labels.is_floating_point() or labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(
            f"labels must hold token ids (integers, -100 where no loss is wanted), got dtype {labels.dtype}: use "
            "`.long()` on ids, and pass the ids themselves, not one-hot or probability vectors."
        )
    if tuple(labels.shape) != tuple(tokens.shape[:2]):
        raise ValueError(
            f"labels has shape {tuple(labels.shape)} but the input has (batch, seq) {tuple(tokens.shape[:2])}: give "
            "one label per input position, the input ids themselves for language modelling (the model shifts them "
            "by one inside), with -100 where no loss is wanted."
        )
    if labels.device.type == "cpu":  # (on a GPU, reading them back would stop the host each step)
        valid = (labels == -100) | ((labels >= 0) & (labels < vocab_size))
        if not bool(valid.all()):
            bad = labels[~valid][0].item()
            raise ValueError(
                f"labels holds {bad}, neither a token id of the vocabulary (0..{vocab_size - 1}) nor -100 (no loss "
                "there): mark the positions to leave out with -100, and check that the labels come from this "
                "model's tokenizer."
            )
    return labels.long()


def check_embeddings(inputs_embeds: torch.Tensor, dtype: torch.dtype):
    """`inputs_embeds` in the embedding's dtype (a float64 tensor into a float32 model ends in torch's dtype error
    deep inside), and finite (NaN or inf would give NaN logits without a word)."""
    if torch.compiler.is_compiling():
        return
    if inputs_embeds.dtype != dtype:
        raise ValueError(
            f"inputs_embeds is {inputs_embeds.dtype} but the model's embeddings are {dtype}: convert them with "
            "`inputs_embeds.to(model.dtype)`."
        )
    if inputs_embeds.device.type == "cpu" and not bool(torch.isfinite(inputs_embeds).all()):
        raise ValueError(
            "inputs_embeds holds NaN or inf: the model would return NaN logits; check what computed them (an "
            "overflow in float16, a division by zero)."
        )


def reads_values(tokens: torch.Tensor, cache: Cache | None, config) -> bool:
    """Whether the checks may look at the ids' and the mask's values: always on a CPU; on a GPU, not in a decoding
    step (one token per sequence over a `DynamicCache` holding earlier ones), where reading a value back waits for
    the GPU to finish the step before and so stops the host running ahead. A step's ids come from the model's own
    logits, and the prompt's were checked. (Other caches are always read: whether a static cache is empty cannot be
    told without reading it, and generate compiles its steps, where no check runs.)"""
    if tokens.device.type == "cpu" or tokens.shape[1] != 1 or type(cache) is not DynamicCache:
        return True
    return past_length(cache, config) == 0  # a one-token prompt into an empty cache is still checked


def check_cache(cache: Cache, config, batch: int):
    """The cache must have been built for this model (same layers, same kinds, same widths) and batch. Reads the
    layers' classes and their tensors' shapes only."""
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
    expected = [
        "dummy" if mode == "reuse" or kind == "mlp" else kind for kind, mode in zip(config.layer_types, sharing)
    ]
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


def check_attention_mask(mask: torch.Tensor, batch: int, length: int, past: int | None, reads_values: bool = True):
    """A 2D mask has one row per sequence and one column per token, the `past` cached ones included (as generate
    builds it; None: the cache cannot say how many), and holds 1 for tokens, 0 for padding (or True/False; the
    values looked at where `reads_values`)."""
    if (
        mask.ndim != 2
        or mask.shape[0] != batch
        or (mask.shape[1] < length if past is None else mask.shape[1] != past + length)
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
