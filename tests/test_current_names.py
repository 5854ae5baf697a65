"""The tests, the docs' Python snippets and the examples use transformers 5.24's names, so that running them prints
none of its deprecation warnings: no `.past_key_values` read off an output (5.24 logs one), no `generate(...,
past_key_values=...)`, no `gradient_checkpointing` argument or method (FutureWarnings); `conftest.returned_cache` and
`cache_kwarg` give the installed version's name (5.23 knows only the old one there). One test keeps each old name
working. (A forward of samba-hf's models takes `past_key_values=` without a warning, so that is not counted.)"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_NAMES_KEPT = {
    "test_cache.py": {"test_the_cache_is_taken_under_either_name"},
    "test_forward_and_training.py": {"test_the_old_checkpointing_names_still_switch_it_on"},
}
OLD_ATTRIBUTES = {"past_key_values", "gradient_checkpointing_enable", "is_gradient_checkpointing"}
OLD_KEYWORDS = {"gradient_checkpointing", "gradient_checkpointing_kwargs"}


def old_names(source: str, kept: set[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, name) for each use of a name transformers 5.24 warns about, outside the top-level functions `kept`."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if function is None and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.name in kept:
                    continue
                visit(child, child.name)
                continue
            if isinstance(child, ast.Attribute) and child.attr in OLD_ATTRIBUTES:
                found.append((child.lineno, f".{child.attr}"))
            if isinstance(child, ast.Call):
                generate = isinstance(child.func, ast.Attribute) and child.func.attr == "generate"
                found.extend(
                    (child.lineno, f"{k.arg}=")
                    for k in child.keywords
                    if k.arg in OLD_KEYWORDS or (generate and k.arg == "past_key_values")
                )
            visit(child, function)

    visit(ast.parse(source), None)
    return sorted(found)


def python_sources():
    """(where, source, kept functions) of every test file, example, and ```python block of README.md and docs/."""
    for path in [*sorted((ROOT / "tests").glob("*.py")), *sorted((ROOT / "examples").glob("*.py"))]:
        yield str(path.relative_to(ROOT)), path.read_text(), OLD_NAMES_KEPT.get(path.name, set())
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, block in enumerate(re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S), 1):
            yield f"{page.relative_to(ROOT)}, python block {number}", block, set()


def test_the_tests_docs_and_examples_use_the_current_names():
    found = [
        f"{where}:{line}: {name}" for where, source, kept in python_sources() for line, name in old_names(source, kept)
    ]
    assert not found, "old names (use cache=, conftest.returned_cache / cache_kwarg, activation_checkpointing):\n" + (
        "\n".join(found)
    )


def test_the_checker_finds_each_old_name():
    source = (
        "def test_a():\n    out.past_key_values\n    model.generate(ids, past_key_values=c)\n"
        "    model(ids, past_key_values=c)\n    model.gradient_checkpointing_enable()\n"
        "    TrainingArguments('o', gradient_checkpointing=True)\n"
        "def test_b():\n    out.past_key_values\n"
    )
    assert old_names(source) == [
        (2, ".past_key_values"),
        (3, "past_key_values="),
        (5, ".gradient_checkpointing_enable"),
        (6, "gradient_checkpointing="),
        (8, ".past_key_values"),
    ]
    assert old_names(source, {"test_a"}) == [(8, ".past_key_values")]
