"""SambaY: the architecture of microsoft/Phi-4-mini-flash-reasoning, built from Samba's blocks.

A Samba self-decoder (Mamba + sliding-window differential attention) and a YOCO cross-decoder (one full attention
layer whose keys/values every cross-attention layer reads, and Gated Memory Units on the memory of the last
self-decoder Mamba layer). See `configuration_sambay.py` for the layer pattern.

One forward, as data sees it (layer i of L):
    h = embed_tokens(ids)
    for each layer: h += mixer_i(input_layernorm(h)); h += mlp(post_attention_layernorm(h))
        Mamba layers (i < L/2 even, and i = L/2): Samba's mixer; layer L/2 also hands on its scan output before the
            gate, the memory m (batch, seq, d_inner)
        attention layers (odd i): differential attention (`SambaYDifferentialAttention`), sliding below L/2, full at
            L/2 + 1, whose keys/values (cache included) the cross-attention layers above it read
        GMU layers (even i > L/2 + 1): out_proj(silu(in_proj(x)) * m)
    logits = lm_head(final_layernorm(h))        (the head is the embedding matrix)
Parameter names are the release's (`attn` for every mixer, `mlp.fc1` = [gate; up], `Wqkv`), so the released
safetensors load unchanged. Decoding state lives in transformers' `DynamicCache(config=...)`: Mamba conv + SSM
states, the sliding keys/values below L/2, and the one full cache of layer L/2 + 1; the cross-decoder keeps none.

Numerics follow the release: the residual stream turns float32 at the first Mamba (and every GMU) layer, norms read
it in their own dtype.

This file is also the remote code of a saved model: it imports only torch, transformers and its siblings.
"""

import math

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import logging

from .attention_samba import ALL_ATTENTION_FUNCTIONS, SlotMask, attention_implementation, eager_attention_forward
from .configuration_sambay import SambaYConfig
from .linear_samba import SambaLinear
from .modeling_samba import SambaForCausalLM, SambaMambaMixer, SambaModel, SambaPreTrainedModel, SambaRMSNorm

logger = logging.get_logger(__name__)


class SambaYDifferentialAttention(nn.Module):
    """Differential attention (Ye et al., 2024) as SambaY releases it ("inner_cross_attn"): heads are paired
    (2p, 2p+1); each pair attends twice, A1 from the even heads' queries/keys and A2 from the odd ones', over the
    pair's concatenated values [v_2p | v_2p+1], and returns RMSNorm(A1 V - lambda A2 V) * (1 - lambda_init), split
    back into heads 2p and 2p+1. lambda is one scalar per layer:
        lambda = exp(<lambda_q1, lambda_k1>) - exp(<lambda_q2, lambda_k2>) + lambda_init,
        lambda_init = 0.8 - 0.6 exp(-0.3 i)      (i: the layer's index in the whole model)
    Query pair p reads key/value pair p // (heads / kv_heads): ordinary grouped-query attention on the halves.
    """

    def __init__(self, config: SambaYConfig, layer_idx: int, sliding_window: int | None):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5  # of one head, not of the concatenated pair
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.is_causal = True
        self.sliding_window = sliding_window
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
        self.lambda_q1 = nn.Parameter(torch.zeros(self.head_dim))
        self.lambda_k1 = nn.Parameter(torch.zeros(self.head_dim))
        self.lambda_q2 = nn.Parameter(torch.zeros(self.head_dim))
        self.lambda_k2 = nn.Parameter(torch.zeros(self.head_dim))
        self.subln = SambaRMSNorm(2 * self.head_dim, eps=1e-5)

    @staticmethod
    def pair_values(value: torch.Tensor) -> torch.Tensor:
        """(batch, kv_heads, kv_len, d) -> each pair's [v_2p | v_2p+1], (batch, kv_heads / 2, kv_len, 2d)."""
        return torch.cat([value[:, 0::2], value[:, 1::2]], dim=-1)

    def attend(self, query, key, values, attention_mask, **options):
        """One softmax attention through samba-hf's attention interface (`attention_samba`'s ALL_ATTENTION_FUNCTIONS),
        its own call because the values are twice as wide as the queries and keys: eager and sdpa take that as it is;
        kernels that need one head size (flash-attention) attend to each half of the values and the halves are put
        back side by side (the release's four flash calls per layer)."""
        implementation = attention_implementation(self.config, attention_mask)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        if implementation in ("eager", "sdpa", "samba_slots"):
            return attention(self, query, key, values, attention_mask, **options)
        halves = [
            attention(self, query, key, half.contiguous(), attention_mask, **options)
            for half in values.chunk(2, dim=-1)
        ]
        return torch.cat([out for out, _ in halves], dim=-1), halves[0][1]

    def forward(self, query, key, values, attention_mask, **kwargs) -> tuple[torch.Tensor, tuple]:
        # query (batch, heads, q_len, d); key (batch, kv_heads, kv_len, d); values: `pair_values` of the values
        # -> (batch, q_len, heads * d)
        batch, _, q_len, _ = query.shape
        options = dict(
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            dropout=self.config.attention_dropout if self.training else 0.0,
            **kwargs,
        )
        out1, weights1 = self.attend(query[:, 0::2], key[:, 0::2], values, attention_mask, **options)
        out2, weights2 = self.attend(query[:, 1::2], key[:, 1::2], values, attention_mask, **options)
        # (batch, q_len, heads / 2, 2d)
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1).float())
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1).float())
        lambda_full = (lambda_1 - lambda_2 + self.lambda_init).to(out1.dtype)
        out = self.subln(out1 - lambda_full * out2) * (1 - self.lambda_init)
        return out.reshape(batch, q_len, -1), (weights1, weights2)  # pair p's 2d columns = heads 2p, 2p+1


