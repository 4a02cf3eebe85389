"""benchmarks/README.md is the maintained table: every script is in it, every result file it
names exists, and every anchor README.md links into it is one of its headings."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
README = BENCHMARKS / "README.md"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _result_paths(text: str) -> list[str]:
    """``results/...`` paths the README names in backticks or links, braces expanded; paths with
    a placeholder (``<model>``) or a wildcard are left to the reader."""
    found = re.findall(r"`(results/[^`\s]+)`", text) + re.findall(r"\]\((results/[^)\s#]+)", text)
    out: list[str] = []
    for path in found:
        if "<" in path or "*" in path:
            continue
        if m := re.search(r"\{([^}]+)\}", path):
            out += [path[:m.start()] + alt + path[m.end():] for alt in m.group(1).split(",")]
        else:
            out.append(path)
    return out


def test_every_result_file_the_readme_names_exists() -> None:
    paths = _result_paths(README.read_text())
    assert len(paths) >= 20  # the tables name their sources
    missing = sorted(p for p in set(paths) if not (BENCHMARKS / p).exists())
    assert missing == []


def test_every_script_is_described() -> None:
    text = README.read_text()
    scripts = sorted(p.stem for p in BENCHMARKS.glob("*.py") if '__name__ == "__main__"' in p.read_text())
    assert "tradeoff" in scripts
    assert [s for s in scripts if not re.search(rf"\b{s}\b", text)] == []


def test_every_anchor_readme_links_into_it_is_a_heading() -> None:
    headings = {_slug(line.lstrip("#")) for line in README.read_text().splitlines() if line.startswith("#")}
    linked = set(re.findall(r"benchmarks/README\.md#([\w\-]+)", (ROOT / "README.md").read_text()))
    for doc in (ROOT / "docs").glob("*.md"):
        linked |= set(re.findall(r"benchmarks/README\.md#([\w\-]+)", doc.read_text()))
    assert linked, "README.md links into benchmarks/README.md"
    assert sorted(linked - headings) == []


def test_slug() -> None:
    assert _slug(" A 7B Llama on an 80 GiB H100") == "a-7b-llama-on-an-80-gib-h100"
    assert _slug("What `results/` keeps") == "what-results-keeps"
