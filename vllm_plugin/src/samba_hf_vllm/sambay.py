"""SambaY on vLLM: microsoft/Phi-4-mini-flash-reasoning as downloaded (`Phi4FlashForCausalLM`) and the SambaY
folders samba-hf writes, read top to bottom as samba-hf's `modeling_sambay.py`, built from vLLM's layers.

Layer i of L (see `configuration_sambay.py`): below L/2, Mamba (even i) and sliding-window differential attention
(odd i); at L/2 a Mamba layer that also hands on its scan output before the gate, the memory m; at L/2 + 1 full
differential attention, whose keys/values every cross-attention layer above reads (YOCO: vLLM's KV sharing, the
cross-decoder keeps no cache); above, GMUs (even i: out_proj(silu(in_proj(x)) * m)) and cross-attention (odd i).
Each layer: h += mixer(LayerNorm(h)); h += SwiGLU(LayerNorm(h)). As in the release, the residual stream turns
float32 at the first Mamba layer and the norms read it in their own dtype. Parameter names are the release's
(`attn` for every mixer, `Wqkv`, `mlp.fc1` = [gate; up]), so its safetensors load unchanged.

Differential attention runs on vLLM's stock `Attention` (every backend, CPU included), two calls per layer: the
queries and keys are reordered into [even heads of each pair | odd heads], so that grouped-query attention maps A1's
queries to A1's keys and A2's to A2's, and each call attends with one half of each pair's values [v_2p | v_2p+1].
The first half of the output heads is then A1 [v_2p | v_2p+1], the second A2 [v_2p | v_2p+1], exactly.
"""

import math

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.utils import make_layers

from . import samba
from .samba import SambaForCausalLM, clear_unwritten_values, mamba_mixer


def check_tensor_parallel(config, tp_size: int) -> None:
    """Samba's checks, and differential attention pairs heads: each rank must hold whole pairs of query and of
    key/value heads."""
    samba.check_tensor_parallel(config, tp_size)
    if config.num_attention_heads % (2 * tp_size) or config.num_key_value_heads % (2 * tp_size):
        raise ValueError(
            f"samba-hf-vllm: tensor_parallel_size={tp_size} must leave each rank whole pairs of heads "
            f"(num_attention_heads={config.num_attention_heads}, num_key_value_heads={config.num_key_value_heads}); "
            "choose a size that divides half of each."
        )


class SambaYDifferentialAttention(nn.Module):
    """RMSNorm(A1 V - lambda A2 V) * (1 - lambda_init) per head pair, with
    lambda = exp(<lambda_q1, lambda_k1>) - exp(<lambda_q2, lambda_k2>) + lambda_init,
    lambda_init = 0.8 - 0.6 e^(-0.3 i).
    `attend_even` / `attend_odd` are vLLM attentions over the even / odd value heads of each pair (v_2p / v_2p+1); in a
    cross-attention layer they read the caches of the full-attention layer's (`shared_with`)."""

    def __init__(
        self,
        config,
        layer_idx: int,
        heads: int,
        kv_heads: int,
        window: int | None,
        vllm_config: VllmConfig,
        prefix: str,
        shared_with: str | None = None,
    ):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.heads = heads  # on this rank
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):  # float32, as samba-hf keeps them
            setattr(self, name, nn.Parameter(torch.zeros(self.head_dim, dtype=torch.float32)))
        self.subln = RMSNorm(2 * self.head_dim, eps=1e-5)
        for name in ("attend_even", "attend_odd"):  # vLLM wants one integer in a layer's name: its index
            setattr(
                self,
                name,
                Attention(
                    heads,
                    self.head_dim,
                    self.head_dim**-0.5,
                    num_kv_heads=kv_heads,
                    cache_config=vllm_config.cache_config,
                    per_layer_sliding_window=window,
                    prefix=f"{prefix}.{name}",
                    kv_sharing_target_layer_name=None if shared_with is None else f"{shared_with}.{name}",
                ),
            )

    def forward(self, query, key=None, value=None) -> torch.Tensor:
        # query (tokens, heads, d); key, value (tokens, kv_heads, d), None in a cross-attention layer
        def split(t):  # even heads of pairs, then odd
            return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).flatten(1)

        query, tokens = split(query), query.shape[0]
        key = None if key is None else split(key)
        halves = []
        for half, attention in enumerate((self.attend_even, self.attend_odd)):
            if key is None:
                halves.append(attention(query, None, None))
                continue
            clear_unwritten_values(attention)
            v = value[:, half::2]  # (tokens, kv_heads / 2, d): this half of each pair's values, for A1 and for A2
            halves.append(attention(query, key, torch.cat([v, v], dim=1).flatten(1)))
        out = torch.cat([h.view(tokens, self.heads, self.head_dim) for h in halves], dim=-1)  # (tokens, heads, 2d)
        a1, a2 = out[:, : self.heads // 2], out[:, self.heads // 2 :]  # pair p: A1 [v_2p | v_2p+1], A2 likewise
        lambda_full = (
            torch.exp((self.lambda_q1 * self.lambda_k1).sum())
            - torch.exp((self.lambda_q2 * self.lambda_k2).sum())
            + self.lambda_init
        ).to(a1.dtype)
        out = self.subln((a1 - lambda_full * a2).reshape(-1, 2 * self.head_dim)) * (1 - self.lambda_init)
        return out.view(tokens, -1)  # pair p's 2d columns are heads 2p, 2p+1


class SambaYAttention(nn.Module):
    """Fused `Wqkv` (with bias; queries only in a cross-attention layer) and `out_proj` (with bias); no position
    encoding. Sharded by whole head pairs."""

    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, prefix: str, shared_with: str | None):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.heads, self.kv_heads = config.num_attention_heads // tp_size, config.num_key_value_heads // tp_size
        self.cross = config.block_types[layer_idx] == "cross_attention"
        if self.cross:
            self.Wqkv = ColumnParallelLinear(
                config.hidden_size, config.num_attention_heads * self.head_dim, bias=True, prefix=f"{prefix}.Wqkv"
            )
        else:
            self.Wqkv = QKVParallelLinear(
                config.hidden_size,
                self.head_dim,
                config.num_attention_heads,
                config.num_key_value_heads,
                bias=True,
                prefix=f"{prefix}.Wqkv",
            )
        self.out_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=True, prefix=f"{prefix}.out_proj"
        )
        window = config.sliding_window if config.block_types[layer_idx] == "sliding_attention" else None
        self.inner_cross_attn = SambaYDifferentialAttention(
            config,
            layer_idx,
            self.heads,
            self.kv_heads,
            window,
            vllm_config,
            f"{prefix}.inner_cross_attn",
            shared_with=shared_with,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.Wqkv(hidden_states)[0].view(hidden_states.shape[0], -1, self.head_dim)
        if self.cross:
            out = self.inner_cross_attn(qkv)
        else:
            query, key, value = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
            out = self.inner_cross_attn(query, key, value)
        return self.out_proj(out)[0]


class SambaYGatedMemoryUnit(nn.Module):
    """GMU: out_proj(silu(in_proj(x)) * m), m the memory of layer L/2 at the same positions (sharded alike)."""

    def __init__(self, config, prefix: str):
        super().__init__()
        d_inner = config.mamba_d_inner
        self.in_proj = ColumnParallelLinear(config.hidden_size, d_inner, bias=False, prefix=f"{prefix}.in_proj")
        self.out_proj = RowParallelLinear(d_inner, config.hidden_size, bias=False, prefix=f"{prefix}.out_proj")

    def forward(self, hidden_states: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.out_proj(nn.functional.silu(self.in_proj(hidden_states)[0]) * memory)[0]


class SambaYMLP(nn.Module):
    """SwiGLU with the release's fused input projection: fc1 = [gate; up], fc2 = down."""

    def __init__(self, config, prefix: str):
        super().__init__()
        self.fc1 = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False, prefix=f"{prefix}.fc1"
        )
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False, prefix=f"{prefix}.fc2")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)[0]))[0]


class SambaYDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, prefix: str, model_prefix: str):
        super().__init__()
        self.block = config.block_types[layer_idx]
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SambaYMLP(config, prefix=f"{prefix}.mlp")
        if self.block in ("mamba", "memory"):
            self.attn = mamba_mixer(config, vllm_config, f"{prefix}.attn", returns_memory=self.block == "memory")
            self.memory_width = config.mamba_d_inner // get_tensor_model_parallel_world_size()
        elif self.block == "gmu":
            self.attn = SambaYGatedMemoryUnit(config, prefix=f"{prefix}.attn")
        else:
            full = config.block_types.index("full_attention")
            shared = f"{model_prefix}.layers.{full}.attn.inner_cross_attn" if self.block == "cross_attention" else None
            self.attn = SambaYAttention(config, layer_idx, vllm_config, prefix=f"{prefix}.attn", shared_with=shared)

    def forward(self, hidden_states, memory):
        residual = hidden_states
        x = self.input_layernorm(hidden_states.to(self.input_layernorm.weight.dtype))
        if self.block in ("mamba", "memory"):
            width = x.shape[1] + (self.memory_width if self.block == "memory" else 0)
            out = x.new_empty(x.shape[0], width)
            self.attn(x, out)
            if self.block == "memory":
                out, memory = out[:, : x.shape[1]], out[:, x.shape[1] :]
        elif self.block == "gmu":
            out = self.attn(x, memory)
        else:
            out = self.attn(x)
        if self.block in ("mamba", "memory", "gmu"):
            residual = residual.float()  # the release's residual stream is float32 from the first Mamba layer on
        hidden_states = residual + out
        mlp_input = self.post_attention_layernorm(hidden_states.to(self.post_attention_layernorm.weight.dtype))
        return hidden_states + self.mlp(mlp_input), memory


class SambaYModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: SambaYDecoderLayer(
                config,
                int(prefix.rsplit(".", 1)[1]),
                vllm_config,
                prefix,
                model_prefix=prefix.rsplit(".layers.", 1)[0],
            ),
            prefix=f"{prefix}.layers",
        )
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        memory = None
        for layer in self.layers:
            hidden_states, memory = layer(hidden_states, memory)
        return self.final_layernorm(hidden_states.to(self.final_layernorm.weight.dtype))


class SambaYForCausalLM(SambaForCausalLM):
    """Samba's head, state classmethods (SambaY's Mamba layers are Mamba-1) and loader (the head is tied; the
    release's names need no renaming but A_log); SambaY's model and head-pair sharding."""

    model_class = SambaYModel
    check_tensor_parallel = staticmethod(check_tensor_parallel)
