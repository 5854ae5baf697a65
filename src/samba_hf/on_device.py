"""A samba-hf model as one program for an on-device runtime: `forward(tokens, input_pos) -> logits`, its state in
buffers the program updates in place.

ExecuTorch's LLM runner (and any loop like it) calls a program's `forward` with the prompt's tokens and their
positions, then one token at a time, and keeps no cache itself: the program holds it. `SambaOnDevice` holds samba-hf's
state as module buffers of fixed size (batch 1):
- a Mamba or Mamba-2 layer: its conv window (the last `d_conv - 1` inputs, in the model's dtype) and its SSM state
  (float32);
- a sliding-window layer: a ring of `sliding_window + max_seq_len` key and value slots (position p in slot
  p % size), so a call's new keys are written before it attends and every key it may see is still there;
- a full-attention layer (SambaY's shared one included): `max_context_len` slots, position p in slot p;
- per kind, the position each slot holds (-1: empty), from which the masks are made.
A call writes only its own tokens' slots (in place: the program's memory traffic is the weights and what attention
reads, not a copy of every buffer) and attends over the buffer. A call whose first position is 0 starts a new text:
the recurrent states and the slot positions are cleared first (by `where`, not a branch, so the program has one
path); keys and values left from an earlier text are masked out by their positions. The sizes never change, so a
program's memory is what it is at its first call, whatever the length of the text (up to `max_context_len` positions
for a layout with full-attention layers).

`export_executorch` writes it as an ExecuTorch program (XNNPACK, optionally with 8-bit dynamic activations and 4-bit
weights) with the metadata methods ExecuTorch's LLM runner reads (`TextLLMRunner`, and its C++ runner on a phone).
"""

import torch
from torch import nn
from transformers.cache_utils import Cache, DummyLayer, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from .attention_samba import SlotMask

_EMPTY_LAYERS = {
    "linear_attention": lambda config: LinearAttentionLayer(),
    "sliding_attention": lambda config: DynamicSlidingWindowLayer(sliding_window=config.sliding_window),
    "full_attention": lambda config: DynamicLayer(),
    "mlp": lambda config: DummyLayer(),
}
# the blocks that keep a state, by their kind in `block_types` (SambaY) or `layer_types` (Samba)
_RECURRENT = ("linear_attention", "mamba", "memory")
_ATTENTION = ("sliding_attention", "full_attention")


class OnDeviceCache(Cache):
    """The cache a `SambaOnDevice` forward hands the model: the program's buffers, written in place. What the mixers
    and attention layers ask of a cache, answered from them."""

    def __init__(self, program: "SambaOnDevice", slots: dict[str, torch.Tensor]):
        self.program, self.slots = program, slots  # slots: per attention kind, the slot of each new token (seq,)
        # empty layers of each kind, for the checks that read a cache's layout; the state is the program's
        config = program.model.config
        sharing = getattr(config, "kv_sharing_modes", None) or ["own"] * len(config.layer_types)  # (SambaY's)
        self.layers = [
            DummyLayer() if mode == "reuse" else _EMPTY_LAYERS[kind](config)
            for kind, mode in zip(config.layer_types, sharing)
        ]
        self.layer_class_to_replicate, self.offloading = None, False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # (positions come with every call; nothing asks the cache for them)

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        return False

    def has_previous_state(self, layer_idx: int | None = None) -> bool:
        return True  # (a new text's states are zeros: `SambaOnDevice.forward` clears them)

    # Mamba layers
    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return getattr(self.program, f"ssm_{layer_idx}")

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        state = getattr(self.program, f"ssm_{layer_idx}")
        state.copy_(recurrent_states)
        return state

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        """[the kept window, the new inputs] (batch, channels, d_conv - 1 + seq); the window keeps the last
        d_conv - 1."""
        window = getattr(self.program, f"conv_{layer_idx}")
        full = torch.cat([window, conv_states.to(window.dtype)], dim=-1)
        window.copy_(full[..., full.shape[-1] - window.shape[-1] :])
        return full.to(conv_states.dtype)

    # attention layers
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Writes the new keys and values into their slots and returns the layer's whole buffers (batch, kv_heads,
        slots, head_dim), which the positions' mask reads."""
        keys, values = getattr(self.program, f"keys_{layer_idx}"), getattr(self.program, f"values_{layer_idx}")
        slots = self.slots[self.program.attention_kind[layer_idx]]
        keys.index_copy_(2, slots, key_states)  # (in place: the new tokens' slots only)
        values.index_copy_(2, slots, value_states)
        return keys, values