class SambaYAttention(nn.Module):
    """Projections and cache of a differential-attention layer: fused `Wqkv` (with bias; queries only in the
    cross-attention layers, which read the keys/values of layer L/2 + 1) and `out_proj` (with bias). No positional
    encoding."""

    def __init__(self, config: SambaYConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.block = config.block_types[layer_idx]
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        width = self.num_heads + (0 if self.block == "cross_attention" else 2 * self.num_kv_heads)
        self.Wqkv = SambaLinear(config.hidden_size, width * self.head_dim, bias=True)
        self.out_proj = SambaLinear(self.num_heads * self.head_dim, config.hidden_size, bias=True)
        window = config.sliding_window if self.block == "sliding_attention" else None
        self.inner_cross_attn = SambaYDifferentialAttention(config, layer_idx, window)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, tuple, tuple[torch.Tensor, torch.Tensor]]:
        """Returns (output, attention weights, the (key, paired values) attended, cached positions included: what
        the cross-attention layers read, paired once for all of them)."""
        batch, seq_len, _ = hidden_states.shape
        qkv = self.Wqkv(hidden_states)
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        query = qkv[..., :q_width].view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        if self.block == "cross_attention":
            key, values = shared_kv
        else:
            key = qkv[..., q_width : q_width + kv_width].view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
            value = qkv[..., q_width + kv_width :].view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
            if past_key_values is not None:
                key, value = past_key_values.update(key, value, self.layer_idx)
            values = self.inner_cross_attn.pair_values(value)
        out, weights = self.inner_cross_attn(query, key, values, attention_mask, **kwargs)
        return self.out_proj(out), weights, (key, values)


class SambaYGatedMemoryUnit(nn.Module):
    """GMU: out_proj(silu(in_proj(x)) * m), m the memory of layer L/2 at the same positions (no state, no cache)."""

    def __init__(self, config: SambaYConfig):
        super().__init__()
        self.in_proj = SambaLinear(config.hidden_size, config.mamba_d_inner, bias=False)
        self.out_proj = SambaLinear(config.mamba_d_inner, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.act(self.in_proj(hidden_states)) * memory)


class SambaYMLP(nn.Module):
    """SwiGLU with the release's fused input projection: fc1 = [gate; up], fc2 = down."""

    def __init__(self, config: SambaYConfig):
        super().__init__()
        self.fc1 = SambaLinear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.fc2 = SambaLinear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(self.act(gate) * up)


class SambaYDecoderLayer(GradientCheckpointingLayer):
    """h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h)); `attn` is the layer's mixer, whatever
    its kind (the release's name). Passes on the memory (set by layer L/2) and the shared keys/values (set by
    layer L/2 + 1)."""

    def __init__(self, config: SambaYConfig, layer_idx: int):
        super().__init__()
        self.block = config.block_types[layer_idx]
        self.layer_type = config.layer_types[layer_idx]  # the mask it reads
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if self.block in ("mamba", "memory"):
            self.attn = SambaMambaMixer(config, layer_idx)
        elif self.block == "gmu":
            self.attn = SambaYGatedMemoryUnit(config)
        else:
            self.attn = SambaYAttention(config, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SambaYMLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        memory: torch.Tensor | None = None,
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        documents=None,
        **kwargs,
    ):
        residual = hidden_states
        x = self.input_layernorm(hidden_states.to(self.input_layernorm.weight.dtype))
        if self.block in ("mamba", "memory"):
            out = self.attn(
                x,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                documents=documents,
                return_memory=self.block == "memory",
            )
            if self.block == "memory":
                out, memory = out
        elif self.block == "gmu":
            out = self.attn(x, memory)
        else:
            out, _, kv = self.attn(x, attention_mask, past_key_values=past_key_values, shared_kv=shared_kv, **kwargs)
            if self.block == "full_attention":
                shared_kv = kv
        if self.block in ("mamba", "memory", "gmu"):
            residual = residual.float()  # the release's residual stream is float32 from the first Mamba layer on
        hidden_states = residual + out
        mlp_input = self.post_attention_layernorm(hidden_states.to(self.post_attention_layernorm.weight.dtype))
        return hidden_states + self.mlp(mlp_input), memory, shared_kv


