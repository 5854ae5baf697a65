"""SambaY: a tiny Phi-4-mini-flash-reasoning laid out as the release (config.json with Microsoft's remote code in
auto_map, two bf16 shards, no head, no vocabulary), served by vLLM through the plugin with no
`--trust-remote-code` and the tokenizer given apart: greedy tokens equal samba-hf's in float32 (differential
attention, the memory layer and GMUs, the YOCO shared cache), batched, chunked, prefix-cached, tensor parallel 2;
bf16 log-probs close over passes."""

import pytest
from conftest import assert_logprobs_close, engine, generate, prefix_cache_hits, tokens


@pytest.fixture(scope="module")
def sambay(references):
    return references["sambay"]


def test_batched_chunked_and_prefix_cached_equal_samba_hf(sambay):
    expected = tokens(sambay["float32"])
    with engine(
        sambay["folder"],
        tokenizer=sambay["tokenizer"],
        max_num_seqs=2,
        max_num_batched_tokens=32,
        disable_log_stats=False,
    ) as llm:
        assert tokens(generate(llm, sambay["prompts"])) == expected
        hits = prefix_cache_hits(llm)
        assert tokens(generate(llm, sambay["prompts"])) == expected
        assert prefix_cache_hits(llm) > hits


def test_bfloat16_logprobs_stay_close_over_passes(sambay):
    with engine(sambay["folder"], tokenizer=sambay["tokenizer"], dtype="bfloat16") as llm:
        for _ in range(3):
            assert_logprobs_close(sambay["bfloat16"], generate(llm, sambay["prompts"], logprobs=5))


def test_tensor_parallel_2_equals_samba_hf(sambay):
    with engine(sambay["folder"], tokenizer=sambay["tokenizer"], tensor_parallel_size=2) as llm:
        assert tokens(generate(llm, sambay["prompts"])) == tokens(sambay["float32"])


def test_a_sambay_folder_saved_by_samba_hf_serves_the_same(sambay):
    """The release's weights loaded and saved by samba-hf (architectures "SambaYForCausalLM", samba-hf's remote code
    in auto_map): the same tokens."""
    with engine(sambay["saved_folder"], tokenizer=sambay["tokenizer"]) as llm:
        assert tokens(generate(llm, sambay["prompts"])) == tokens(sambay["float32"])
