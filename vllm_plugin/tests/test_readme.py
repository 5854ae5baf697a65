"""The blocks of samba-hf's pages that run in vLLM's environment (README.md and docs/*.md: the bash blocks that start
by activating `.venv-vllm`) run as written, here, in a temporary folder where `path/to/...` are the test folders:
the embedded default model as the Samba folder, the release-laid-out tiny SambaY as Phi-4-mini-flash-reasoning with
the default model's tokenizer as the gpt-4o one, the tiny Mamba-2-Hybrid. Left to CI: the plugin's install command
and its test command (which runs this). samba-hf's own tests (tests/test_docs.py) run every other block."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# samba-hf's block runner decides which blocks are vLLM's: the same reading of the pages on both sides, so that no
# block is run by neither (it imports only the standard library and pytest).
_spec = importlib.util.spec_from_file_location("samba_hf_test_docs", ROOT / "tests" / "test_docs.py")
docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs)


def vllm_blocks(page: Path) -> list[tuple[str, int, str]]:
    """(page, line of the opening fence, body) of each block that is for vLLM's environment."""
    return [
        (docs.name(page), line, body)
        for language, line, body in docs.BLOCKS[page]
        if docs.in_vllm_environment(language, body)
    ]


def run_by_ci(body: str) -> bool:
    return "pip install -e 'vllm_plugin[cpu" in body or "make_fixtures.py" in body


ALL = [block for page in docs.PAGES for block in vllm_blocks(page)]
BLOCKS = [(page, line, body) for page, line, body in ALL if not run_by_ci(body)]
# checked before anything runs: an install block taken for a command would run against this very environment
assert len(BLOCKS) == 3 and len(ALL) == 5, f"the pages' vLLM blocks changed: update this test ({ALL})"


@pytest.mark.parametrize("page, line, body", BLOCKS, ids=[f"{page}:{line}" for page, line, _ in BLOCKS])
def test_block_runs(page, line, body, references, tmp_path):
    folders = {
        "samba-folder": references["default"]["folder"],
        "mamba2-hybrid-folder": references["mamba2-hybrid"]["folder"],
        "Phi-4-mini-flash-reasoning": references["sambay"]["folder"],
        "gpt-4o-tokenizer": references["sambay"]["tokenizer"],
    }
    (tmp_path / "path" / "to").mkdir(parents=True)
    for name, target in folders.items():
        (tmp_path / "path" / "to" / name).symlink_to(target, target_is_directory=True)
    (tmp_path / ".venv-vllm").symlink_to(sys.prefix, target_is_directory=True)  # this environment
    result = subprocess.run(
        ["bash", "-e", "-c", body],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, f"{page}:{line}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    if "completions" in body:
        assert '"finish_reason":"length"' in result.stdout, result.stdout  # the server answered with 16 tokens
