"""How the package's code is laid out: no two modules import each other (at any depth), and the code says what and
why, leaving measurements, dates and machines to docs/."""

import ast
import re
from pathlib import Path

import samba_hf

PACKAGE = Path(samba_hf.__file__).parent
SOURCES = sorted(path for path in PACKAGE.rglob("*.py") if path.parent.name not in ("default_model", "passkey_model"))


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set) -> set:
    """The package's modules that `path` imports anywhere in it (lazy imports inside functions included)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:  # `from . import x` imports the module x; `from .x import y`, the module x
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return (found & modules) - {name}


def test_no_modules_import_each_other():
    modules = {module_name(path) for path in SOURCES}
    graph = {module_name(path): imported_modules(path, modules) for path in SOURCES}
    assert graph["samba_hf.modeling_samba"] >= {"samba_hf.attention_samba", "samba_hf.cache_samba"}  # it reads them
    cycles, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycles.append(path[path.index(imported) :] + [imported])
            elif imported not in state:
                visit(imported, path + [imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_the_code_names_no_machine_and_no_date():
    """Measurements belong in docs/ with their machine, date and command; the code says what and why."""
    pattern = re.compile(r"\b(H100|H200|A100|EPYC|Xeon)\b|\b20\d\d-\d\d-\d\d\b")
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in SOURCES
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found