class SambaOnDevice(nn.Module):
    """`model` (a samba-hf causal LM, eval) with its decoding state in buffers: `forward(tokens (1, seq <=
    max_seq_len), input_pos (1,)) -> the last token's logits (1, 1, vocab)` (module docstring)."""

    def __init__(self, model, max_context_len: int, max_seq_len: int = 128):
        super().__init__()
        config = model.config
        self.model, self.max_context_len, self.max_seq_len = model, max_context_len, max_seq_len
        blocks = getattr(config, "block_types", config.layer_types)  # (SambaY names its blocks; Samba its layers)
        self.attention_kind = {}
        dtype = next(model.parameters()).dtype
        sizes = {"sliding_attention": (config.sliding_window or 0) + max_seq_len, "full_attention": max_context_len}
        for index, block in enumerate(blocks):
            layer = model.model.layers[index]
            if block in _RECURRENT:
                mixer = getattr(layer, "mamba", None) or layer.attn
                channels = mixer.conv1d.in_channels
                self.register_buffer(f"conv_{index}", torch.zeros(1, channels, config.mamba_d_conv - 1, dtype=dtype))
                self.register_buffer(f"ssm_{index}", torch.zeros(1, *self._ssm_shape(mixer, config)))
            elif block in _ATTENTION:
                self.attention_kind[index] = block
                shape = (1, config.num_key_value_heads, sizes[block], config.head_dim)
                self.register_buffer(f"keys_{index}", torch.zeros(shape, dtype=dtype))
                self.register_buffer(f"values_{index}", torch.zeros(shape, dtype=dtype))
        for kind in sorted(set(self.attention_kind.values())):  # which position each slot holds
            self.register_buffer(f"{kind}_positions", torch.full((sizes[kind],), -1, dtype=torch.long))

    @staticmethod
    def _ssm_shape(mixer, config) -> tuple[int, ...]:
        if getattr(config, "mamba_version", 1) == 2:
            return (mixer.num_heads, mixer.head_dim, config.mamba_d_state)
        return (mixer.intermediate_size, config.mamba_d_state)

    def forward(self, tokens: torch.LongTensor, input_pos: torch.LongTensor) -> torch.Tensor:
        """tokens (1, seq); input_pos (1,): the first token's position (the rest follow it). Returns the last
        token's logits (1, 1, vocab), as ExecuTorch's LLM runner reads them."""
        if not torch.compiler.is_exporting():  # (a program's bounds are its traced shapes and the runner's limits)
            self._check(tokens, input_pos)
        input_pos = input_pos[:1] + torch.arange(tokens.shape[1], device=tokens.device)  # (seq,)
        keep = input_pos[0] > 0  # False at a new text's first call: clear the states
        for name, buffer in self.named_buffers(recurse=False):  # (the state, not the model's own buffers)
            if name.startswith(("conv_", "ssm_")):
                buffer.mul_(keep.to(buffer.dtype))  # (finite: they start as zeros, `export_executorch`)
        queries = input_pos[:, None]  # (seq, 1)
        slots, masks = {}, {"linear_attention": None}
        for kind in set(self.attention_kind.values()):
            positions = getattr(self, f"{kind}_positions")
            positions.copy_(torch.where(keep, positions, torch.full_like(positions, -1)))
            slots[kind] = input_pos % positions.shape[0]
            positions.index_copy_(0, slots[kind], input_pos)
            visible = (positions >= 0) & (positions <= queries)  # (seq, slots)
            if kind == "sliding_attention":
                visible = visible & (positions > queries - self.model.config.sliding_window)
            masks[kind] = SlotMask(visible[None, None])
        return self.model(
            input_ids=tokens,
            position_ids=input_pos[None],
            attention_mask=masks,
            cache=OnDeviceCache(self, slots),
            use_cache=True,
            logits_to_keep=1,
        ).logits

    def _check(self, tokens: torch.Tensor, input_pos: torch.Tensor):
        if tokens.ndim != 2 or tokens.shape[0] != 1 or not 1 <= tokens.shape[1] <= self.max_seq_len:
            raise ValueError(
                f"tokens: one sequence of 1 to max_seq_len={self.max_seq_len} tokens, (1, seq), not "
                f"{tuple(tokens.shape)}: give a longer prompt in several calls"
            )
        last = int(input_pos[0]) + tokens.shape[1] - 1
        if "full_attention" in self.attention_kind.values() and last >= self.max_context_len:
            raise ValueError(
                f"position {last} is past max_context_len={self.max_context_len}, the full-attention layers' "
                "buffers: make the program with a larger max_context_len"
            )


