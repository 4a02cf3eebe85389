"""Solver time limits: ``auto`` always returns a plan or ``InfeasibleBudget``; only an explicitly
chosen ``milp`` lets its timeout reach the user, as a ``SolverTimeout`` saying what to do."""

from __future__ import annotations

import pytest
from profile_builders import chain_profile, decoder_profile, residual_block, unet_profile

from memfit.errors import InfeasibleBudget, MemfitError, SolverTimeout
from memfit.planning.candidates import PlanningContext
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate
from memfit.planning.solvers import milp

# HiGHS checks its clock before it finds any incumbent: a limit of 1 ns is a MILP that always
# runs out of time, whatever the machine's load.
TINY_S = 1e-9

PROFILES = {
    # chain share below auto.CHAIN_SHARE: auto's MILP-only path, greedy takes over
    "unet": lambda: unet_profile([(256, 512), (128, 256), (64, 128)]),
    # chains: auto runs chain and milp, keeps chain's plan when milp has none
    "decoder": lambda: decoder_profile(4),
    "chain6": lambda: chain_profile([residual_block([256, 256], param_bytes=128) for _ in range(6)],
                                    head_param_bytes=128),
}
FALLBACK = {"unet": "greedy", "decoder": "chain", "chain6": "chain"}


@pytest.fixture(scope="module", params=list(PROFILES), ids=list(PROFILES))
def case(request):
    prof = PROFILES[request.param]()
    lo = milp.min_peak(PlanningContext(prof))[0]
    return request.param, prof, (lo + prof.peak_bytes) // 2


def test_auto_returns_a_fitting_plan_when_milp_runs_out_of_time(case):
    name, prof, budget = case
    p = plan_for_budget(prof, budget=budget, solver="auto", time_limit_s=TINY_S)
    assert p.solver == FALLBACK[name]
    assert p.predicted_peak_bytes == simulate(prof, p).peak_bytes <= budget
    assert len(p.regions) > 0
    assert "milp found no plan within its time limit of 1e-09 s" in p.notes[0]


def test_explicit_milp_timeout_is_a_memfit_error_saying_what_to_do(case):
    _, prof, budget = case
    with pytest.raises(SolverTimeout) as info:
        plan_for_budget(prof, budget=budget, solver="milp", time_limit_s=TINY_S)
    e = info.value
    assert isinstance(e, MemfitError) and isinstance(e, TimeoutError)
    assert e.solver == "milp" and e.time_limit_s == TINY_S
    msg = str(e)
    assert "time limit of 1e-09 s" in msg and "time_limit_s=" in msg and "solver='auto'" in msg


def test_auto_reports_greedys_smaller_minimum_when_milp_runs_out_of_time():
    prof = PROFILES["unet"]()
    with pytest.raises(InfeasibleBudget) as info:
        plan_for_budget(prof, budget=1, solver="auto", time_limit_s=TINY_S)
    low = info.value.min_feasible_bytes
    assert low < prof.peak_bytes  # a real plan's peak, not the un-checkpointed one
    p = plan_for_budget(prof, budget=low, solver="auto", time_limit_s=TINY_S)  # and a plan reaches it
    assert p.predicted_peak_bytes == simulate(prof, p).peak_bytes <= low
