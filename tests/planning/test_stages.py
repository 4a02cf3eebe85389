"""A pipeline stage's plan (NOTE [pipeline stage memory model]) on hand-made profiles."""

from __future__ import annotations

import pytest
from profile_builders import chain_profile, residual_block

from memfit.errors import InfeasibleBudget
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate
from memfit.planning.stages import held_bytes, plan_stage, stage_candidates, stage_peak


@pytest.fixture(scope="module")
def chain6():
    return chain_profile([residual_block([256, 256], param_bytes=128) for _ in range(6)],
                         head_param_bytes=128)


def test_held_bytes_are_the_live_bytes_at_the_end_of_forward(chain6):
    none = plan_for_budget(chain6, budget=chain6.peak_bytes, solver="none")
    assert held_bytes(chain6, simulate(chain6, none)) == chain6.live_bytes[chain6.n_forward - 1]


@pytest.mark.parametrize("k", [1, 2, 4], ids=lambda k: f"in_flight={k}")
def test_stage_peak_is_k_minus_one_helds_plus_one_step(chain6, k):
    p = plan_for_budget(chain6, budget=0.7)
    sim = simulate(chain6, p)
    sp = stage_peak(chain6, p, k)
    assert sp.step_peak_bytes == sim.peak_bytes == p.predicted_peak_bytes
    assert sp.peak_bytes == (k - 1) * held_bytes(chain6, sim) + sim.peak_bytes


def test_a_stage_holding_fewer_micro_batches_never_recomputes_more(chain6):
    cands = stage_candidates(chain6)
    cap = min(stage_peak(chain6, c, 4).peak_bytes for c in cands) + 200  # just feasible holding 4
    plans = {k: plan_stage(chain6, budget=cap, in_flight=k, candidates=cands) for k in (1, 2, 4)}
    for k, p in plans.items():
        info = p.extra["pipeline"]
        assert info["in_flight"] == k and info["stage_budget_bytes"] == cap
        assert info["stage_peak_bytes"] == stage_peak(chain6, p, k).peak_bytes <= cap
    assert plans[1].recompute_s <= plans[2].recompute_s <= plans[4].recompute_s
    assert plans[1].recompute_s < plans[4].recompute_s  # k=1 needs far less here
    # the fastest candidate that fits: none cheaper fits
    for k, p in plans.items():
        assert all(c.recompute_s >= p.recompute_s for c in cands
                   if stage_peak(chain6, c, k).peak_bytes <= cap)


def test_a_budget_the_plain_stage_fits_needs_no_plan(chain6):
    p = plan_stage(chain6, budget=1.0, in_flight=3)
    assert p.regions == () and p.extra["pipeline"]["stage_peak_bytes"] == p.extra["pipeline"]["stage_budget_bytes"]


def test_an_infeasible_stage_budget_names_the_smallest_stage_peak(chain6):
    cands = stage_candidates(chain6)
    low = min(stage_peak(chain6, c, 4).peak_bytes for c in cands)
    with pytest.raises(InfeasibleBudget, match="holding 4 micro-batches") as e:
        plan_stage(chain6, budget=low - 1, in_flight=4, candidates=cands)
    assert e.value.min_feasible_bytes == low and e.value.budget_bytes == low - 1
    assert plan_stage(chain6, budget=low, in_flight=4, candidates=cands).extra["pipeline"]["stage_peak_bytes"] == low


@pytest.mark.parametrize("bad", [0, -1, 1.5, True], ids=repr)
def test_in_flight_must_be_a_positive_int(chain6, bad):
    with pytest.raises(ValueError, match="in_flight must be an int >= 1"):
        plan_stage(chain6, budget=0.5, in_flight=bad)
