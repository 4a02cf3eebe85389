"""The MILP on GPT-like profiles with sub-modules: its compressed rows are few and exact, and
auto uses it. How fast it solves is a benchmark (``python -m benchmarks.milp_speed``), not
asserted here: a unit test's wall clock moves with the machine's load."""

from __future__ import annotations

import pytest
from profile_builders import gpt_like

from memfit.planning.candidates import PlanningContext
from memfit.planning.costs import LinearModel
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate
from memfit.planning.solvers import auto, chain, milp, milp_rows


@pytest.fixture(scope="module")
def gpt12():
    return gpt_like(12)


def test_compressed_milp_is_proven_optimal(gpt12):
    # 318 variables x 5,934 points; the dense model took 8-11 s per solve here, the compressed
    # one 0.2-0.9 s (benchmarks/milp_speed.py times it).
    ctx = PlanningContext(gpt12)
    n_vars, n_points = auto.milp_cells(ctx)
    assert (n_vars, n_points) == (318, 5934)  # 12 block outputs escape: never saved
    lo = chain.min_peak(ctx, nested=False)  # milp's space has no nested regions
    peak, proven = milp.min_peak(ctx)
    assert proven and peak <= lo
    for budget in (lo, int(0.5 * gpt12.peak_bytes), int(0.8 * gpt12.peak_bytes)):
        sol = milp.solve(ctx, budget)
        assert not any("not proven optimal" in n for n in sol.notes), sol.notes
        assert sol.predicted_peak_bytes <= budget
        assert sol.recompute_s <= chain.solve(ctx, budget, nested=False).recompute_s  # a wider plan space


def test_compressed_rows_are_few(gpt12):
    ctx = PlanningContext(gpt12)
    lm = LinearModel(ctx, ctx.region_candidates())
    A = lm.matrix()
    rows = milp_rows.memory_rows(lm, A, int(0.5 * gpt12.peak_bytes))
    # measured: 187 of 5,934 rows; 2,380 nonzero differences for 36,182 nonzero coefficients
    assert rows.n_rows * 20 < lm.n_points
    diffs = A[rows.points] - A[rows.points[rows.parent]] * (rows.parent >= 0)[:, None]
    assert (diffs != 0).sum() * 10 < (A[rows.points] != 0).sum()


def test_auto_runs_milp_on_a_gpt_and_keeps_the_faster_plan():
    prof = gpt_like(8)
    ctx = PlanningContext(prof)
    n_vars, n_points = auto.milp_cells(ctx)
    assert n_vars * n_points <= auto.BOTH_MAX_CELLS
    budget = int(0.5 * prof.peak_bytes)
    p = plan_for_budget(prof, budget=budget)
    c = plan_for_budget(prof, budget=budget, solver="chain")
    assert p.solver == "milp" and "faster" in p.notes[0]
    assert p.recompute_s < c.recompute_s
    assert simulate(prof, p).peak_bytes <= budget
    # sub-module regions ("layers.k.attn", ...): some region is inside a block
    assert any(r.modules[0].count(".") >= 2 for r in p.regions)


def test_outputs_that_escape_their_region_are_never_saveable():
    # A block's final residual add feeds the next block: caching it under selective
    # checkpointing would hold it until the block is recomputed (measured: +2 MiB on the zoo
    # GPT over the prediction), so no candidate offers it.
    prof = gpt_like(2)
    ctx = PlanningContext(prof)
    cands = ctx.region_candidates()
    assert cands
    for c in cands:
        last = c.model.b
        for i in (ch.op for ch in c.choices):
            for t in prof.ops[i].outputs:
                use = prof.storages[t.storage].last_forward_use
                assert use is not None and use <= last, (c.keys.get(i), use, last)
    block = ctx.candidate(("layers.0",))
    assert block is not None
    add_keys = [k for i, k in block.keys.items() if k.startswith("aten.add.Tensor")]
    saveable_keys = {block.keys[ch.op] for ch in block.choices}
    assert add_keys and add_keys[-1] not in saveable_keys
