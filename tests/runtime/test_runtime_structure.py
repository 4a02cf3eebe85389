"""memfit.runtime's modules import each other without cycles and stay small.

Imports inside functions count: they tie modules together just the same (a lazy import only
hides a cycle until someone moves it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "src" / "memfit" / "runtime"
MAX_LINES = 450


def _module(path: Path) -> str:
    return "memfit.runtime" if path.stem == "__init__" else f"memfit.runtime.{path.stem}"


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(["memfit", "runtime"][: 3 - node.level] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the runtime modules it imports (a re-exporting ``__init__`` is no tie)."""
    files = {_module(p): p for p in RUNTIME.glob("*.py") if p.stem != "__init__"}
    return {name: {d for d in _imports(p) if d in files and d != name}
            for name, p in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)) is not None:
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)) is not None:
            return found
    return None


def test_runtime_modules_import_each_other_without_cycles():
    graph = import_graph()
    assert "memfit.runtime.segment" in graph and "memfit.runtime.checkpoint" in graph["memfit.runtime.segment"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_a_lazy_import_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("path", sorted(RUNTIME.glob("*.py")), ids=lambda p: p.name)
def test_runtime_module_is_at_most_450_lines(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES
