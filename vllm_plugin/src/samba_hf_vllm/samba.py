"""Samba on vLLM: the folders samba-hf writes (`SambaForCausalLM`), read top to bottom as samba-hf's
`modeling_samba.py`, built from vLLM's layers.

A layer is one of `config.layer_types`:
- "linear_attention": a Mamba mixer, vLLM's `MambaMixer` (Mamba-1, Samba) or `MambaMixer2` (Mamba-2, the
  Mamba-2-Hybrid), then the MLP when `config.mixer_mlp`;
- "sliding_attention" / "full_attention": grouped-query attention (vLLM's `Attention`, with the window per layer;
  RoPE when `config.use_rope`), then the MLP when `config.mixer_mlp`;
- "mlp": an MLP block alone (Megatron's one-sub-layer blocks).
Each sub-layer is x += f(RMSNorm(x)). Parameter names are samba-hf's, so the safetensors load as written.

vLLM has no Mamba-1 scan on CPU: there `SambaMambaMixer` runs samba-hf's causal conv and compiled scan
(`ssm_samba.py`) over vLLM's state slots. On CUDA it is vLLM's `MambaMixer` unchanged.
"""

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import get_act_and_mul_fn, get_act_fn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, make_layers, maybe_prefix
from vllm.platforms import current_platform

from .ssm_samba import depthwise_causal_conv, selective_scan


def check_supported(config, vllm_config: VllmConfig) -> None:
    """One clear error for what these classes do not serve (vLLM would fail later, or compute something else)."""
    if config.hidden_act not in ("silu", "swish"):
        raise ValueError(
            f"samba-hf-vllm: hidden_act={config.hidden_act!r} is not served: the Mamba layers here "
            "compute SiLU (as every released Samba, SambaY and Mamba-2-Hybrid); serve it with samba-hf."
        )
    if vllm_config.speculative_config is not None:
        raise ValueError(
            "samba-hf-vllm: speculative decoding is not supported (the Mamba state advances one token "
            "per step here); serve without --speculative-config."
        )


def check_tensor_parallel(config, tp_size: int) -> None:
    """One clear error where the layout cannot be split over `tp_size` ranks (vLLM would fail in an assert)."""
    problems = []
    if config.num_attention_heads % tp_size:
        problems.append(f"num_attention_heads={config.num_attention_heads}")
    kv = config.num_key_value_heads
    if kv % tp_size and tp_size % kv:
        problems.append(f"num_key_value_heads={kv}")
    if "linear_attention" in config.layer_types:
        if config.mamba_d_inner % tp_size:
            problems.append(f"the Mamba inner width {config.mamba_d_inner}")
        if config.mamba_version == 2 and config.mamba2_num_heads % tp_size:
            problems.append(f"mamba2 heads={config.mamba2_num_heads}")
    if config.intermediate_size % tp_size:
        problems.append(f"intermediate_size={config.intermediate_size}")
    if problems:
        raise ValueError(
            f"samba-hf-vllm: tensor_parallel_size={tp_size} does not divide {', '.join(problems)}; "
            "choose a tensor-parallel size that divides them."
        )


