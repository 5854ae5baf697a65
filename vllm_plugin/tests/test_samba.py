"""Samba (the embedded default model of samba-hf: Mamba-1 and sliding-window attention) served by vLLM through the
plugin: greedy tokens equal samba-hf's `generate` in float32 under what vLLM does to a model (continuous batching
of requests of different lengths, chunked prefill, prefix caching, preemption, tensor parallel 2), and bfloat16
log-probs close to samba-hf's over several passes of one engine."""

import pytest
from conftest import assert_logprobs_close, engine, generate, prefix_cache_hits, tokens


@pytest.fixture(scope="module")
def default(references):
    return references["default"]


def test_batched_continuous_and_prefix_cached_equal_samba_hf(default):
    """Four prompts (300 tokens, past the 256-token window, down to 9), at most two running at once, so requests join
    as others leave; then all of them again, served from the prefix cache."""
    expected = tokens(default["float32"])
    with engine(default["folder"], max_num_seqs=2, disable_log_stats=False) as llm:
        assert tokens(generate(llm, default["prompts"])) == expected
        hits = prefix_cache_hits(llm)
        assert tokens(generate(llm, default["prompts"])) == expected
        assert prefix_cache_hits(llm) > hits  # the second pass read cached blocks (and the Mamba states with them)


def test_chunked_prefill_and_preemption_equal_samba_hf(default):
    """Prefill in chunks of 32 tokens, and so few cache blocks that running requests are preempted and recomputed."""
    expected = tokens(default["float32"])
    with engine(
        default["folder"],
        max_num_batched_tokens=32,
        max_num_seqs=4,
        enable_prefix_caching=False,
        num_gpu_blocks_override=6,
        disable_log_stats=False,
    ) as llm:
        assert tokens(generate(llm, default["prompts"])) == expected
        preempted = sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    assert preempted > 0


def test_bfloat16_logprobs_stay_close_over_passes(default):
    """bf16, as samba-hf runs it in bf16: three passes of one engine (the page reuse that once returned all-zero
    tokens happens from the second on)."""
    with engine(default["folder"], dtype="bfloat16") as llm:
        for _ in range(3):
            assert_logprobs_close(default["bfloat16"], generate(llm, default["prompts"], logprobs=5))


def test_tensor_parallel_2_equals_samba_hf(default):
    with engine(default["folder"], tensor_parallel_size=2) as llm:
        assert tokens(generate(llm, default["prompts"])) == tokens(default["float32"])
