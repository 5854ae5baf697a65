"""A samba-hf model as one program for an on-device runtime: `forward(tokens, input_pos) -> logits`, its state in
buffers the program updates in place.

ExecuTorch's LLM runner (and any loop like it) calls a program's `forward` with the prompt's tokens and their
positions, then one token at a time, and keeps no cache itself: the program holds it. `SambaOnDevice` holds samba-hf's
state as module buffers of fixed size (batch 1):
- a Mamba or Mamba-2 layer: its conv window (the last `d_conv - 1` inputs, in the model's dtype) and its SSM state
  (float32);
- a sliding-window layer: a ring of `sliding_window` key and value positions, and the position each slot holds
  (-1: empty);
- a full-attention layer: `max_context_len` key and value positions, written at their position.
A forward whose first position is 0 starts a new text: every state is cleared first (by arithmetic, not a branch,
so the program has one path). The masks are made from the positions alone. The sizes never change, so a program's
memory is what it is at its first call, whatever the length of the text (up to `max_context_len` positions for a
layout with full-attention layers).

`export_executorch` writes it as an ExecuTorch program (XNNPACK) with the metadata methods ExecuTorch's LLM runner
reads (`TextLLMRunner`, and its C++ runner on a phone).

SambaY (Phi-4-mini-flash-reasoning's layout) is not taken yet: its cross-decoder reads one key/value cache that a
self-decoder layer shares.
"""

import torch
from torch import nn
from transformers.cache_utils import Cache, DummyLayer, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

_EMPTY_LAYERS = {
    "linear_attention": lambda config: LinearAttentionLayer(),
    "sliding_attention": lambda config: DynamicSlidingWindowLayer(sliding_window=config.sliding_window),
    "full_attention": lambda config: DynamicLayer(),
    "mlp": lambda config: DummyLayer(),
}


class OnDeviceCache(Cache):
    """The cache a `SambaOnDevice` forward hands the model: views of the program's buffers, updated in place. What
    the mixers and attention layers ask of a cache, answered from them."""

    def __init__(self, program: "SambaOnDevice", input_pos: torch.Tensor, ring: tuple[torch.Tensor, torch.Tensor]):
        self.program, self.input_pos, self.ring = program, input_pos, ring  # ring: `ring_writes` of this input
        # empty layers of each kind, for the checks that read a cache's layout; the state is the program's
        self.layers = [_EMPTY_LAYERS[kind](program.model.config) for kind in program.model.config.layer_types]
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
        """The keys and values this input attends to, [the layer's buffer, the new ones]; the new ones are written
        into the buffer: at their position in a full layer, at position % window in a sliding one (the last
        `window` of them)."""
        keys, values = getattr(self.program, f"keys_{layer_idx}"), getattr(self.program, f"values_{layer_idx}")
        full_keys, full_values = torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
        if self.program.is_sliding[layer_idx]:
            take, index = self.ring
            keys.copy_(torch.where(take[:, None], key_states[0].index_select(-2, index), keys[0])[None])
            values.copy_(torch.where(take[:, None], value_states[0].index_select(-2, index), values[0])[None])
        else:
            keys.index_copy_(-2, self.input_pos, key_states)
            values.index_copy_(-2, self.input_pos, value_states)
        return full_keys, full_values


