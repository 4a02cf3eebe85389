"""The planner at depth: the peak floor, suffix peaks and the state cap (NOTE [peak floor] in
memfit.planning.arrays, NOTE [suffix peaks] and NOTE [state cap] in
memfit.planning.solvers.chain). No wall-clock assertion here: benchmarks/published.py times
the planner; these tests check what makes it fast without changing its plans."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profile_builders import StepBuilder, decoder_profile, random_chain, random_unet, residual_block
from profile_builders import _run_block as run_block

from memfit.errors import InfeasibleBudget
from memfit.planning.candidates import PlanningContext
from memfit.planning.plan import Plan
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate
from memfit.planning.solvers import brute, chain


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["chain", "unet"]), ws=st.booleans())
def test_no_plan_peaks_below_the_floor(seed, kind, ws):
    rng = random.Random(seed)
    prof = (random_chain(rng, max_blocks=4, max_ops=2, workspace=ws) if kind == "chain"
            else random_unet(rng, max_levels=2, workspace=ws))
    ctx = PlanningContext(prof)
    floor = ctx.arrays.floor_peak()
    assert floor <= prof.peak_bytes
    lm, plans = brute.enumerate_plans(ctx, "regions")
    for choices, peak, _ in plans:
        assert peak >= floor
        regions = tuple(lm.cands[i].region(ops) for i, ops in choices)
        assert simulate(prof, Plan(regions, 0, 0.0, None, "t", "")).peak_bytes >= floor


def _gradient_bound_chain():
    # an embedding table larger than every activation: its gradient, made by the step's last
    # op, sets the peak there
    b = StepBuilder("gradient_bound")
    tokens = b.input(16)
    with b.module("embed", "Embedding"):
        w = b.param(1 << 16)
        (x,) = b.op("aten.embedding.default", [tokens, w], 64, saves=[tokens], params=[w])
    b.container("layers", "ModuleList")
    for k in range(6):
        with b.module(f"layers.{k}", "Block", parent="layers"):
            x = run_block(b, x, residual_block([256, 256], param_bytes=4096))
    with b.module("head", "Linear"):
        (logits,) = b.op("aten.mm.default", [x], 64, saves=[x])
    b.op("aten.nll_loss.default", [logits], 4, saves=[logits], keep_until_backward=True)
    return b.build()


def test_the_floor_answers_without_a_search_when_gradients_set_the_peak(monkeypatch):
    prof = _gradient_bound_chain()
    ctx = PlanningContext(prof)
    assert ctx.arrays.floor_peak() == prof.peak_bytes
    assert chain.min_peak(ctx) == prof.peak_bytes  # the search agrees

    def no_search(*a, **k):
        raise AssertionError("the chain model was built")

    monkeypatch.setattr(chain.ChainModel, "__init__", no_search)
    with pytest.raises(InfeasibleBudget, match="what no plan drops") as e:
        plan_for_budget(prof, budget=0.6)
    assert e.value.min_feasible_bytes == prof.peak_bytes
    smallest = plan_for_budget(prof, budget="min")
    assert smallest.regions == () and smallest.predicted_peak_bytes == prof.peak_bytes


def test_suffix_peaks_give_the_chain_minimum_of_a_state_dp():
    # the least peak read off R[0] is reached by the plan its choices trace, and a budget one
    # byte below it has no plan
    prof = decoder_profile(12)
    ctx = PlanningContext(prof)
    model = chain.chain_model(ctx, ctx.chains[0])
    chosen, peak, _ = chain.run_dp(model, None)
    assert peak == max(model.outside_peak, chain.suffix_peaks(model)[0][0])
    fit = chain.solve(ctx, peak)
    assert fit.predicted_peak_bytes <= peak
    with pytest.raises(chain.Infeasible) as e:
        chain.solve(ctx, peak - 1)
    assert e.value.min_bytes == peak
    assert len(chosen) >= 1


def test_min_is_one_state_search_and_the_fastest_plan_at_its_peak(monkeypatch):
    # "min": the floor check (budget 1) and one search at the least peak; no re-solve at the
    # plan's simulated peak, which could find no faster plan (a subset of the same plans)
    prof = decoder_profile(12)
    searched: list[int | None] = []
    real = chain.run_dp

    def counting(model, budget_bytes):
        searched.append(budget_bytes)
        return real(model, budget_bytes)

    monkeypatch.setattr(chain, "run_dp", counting)
    smallest = plan_for_budget(prof, budget="min", solver="chain")
    assert searched == [1, smallest.predicted_peak_bytes]
    monkeypatch.setattr(chain, "run_dp", real)
    at_peak = plan_for_budget(prof, budget=smallest.predicted_peak_bytes, solver="chain")
    assert at_peak.regions == smallest.regions
    assert at_peak.recompute_s == smallest.recompute_s


@pytest.mark.parametrize("frac", [0.6, 0.7, 0.85])
def test_the_state_cap_keeps_plans_that_fit_and_close_to_the_optimum(monkeypatch, frac):
    prof = decoder_profile(24)
    exact = plan_for_budget(prof, budget=frac)
    assert not any("NOTE [state cap]" in n for n in exact.notes)
    monkeypatch.setattr(chain, "STATE_CAP", 256)
    capped = plan_for_budget(prof, budget=frac)
    assert capped.predicted_peak_bytes <= capped.budget_bytes == exact.budget_bytes
    assert capped.recompute_s >= exact.recompute_s
    # 256 bands of kept bytes (this decoder's frontier reaches some 1,500 states) lose little:
    # measured 0.2-3.6% over the optimum at these budgets; 5% allowed
    assert capped.recompute_s <= exact.recompute_s * 1.05
    if capped.recompute_s > exact.recompute_s:
        assert any("NOTE [state cap]" in n for n in capped.notes)


def test_plans_of_chains_under_the_cap_are_exact(monkeypatch):
    # 32 decoder layers never reach the cap: the plan equals the uncapped DP's
    prof = decoder_profile(32)
    default = [plan_for_budget(prof, budget=f) for f in (0.6, 0.8)]
    monkeypatch.setattr(chain, "STATE_CAP", 10**9)
    exact = [plan_for_budget(prof, budget=f) for f in (0.6, 0.8)]
    for d, e in zip(default, exact, strict=True):
        assert d.regions == e.regions and d.recompute_s == e.recompute_s


@pytest.mark.slow
def test_a_126_layer_decoder_plans_within_the_state_cap(monkeypatch):
    # the 405B shape's depth, built without a model: every boundary keeps at most STATE_CAP
    # states, and the chain model is built once for all the re-solves of one plan call
    prof = decoder_profile(126)
    built = []
    real_init = chain.ChainModel.__init__

    def counting(self, *a, **k):
        built.append(1)
        real_init(self, *a, **k)

    monkeypatch.setattr(chain.ChainModel, "__init__", counting)
    over, capped = [], []
    real_prune = chain._prune

    def watched(*a, **k):
        out = real_prune(*a, **k)
        if k.get("cap") is not None:
            capped.append(out[0].size)
        elif out[0].size > chain.STATE_CAP:
            over.append(out[0].size)
        return out

    monkeypatch.setattr(chain, "_prune", watched)
    p = plan_for_budget(prof, budget="min")
    assert p.solver == "chain" and p.predicted_peak_bytes == p.budget_bytes
    assert len(built) == 1
    assert len(capped) == len(over) and max(capped, default=0) <= chain.STATE_CAP + 1
    q = plan_for_budget(prof, budget=0.7)
    assert q.predicted_peak_bytes <= q.budget_bytes
    assert len(built) == 2  # one per plan call
