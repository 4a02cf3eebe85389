"""Nested regions (NOTE [nested regions]): the plan rules, and the chain DP's nested choices
against the simulator. Their memory model against measured peaks: tests/end_to_end/test_predicted_peaks.py."""

from __future__ import annotations

import numpy as np
import pytest
from profile_builders import chain_profile, gpt_like, residual_block

from memfit.planning.candidates import PlanningContext
from memfit.planning.plan import Plan, Region
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate
from memfit.planning.solvers import chain


def _plan(*regions: Region) -> Plan:
    return Plan(regions, 0, 0.0, None, "t", "")


@pytest.mark.parametrize("n_blocks", [3, 6])
def test_nested_choices_lower_the_floor_and_predict_exactly(n_blocks):
    prof = gpt_like(n_blocks)
    ctx = PlanningContext(prof)
    flat = chain.min_peak(ctx, nested=False)
    lo = chain.min_peak(ctx)
    assert lo < flat  # the attention maps are not held during the MLP's backward
    nested_seen = False
    for budget in np.linspace(lo, prof.peak_bytes, 7).astype(int):
        sol = chain.solve(ctx, int(budget))
        sim = simulate(prof, _plan(*sol.regions))
        # the DP's local evaluation of a nesting equals the simulator's timeline
        assert sim.peak_bytes == sol.predicted_peak_bytes <= budget
        assert sim.recompute_s == sol.recompute_s  # dyadic op times: exact sums
        names = [r.name for r in sol.regions]
        nested_seen |= any(a != b and b.startswith(a + ".") for a in names for b in names)
    assert nested_seen
    with pytest.raises(chain.Infeasible):
        chain.solve(ctx, lo - 1)


def test_planner_reaches_the_nested_floor():
    prof = gpt_like(4)
    ctx = PlanningContext(prof)
    lo = chain.min_peak(ctx)
    p = plan_for_budget(prof, budget=lo)
    assert p.predicted_peak_bytes == lo
    inner = [r for r in p.regions if r.name.count(".") >= 2]
    assert inner and all(r.save == () for r in inner)


@pytest.mark.parametrize("regions, message", [
    ((Region(("layers.0",)), Region(("layers.0.attn",)), Region(("layers.0.attn.drop",))), "two levels"),
    ((Region.saving(("layers.0",), ("aten.mm.default#0",)), Region(("layers.0.attn",))), "must save no ops"),
    ((Region(("layers.0",)), Region.saving(("layers.0.attn",), ("aten.mm.default#0",))), "must save no ops"),
    ((Region(("layers.0", "layers.1")), Region(("layers.1", "layers.2"))), "overlap or nest"),
    ((Region(("layers.0.attn",)), Region(("layers.0.mlp",)), Region(("layers.0", "layers.1"))), None),
    # NOTE [segments nested in a block]: a segment of a block's sub-modules inside the block
    ((Region(("layers.0",)), Region(("layers.0.ln1", "layers.0.attn"))), None),
    ((Region(("layers.0", "layers.1")), Region(("layers.0.ln1", "layers.0.attn"))), "overlap or nest"),
])
def test_nesting_rules(regions, message):
    prof = gpt_like(3)
    if message is None:  # two inner regions in one block of a segment: allowed
        assert simulate(prof, _plan(*regions)).peak_bytes > 0
        return
    with pytest.raises(ValueError, match=message):
        simulate(prof, _plan(*regions))


def test_inner_replays_after_the_outer_one():
    prof = gpt_like(2)
    sim = simulate(prof, _plan(Region(("layers.1",)), Region(("layers.1.attn",))))
    rp_outer, rp_inner = sim.recompute_points
    alone = simulate(prof, _plan(Region(("layers.1",))))
    assert rp_outer == alone.recompute_points[0] < rp_inner  # the block's recompute point stays
    t_outer, t_inner = sim.region_recompute_s
    # the attention runs in the block's replay and again in its own
    assert t_outer == alone.recompute_s and t_inner > 0
    assert sim.peak_bytes <= alone.peak_bytes


def test_a_segment_nested_in_its_block_replays_after_it():
    """NOTE [segments nested in a block]: the segment's ops rerun in the block's replay and
    again in its own, as a module nested in the block does."""
    prof = gpt_like(2)
    seg = Region(("layers.1.ln1", "layers.1.attn"))
    sim = simulate(prof, _plan(Region(("layers.1",)), seg))
    alone = simulate(prof, _plan(Region(("layers.1",))))
    rp_outer, rp_inner = sim.recompute_points
    assert rp_outer == alone.recompute_points[0] < rp_inner
    t_outer, t_inner = sim.region_recompute_s
    assert t_outer == alone.recompute_s
    assert t_inner == simulate(prof, _plan(seg)).recompute_s
    assert sim.peak_bytes <= alone.peak_bytes


@pytest.mark.parametrize("n_blocks", [8, 16])
def test_blocks_nested_in_segments_lower_the_floor_and_predict_exactly(n_blocks, monkeypatch):
    """NOTE [nested segments]: a segment with each of its blocks checkpointed inside it holds
    one input from forward to its backward where a region per block holds one per block."""
    prof = chain_profile([residual_block([256, 256], act_bytes=256)] * n_blocks, act_bytes=256)
    lo = chain.min_peak(PlanningContext(prof))
    with monkeypatch.context() as m:
        m.setattr(chain.ChainModel, "_blocks_nested_choice", lambda self, k, j, seg: [])
        without = chain.min_peak(PlanningContext(prof))
    assert lo < without
    seen = False
    ctx = PlanningContext(prof)
    for budget in np.linspace(lo, without, 5).astype(int):
        sol = chain.solve(ctx, int(budget))
        sim = simulate(prof, _plan(*sol.regions))
        assert sim.peak_bytes == sol.predicted_peak_bytes <= budget
        assert sim.recompute_s == sol.recompute_s  # dyadic op times: exact sums
        segs = [r for r in sol.regions if r.is_segment]
        seen |= any(Region((m,)) in sol.regions for s in segs for m in s.modules)
    assert seen
