"""The README's Quick start, "Does my training job fit this GPU?" and "Options" run as written,
in order (the later ones use the first's model and inputs), and in the current spelling (no
DeprecationWarning)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SECTIONS = ("Quick start", "Does my training job fit this GPU?", "Options")


def _blocks(section: str) -> list[str]:
    text = README.read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, re.S)


def test_each_section_has_one_python_block():
    assert [len(_blocks(s)) for s in SECTIONS] == [1, 1, 1]


@pytest.mark.slow
def test_the_quick_start_and_the_job_on_a_gpu_run(capsys):
    names: dict = {"__name__": "__readme__"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        exec(compile(_blocks(SECTIONS[0])[0], "README.md: Quick start", "exec"), names)
        assert not hasattr(names["model"], "memfit_plan")  # unapplied at its end
        out = capsys.readouterr().out
        assert "optimizer states" in out and "AdamW" in out  # the breakdown was printed
        exec(compile(_blocks(SECTIONS[1])[0], "README.md: the job on a GPU", "exec"), names)
    memory = names["model"].memfit_plan.memory
    assert memory is not None and memory.fits and memory.device_memory_bytes == 80 * 2**30
    found = names["found"]
    assert found.batch > 10_000 and found.plan.memory.total_bytes <= 80 * 2**30
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        exec(compile(_blocks(SECTIONS[2])[0], "README.md: Options", "exec"), names)
    plan = names["model"].memfit_plan
    assert plan.memory is None and plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.budget_bytes == int(0.5 * plan.plain_peak_bytes) and plan.solver == "chain"
