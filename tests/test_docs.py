"""Every ```python and ```bash block of README.md and of docs/*.md runs as written, in order, on a CPU, without
network.

Each block runs in a fresh subprocess (python blocks with this interpreter, bash blocks with `bash -e` and this
interpreter's bin folder first on PATH) inside a temporary working directory, one per page, that stands in for the
repository root: `examples/` is linked into it, so the commands are exactly what a user types at the root, and
nothing is written into the repository. Later blocks of a page may use what earlier ones wrote, as for a reader who
runs them one after the other.

The pages' `path/to/...` folders are the ones a user downloads; here they are tiny stand-ins laid out the same way:
`path/to/Phi-4-mini-flash-reasoning` is a SambaY folder laid out as the release (its config.json fields, bf16 shards,
the chat template and chat tokens, no vocabulary) and `path/to/gpt-4o-tokenizer` a word-level tokenizer whose
end-of-text token sits where GPT-4o's does relative to the chat tokens (`tests/test_sambay.py` builds both).

Not run here: the README's first two blocks, the install and test commands, which CI runs itself (recognised by
their content); and the blocks that run in vLLM's environment (they start by activating `.venv-vllm`, or install or
feed it: `in_vllm_environment`, which the plugin's tests use too), which `vllm_plugin/tests/test_readme.py` runs
there. Blocks of program output, and commands shown but not run (they need downloaded weights), are fenced ```text.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(.*)$")
RUN = ("python", "bash")
OUTPUT = ("text",)


def fenced_blocks(page: Path) -> list[tuple[str, int, str]]:
    """(language, line number of the opening fence, body) for each fenced block, in order."""
    blocks, language, start, body = [], None, 0, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = FENCE.match(line.strip())
        if language is None:
            if fence:
                language, start, body = fence.group(1).strip(), number, []
        elif fence and not fence.group(1).strip():
            blocks.append((language, start, "\n".join(body) + "\n"))
            language = None
        else:
            body.append(line)
    assert language is None, f"{page.name}:{start}: unclosed code block"
    return blocks


def run_by_ci(language: str, body: str) -> bool:
    """The install command and the test command: CI runs those two itself."""
    install = language == "bash" and "python3 -m venv .venv " in body and "pip install -e '.[dev]'" in body
    tests = language == "bash" and body.strip() == ". .venv/bin/activate && python -m pytest -q"
    return install or tests


def run_by_the_multiprocess_tests(language: str, body: str) -> bool:
    """The fine-tuning page's commands of examples/finetune.py on one process and two (`accelerate launch`): the
    same script with the same options runs in tests/test_multiprocess.py (DDP) and tests/test_fsdp.py (FSDP2, its
    bf16 policy), on a tiny model, against one process's losses and weights; here they would only repeat that on the
    embedded default, for half a minute of the suite."""
    lines = [line for line in body.splitlines() if line.strip()]
    return (
        language == "bash"
        and any(line.startswith("accelerate launch") for line in lines)
        and all(
            line.startswith(("python examples/finetune.py ", "accelerate launch --multi_gpu --num_processes 2 "))
            and "examples/finetune.py" in line
            for line in lines
        )
    )


def in_vllm_environment(language: str, body: str) -> bool:
    """Blocks for vLLM's environment (its install, its commands, its test command): the plugin's tests run them."""
    return language == "bash" and (
        body.startswith(". .venv-vllm/bin/activate") or "vllm_plugin[" in body or "SAMBA_VLLM_FIXTURES=" in body
    )


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


BLOCKS = {page: fenced_blocks(page) for page in PAGES}
RUNNABLE = [
    (page, language, line, body)
    for page in PAGES
    for language, line, body in BLOCKS[page]
    if language in RUN
    and not run_by_ci(language, body)
    and not in_vllm_environment(language, body)
    and not run_by_the_multiprocess_tests(language, body)
]


def test_every_block_is_run_or_marked_as_output():
    unknown = [
        (name(page), line, language)
        for page in PAGES
        for language, line, _ in BLOCKS[page]
        if language not in RUN + OUTPUT
    ]
    assert not unknown, f"blocks that are neither python/bash (run here) nor text (output, or not run): {unknown}"
    left_to_ci = [
        (name(page), line) for page in PAGES for language, line, body in BLOCKS[page] if run_by_ci(language, body)
    ]
    readme = BLOCKS[ROOT / "README.md"]
    assert left_to_ci == [("README.md", readme[0][1]), ("README.md", readme[1][1])], (
        f"only README's first two blocks may be left to CI, not {left_to_ci}"
    )
    assert len(PAGES) >= 10 and len(RUNNABLE) >= 15, [(name(p), line) for p, _, line, _ in RUNNABLE]
    left_to_tests = [
        name(page)
        for page in PAGES
        for language, _, body in BLOCKS[page]
        if run_by_the_multiprocess_tests(language, body)
    ]
    assert left_to_tests == ["docs/fine-tuning.md", "docs/fine-tuning.md"], left_to_tests


@pytest.fixture(scope="session")
def downloads(tmp_path_factory):
    """Stand-ins for the folders the pages call path/to/...: built once, linked into every page's folder."""
    from test_sambay import release_folder, word_tokenizer

    folder = tmp_path_factory.mktemp("downloads")
    release_folder(folder / "Phi-4-mini-flash-reasoning")
    word_tokenizer(folder / "gpt-4o-tokenizer")
    return folder


@pytest.fixture(scope="session")
def workdirs(tmp_path_factory, downloads):
    """One stand-in for the repository root per page, shared by that page's blocks in order."""
    made = {}

    def workdir(page: Path) -> Path:
        if page not in made:
            folder = made[page] = tmp_path_factory.mktemp(page.stem)
            (folder / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
            (folder / "path").mkdir()
            (folder / "path" / "to").symlink_to(downloads, target_is_directory=True)
        return made[page]

    return workdir


def environment() -> dict:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES=""
    )  # a CPU-only machine, with no network
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.parametrize(
    "page, language, line, body",
    RUNNABLE,
    ids=[f"{name(page)}:{line}-{language}" for page, language, line, _ in RUNNABLE],
)
def test_block_runs(page, language, line, body, workdirs):
    command = [sys.executable, "-c", body] if language == "python" else ["bash", "-e", "-c", body]
    result = subprocess.run(
        command, cwd=workdirs(page), env=environment(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, (
        f"{name(page)}:{line} ({language} block) exited {result.returncode}\n--- block\n{body}"
        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    )