class SambaMambaMixer(MambaMixer):
    """vLLM's Mamba-1 mixer (same parameters, sharding and state slots). On CPU, where vLLM has no Mamba-1 scan,
    `forward_impl` runs samba-hf's conv and compiled scan per request; elsewhere vLLM's kernels.

    `returns_memory` (SambaY's layer L/2): `output` is (tokens, hidden + d_inner/tp) and receives
    [out_proj(y * silu(z)) | y], the scan output before the gate being the memory the GMU layers read. This layer runs
    samba-hf's path on every device: on CUDA that is mamba-ssm's kernels where installed, else a PyTorch scan (slow;
    vLLM's own kernels take z=None and would serve it, not done: no GPU has run this plugin yet).
    """

    def __init__(self, *args, returns_memory: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.returns_memory = returns_memory

    def forward_impl(self, hidden_states: torch.Tensor, output: torch.Tensor):
        if not current_platform.is_cpu() and not self.returns_memory:
            return super().forward_impl(hidden_states, output)
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if metadata is not None else None
        x, z = self.in_proj(hidden_states)[0].chunk(2, dim=-1)  # (tokens, d_inner/tp) each
        if metadata is None:  # vLLM's profile run: no state to read
            self._write(output, x.contiguous(), z)
            return
        conv_state, ssm_state = self.kv_cache  # conv (slots, K-1, d) or (slots, d, K-1); ssm (slots, d, N)
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)  # (slots, d, K-1)
        # vLLM may have repacked a bf16 conv weight for its own GEMM; the plain one is kept beside it.
        weight = getattr(self.conv1d, "_cpu_unpacked_conv_weight", self.conv1d.weight)
        weight = weight.reshape(-1, self.conv_kernel_size)  # (d/tp, K)
        num_decodes, num_prefill_tokens = metadata.num_decode_tokens, metadata.num_prefill_tokens
        y = x.new_empty(num_decodes + num_prefill_tokens, x.shape[1])

        # decode tokens come first, one per request, all stepped at once
        if num_decodes:
            slots = metadata.state_indices_tensor_d[:num_decodes, 0]
            window = torch.cat([conv_state[slots].to(x.dtype), x[:num_decodes, :, None]], dim=-1)  # (rows, d, K)
            conv_state[slots] = window[..., 1:].to(conv_state.dtype)
            u = F.silu(depthwise_causal_conv(weight, self.conv1d.bias, window, 1))[..., 0]  # (rows, d)
            h0 = ssm_state[slots].float()
            y[:num_decodes], h = self._scan(u, z[:num_decodes], h0)
            ssm_state[slots] = h.to(ssm_state.dtype)

        # then the prefills (or prefill chunks), one request at a time
        if num_prefill_tokens:
            starts = metadata.query_start_loc_p.tolist()
            slots = metadata.state_indices_tensor_p.tolist()
            continues = metadata.has_initial_states_p.tolist()
            for i, slot in enumerate(slots):
                start, end = num_decodes + starts[i], num_decodes + starts[i + 1]
                left = (
                    conv_state[slot].to(x.dtype) if continues[i] else x.new_zeros(weight.shape[0], weight.shape[1] - 1)
                )
                window = torch.cat([left, x[start:end].t()], dim=-1)  # (d, K-1+L)
                conv_state[slot] = window[:, window.shape[1] - weight.shape[1] + 1 :].to(conv_state.dtype)
                u = F.silu(depthwise_causal_conv(weight, self.conv1d.bias, window[None], end - start))[0].t()
                h0 = ssm_state[slot].float()[None] if continues[i] else None
                y[start:end], h = self._scan(u, z[start:end], h0, sequence=True)
                ssm_state[slot] = h[0].to(ssm_state.dtype)

        self._write(output, y, z)

    def _write(self, output, y, z):
        """output[:tokens] = out_proj(y) (y gated by the scan), or [out_proj(y * silu(z)) | y] for the memory layer."""
        tokens = y.shape[0]
        if not self.returns_memory:
            output[:tokens] = self.out_proj(y)[0]
            return
        hidden = output.shape[1] - y.shape[1]
        output[:tokens, hidden:] = y
        output[:tokens, :hidden] = self.out_proj(y * F.silu(z[:tokens]))[0]

    def _scan(self, u, z, h0, sequence=False):
        """u, z (tokens, d); y is gated by z except in the memory layer, whose memory is the scan output before the
        gate. sequence=False: each token is its own request, from h0 (rows, d, N); True: one request of all the tokens,
        from h0 (1, d, N) or zeros. Returns y (tokens, d) in u's dtype and the last state(s)."""
        dt, B, C = self._ssm_transform(u.contiguous())  # dt (d, tokens); B, C (tokens, N)
        dt = F.softplus(dt.t().float() + self._time_proj_bias())
        # as (batch, seq, ...): one sequence of all the tokens, or one step of each
        batched = (lambda t: t[None]) if sequence else (lambda t: t[:, None])
        u, dt, B, C = map(batched, (u, dt, B, C))
        y, h = selective_scan(u, dt, self.A, B, C, self.D, None if self.returns_memory else batched(z), h0)
        return (y[0] if sequence else y[:, 0]), h


