"""Samba: Mamba layers interleaved with sliding-window attention, each followed by a SwiGLU MLP.

Ren et al., "Samba: Simple Hybrid State Space Models for Efficient Unlimited Context Language Modeling", ICLR 2025.

One forward, as data sees it:
    input_ids -> embed_tokens -> for each layer: x += mixer(input_layernorm(x)); x += mlp(post_attention_layernorm(x))
              -> norm -> lm_head (last `logits_to_keep` positions only)
where the mixer is a `SambaMambaMixer` ("linear_attention" layers; a `SambaMamba2Mixer` with `mamba_version=2`) or a
`SambaAttention` ("sliding_attention" / "full_attention" layers). Layouts with "mlp" layers (NVIDIA's
Mamba-2-Hybrid, Megatron's one-sub-layer blocks) run x += mixer(input_layernorm(x)) or x += mlp(input_layernorm(x)).

Beside this file: `attention_samba.py` (which attention runs, and the sliding-window backends), `ssm_samba.py` (which
scan and conv kernel runs), `cache_samba.py` (the decoding cache: transformers' hybrid `DynamicCache(config=...)`,
one conv window and one SSM state per Mamba layer, at most `sliding_window - 1` key/value positions per sliding
layer, written in place), `validation_samba.py` (the input checks), `hub_samba.py` (what a saved folder holds),
`speculative_samba.py` (prompt lookup that pauses after refused drafts).

This file is also the remote code of a saved model: it imports only torch, transformers and its siblings.
"""

import contextlib
import math
from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, StaticCache
from transformers.generation import GenerationMixin
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
from transformers.generation.configuration_utils import GenerationMode
from transformers.masking_utils import (
    create_causal_mask,
    create_recurrent_attention_mask,
    create_sliding_window_causal_mask,
    find_packed_sequence_indices,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .attention_samba import (
    ALL_ATTENTION_FUNCTIONS,
    attention_implementation,
    eager_attention_forward,
    ready_sliding_mask,
    sliding_window_mask,
)
from .cache_samba import (
    CACHE_NAME,
    ForwardCache,
    cache_nbytes,
    check_cache_continues,
    check_cache_type,
    check_static_cache_room,
    has_attention_layers,
    record_states,
    stop_recording,
)
from .configuration_samba import SambaConfig
from .hub_samba import save_folder
from .kernels_samba import resolve_kernel_implementation
from .linear_samba import SambaLinear
from .speculative_samba import PausingPromptLookup
from .ssm_samba import causal_conv, check_kernel_implementation, scan_keeping_states, selective_scan, ssd_scan
from .validation_samba import check_embeddings, check_inputs, check_labels

logger = logging.get_logger(__name__)

# The builder of each kind of layer's mask, keyed by layer type (see `SambaModel._mask_mapping`); "mlp" layers need
# none.
MASK_BUILDERS = {
    "linear_attention": create_recurrent_attention_mask,  # 2D padding mask (or None) for the Mamba mixer
    "sliding_attention": create_sliding_window_causal_mask,
    "full_attention": create_causal_mask,
}

# The shortest inference chunk on a GPU (see `SambaModel._inference_chunk`).
CUDA_MIN_INFERENCE_CHUNK = 65536


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
        inv_freq = 1.0 / (
            base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim)
        )
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


