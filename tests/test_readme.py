"""Every ```python and ```bash block of README.md runs as written, in order, on a CPU, without network.

Each block runs in a fresh subprocess (python blocks with this interpreter, bash blocks with `bash -e` and this
interpreter's bin folder first on PATH) inside one temporary working directory that stands in for the repository
root: `examples/` is linked into it, so the README's commands are exactly what a user types at the root, and
nothing is written into the repository. The only blocks not run here are the first two, the install and test
commands, which CI runs itself (recognised by their content), and those of the section "Serving with vLLM", which
need vLLM's environment: the plugin's tests run them there (`vllm_plugin/tests/test_readme.py`). Blocks of program
output are fenced ```text.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(.*)$")
RUN = ("python", "bash")
OUTPUT = ("text",)


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, line number of the opening fence, body) for each fenced block, in order."""
    blocks, language, start, body = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line.strip())
        if language is None:
            if fence:
                language, start, body = fence.group(1).strip(), number, []
        elif fence and not fence.group(1).strip():
            blocks.append((language, start, "\n".join(body) + "\n"))
            language = None
        else:
            body.append(line)
    assert language is None, f"README.md:{start}: unclosed code block"
    return blocks


def run_by_ci(language: str, body: str) -> bool:
    """The install command and the test command: CI runs those two itself."""
    install = language == "bash" and "python3 -m venv .venv" in body and "pip install -e '.[dev]'" in body
    tests = language == "bash" and body.strip() == ". .venv/bin/activate && python -m pytest -q"
    return install or tests


def section_lines(text: str, heading: str) -> range:
    """The line numbers of a `## ` section, heading included."""
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next((n for n in range(start + 1, len(lines) + 1) if lines[n - 1].startswith("## ")), len(lines) + 1)
    return range(start, end)


BLOCKS = fenced_blocks(README.read_text())
SERVING = section_lines(README.read_text(), "## Serving with vLLM")  # run by vllm_plugin/tests/test_readme.py
RUNNABLE = [(language, line, body) for language, line, body in BLOCKS
            if language in RUN and not run_by_ci(language, body) and line not in SERVING]


def test_every_block_is_run_or_marked_as_output():
    unknown = [(line, language) for language, line, _ in BLOCKS if language not in RUN + OUTPUT]
    assert not unknown, f"README.md blocks that are neither python/bash (run here) nor text (output): {unknown}"
    skipped = [line for language, line, body in BLOCKS if run_by_ci(language, body)]
    assert skipped == [BLOCKS[0][1], BLOCKS[1][1]], f"only the first two blocks may be left to CI, not {skipped}"
    assert len(RUNNABLE) >= 6, [line for _, line, _ in RUNNABLE]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A stand-in for the repository root, shared by the blocks in README order (later blocks may use earlier
    outputs, as for a reader who runs them one after the other)."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    return folder


def environment() -> dict:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               CUDA_VISIBLE_DEVICES="")  # a CPU-only machine, with no network
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.parametrize("language, line, body", RUNNABLE, ids=[f"{lang}-line{line}" for lang, line, _ in RUNNABLE])
def test_readme_block_runs(language, line, body, workdir):
    command = [sys.executable, "-c", body] if language == "python" else ["bash", "-e", "-c", body]
    result = subprocess.run(command, cwd=workdir, env=environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"README.md:{line} ({language} block) exited {result.returncode}\n--- block\n{body}"
        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")