def clear_unwritten_values(attention: Attention) -> None:
    """On CPU (elsewhere nothing): zero the value slots after a request's last token in its last KV block, when this
    step is the first to write that block (later steps fill slots that are zero already, and no one else writes the
    block meanwhile).

    vLLM's CPU attention kernel (0.32) multiplies the values of a block's unwritten slots by zero weights, so a
    non-finite bit pattern left there makes the output NaN (`upstream/cpu_attention_nan_repro.py`). In a hybrid
    model the cache manager hands attention pages that held Mamba states (float32 states read as bfloat16 contain
    NaN patterns): served in bf16, a request admitted after others finished returned only token 0.
    """
    if not current_platform.is_cpu():
        return
    metadata = get_forward_context().attn_metadata
    metadata = metadata.get(attention.layer_name) if metadata is not None else None
    if metadata is None or attention.kv_cache.numel() == 0:
        return
    blocks, kv_heads, block_size, _ = attention.kv_cache.shape  # a block's memory read as [keys; values] rows
    starts = metadata.query_start_loc.long()
    seq_lens = metadata.seq_lens[: starts.numel() - 1].long()
    last = seq_lens - 1  # each request's last position, written by this step
    first = seq_lens - (starts[1:] - starts[:-1])  # its first position written by this step
    fresh = first <= last // block_size * block_size  # this step writes its last block's first slot
    if not bool(fresh.any()):
        return
    last = last[fresh]
    rows = metadata.block_table[: seq_lens.numel()][fresh]
    block_ids = rows.gather(1, (last // block_size)[:, None].to(rows.dtype))[:, 0].long()
    values = attention.kv_cache.view(blocks, kv_heads, 2 * block_size, -1)[:, :, block_size:]
    after_last = torch.arange(block_size) > (last % block_size)[:, None]  # (requests, block_size)
    values[block_ids] = values[block_ids].masked_fill(after_last[:, None, :, None], 0)


class SambaAttention(nn.Module):
    """Grouped-query attention, RoPE when `config.use_rope`; the layer's window (vLLM counts it as samba-hf does: the
    query and the W-1 keys before it) when it is a "sliding_attention" layer."""

    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)  # replicated when fewer than ranks
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=config.attention_bias,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = None
        if config.use_rope:
            self.rotary_emb = get_rope(
                self.head_dim,
                max_position=vllm_config.model_config.max_model_len,
                is_neox_style=True,
                rope_parameters=config.rope_parameters,
            )
        window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=vllm_config.cache_config,
            per_layer_sliding_window=window,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states)[0].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        clear_unwritten_values(self.attn)
        return self.o_proj(self.attn(q, k, v))[0]


class SambaMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) (SwiGLU), or down_proj(act(up_proj(x))) when not `mlp_gated`."""

    def __init__(self, config, prefix: str):
        super().__init__()
        activation = config.mlp_hidden_act or config.hidden_act
        self.gated = config.mlp_gated
        if self.gated:
            self.gate_up_proj = MergedColumnParallelLinear(
                config.hidden_size, [config.intermediate_size] * 2, bias=False, prefix=f"{prefix}.gate_up_proj"
            )
            self.act_fn = get_act_and_mul_fn(activation)
        else:
            self.up_proj = ColumnParallelLinear(
                config.hidden_size, config.intermediate_size, bias=False, prefix=f"{prefix}.up_proj"
            )
            self.act_fn = get_act_fn(activation)
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=False, prefix=f"{prefix}.down_proj"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.gate_up_proj(x)[0] if self.gated else self.up_proj(x)[0]
        return self.down_proj(self.act_fn(up))[0]


def complete_cpu_mamba2_prefix_caching() -> None:
    """Give vLLM's CPU build the two pieces `MambaMixer2` needs to keep the state of a prompt longer than one block for
    the prefix cache (without them it fails: "index 1 is out of bounds", then a Triton kernel called on CPU).

    - vLLM 0.32's CPU SSD scan ignores `return_intermediate_states` and returns one state per sequence: wrapped, with
      that flag it runs chunk by chunk, each from the state the previous one left, and returns every chunk-end state
      (as the Triton kernel does).
    - `store_prefill_checkpoint` is a Triton kernel only: on CPU it is done with tensor indexing.
    Installed once per process, only on CPU. Without prefix-cache checkpoints both run as before, so other models
    served beside this one only lose the failure.
    """
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.model_executor.layers.mamba.ops import ssd_combined

    scan = ssd_combined._mamba_chunk_scan_combined_fwd
    if getattr(scan, "keeps_chunk_states", False):
        return

    def scan_keeping_chunk_states(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        out,
        *,
        return_intermediate_states=False,
        initial_states=None,
        seq_idx=None,
        cu_seqlens=None,
        cu_chunk_seqlens=None,
        last_chunk_indices=None,
        **rest,
    ):
        if not return_intermediate_states:
            return scan(
                x,
                dt,
                A,
                B,
                C,
                chunk_size,
                out,
                initial_states=initial_states,
                seq_idx=seq_idx,
                cu_seqlens=cu_seqlens,
                cu_chunk_seqlens=cu_chunk_seqlens,
                last_chunk_indices=last_chunk_indices,
                **rest,
            )
        bounds, owners = cu_chunk_seqlens.tolist(), seq_idx.tolist()  # chunk c: tokens bounds[c]:bounds[c+1]
        one = torch.zeros(1, dtype=torch.int32)
        states = []
        for c, owner in enumerate(owners):
            start, end = bounds[c], bounds[c + 1]
            if c > 0 and owners[c - 1] == owner:
                h0 = states[-1][None]
            else:  # a sequence's first chunk: from its cached state, or zeros
                h0 = None if initial_states is None else initial_states[owner : owner + 1]
            length = torch.tensor([0, end - start], dtype=torch.int32)
            states.append(
                scan(
                    x[start:end],
                    dt[start:end],
                    A,
                    B[start:end],
                    C[start:end],
                    chunk_size,
                    out[start:end],
                    initial_states=h0,
                    seq_idx=one,
                    cu_seqlens=length,
                    cu_chunk_seqlens=length,
                    last_chunk_indices=one,
                    **rest,
                )[0]
            )
        return torch.stack(states)  # (chunks, heads, head_dim, d_state)

    def store_prefill_checkpoint(
        checkpoint, chunk_idx, x, conv_state, chunk_states, ssm_state, query_start_loc, *, state_len
    ):
        # x (dim, tokens); conv_state (blocks, dim, >= state_len); chunk_states (chunks, ...); ssm_state (blocks, ...)
        rows = zip(
            checkpoint.checkpoint_offsets.tolist(),
            checkpoint.state_indices.tolist(),
            chunk_idx.tolist(),
            query_start_loc.tolist(),
        )
        for offset, block, chunk, start in rows:
            if offset > 0:  # the row's state `offset` tokens into its prompt, kept in `block`
                conv_state[block, :, :state_len] = x[:, start + offset - state_len : start + offset]
                ssm_state[block] = chunk_states[chunk].to(ssm_state.dtype)

    scan_keeping_chunk_states.keeps_chunk_states = True
    ssd_combined._mamba_chunk_scan_combined_fwd = scan_keeping_chunk_states
    mamba_mixer2.store_prefill_checkpoint = store_prefill_checkpoint


def mamba_mixer(config, vllm_config: VllmConfig, prefix: str, returns_memory: bool = False) -> nn.Module:
    """The layer's Mamba mixer, Mamba-1 (Samba, SambaY) or Mamba-2 (the Mamba-2-Hybrid), as vLLM builds them."""
    common = dict(
        hidden_size=config.hidden_size,
        ssm_state_size=config.mamba_d_state,
        conv_kernel_size=config.mamba_d_conv,
        intermediate_size=config.mamba_d_inner,
        use_conv_bias=config.mamba_conv_bias,
        use_bias=config.mamba_proj_bias,
        activation=config.hidden_act,
        model_config=vllm_config.model_config,
        cache_config=vllm_config.cache_config,
        prefix=prefix,
    )
    if config.mamba_version == 2:  # its gated group norm reads the epsilon (SambaY has no RMSNorm epsilon)
        return MambaMixer2(
            n_groups=config.mamba2_n_groups,
            num_heads=config.mamba2_num_heads,
            head_dim=config.mamba2_head_dim,
            use_rms_norm=True,
            rms_norm_eps=config.rms_norm_eps,
            quant_config=vllm_config.quant_config,
            **common,
        )
    return SambaMambaMixer(
        time_step_rank=config.mamba_dt_rank,
        use_rms_norm=False,
        is_lora_enabled=bool(vllm_config.lora_config),
        returns_memory=returns_memory,
        **common,
    )


