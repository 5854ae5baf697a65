"""The bash blocks of README.md's section "Serving with vLLM" run as written, in this (vLLM's) environment, in a
temporary folder where `path/to/...` are the test folders: the embedded default model as the Samba folder, the
release-laid-out tiny SambaY as Phi-4-mini-flash-reasoning with the default model's tokenizer as the gpt-4o one, the
tiny Mamba-2-Hybrid. Left to CI: the install command and the test command (which runs this)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def serving_blocks() -> list[tuple[int, str]]:
    lines = README.read_text().splitlines()
    start = lines.index("## Serving with vLLM")
    end = next(n for n in range(start + 1, len(lines)) if lines[n].startswith("## "))
    blocks, body, opened = [], None, 0
    for number in range(start, end):
        line = lines[number]
        if body is None and re.fullmatch(r"```\w+", line.strip()):
            body, opened = [], number + 1
            assert line.strip() == "```bash", f"README.md:{opened}: the serving section holds bash blocks only"
        elif body is not None and line.strip() == "```":
            blocks.append((opened, "\n".join(body) + "\n"))
            body = None
        elif body is not None:
            body.append(line)
    return blocks


def run_by_ci(body: str) -> bool:
    return "pip install -e 'vllm_plugin[cpu" in body or "make_fixtures.py" in body


BLOCKS = [(line, body) for line, body in serving_blocks() if not run_by_ci(body)]
# checked before anything runs: an install block taken for a command would run against this very environment
assert len(BLOCKS) == 2 and len(serving_blocks()) == 4, "README's serving section changed: update this test"


@pytest.mark.parametrize("line, body", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_block_runs(line, body, references, tmp_path):
    folders = {"samba-folder": references["default"]["folder"], "mamba2-hybrid-folder": references["mamba2-hybrid"]["folder"],
               "Phi-4-mini-flash-reasoning": references["sambay"]["folder"], "gpt-4o-tokenizer": references["sambay"]["tokenizer"]}
    (tmp_path / "path" / "to").mkdir(parents=True)
    for name, target in folders.items():
        (tmp_path / "path" / "to" / name).symlink_to(target, target_is_directory=True)
    (tmp_path / ".venv-vllm").symlink_to(sys.prefix, target_is_directory=True)  # this environment
    result = subprocess.run(["bash", "-e", "-c", body], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, f"README.md:{line}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    if "completions" in body:
        assert '"finish_reason":"length"' in result.stdout, result.stdout  # the server answered with 16 tokens
