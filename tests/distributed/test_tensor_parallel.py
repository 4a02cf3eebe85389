"""Tensor parallelism (DTensor ``ColwiseParallel`` / ``RowwiseParallel``) planned by
``memfit.fit`` after ``parallelize_module``, on 2 gloo ranks (``tp_ranks.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.processes  # 2 ranks, each a process
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
pytest.importorskip("torch.distributed.tensor.parallel")

from test_pipeline import launch  # noqa: E402  (this folder is on the path under pytest)


def test_tp_one_plan_and_weights_equal_plain_tp_after_3_adamw_steps(tmp_path: Path) -> None:
    results = launch("", tmp_path, script="tp_ranks.py")
    for res in results:
        assert "fit_error" not in res, res["fit_error"]
        assert res["regions"] == results[0]["regions"]  # one plan per job
        # each MLP's proj all-reduces in forward (RowwiseParallel), so no region holds one
        # (NOTE [collectives in a region] in memfit.planning.rules); seen: the attentions
        reduces = ["blocks.0.mlp.proj", "blocks.1.mlp.proj"]
        held = [m for r in res["regions"] for m in r
                if any(q == m or q.startswith(m + ".") or m == "" for q in reduces)]
        assert res["regions"] and held == [], res["regions"]
        assert res["predicted_peak_bytes"] <= res["budget_bytes"]
        assert res["measured_bytes"] <= 1.03 * res["budget_bytes"], res
        assert res["measured_bytes"] < res["plain_measured_bytes"]
        assert res["n_weights"] == 29
        assert res["unequal"] == [], f"{len(res['unequal'])} parameters differ from plain TP"
