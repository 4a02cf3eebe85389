"""Build memfit's wheel and import every module from it, not from the source tree.

Usage (from the repository root): python .ci/check_wheel.py
Fails (exit 1) when the wheel lacks a module of src/memfit (a subpackage left out by the
package finder) or py.typed, or when a module does not import from the unpacked wheel.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "memfit"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        str(ROOT), "-w", str(out / "dist")], check=True)
        (wheel,) = (out / "dist").glob("memfit-*.whl")
        names = set(zipfile.ZipFile(wheel).namelist())
        want = {f"memfit/{p.relative_to(SRC).as_posix()}" for p in SRC.rglob("*.py")} | {"memfit/py.typed"}
        missing = sorted(want - names)
        if missing:
            print(f"{wheel.name} lacks {len(missing)} file(s): {', '.join(missing)}")
            return 1
        unpacked = out / "unpacked"
        zipfile.ZipFile(wheel).extractall(unpacked)
        modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in want
                         if n.endswith(".py") and not n.endswith("__main__.py"))
        code = (f"import importlib, sys; sys.path.insert(0, {str(unpacked)!r}); "
                f"mods = {modules!r}; [importlib.import_module(m) for m in mods]; "
                f"bad = [m for m in mods if not sys.modules[m].__file__.startswith({str(unpacked)!r})]; "
                "print('imported from the source tree, not the wheel:', bad) if bad else None; "
                "sys.exit(1 if bad else 0)")
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp)
        if done.returncode:
            return done.returncode
        print(f"{wheel.name}: {len(want)} files, {len(modules)} modules import from the wheel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
