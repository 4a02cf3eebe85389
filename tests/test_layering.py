"""The floors of docs/design.md, enforced: each stage imports only downwards, and the planner
runs without torch.

Every module of ``src/memfit`` sits on a floor (``FLOORS``, by its first name under
``memfit``); an import of a module on a higher floor fails here, naming both and the line.
Function-level imports count (a deferred import is still a dependency); imports under
``if TYPE_CHECKING:`` do not (they never run).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "memfit"

# docs/design.md, "Floors": lower numbers are imported by higher ones, never the other way.
FLOORS = {
    "_native_output": 0, "_torch": 0, "errors": 0, "ops": 0, "units": 0, "timemodel": 0,
    "torch_support": 0,
    "step": 1,
    "profiling": 2,
    "planning": 3,
    "runtime": 4,
    "parallel": 5,
    "measuring": 6,
    "job": 7,
    "api": 8, "compiled": 8, "": 8,  # "" is the package itself: the public face (memfit/__init__.py)
    "integrations": 9, "jax": 9,  # memfit.jax: a second front end, never imported below
    "cli": 10, "zoo": 10, "__main__": 10,
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS[parts[1] if len(parts) > 1 else ""]


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


def imports(path: Path) -> list[tuple[str, int]]:
    """The memfit modules ``path`` imports, with their lines (``from memfit import ops`` is an
    import of ``memfit.ops``; ``from memfit import Plan`` one of the public face)."""
    module = _module(path)
    tree = ast.parse(path.read_text())
    type_only = {id(n) for node in ast.walk(tree)
                 if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                 for n in ast.walk(node)}
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub if _is_module(sub) else base, node.lineno))
    return [(name, line) for name, line in found if name == "memfit" or name.startswith("memfit.")]


def test_every_top_level_name_has_a_floor():
    names = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists())}
    names = {"" if n == "__init__" else n for n in names}
    assert names == set(FLOORS), ("place each top-level module or package on a floor in FLOORS "
                                  "(and in docs/design.md): " + str(sorted(names ^ set(FLOORS))))


def test_the_top_level_holds_at_most_eight_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 8, f"the public face and the shared core only: {modules}"


def test_no_module_imports_a_higher_floor():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        for target, line in imports(path):
            if _floor(target) > _floor(module):
                upward.append(f"{module} (floor {_floor(module)}) imports {target} "
                              f"(floor {_floor(target)}) at line {line}")
    assert not upward, "imports that go up a floor:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The check above can fail: a profiling module that imports the planner is caught."""
    bad = PACKAGE / "profiling" / "_layering_probe.py"
    bad.write_text("def f():\n    from memfit.planning import planner\n    return planner\n")
    try:
        assert imports(bad) == [("memfit.planning.planner", 2)]
        assert _floor("memfit.planning.planner") > _floor(_module(bad))
    finally:
        bad.unlink()


# The start of a child process in which importing torch fails.
_NO_TORCH = textwrap.dedent("""
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")

    sys.meta_path.insert(0, NoTorch())
""")


@pytest.mark.processes
def test_the_planner_imports_and_plans_without_torch():
    """Every planning module imports, and a hand-built profile is planned, in a process where
    importing torch fails (the JAX front end plans without it; NOTE [torch-free facts] in
    memfit.ops)."""
    code = _NO_TORCH + textwrap.dedent("""
        import importlib, pkgutil
        import memfit.planning
        for m in pkgutil.walk_packages(memfit.planning.__path__, "memfit.planning."):
            importlib.import_module(m.name)
        from memfit.planning.planner import plan_for_budget
        from profile_builders import gpt_like
        p = plan_for_budget(gpt_like(6, d=256), budget=0.5)
        print(len(p.regions), p.predicted_peak_bytes <= p.budget_bytes,
              "torch" in sys.modules)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                        str(ROOT / "tests" / "planning")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    regions, fits, torch_loaded = done.stdout.split()
    assert int(regions) > 0 and fits == "True" and torch_loaded == "False"


@pytest.mark.processes
def test_the_jax_front_end_imports_without_torch():
    """``memfit.jax`` needs memfit's planner and data, not torch (skipped where jax is not
    installed: it is the ``jax`` extra)."""
    pytest.importorskip("jax")
    code = _NO_TORCH + textwrap.dedent("""
        import memfit.jax
        print(sorted(memfit.jax.__all__), "torch" in sys.modules)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("False")