class SambaAttention(nn.Module):
    """Multi-head (GQA-capable) causal attention with RoPE; sliding-window for "sliding_attention" layers. The
    attention itself is looked up once in samba-hf's attention interface, by the name the mask gives: the configured
    implementation, or, for a long input's sliding window, one of samba-hf's paths (attention_samba.py)."""

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
        attention_mask,
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

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            attention_implementation(self.config, attention_mask), eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            scaling=self.scaling,
            dropout=0.0 if not self.training else self.attention_dropout,
            sliding_window=self.sliding_window,  # flash-attention reads the window here, the others from the mask
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


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

    @classmethod
    def find(cls, position_ids, attention_mask, cache: ForwardCache, batch_size) -> "PackedDocuments | None":
        """The documents packed into the rows (position_ids restart within a row, no padding), or None."""
        if position_ids is None or position_ids.shape[1] < 2 or isinstance(attention_mask, dict):
            return None
        if torch.compiler.is_exporting():  # where documents lie is data an exported program's shapes cannot depend
            return None  # on: one document per row (packed batches are for training)
        if attention_mask is not None and not bool(attention_mask.all()):
            return None  # padding: position_ids repeat over padded positions, that is not packing (as transformers)
        document_ids = find_packed_sequence_indices(position_ids)
        if document_ids is None:
            return None
        if cache.has_content():
            raise ValueError(
                "Packed sequences (position_ids restarting inside a row) cannot continue from a cache: run packed "
                "batches without past_key_values, or pass one document per row."
            )
        return cls(document_ids.expand(batch_size, -1))  # position_ids may come as (1, seq)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])[self.index]  # (batch, seq, d) -> (documents, longest, d)

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        # the valid positions, read row by row, are the tokens in their original order
        return rows[self.valid].reshape(*self.shape, rows.shape[-1])