QUANTIZATIONS = ("8da4w",)


def quantize_8da4w(model, group_size: int = 32):
    """Quantizes `model`'s linear layers in place for an on-device program (torchao): 8-bit dynamic activations and
    4-bit symmetric weights, a scale per `group_size` weights of a row (ExecuTorch's XNNPACK runs them as its
    quantized products). Layers whose input width is not a multiple of `group_size` (Mamba's dt_proj, of width
    dt_rank) and the embedding stay as they are. Returns the model."""
    import logging

    torchao_logger = logging.getLogger("torchao")
    level = torchao_logger.level
    torchao_logger.setLevel(logging.ERROR)  # (its import names each CUDA-only library a CPU build lacks)
    try:
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
        from torchao.quantization.granularity import PerGroup
    finally:
        torchao_logger.setLevel(level)

    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    quantize_(model, config, filter_fn=lambda m, name: isinstance(m, nn.Linear) and m.in_features % group_size == 0)
    return model


def export_executorch(model, path, max_seq_len: int = 128, max_context_len: int | None = None):
    """Write `model` (a samba-hf causal LM, float32 or quantized by `quantize_8da4w`) to `path` as an ExecuTorch
    program, XNNPACK-delegated, that ExecuTorch's LLM runner generates from: `forward(tokens (1, <= max_seq_len),
    input_pos (1,))`, the state inside (`SambaOnDevice`), and the runner's metadata methods. `max_context_len`: the
    longest text (the full-attention layers' buffers; default `config.max_position_embeddings`, or 4096 where a
    layout has full-attention layers). The file is written whole or not at all."""
    from pathlib import Path

    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    from .conversion.writer import written_whole

    config = model.config
    if max_context_len is None:
        has_full = "full_attention" in config.layer_types
        max_context_len = 4096 if has_full else config.max_position_embeddings
    program = SambaOnDevice(model.eval(), max_context_len, max_seq_len).eval()
    example = (torch.zeros(1, min(8, max_seq_len), dtype=torch.long), torch.zeros(1, dtype=torch.long))
    tokens = torch.export.Dim("tokens", min=1, max=max_seq_len)
    with torch.no_grad():
        exported = torch.export.export(
            program, example, dynamic_shapes=({1: tokens}, None), prefer_deferred_runtime_asserts_over_guards=True
        )
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    metadata = {
        "get_max_seq_len": max_seq_len,
        "get_max_context_len": max_context_len,
        "get_vocab_size": config.vocab_size,
        "get_bos_id": config.bos_token_id if config.bos_token_id is not None else -1,
        "get_eos_ids": [token for token in eos if token is not None],
        "use_kv_cache": True,  # (the state lives in the program)
        "use_sdpa_with_kv_cache": False,
        "enable_dynamic_shape": True,  # a prompt in one call
    }
    lowered = to_edge_transform_and_lower(
        exported,
        partitioner=[XnnpackPartitioner()],
        # (the exported program keeps a shape assert torch.export could not prove, which ExecuTorch's IR check refuses)
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
        constant_methods=metadata,
    ).to_executorch(
        ExecutorchBackendConfig(
            # the states start as the zeros they were made with (ExecuTorch otherwise keeps only a mutable buffer's
            # shape: whatever memory held, NaN included, would survive a clearing product or reach attention
            # through a masked slot)
            passes=[InitializedMutableBufferPass(["keys_", "values_", "conv_", "ssm_"])],
        )
    )
    path = Path(path)
    with written_whole(path) as partial, open(partial, "wb") as out:
        lowered.write_to_file(out)
    return path