def ring_writes(input_pos: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each slot s of a ring of `size` positions (position p lives at p % size), whether consecutive positions
    `input_pos` write it, and which of them (an index into `input_pos`): the last one that falls there. Arithmetic
    only, so one program serves every length (a slice of the last `size` would depend on the length)."""
    first, last = input_pos[0], input_pos[-1]
    slots = torch.arange(size, device=input_pos.device)
    latest = last - (last + size - slots) % size  # the last position <= `last` at each slot (% of a positive)
    return latest >= first, (latest - first).clamp(min=0)


class SambaOnDevice(nn.Module):
    """`model` (a samba-hf causal LM, eval) with its decoding state in buffers: `forward(tokens (1, seq), input_pos
    (seq,)) -> logits (1, seq, vocab)` (module docstring)."""

    def __init__(self, model, max_context_len: int):
        super().__init__()
        config = model.config
        if getattr(config, "model_type", "samba") != "samba":
            raise ValueError(
                f"SambaOnDevice takes Samba's layouts (model_type 'samba'), not {config.model_type!r}: SambaY's "
                "cross-decoder reads a key/value cache another layer shares, which this program does not hold yet"
            )
        self.model, self.max_context_len = model, max_context_len
        self.is_sliding = {}
        parameters = next(model.parameters())
        for index, kind in enumerate(config.layer_types):
            layer = model.model.layers[index]
            if kind == "linear_attention":
                mixer = layer.mamba
                channels = mixer.conv1d.in_channels
                self.register_buffer(
                    f"conv_{index}", torch.zeros(1, channels, config.mamba_d_conv - 1, dtype=parameters.dtype)
                )
                self.register_buffer(f"ssm_{index}", torch.zeros(1, *self._ssm_shape(mixer, config)))
            elif kind in ("sliding_attention", "full_attention"):
                self.is_sliding[index] = kind == "sliding_attention"
                size = config.sliding_window if self.is_sliding[index] else max_context_len
                shape = (1, config.num_key_value_heads, size, config.head_dim)
                self.register_buffer(f"keys_{index}", torch.zeros(shape, dtype=parameters.dtype))
                self.register_buffer(f"values_{index}", torch.zeros(shape, dtype=parameters.dtype))
        self.register_buffer("window_positions", torch.full((config.sliding_window or 1,), -1, dtype=torch.long))
        if not all(self.is_sliding.values()):  # (full-attention layers)
            self.register_buffer("full_positions", torch.full((max_context_len,), -1, dtype=torch.long))

    @staticmethod
    def _ssm_shape(mixer, config) -> tuple[int, ...]:
        if config.mamba_version == 2:
            return (mixer.num_heads, mixer.head_dim, config.mamba_d_state)
        return (mixer.intermediate_size, config.mamba_d_state)

    def forward(self, tokens: torch.LongTensor, input_pos: torch.LongTensor) -> torch.Tensor:
        """tokens (1, seq); input_pos (1,): the first token's position (the rest follow it). Returns the last
        token's logits (1, 1, vocab), as ExecuTorch's LLM runner reads them."""
        input_pos = input_pos[:1] + torch.arange(tokens.shape[1], device=tokens.device)  # (seq,)
        keep = (input_pos[0] > 0).to(torch.float32)  # 0 at a new text's first call: clear every state
        for name, buffer in self.named_buffers(recurse=False):  # (the state, not the model's own buffers)
            if name.endswith("_positions"):
                buffer.copy_(torch.where(keep > 0, buffer, torch.full_like(buffer, -1)))
            else:
                buffer.mul_(keep.to(buffer.dtype))
        masks = {"linear_attention": None}
        queries = input_pos[:, None]  # (seq, 1)
        if any(self.is_sliding.values()):
            keys = torch.cat([self.window_positions, input_pos])[None, :]  # (1, window + seq)
            window = self.model.config.sliding_window
            masks["sliding_attention"] = ((keys >= 0) & (keys <= queries) & (keys > queries - window))[None, None]
        if not all(self.is_sliding.values()):
            keys = torch.cat([self.full_positions, input_pos])[None, :]
            masks["full_attention"] = ((keys >= 0) & (keys <= queries))[None, None]
        ring = ring_writes(input_pos, self.window_positions.shape[0])  # every sliding layer's, and the positions'
        cache = OnDeviceCache(self, input_pos, ring)
        logits = self.model(
            input_ids=tokens,
            position_ids=input_pos[None],
            attention_mask=masks,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits
        # the positions each slot now holds (the layers wrote their keys and values there)
        take, index = ring
        self.window_positions.copy_(torch.where(take, input_pos.index_select(0, index), self.window_positions))
        if not all(self.is_sliding.values()):
            self.full_positions.index_copy_(0, input_pos, input_pos)
        return logits


def export_executorch(model, path, max_seq_len: int = 256, max_context_len: int | None = None):
    """Write `model` (a samba-hf causal LM) to `path` as an ExecuTorch program, XNNPACK-delegated, that ExecuTorch's
    LLM runner generates from: `forward(tokens (1, <= max_seq_len), input_pos (1,))`, the state inside
    (`SambaOnDevice`), and the runner's metadata methods. `max_context_len`: the longest text (the full-attention
    layers' buffers; default `config.max_position_embeddings`, or 4096 where a layout has full-attention layers).
    The file is written whole or not at all."""
    import os
    import tempfile
    from pathlib import Path

    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from .conversion.writer import current_umask

    config = model.config
    if max_context_len is None:
        has_full = "full_attention" in config.layer_types
        max_context_len = 4096 if has_full else config.max_position_embeddings
    program = SambaOnDevice(model.eval(), max_context_len).eval()
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
    ).to_executorch()
    path = Path(path)
    handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(handle, "wb") as out:
            lowered.write_to_file(out)
        os.chmod(partial, 0o666 & ~current_umask())  # (mkstemp's file is the owner's alone)
        os.replace(partial, path)
    except BaseException:
        os.unlink(partial)
        raise
    return path