class SambaDecoderLayer(nn.Module):
    """x += mixer(input_layernorm(x)); x += mlp(post_attention_layernorm(x)) (no MLP when `config.mixer_mlp` is
    False). An "mlp" layer is x += mlp(input_layernorm(x)) alone."""

    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = None
        if self.layer_type == "mlp":
            self.mlp = SambaMLP(config, prefix=f"{prefix}.mlp")
            return
        if self.layer_type == "linear_attention":
            self.mamba = mamba_mixer(config, vllm_config, prefix=f"{prefix}.mamba")
        else:
            self.self_attn = SambaAttention(config, layer_idx, vllm_config, prefix=f"{prefix}.self_attn")
        if config.mixer_mlp:
            self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp = SambaMLP(config, prefix=f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.layer_type == "mlp":
            return residual + self.mlp(hidden_states)
        if self.layer_type != "linear_attention":
            hidden_states = self.self_attn(positions, hidden_states)
        elif isinstance(self.mamba, MambaMixer2):
            hidden_states = self.mamba(hidden_states)
        else:
            output = torch.empty_like(hidden_states)
            self.mamba(hidden_states, output)
            hidden_states = output
        hidden_states = residual + hidden_states
        if self.mlp is not None:
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


class SambaModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: SambaDecoderLayer(config, int(prefix.rsplit(".", 1)[1]), vllm_config, prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)


class SambaForCausalLM(nn.Module, HasInnerState, IsHybrid):
    model_class = SambaModel
    check_tensor_parallel = staticmethod(check_tensor_parallel)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_supported(config, vllm_config)
        self.check_tensor_parallel(config, vllm_config.parallel_config.tensor_parallel_size)
        if config.mamba_version == 2 and current_platform.is_cpu():
            complete_cpu_mamba2_prefix_caching()
        self.config = config
        self.model = self.model_class(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
        cache = vllm_config.cache_config
        return MambaStateDtypeCalculator.mamba1_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
        )

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        config, tp_size = vllm_config.model_config.hf_config, vllm_config.parallel_config.tensor_parallel_size
        if config.mamba_version == 2:
            return MambaStateShapeCalculator.mamba2_state_shape(
                tp_world_size=tp_size,
                intermediate_size=config.mamba_d_inner,
                n_groups=config.mamba2_n_groups,
                num_heads=config.mamba2_num_heads,
                head_dim=config.mamba2_head_dim,
                state_size=config.mamba_d_state,
                conv_kernel=config.mamba_d_conv,
            )
        return MambaStateShapeCalculator.mamba1_state_shape(
            tp_world_size=tp_size,
            intermediate_size=config.mamba_d_inner,
            state_size=config.mamba_d_state,
            conv_kernel=config.mamba_d_conv,
        )

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.mamba1_state_copy_func()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stacked = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v")}
        if self.config.mlp_gated:
            stacked |= {".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}
        mapper = WeightsMapper(orig_to_new_substr={".A_log": ".A"}, orig_to_new_stacked=stacked)
        # a tied head is the embedding: a saved copy of it (if any) is not read
        loader = AutoWeightsLoader(
            self, ignore_unexpected_prefixes=["lm_head."] if self.config.tie_word_embeddings else None
        )
        return loader.load_weights(weights, mapper=mapper)
