"""Solvers against brute force on random small chains and DAGs, and their contracts."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.planning.candidates import PlanningContext
from memfit.planning.plan import Plan
from memfit.planning.simulate import simulate
from memfit.planning.solvers import Infeasible, brute, chain, get_solver, greedy, milp
from memfit.planning.testing import (
    chain_profile,
    decoder_profile,
    random_chain,
    random_unet,
    residual_block,
)


def _budgets(lo: int, hi: int) -> list[int]:
    return sorted({lo - 1, lo, lo + 1, (2 * lo + hi) // 3, (lo + 2 * hi) // 3, hi})


def _result(solve, ctx, budget, **kw):
    try:
        sol = solve(ctx, budget, **kw)
    except Infeasible as e:
        return ("infeasible", e.min_bytes), None
    return sol.recompute_s, sol


def _sim_peak(prof, sol):
    return simulate(prof, Plan(sol.regions, 0, 0.0, None, "t", "")).peak_bytes


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_chain_equals_brute_on_random_chains(seed):
    prof = random_chain(random.Random(seed), max_blocks=4, max_ops=2)
    ctx = PlanningContext(prof)
    if not ctx.chains:
        return
    lo = brute.min_peak(ctx, "chain")
    assert chain.min_peak(ctx) == lo
    for budget in _budgets(lo, prof.peak_bytes):
        t_chain, sol = _result(chain.solve, ctx, budget)
        t_brute, _ = _result(brute.solve, ctx, budget, mode="chain")
        assert t_chain == t_brute  # dyadic op times: float sums are exact
        if sol is not None:
            assert _sim_peak(prof, sol) <= budget


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["chain", "unet"]))
def test_milp_equals_brute_on_random_graphs(seed, kind):
    rng = random.Random(seed)
    prof = random_chain(rng, max_blocks=3, max_ops=3) if kind == "chain" else random_unet(rng, max_levels=2)
    ctx = PlanningContext(prof)
    lo = brute.min_peak(ctx, "regions")
    assert milp.min_peak(ctx)[0] == lo
    for budget in _budgets(lo, prof.peak_bytes):
        t_milp, sol = _result(milp.solve, ctx, budget)
        t_brute, _ = _result(brute.solve, ctx, budget, mode="regions")
        assert t_milp == t_brute
        if sol is not None:
            assert _sim_peak(prof, sol) <= budget


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_peak_never_rises_as_budget_falls(seed):
    prof = random_chain(random.Random(seed), max_blocks=5, max_ops=3)
    ctx = PlanningContext(prof)
    if not ctx.chains:
        return
    lo = chain.min_peak(ctx)
    last_peak, last_t = None, None
    for budget in range(prof.peak_bytes, lo - 1, -max(1, (prof.peak_bytes - lo) // 12)):
        sol = chain.solve(ctx, budget)
        if last_peak is not None:
            assert sol.recompute_s >= last_t  # less memory never costs less time
        assert sol.predicted_peak_bytes <= budget
        last_peak, last_t = sol.predicted_peak_bytes, sol.recompute_s


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["chain", "unet"]))
def test_greedy_plans_fit(seed, kind):
    rng = random.Random(seed)
    prof = random_chain(rng) if kind == "chain" else random_unet(rng)
    ctx = PlanningContext(prof)
    lo = milp.min_peak(ctx)[0]
    for budget in _budgets(lo, prof.peak_bytes):
        _, sol = _result(greedy.solve, ctx, budget)
        if sol is not None:
            assert _sim_peak(prof, sol) <= budget
            t_opt, _ = _result(milp.solve, ctx, budget)
            assert sol.recompute_s >= t_opt


def test_late_blocks_kept_when_gradients_dominate():
    # parameter gradients pile up towards the end of backward, so the smallest peak is reached
    # there; the activations of late blocks are freed early in backward, before the gradients
    # exist, so keeping them is free: the least-time plan at the smallest budget keeps them
    blocks = [residual_block([256, 256], param_bytes=128) for _ in range(6)]
    prof = chain_profile(blocks, head_param_bytes=128)
    ctx = PlanningContext(prof)
    lo = chain.min_peak(ctx)
    assert lo == 1472 and prof.peak_bytes == 2432
    sol = chain.solve(ctx, lo)
    assert [r.modules for r in sol.regions] == [(f"layers.{k}",) for k in range(4)]
    assert _sim_peak(prof, sol) == lo
    every = get_solver("every_block")(ctx, lo)
    assert simulate(prof, Plan(every.regions, 0, 0.0, None, "t", "")).recompute_s > sol.recompute_s


def test_large_blocks_keep_recompute_all_and_beat_baselines():
    # decoder blocks have more than ENUM_LIMIT saveable ops (the knapsack-frontier path)
    prof = decoder_profile(4, param_bytes=512)
    ctx = PlanningContext(prof)
    assert max(len(ctx.candidate((b,)).saveable) for b in ctx.chains[0].blocks) > chain.ENUM_LIMIT
    for name in ("every_block", "save_matmuls"):
        base = get_solver(name)(ctx, 0)
        sim = simulate(prof, Plan(base.regions, 0, 0.0, None, "t", ""))
        sol = chain.solve(ctx, sim.peak_bytes)
        assert _sim_peak(prof, sol) <= sim.peak_bytes
        assert sol.recompute_s <= sim.recompute_s


def test_unknown_solver_lists_known():
    with pytest.raises(ValueError, match="chain, milp, greedy"):
        get_solver("fastest")
