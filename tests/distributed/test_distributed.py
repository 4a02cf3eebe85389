"""One plan per job (NOTE [one plan per job] in ``memfit.parallel.distributed``), on 2 gloo ranks.

Each test starts ``python -m torch.distributed.run --nproc_per_node 2 --standalone`` on a
per-rank script of this folder (``--standalone``: a free port per launch, so pytest-xdist may
run several at once) and asserts on the JSON every rank writes. Model: the tiny Llama of
``tests/integrations/hf_models.py``; training: 3 AdamW steps on each rank's own batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launcher import launch

pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.processes  # 2 ranks, each a process
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

RANKS = 2
def assert_one_plan(results: list[dict[str, Any]]) -> None:
    """Every rank saw every rank's ``Plan.to_dict()`` equal to its own, and planned something."""
    for r, res in enumerate(results):
        plans = res["plans"]
        assert len(plans) == RANKS
        assert all(p == plans[0] for p in plans), f"rank {r}: the ranks' plans differ"
        assert res["regions"] > 0
    assert results[0]["plans"] == results[1]["plans"]


@pytest.mark.parametrize("order", ["fit-then-wrap", "fit-wrapped"])
def test_ddp_one_plan_and_weights_equal_plain_ddp(order: str, tmp_path: Path) -> None:
    results = launch("ddp_ranks.py", order, tmp_path=tmp_path)
    assert_one_plan(results)
    for res in results:
        assert res["n_weights"] > 0
        assert res["unequal"] == [], f"{len(res['unequal'])} parameters differ from plain DDP"


@pytest.mark.parametrize("order", ["shard-then-fit", "fit-then-shard"])
def test_fsdp2_one_plan_verified_and_weights_equal_plain_fsdp2(order: str, tmp_path: Path) -> None:
    results = launch("fsdp_ranks.py", order, tmp_path=tmp_path)
    assert_one_plan(results)
    for res in results:
        report = res["verify"]
        assert report["compared"] == "in place"
        assert report["bitwise"] and report["max_abs_diff"] == 0.0, res["verify_text"]
        # verify is ok: its peak checks read the tensors' peak in a distributed job (NOTE
        # [peaks in a distributed job]); the allocator's also holds gloo's buffers (+4.7% here)
        failed = [c["name"] for c in report["checks"] if not c["passed"]]
        if order == "shard-then-fit":
            assert failed == [] and report["ok"], res["verify_text"]
        else:  # planned before sharding, the profile lacks the gathered parameters (+2-6%)
            assert set(failed) <= {"peak matches prediction", "peak within budget"}, res["verify_text"]
        assert "collective backend" in res["verify_text"], res["verify_text"]
        assert report["peak_bytes"] >= report["tracked_peak_bytes"], res["verify_text"]
        if order == "shard-then-fit":
            # the tensors' peak, the meter the prediction is built on, is predicted to 0.1%
            # (512 B of 7.6 MB seen; the 3% of NOTE [peak tolerance] would hide gloo's share),
            # less what the prediction counts and that meter does not see: the regions' RNG
            # states (NOTE [region state bytes]; 34,880 B over 7 regions seen) and the masks
            # and generator states of the draws the plan keeps, made with Python dispatch off
            # (NOTE [kept draws], rule 4; 70,592 B each here). The plan depends on the op
            # times measured, so whether it keeps draws changes from run to run.
            pred = report["predicted_peak_bytes"]
            unseen = res["regions"] * torch.get_rng_state().nbytes + res["kept_draw_bytes"]
            err = pred - report["tracked_peak_bytes"]
            assert -0.001 * pred <= err <= unseen + 0.001 * pred, res["verify_text"]
        assert res["n_weights"] > 0
        assert res["unequal"] == [], f"{len(res['unequal'])} parameters differ from plain FSDP2"
        for how, error in res["refused"].items():  # NOTE [collectives in a region]
            assert error is not None and error.startswith("PlanMismatch: region "), how
            assert "FSDPLlamaDecoderLayer" in error, error


@pytest.mark.parametrize("case", ["plans-differ", "cannot-apply"])
def test_apply_of_different_plans_raises_on_every_rank(case: str, tmp_path: Path) -> None:
    results = launch("errors_ranks.py", case, tmp_path=tmp_path)
    for r, res in enumerate(results):
        assert res["raised"] == "PlansDiffer", f"rank {r}: {res}"
        assert not res["carries_plan"]  # nothing was applied anywhere
    assert results[0]["ranks"] == results[1]["ranks"]
    ranks = results[0]["ranks"]
    if case == "plans-differ":
        assert sorted(ranks.values()) == [[0], [1]]
        assert all(res["unchecked_applied"] for res in results)
        assert "ranks 0 hold plan" in results[0]["message"]
    else:
        assert [k for k, v in ranks.items() if v == [0, 1]]  # one digest held by both
        errors = {k: v for k, v in ranks.items() if k.startswith("error: PlanMismatch")}
        assert list(errors.values()) == [[1]]
        assert "'model.layers.5'" in results[0]["message"]


def test_infeasible_budget_on_the_planning_rank_raises_on_every_rank(tmp_path: Path) -> None:
    results = launch("errors_ranks.py", "infeasible", tmp_path=tmp_path)
    for res in results:
        assert res["raised"] == "InfeasibleBudget", res
        assert res["budget_bytes"] == 1
        assert not res["carries_plan"]
    assert results[0]["min_feasible_bytes"] == results[1]["min_feasible_bytes"] > 1
    assert "[raised while planning on rank 0]" in results[1]["message"]
