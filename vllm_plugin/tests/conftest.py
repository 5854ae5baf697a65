"""Shared by the plugin's tests: the references samba-hf computed (see make_fixtures.py), one vLLM engine at a time,
and the comparisons.

The references come from samba-hf's environment, which vLLM cannot share: `SAMBA_VLLM_FIXTURES` names the folder
`make_fixtures.py` wrote (default: vllm_plugin/tests/fixtures).
"""

import gc
import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for tiny models, small for a 2-core CI machine
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # tensor parallel 2 on a 2-core machine

FIXTURES = Path(os.environ.get("SAMBA_VLLM_FIXTURES", Path(__file__).parent / "fixtures"))


@pytest.fixture(scope="session")
def references() -> dict:
    path = FIXTURES / "references.json"
    if not path.is_file():
        pytest.fail(
            f"{path} is missing: make it in samba-hf's environment first, "
            f"`python vllm_plugin/tests/make_fixtures.py {FIXTURES}` (or set SAMBA_VLLM_FIXTURES to its folder)"
        )
    return json.loads(path.read_text())


@contextmanager
def engine(folder: str, **kwargs):
    """An `LLM` on `folder` (float32, eager, 1024 positions unless given), shut down afterwards."""
    from vllm import LLM

    kwargs = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True, "seed": 0, **kwargs}
    llm = LLM(model=folder, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm, prompts: list[list[int]], max_tokens=24, logprobs: int | None = None) -> list[dict]:
    """Greedy generation from token ids, EOS not stopping it: per prompt the tokens and (logprobs) the top log-probs
    of each step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        steps = [{str(i): lp.logprob for i, lp in step.items()} for step in completion.logprobs or []]
        results.append({"tokens": list(completion.token_ids), "logprobs": steps})
    return results


def tokens(results: list[dict]) -> list[list[int]]:
    return [r["tokens"] for r in results]


def assert_logprobs_close(expected: list[dict], actual: list[dict]):
    """The judgement of vLLM's `check_logprobs_close`: two greedy runs agree token by token until they first differ;
    there each one's token must be among the other's top log-probs (a near tie broken the other way), and the texts
    are not compared after it."""
    assert len(actual) == len(expected), f"{len(actual)} outputs for {len(expected)} prompts"
    for n, (a, b) in enumerate(zip(expected, actual)):
        assert len(b["tokens"]) == len(a["tokens"]) == len(b["logprobs"]), f"prompt {n}: lengths differ"
        for step, (token_a, token_b) in enumerate(zip(a["tokens"], b["tokens"])):
            if token_a == token_b:
                continue
            top_a, top_b = a["logprobs"][step], b["logprobs"][step]
            assert str(token_b) in top_a and str(token_a) in top_b, (
                f"prompt {n}, step {step}: samba-hf chose {token_a} (top {top_a}), vLLM {token_b} (top {top_b})"
            )
            break


def prefix_cache_hits(llm) -> int:
    return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
