"""``memfit.integrations.deepspeed.initialize`` under DeepSpeed's engine, ZeRO stages 1-3, on 2
gloo ranks (``deepspeed_ranks.py``): weights after 3 AdamW steps bitwise equal to the same
engine without memfit, and the measured step peak below its. DeepSpeed is installed by
``./run`` into ``.venv/deepspeed`` (it builds against the installed torch:
``--no-build-isolation``), or importable from the environment."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.processes  # 2 ranks, each a process
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from launcher import launch  # noqa: E402  (this folder is on the path under pytest)

SITE = Path(sys.prefix) / "deepspeed"  # ./run's install target
if importlib.util.find_spec("deepspeed") is None and not (SITE / "deepspeed").is_dir():
    pytest.skip(f"DeepSpeed is not installed (./run setup puts it in {SITE})",
                allow_module_level=True)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_weights_equal_the_engine_without_memfit(stage: int, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    results = launch("deepspeed_ranks.py", str(stage), tmp_path=tmp_path)
    for res in results:
        assert res["regions"], "budget=0.6 planned no region"
        assert res["regions"] == results[0]["regions"]  # one plan per job
        assert abs(res["budget_bytes"] - 0.6 * res["plain_peak_bytes"]) <= 1
        assert res["predicted_peak_bytes"] <= res["budget_bytes"]
        assert res["config_unchanged"]
        assert res["n_weights"] == 29
        assert res["elements"] > 0
        assert len(res["trained"]) == 29  # every weight moved in 3 steps
        # measured forward + backward (the CPU allocator): below the plain engine's; under
        # ZeRO-3 (no gradient buckets) within the budget (seen: the prediction + 16 B)
        assert res["measured_bytes"] < res["plain_measured_bytes"]
        if stage == 3:
            assert res["measured_bytes"] <= res["budget_bytes"]
        assert res["unequal"] == [], f"{len(res['unequal'])} parameters differ under ZeRO-{stage}"
