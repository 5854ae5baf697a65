"""A tiny Mamba-2-Hybrid as `samba-hf convert megatron` writes one (Mamba-2 with two groups, GELU MLP blocks, NoPE
full attention, untied head) served by vLLM's `MambaMixer2` through the plugin: greedy tokens equal samba-hf's in
float32, batched and chunked, prefix-cached, tensor parallel 2; bf16 log-probs close over passes."""

import pytest
from conftest import assert_logprobs_close, engine, generate, prefix_cache_hits, tokens


@pytest.fixture(scope="module")
def hybrid(references):
    return references["mamba2-hybrid"]


def test_batched_chunked_and_prefix_cached_equal_samba_hf(hybrid):
    expected = tokens(hybrid["float32"])
    with engine(hybrid["folder"], max_num_seqs=2, max_num_batched_tokens=32, disable_log_stats=False) as llm:
        assert tokens(generate(llm, hybrid["prompts"])) == expected
        hits = prefix_cache_hits(llm)
        assert tokens(generate(llm, hybrid["prompts"])) == expected
        assert prefix_cache_hits(llm) > hits


def test_bfloat16_logprobs_stay_close_over_passes(hybrid):
    with engine(hybrid["folder"], dtype="bfloat16") as llm:
        for _ in range(3):
            assert_logprobs_close(hybrid["bfloat16"], generate(llm, hybrid["prompts"], logprobs=5))


def test_tensor_parallel_2_equals_samba_hf(hybrid):
    with engine(hybrid["folder"], tensor_parallel_size=2) as llm:
        assert tokens(generate(llm, hybrid["prompts"])) == tokens(hybrid["float32"])


def test_unchunked_prompts_longer_than_a_block_are_prefix_cached(hybrid):
    """The whole 300-token prompt in one step: the Mamba-2 state of every full block is kept for the prefix cache."""
    expected = tokens(hybrid["float32"])
    with engine(hybrid["folder"], disable_log_stats=False) as llm:
        assert tokens(generate(llm, hybrid["prompts"])) == expected
        hits = prefix_cache_hits(llm)
        assert tokens(generate(llm, hybrid["prompts"])) == expected
        assert prefix_cache_hits(llm) > hits
