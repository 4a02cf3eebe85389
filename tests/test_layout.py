"""The package map in docs/design.md names every module under src/memfit, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "memfit"


def _mapped() -> list[str]:
    """The module paths of the design's layout block (the code block after ``## Layout``)."""
    text = (ROOT / "docs" / "design.md").read_text()
    layout = text.split("## Layout", 1)[1]
    block = layout.split("```", 2)[1]
    return [m.group(1) for line in block.splitlines() if (m := re.match(r"(\S+\.py)(\s|$)", line))]


def test_every_module_is_on_the_map_and_every_mapped_module_exists():
    mapped = _mapped()
    on_disk = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))
    assert len(mapped) == len(set(mapped)), "a module is listed twice in docs/design.md"
    missing = sorted(set(on_disk) - set(mapped))
    stale = sorted(set(mapped) - set(on_disk))
    assert not missing, f"modules missing from the map in docs/design.md: {missing}"
    assert not stale, f"docs/design.md maps modules that do not exist: {stale}"


def test_every_mapped_line_says_what_the_module_is():
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    for line in block.splitlines():
        if line.endswith(".py"):
            raise AssertionError(f"no description for {line} in docs/design.md")
