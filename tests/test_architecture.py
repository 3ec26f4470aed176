"""The package's layering (docs/architecture.md): which wings may import which, no import cycle,
and modules small enough to read. Imports are read from the source (module level and inside
functions alike), so a lazy import cannot hide a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "flashspec"

# Wings from the bottom up: a module may import its own wing and the wings of lower layers only.
# Wings of one layer are independent of each other.
LAYERS = [
    ["sampling", "stats", "checks", "paths", "version"],
    ["kernels"],
    ["verify", "draft_tree", "models"],
    ["drafters", "select"],
    ["decode"],
    ["engine"],
    ["data"],
    ["tuning", "training", "demo"],
    ["serve"],
    ["bench"],
    ["cli"],
    ["__main__"],
]
# The package's face (flashspec/__init__.py) re-exports the public API from any layer below the
# command line; nothing inside the package imports it.
FACE = "flashspec"
# Imports that break the rule, each with its reason. Empty now; an entry whose import is gone
# fails the test, so the list cannot go stale.
EXCEPTIONS: dict[tuple[str, str], str] = {}
# The largest a module outside the benchmarks may grow (lines), so that each reads in one sitting.
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """The flashspec modules ``name`` imports (resolved to modules where the name is one)."""
    modules = _modules()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "flashspec":
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "flashspec")
    return found


def _wing(module: str) -> str:
    parts = module.split(".")
    return FACE if len(parts) == 1 else parts[1]


def _layer(wing: str) -> int:
    for i, wings in enumerate(LAYERS):
        if wing in wings:
            return i
    raise AssertionError(f"{wing!r} is in no layer of tests/test_architecture.py: place it there.")


def _graph() -> dict[str, set[str]]:
    return {name: _imports(name, path) for name, path in _modules().items()}


def test_every_wing_has_a_layer():
    for module in _modules():
        if module != FACE:
            _layer(_wing(module))


def _violations(graph: dict[str, set[str]]) -> tuple[list[str], set[tuple[str, str]]]:
    """The imports of ``graph`` that break the layering, and the exceptions they used."""
    broken, used = [], set()
    for module, imports in graph.items():
        wing = _wing(module)
        for imported in imports:
            other = _wing(imported)
            if other == wing:
                continue
            if other == FACE:
                problem = "imports the package's face"
            elif wing == FACE:
                problem = "" if _layer(other) < _layer("cli") else "the face imports the command line"
            elif _layer(other) >= _layer(wing):
                problem = f"{wing} (layer {_layer(wing)}) imports {other} (layer {_layer(other)})"
            else:
                problem = ""
            if problem and (module, imported) in EXCEPTIONS:
                used.add((module, imported))
            elif problem:
                broken.append(f"{module} -> {imported}: {problem}")
    return sorted(broken), used


def test_no_wing_imports_one_above_it_or_beside_it():
    broken, used = _violations(_graph())
    assert not broken, "\n".join(broken)
    assert used == set(EXCEPTIONS), f"exceptions whose import is gone: {sorted(set(EXCEPTIONS) - used)}"


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for imported in sorted(graph.get(module, ())):
            if imported not in graph:
                continue
            if state.get(imported) == 1:
                cycle = stack[stack.index(imported):] + [imported]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_modules_outside_the_benchmarks_stay_short():
    long = {name: len(path.read_text().splitlines()) for name, path in _modules().items() if _wing(name) != "bench"}
    assert max(long.values()) < MAX_LINES, sorted(((n, l) for n, l in long.items() if l >= MAX_LINES), key=lambda x: -x[1])


def test_the_rules_catch_a_violation():
    """The check is not vacuous: the drafters importing the engine, the select wing importing
    the drafters beside it, or a module importing the package's face are reported."""
    graph = _graph()
    graph["flashspec.drafters.base"] = graph["flashspec.drafters.base"] | {"flashspec.engine"}
    graph["flashspec.select.guard"] = graph["flashspec.select.guard"] | {"flashspec.drafters.base"}
    graph["flashspec.decode.loop"] = graph["flashspec.decode.loop"] | {"flashspec"}
    broken, _ = _violations(graph)
    assert broken == ["flashspec.decode.loop -> flashspec: imports the package's face",
                      "flashspec.drafters.base -> flashspec.engine: drafters (layer 3) imports engine (layer 5)",
                      "flashspec.select.guard -> flashspec.drafters.base: select (layer 3) imports drafters (layer 3)"]