class SambaYPreTrainedModel(SambaPreTrainedModel):
    config: SambaYConfig
    config_class = SambaYConfig
    _no_split_modules = ["SambaYDecoderLayer"]
    _keep_in_fp32_modules_strict = ["A_log", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"]
    _can_record_outputs = {"hidden_states": SambaYDecoderLayer}  # attention weights come in pairs: not recorded
    _auto_model_entry = "modeling_sambay.SambaYModel"

    @torch.no_grad()
    def _init_weights(self, module):
        """Samba's recipe for what the two share (embeddings, linear layers, Mamba, RMSNorm); LayerNorms at
        ones/zeros; the lambda vectors N(0, 0.1) as in differential attention."""
        if isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, SambaYDifferentialAttention):
            for param in (module.lambda_q1, module.lambda_k1, module.lambda_q2, module.lambda_k2):
                init.normal_(param, mean=0.0, std=0.1)
        else:
            super()._init_weights(module)


class SambaYModel(SambaYPreTrainedModel, SambaModel):
    # sliding layers read their mask as transformers builds it (long inputs go through in chunks)
    _owns_long_sliding_window = False

    def __init__(self, config: SambaYConfig):
        SambaYPreTrainedModel.__init__(self, config)
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([SambaYDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def norm(self, hidden_states: torch.Tensor) -> torch.Tensor:  # SambaModel.forward's last step
        return self.final_layernorm(hidden_states.to(self.final_layernorm.weight.dtype))

    def _run_layers(
        self, inputs_embeds, attention_mask, position_ids, past_key_values, kwargs, documents=None, keep_last=None
    ):
        """Self-decoder on every position (it fills the cache), then the cross-decoder, which keeps no state, on the
        last `keep_last` positions only (YOCO's prefill saving; None: all)."""
        mask_mapping = self._mask_mapping(
            inputs_embeds, attention_mask, position_ids, past_key_values, kwargs, documents
        )
        hidden_states, memory, shared_kv = inputs_embeds, None, None
        cross_start = self.config.block_types.index("full_attention") + 1
        for index, decoder_layer in enumerate(self.layers):
            if index == cross_start and keep_last is not None and keep_last < hidden_states.shape[1]:
                if keep_last == 0:  # no position of this piece is asked for (a chunk before the kept ones)
                    return hidden_states[:, :0]
                cross_mask = self._cross_decoder_mask(
                    mask_mapping["full_attention"], keep_last, shared_kv[0].shape[-2]
                )
                if cross_mask is not False:
                    hidden_states, memory = hidden_states[:, -keep_last:], memory[:, -keep_last:]
                    mask_mapping = {**mask_mapping, "full_attention": cross_mask}
            hidden_states, memory, shared_kv = decoder_layer(
                hidden_states,
                attention_mask=mask_mapping[decoder_layer.layer_type],
                past_key_values=past_key_values,
                memory=memory,
                shared_kv=shared_kv,
                position_ids=position_ids,
                documents=documents,
                **kwargs,
            )
        return hidden_states

    def _cross_decoder_mask(self, mask, keep_last: int, kv_len: int):
        """The full-attention mask for queries at the last `keep_last` (>= 1) positions only, or False where this
        implementation's mask cannot be cut (the cross-decoder then runs on every position)."""
        implementation = self.config._attn_implementation
        if isinstance(mask, torch.Tensor) and mask.ndim == 4:  # (batch, 1, q_len, kv_len): keep the last rows
            return mask[:, :, -keep_last:]
        if isinstance(mask, SlotMask):
            return SlotMask(mask.visible[:, :, -keep_last:])
        if implementation.startswith("flash") and (mask is None or isinstance(mask, torch.Tensor)):
            return mask  # flash-attention aligns a shorter causal query block with the end of the keys itself
        if implementation == "sdpa" and mask is None:  # causal, left out: query i sees keys up to kv_len - keep + i
            if keep_last <= 1:
                return None
            return torch.ones(keep_last, kv_len, dtype=torch.bool, device=self.embed_tokens.weight.device).tril(
                kv_len - keep_last
            )[None, None]
        return False


class SambaYForCausalLM(SambaYPreTrainedModel, SambaForCausalLM):
    def __init__(self, config: SambaYConfig):
        SambaYPreTrainedModel.__init__(self, config)
        self.model = SambaYModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = SambaLinear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


__all__ = ["SambaYForCausalLM", "SambaYModel", "SambaYPreTrainedModel"]
