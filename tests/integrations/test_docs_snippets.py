"""Every Python block of docs/integrations.md runs as written."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def _snippets() -> dict[str, str]:
    text = DOC.read_text()
    found: dict[str, str] = {}
    for match in re.finditer(r"^### (.+?)\n(.*?)(?=^### |\Z)", text, re.S | re.M):
        title, body = match.groups()
        blocks = re.findall(r"```python\n(.*?)```", body, re.S)
        for i, code in enumerate(blocks):
            key = re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_") + (f"_{i}" if i else "")
            found[key] = code
    return found


SNIPPETS = _snippets()


def test_the_doc_has_a_snippet_per_integration():
    assert list(SNIPPETS) == ["plain_pytorch", "hugging_face_enable", "hugging_face_trainer",
                              "peft_lora", "accelerate", "lightning"]


@pytest.mark.hf
@pytest.mark.parametrize("name", list(SNIPPETS), ids=list(SNIPPETS))
@pytest.mark.slow
def test_snippet_runs(name, tmp_path, monkeypatch):
    needs = {"hugging_face": "transformers", "peft": "peft", "accelerate": "accelerate",
             "lightning": "lightning"}
    for prefix, package in needs.items():
        if name.startswith(prefix):
            pytest.importorskip(package)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / f"{name}.py"
    path.write_text(SNIPPETS[name])
    runpy.run_path(str(path), run_name="__main__")