class SambaStateSpaceMixer(nn.Module):
    """What every Mamba mixer does around its own projections and scan, Mamba and Mamba-2 alike: packed documents
    run one per row (each from a zero state), padding is zeroed and steps over nothing, the depthwise causal conv
    continues from the cache's window (`convolve`), and the scan from the cache's state, token by token while the
    cache records for assisted generation, the last state written back (`scan`). A subclass holds its projections
    and parameters and computes its layer in `mix`, with the kernels the switch chose (`choose_kernels`)."""

    scan_kernel = conv_kernel = "auto"  # the kernel switch's choices (`kernels_samba`)

    def __init__(self, config: SambaConfig, layer_idx: int, in_proj_width: int, conv_channels: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.conv_kernel_size = config.mamba_d_conv
        self.act = ACT2FN[config.hidden_act]
        # in_proj first, then the conv: the order their weights are drawn in from a seed
        self.in_proj = SambaLinear(config.hidden_size, in_proj_width, bias=config.mamba_proj_bias)
        self.conv1d = nn.Conv1d(
            conv_channels,
            conv_channels,
            kernel_size=self.conv_kernel_size,
            groups=conv_channels,
            padding=self.conv_kernel_size - 1,
            bias=config.mamba_conv_bias,
        )

    def choose_kernels(self, chosen: dict[str, str]):
        self.scan_kernel, self.conv_kernel = chosen["scan"], chosen["conv"]

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        documents: PackedDocuments | None = None,
        **options,
    ):
        # hidden_states (batch, seq, hidden); attention_mask (batch, seq): 1 for tokens, 0 for padding, or None.
        if documents is not None:  # packed sequences: the conv and the scan restart at each document
            out = self(documents.unpack(hidden_states), attention_mask=documents.valid, **options)
            return tuple(map(documents.pack, out)) if isinstance(out, tuple) else documents.pack(out)
        mask = attention_mask[:, :, None].to(hidden_states.dtype) if attention_mask is not None else None
        # the SSM state is read before the conv's update marks the layer as having a previous state
        state = past_key_values.get_recurrent_state(self.layer_idx) if past_key_values is not None else None
        return self.mix(hidden_states, mask, past_key_values, state, **options)

    def convolve(self, x: torch.Tensor, mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        """act(depthwise causal conv) over [the cache's window, x] at x's positions, padding zeroed before and after.
        x (batch, seq, channels) -> (batch, seq, channels)."""
        seq_len = x.shape[1]
        if mask is not None:
            x = x * mask
        x = x.transpose(1, 2)  # (batch, channels, seq)
        if cache is not None:
            x = cache.update_conv_state(x, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        x = self.act(causal_conv(self.conv1d, x, seq_len, self.conv_kernel)).transpose(1, 2)
        return x if mask is None else x * mask

    def scan(self, scan: Callable, state, cache: Cache | None, mask, per_token: dict, **fixed) -> torch.Tensor:
        """`scan` (`selective_scan` or `ssd_scan`) over `per_token` (its arguments with a sequence dimension; a
        padded position's step `dt` is zeroed, so it neither decays nor feeds the state) from `state`, the last
        state written to the cache; while the cache records, each token's state kept for `crop`
        (`scan_keeping_states`). Returns y."""
        if mask is not None:
            per_token["dt"] = per_token["dt"] * mask  # dt (batch, seq, channels or heads), mask (batch, seq, 1)
        fixed["kernel"] = self.scan_kernel
        if cache is not None and cache.is_recording_past(self.layer_idx):
            before = state
            y, state, states = scan_keeping_states(scan, state, per_token, **fixed)
            record_states(cache, self.layer_idx, states, before)
        else:
            y, state = scan(**per_token, **fixed, h0=state)
        if cache is not None:
            cache.update_recurrent_state(state, self.layer_idx)
        return y


class SambaMambaMixer(SambaStateSpaceMixer):
    """The Mamba (selective SSM) mixer, as in mamba-ssm's `Mamba` and the official Samba code.

    in_proj -> (x, z); x: causal depthwise conv (continuing from the cached window) -> SiLU -> x_proj -> (dt, B, C);
    dt_proj + softplus; selective scan (float32, from the cached SSM state); y * silu(z); out_proj.
    Every projection is called as a module, so adapters (LoRA) wrapping them take effect.
    """

    def __init__(self, config: SambaConfig, layer_idx: int):
        super().__init__(config, layer_idx, 2 * config.mamba_d_inner, conv_channels=config.mamba_d_inner)  # in: x, z
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.mamba_d_inner
        self.ssm_state_size = config.mamba_d_state
        self.time_step_rank = config.mamba_dt_rank

        self.x_proj = SambaLinear(self.intermediate_size, self.time_step_rank + 2 * self.ssm_state_size, bias=False)
        self.dt_proj = SambaLinear(self.time_step_rank, self.intermediate_size, bias=True)
        # S4D-real initialisation: A = -[1, 2, ..., N] for every channel, stored as log(-A).
        A = torch.arange(1, self.ssm_state_size + 1, dtype=torch.float32).expand(self.intermediate_size, -1)
        self.A_log = nn.Parameter(torch.log(A).contiguous())
        self.D = nn.Parameter(torch.ones(self.intermediate_size))
        self.out_proj = SambaLinear(self.intermediate_size, self.hidden_size, bias=config.mamba_proj_bias)
        self.out_proj.is_residual_output = True

    def mix(self, hidden_states, mask, cache, state, return_memory: bool = False):
        """return_memory: also return the scan's output before the gate, (batch, seq, d_inner) (SambaY's memory
        layer)."""
        x, z = self.in_proj(hidden_states).chunk(2, dim=-1)  # (batch, seq, d_inner) each
        x = self.convolve(x, mask, cache)
        dt, B, C = self.x_proj(x).split([self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
        dt = nn.functional.softplus(self.dt_proj(dt).float())  # (batch, seq, d_inner), float32
        gate = None if return_memory else z
        y = self.scan(
            selective_scan, state, cache, mask, dict(u=x, dt=dt, B=B, C=C, z=gate), A=self.decay_rates(), D=self.D
        )
        if return_memory:
            return self.out_proj(y * self.act(z)), y
        return self.out_proj(y)

    def decay_rates(self) -> torch.Tensor:
        """A = -exp(A_log), float32. Without autograd it is kept between calls while A_log is unchanged (same storage,
        same version): a decoding step would otherwise compute d_inner x d_state exps per layer again."""
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


class SambaMamba2Mixer(SambaStateSpaceMixer):
    """The Mamba-2 (SSD) mixer, as in mamba-ssm's `Mamba2` and Megatron-LM's `MambaMixer` (Dao & Gu, 2024).

    in_proj -> (z, xBC, dt); xBC: causal depthwise conv with bias (continuing from the cached window) -> SiLU ->
    (x, B, C); dt + dt_bias, softplus; SSD over heads of `mamba2_head_dim` channels, one A per head, B and C shared by
    the heads of a group (float32, from the cached state, no clamp on dt); + D x; gated group RMSNorm with z; out_proj.
    Every projection is called as a module, so adapters (LoRA) wrapping them take effect.
    """

    def __init__(self, config: SambaConfig, layer_idx: int):
        conv_dim = config.mamba_d_inner + 2 * config.mamba2_n_groups * config.mamba_d_state  # x, B, C
        # in_proj: z, xBC, dt
        super().__init__(config, layer_idx, config.mamba_d_inner + conv_dim + config.mamba2_num_heads, conv_dim)
        self.intermediate_size = config.mamba_d_inner
        self.ssm_state_size = config.mamba_d_state
        self.head_dim = config.mamba2_head_dim
        self.num_heads = config.mamba2_num_heads
        self.n_groups = config.mamba2_n_groups
        self.chunk_size = config.mamba2_chunk_size
        self.conv_dim = conv_dim

        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = SambaGatedRMSNorm(
            self.intermediate_size, self.intermediate_size // self.n_groups, config.rms_norm_eps
        )
        self.out_proj = SambaLinear(self.intermediate_size, config.hidden_size, bias=config.mamba_proj_bias)
        self.out_proj.is_residual_output = True

    def mix(self, hidden_states, mask, cache, state):
        batch, seq_len, _ = hidden_states.shape
        z, xBC, dt = self.in_proj(hidden_states).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        xBC = self.convolve(xBC, mask, cache)  # (batch, seq, conv_dim)
        x, B, C = xBC.split([self.intermediate_size, *2 * [self.n_groups * self.ssm_state_size]], dim=-1)
        dt = nn.functional.softplus(dt.float() + self.dt_bias.float())  # (batch, seq, heads), float32
        A = -torch.exp(self.A_log.float())  # (heads,)
        groups = (batch, seq_len, self.n_groups, self.ssm_state_size)
        x, B, C = x.reshape(batch, seq_len, self.num_heads, self.head_dim), B.reshape(groups), C.reshape(groups)
        y = self.scan(
            ssd_scan, state, cache, mask, dict(x=x, dt=dt, B=B, C=C), A=A, D=self.D, chunk_size=self.chunk_size
        )
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
    # transformers refuses assisted generation to stateful models; a Samba cache goes back to any recorded token
    # (cache_samba.SambaMambaLayer), so generate may verify drafts
    _is_stateful = False
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
        """transformers' save_pretrained, plus `auto_map["AutoModel"]`, a model card, and no earlier weights left
        beside the new ones (`hub_samba.save_folder`)."""
        save_folder(self, save_directory, super().save_pretrained, *args, **kwargs)

    def post_init(self):
        """transformers' post_init, and the kernel switch's choice handed to the layers (checked for this device,
        unless the weights are still to come: `from_pretrained` checks it once they are in place)."""
        super().post_init()
        if self.device.type == "meta":
            self._choose_kernels(resolve_kernel_implementation(self.config.kernel_implementation))
        else:
            self.set_kernel_implementation(self.config.kernel_implementation)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' from_pretrained (`kernel_implementation=` among its arguments, as `attn_implementation=`),
        with the kernel switch's choice checked on the device the weights went to."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, loading info) when asked for
        model.set_kernel_implementation(model.config.kernel_implementation)
        return loaded

    def set_kernel_implementation(self, kernel_implementation: str | dict):
        """Choose which code runs the scan, the conv and the linear layers, as `set_attn_implementation` chooses
        attention: "auto" (the default: the fastest installed), "pytorch", "samba" (samba-hf's own kernels) or
        "mamba_ssm" (mamba-ssm's and causal-conv1d's, on CUDA), or a dict of parts (`{"scan": "pytorch"}`); see
        `kernels_samba`. A ValueError names the choices where one is unknown or cannot run on this model's device."""
        chosen = check_kernel_implementation(kernel_implementation, self.device, self.config.mamba_version)
        self.config.kernel_implementation = kernel_implementation
        self._choose_kernels(chosen)

    def _choose_kernels(self, chosen: dict[str, str]):
        for module in self.modules():
            if isinstance(module, (SambaStateSpaceMixer, SambaLinear)):
                module.choose_kernels(chosen)

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
        if (
            mesh_manager is not None
            and config is not None
            and config.fsdp_mixed_precision
            and config.dp_size > 1
            and config.tp_size == config.pp_size == config.ep_size == 1
        ):
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            from transformers.distributed.fsdp import _get_fsdp_policy_kwargs

            mesh = mesh_manager.get_mesh(("dp_replicate", "fsdp") if config.dp_replicate_size > 1 else "fsdp")
            policy = _get_fsdp_policy_kwargs(config)  # transformers' own: bf16 parameters, float32 reduction
            float32 = {
                **policy,
                "mp_policy": MixedPrecisionPolicy(
                    param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
                ),
            }
            for module in model.modules():
                if isinstance(module, SambaStateSpaceMixer):
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
            init.copy_(
                module.A_log,
                torch.log(torch.arange(1, module.ssm_state_size + 1, dtype=torch.float32)).expand(
                    module.intermediate_size, -1
                ),
            )
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
    # Whether a long input's sliding window is computed by samba-hf's own paths (`attention_samba.sliding_window_mask`)
    _owns_long_sliding_window = True

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
        cache = ForwardCache.prepare(self.config, past_key_values, cache, use_cache)
        check_inputs(self.config, input_ids, inputs_embeds, attention_mask, cache.cache)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        else:
            check_embeddings(inputs_embeds, self.embed_tokens.weight.dtype)
        documents = PackedDocuments.find(position_ids, attention_mask, cache, inputs_embeds.shape[0])
        if documents is not None:  # a packed (training) batch: nothing to continue from it, so no cache; the mask
            use_cache, cache, attention_mask = False, ForwardCache(None, self.config), None  # builders find them
        if position_ids is None:
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + cache.past_length())[
                None
            ]

        # packed documents go through in one piece (their boundaries were found once, above)
        chunk = self._inference_chunk(inputs_embeds, attention_mask, cache, kwargs) if documents is None else 0
        tail = cache.tokens_to_record(attention_mask, inputs_embeds.shape[1], keep_last) if documents is None else 0
        if chunk or tail:
            hidden_states = self._run_in_pieces(inputs_embeds, position_ids, cache, kwargs, keep_last, chunk, tail)
        else:
            hidden_states = self._run_layers(
                inputs_embeds, attention_mask, position_ids, cache.cache, kwargs, documents, keep_last
            )
        if keep_last is not None:
            hidden_states = hidden_states[:, hidden_states.shape[1] - min(keep_last, hidden_states.shape[1]) :]
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states, **{CACHE_NAME: cache.cache if use_cache else None}
        )

    def _run_in_pieces(self, inputs_embeds, position_ids, cache: ForwardCache, kwargs, keep_last, chunk, tail):
        """The input through the cache in pieces, each continuing from the one before (exactly equal to one pass,
        tested): `chunk` tokens at a time for a long inference input (the activations of a piece stay in the CPU's
        caches; memory is bounded by the piece, not the prompt), and the last `tail` tokens apart, the only ones a
        recording cache records."""
        continued = cache.for_pieces()
        length = inputs_embeds.shape[1]
        first_kept = length - min(keep_last, length) if keep_last is not None else 0
        bounds = sorted({*range(0, length - tail, chunk or length), length - tail, length})
        pieces = []
        for start, end in zip(bounds, bounds[1:]):
            with cache.recording_paused() if tail and start < length - tail else contextlib.nullcontext():
                pieces.append(
                    self._run_layers(
                        inputs_embeds[:, start:end],
                        None,
                        position_ids[:, start:end],
                        continued,
                        kwargs,
                        keep_last=max(0, end - max(start, first_kept)),  # of this piece's positions
                    )
                )
        return torch.cat(pieces, dim=1)

    def _run_layers(
        self, inputs_embeds, attention_mask, position_ids, past_key_values, kwargs, documents=None, keep_last=None
    ) -> torch.Tensor:
        """The decoder layers over one piece of the input; every Samba layer keeps state, so all positions run
        (`keep_last` is applied by the caller)."""
        mask_mapping = self._mask_mapping(
            inputs_embeds, attention_mask, position_ids, past_key_values, kwargs, documents
        )
        hidden_states = inputs_embeds
        position_embeddings = None
        if self.config.use_rope and has_attention_layers(self.config):
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
        """One mask per kind of layer (`config.layer_types`), built once per forward (each sized against the cache of
        the first layer of its kind); generate() may pass them ready-made as a dict. A long input's sliding layers
        take samba-hf's own mask where `sliding_window_mask` gives one, and the block-wise path's where a mask made
        elsewhere lost the window (`ready_sliding_mask`): which attention each layer runs is decided here."""
        config = self.config
        if isinstance(attention_mask, dict):
            masks = dict(attention_mask)
        else:
            masks = self._build_masks(inputs_embeds, attention_mask, position_ids, past_key_values, kwargs, documents)
        if "sliding_attention" in masks and self._owns_long_sliding_window:
            masks["sliding_attention"] = ready_sliding_mask(config, inputs_embeds, masks["sliding_attention"])
        return masks

    def _build_masks(self, inputs_embeds, attention_mask, position_ids, past_key_values, kwargs, documents) -> dict:
        config, kinds = self.config, set(self.config.layer_types) & set(MASK_BUILDERS)
        sliding = None
        if "sliding_attention" in kinds and self._owns_long_sliding_window:
            output_attentions = kwargs.get("output_attentions", config.output_attentions)
            sliding = sliding_window_mask(
                config,
                inputs_embeds,
                attention_mask,
                past_key_values,
                documents is not None,
                output_attentions,
                self.training,
            )
        mask_kwargs = {
            "config": config,
            "inputs_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            CACHE_NAME: past_key_values,
            "position_ids": position_ids,
        }
        return {
            kind: sliding
            if kind == "sliding_attention" and sliding is not None
            else MASK_BUILDERS[kind](**mask_kwargs, layer_idx=config.layer_types.index(kind))
            for kind in kinds
        }

    def _inference_chunk(self, inputs_embeds, attention_mask, cache: ForwardCache, kwargs) -> int:
        """The chunk length to split this forward into, or 0. Only inference (no autograd) over an input longer than
        `config.inference_chunk_size`, without padding, per-layer outputs, packed sequences or a static cache. On a
        GPU the chunks are at least `CUDA_MIN_INFERENCE_CHUNK` tokens: there, chunks only bound memory, and each
        continuation from a cached state costs the scan a launch of its own."""
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
        return chunk if cache.takes_pieces() else 0


class SambaForCausalLM(SambaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}  # with the final norm, one unit kept gathered for the backward
    draft_pause_limit = 32  # prompt lookup: the most tokens decoded without drafting after refused drafts

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
            raise ValueError(
                f"logits_to_keep must be 0 (every position), a count of last positions >= 1, or a 1D "
                f"tensor of positions, got {logits_to_keep}"
            )
        keep_last = logits_to_keep if isinstance(logits_to_keep, int) and logits_to_keep > 0 else None
        tokens = input_ids if input_ids is not None else inputs_embeds
        if labels is not None and tokens is not None:
            labels = check_labels(labels, tokens, self.config.vocab_size)
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            cache=cache,  # SambaModel takes the one given (ForwardCache.prepare)
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
            if (
                isinstance(attention_mask, torch.Tensor)
                and attention_mask.ndim == 2
                and not bool(attention_mask.all())
            ):
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
        of a kind Samba takes (`check_cache_type`), an offloaded cache only on a CUDA device, no static cache for
        assisted generation, and a static cache with room for what this call writes. `max_cache_length` is what
        transformers sizes its own static cache by: the prompt and the new tokens, less the last new token (never fed
        back)."""
        cache = model_kwargs.get(CACHE_NAME)
        if cache is not None:
            check_cache_type(cache)
        if generation_mode == GenerationMode.ASSISTED_GENERATION and (
            generation_config.cache_implementation == "static" or isinstance(cache, StaticCache)
        ):
            # transformers' static sliding-window layer cannot be taken back past its window
            raise ValueError(
                "Assisted generation (prompt lookup, an assistant model) takes the cache back after each draft, "
                'which a static cache cannot do: leave out cache_implementation="static" (and the StaticCache), '
                "and let generate make its dynamic cache."
            )
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
            check_static_cache_room(cache, self.config, max_cache_length)

    def _prefill(self, input_ids, generation_config, model_kwargs: dict, *args, **kwargs):
        """transformers' prefill, refusing a cache that already holds every token given (`check_cache_continues`):
        transformers would feed the whole prompt again on top of it, or an empty input."""
        embeds = model_kwargs.get("inputs_embeds")
        given = input_ids.shape[1] if embeds is None else embeds.shape[1]
        mask = model_kwargs.get("attention_mask")
        mask_length = mask.shape[1] if mask is not None else getattr(generation_config, "_mask_length", -1)
        if embeds is not None or mask_length == given:  # (where transformers cuts the input by the cache's length)
            check_cache_continues(model_kwargs.get(CACHE_NAME), given, self.config)
        return super()._prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)

    def _assisted_decoding(self, input_ids, *args, **model_kwargs):
        """transformers' assisted decoding; the cache it hands back (`return_dict_in_generate`, or one passed in) no
        longer records: transformers leaves recording on, and a plain `generate` continuing that cache would record
        every token it decodes (`stop_recording`)."""
        try:
            return super()._assisted_decoding(input_ids, *args, **model_kwargs)
        finally:
            stop_recording(model_kwargs.get("cache", model_kwargs.get("past_key_values")))

    def _get_candidate_generator(self, generation_config, *args, **kwargs):
        """transformers' candidate generator for assisted generation; prompt lookup pauses its drafting after
        refused drafts, up to `draft_pause_limit` tokens at a time (0: transformers' own, drafting every round)."""
        generator = super()._get_candidate_generator(generation_config, *args, **kwargs)
        if isinstance(generator, PromptLookupCandidateGenerator) and self.draft_pause_limit > 0:
            generator = PausingPromptLookup(generator, self.draft_pause_limit)
        return generator

    def cache_nbytes(self, batch_size: int = 1, seq_len: int | None = None, dtype: torch.dtype | None = None) -> int:
        """Bytes held by the generation cache (`DynamicCache(config=...)`) once `seq_len` tokens have been seen, in
        `dtype` (default: the model's; the SSM states are float32 in every dtype). Constant in `seq_len` for a Samba
        layout; `seq_len=None` means "any length past the window", an error for layouts with full-attention layers,
        whose cache has no bound. What each layer holds: `cache_samba.cache_nbytes`."""
        return cache_nbytes(self.config, batch_size, seq_len, torch.finfo(dtype or self.dtype).bits // 8)


__all__ = ["SambaForCausalLM", "SambaModel", "SambaPreTrainedModel"]
