"""NOTE [joined chains] in memfit.planning.chain_joins: a staged network's stage chains joined
end to end into one chain of blocks, planned by the chain DP, with no segment across a join."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.planning.candidates import PlanningContext
from memfit.planning.chain_joins import joined_chain
from memfit.planning.solvers import chain
from memfit.zoo.resnet import BasicBlock


def _staged(seed: int = 0) -> nn.Sequential:
    """A stem, three nn.Sequential stages of four basic blocks, a head."""
    torch.manual_seed(seed)
    stages, c = [], 8
    for i, c_out in enumerate((8, 16, 32)):
        stages.append(nn.Sequential(BasicBlock(c, c_out, 1 if i == 0 else 2),
                                    *(BasicBlock(c_out, c_out, 1) for _ in range(3))))
        c = c_out
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


@pytest.fixture(scope="module")
def staged_profile():
    model = _staged()
    x = torch.randn(4, 3, 32, 32)
    return memfit.profile(model, x, calibrate_time=False)


def test_the_stages_join_into_one_chain_with_no_segment_across_a_join(staged_profile):
    ctx = PlanningContext(staged_profile)
    joined = joined_chain(ctx)
    assert joined is not None
    # the chain of stages ('' : stem, three stages, head) with each stage opened
    assert ctx.chains[0].parent == "" and len(ctx.chains[0].blocks) == 6
    assert joined.blocks == (("0", "1"), ("2",), *((f"{s}.{b}",) for s in (3, 4, 5) for b in range(4)),
                             ("6", "7", "8"))
    assert chain.main_chain(ctx) == joined
    model = chain.chain_model(ctx, joined)
    parents = [blk[0].split(".")[0] if "." in blk[0] else "" for blk in joined.blocks]
    spans = [(c.k, c.j) for c in model.choices if c.j > c.k]
    assert spans  # segments inside a stage
    assert all(parents[k] == parents[j] for k, j in spans)
    assert ctx.candidate(("3.1", "4.0")) is None  # siblings only


def test_the_joined_chain_reaches_a_peak_no_single_chain_does_and_runs_bitwise(staged_profile):
    ctx = PlanningContext(staged_profile)
    joined_min = chain.min_peak(ctx)
    each_min = min(chain.min_peak(ctx, c) for c in ctx.chains)
    assert joined_min < each_min, (joined_min, each_min)
    model = _staged()
    x = torch.randn(4, 3, 32, 32)
    budget = (joined_min + each_min) // 2  # below what any one chain's plan reaches
    memfit.fit(model, x, budget=budget, search=memfit.Search(solver="chain"))
    plan = model.memfit_plan
    assert plan.predicted_peak_bytes <= budget
    assert any("." in r.modules[0] and r.modules[0].split(".")[0] != "3" for r in plan.regions)
    report = memfit.verify(model, x)
    assert report.bitwise and report.max_abs_diff == 0.0, str(report)
    assert report.peak_bytes <= budget, str(report)
