"""The benchmark scripts import one another without a cycle, and the ``gpu_probe`` family shares
its pieces through ``benchmarks.gpu_probe_cases``, not through one another's private names.

Imports inside functions count: a script that defers an import to its ``main`` still closes a
cycle for a reader following the code, and for Python when the two run as ``-m`` modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _imports(folder: Path) -> dict[str, dict[str, set[str]]]:
    """For each module of ``folder``: the benchmark modules it imports, with the names taken."""
    modules = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(folder.glob("*.py")):
        deps: dict[str, set[str]] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
                for alias in node.names:
                    if alias.name in modules:
                        deps.setdefault(alias.name, set())
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("benchmarks."):
                deps.setdefault(node.module.split(".")[1], set()).update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("benchmarks."):
                        deps.setdefault(alias.name.split(".")[1], set())
        deps.pop(path.stem, None)
        graph[path.stem] = deps
    return graph


def _cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        path.append(node)
        for dep in sorted(graph.get(node, {})):
            if state.get(dep) == "open":
                found.append([*path[path.index(dep):], dep])
            elif dep not in state:
                visit(dep, path)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_no_benchmark_module_imports_itself_back() -> None:
    graph = _imports(BENCHMARKS)
    assert {"gpu_probe", "gpu_probe_cases", "gpu_probe_memory", "gpu_probe_report"} <= set(graph)
    assert _cycles(graph) == []


def test_the_gpu_probe_family_takes_no_private_name_from_one_another() -> None:
    graph = _imports(BENCHMARKS)
    family = {m for m in graph if m.startswith("gpu_probe")}
    taken = sorted((m, dep, name) for m in family for dep, names in graph[m].items()
                   if dep in family for name in names if name.startswith("_"))
    assert taken == []
    assert not set(graph["gpu_probe_cases"]) & family  # the shared module sits below the others


def test_a_cycle_is_found() -> None:
    graph: dict[str, dict[str, set[str]]] = {"a": {"b": {"_x"}}, "b": {"c": set()}, "c": {"a": set()},
                                             "d": {"a": set()}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
