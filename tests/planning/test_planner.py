"""plan_for_budget(): budgets, solver choice, InfeasibleBudget, Plan fields and JSON, and speed."""

from __future__ import annotations

import pytest
from profile_builders import chain_profile, decoder_profile, residual_block, unet_profile

from memfit.errors import InfeasibleBudget
from memfit.planning.candidates import PlanningContext
from memfit.planning.plan import Plan
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate
from memfit.planning.solvers import chain, milp


@pytest.fixture(scope="module")
def chain6():
    return chain_profile([residual_block([256, 256], param_bytes=128) for _ in range(6)],
                         head_param_bytes=128)


@pytest.mark.parametrize("solver", ["auto", "chain", "milp", "greedy"])
def test_plan_fits_and_fields_come_from_simulate(chain6, solver):
    p = plan_for_budget(chain6, budget=0.7, solver=solver)
    sim = simulate(chain6, p)
    assert p.budget_bytes == int(0.7 * chain6.peak_bytes)
    assert p.predicted_peak_bytes == sim.peak_bytes <= p.budget_bytes
    assert p.recompute_s == sim.recompute_s
    assert [r.recompute_s for r in p.regions] == list(sim.region_recompute_s)
    assert [r.saved_bytes for r in p.regions] == list(sim.region_saved_bytes)
    assert p.plain_peak_bytes == chain6.peak_bytes and p.plain_step_s == chain6.step_time_s
    assert p.profile_signature == chain6.signature and p.model == "chain"
    assert p.extra["module_types"] == {m: "Block" for r in p.regions for m in r.modules}
    assert p.solver == ("chain" if solver == "auto" else solver)


def test_brute_matches_chain_on_a_tiny_chain():
    prof = chain_profile([residual_block([256, 256], param_bytes=128) for _ in range(3)])
    for frac in (0.75, 0.85, 0.95):
        b, c = plan_for_budget(prof, budget=frac, solver="brute"), plan_for_budget(prof, budget=frac, solver="chain")
        assert b.recompute_s == c.recompute_s and b.predicted_peak_bytes <= b.budget_bytes


def test_auto_picks_chain_or_milp(chain6):
    assert "auto: chain" in plan_for_budget(chain6, budget=0.7).notes[0]
    unet = unet_profile([(256, 512), (128, 256), (64, 128)])
    lo = milp.min_peak(PlanningContext(unet))[0]
    p = plan_for_budget(unet, budget=(lo + unet.peak_bytes) // 2)
    assert p.solver == "milp" and p.notes[0].startswith("auto: milp") and p.regions


@pytest.mark.parametrize("solver", ["auto", "chain", "milp"])
def test_min_budget_is_the_fastest_smallest_peak_plan(chain6, solver):
    p = plan_for_budget(chain6, budget="min", solver=solver)
    lo = chain.min_peak(PlanningContext(chain6))
    assert p.predicted_peak_bytes == p.budget_bytes == lo
    assert p.recompute_s == plan_for_budget(chain6, budget=lo, solver=solver).recompute_s
    with pytest.raises(InfeasibleBudget):
        plan_for_budget(chain6, budget=lo - 1, solver=solver)


def test_min_budget_of_a_baseline_is_its_own_plan(chain6):
    p = plan_for_budget(chain6, budget="min", solver="every_block")
    assert p.regions == plan_for_budget(chain6, budget=1.0, solver="every_block").regions
    # its one plan's peak is the smallest it reaches: the budget, as for a searching solver
    assert p.budget_bytes == p.predicted_peak_bytes < chain6.peak_bytes


def test_plan_takes_a_profile_not_a_module():
    import torch

    with pytest.raises(TypeError, match=r"plan takes a memfit.Profile, got Linear; profile the step first"):
        plan_for_budget(torch.nn.Linear(2, 2), budget=0.5)  # type: ignore[arg-type]


def test_infeasible_budget_names_the_minimum(chain6):
    lo = chain.min_peak(PlanningContext(chain6))
    assert plan_for_budget(chain6, budget=lo).predicted_peak_bytes == lo
    with pytest.raises(InfeasibleBudget) as info:
        plan_for_budget(chain6, budget=lo - 1)
    assert info.value.min_feasible_bytes == lo == 1472
    assert info.value.budget_bytes == lo - 1
    assert "1472 bytes" in str(info.value) and "1.44 KiB" in str(info.value)


def test_budget_above_plain_peak_plans_nothing(chain6):
    p = plan_for_budget(chain6, budget="100%")
    assert p.regions == () and p.predicted_peak_bytes == chain6.peak_bytes and p.recompute_s == 0.0


@pytest.mark.parametrize("solver,n_regions", [("none", 0), ("every_block", 6), ("sqrt", 2),
                                              ("save_matmuls", 6)])
def test_baselines(chain6, solver, n_regions):
    p = plan_for_budget(chain6, budget="10%", solver=solver)
    assert len(p.regions) == n_regions
    assert p.notes[-1].startswith("exceeds the budget")  # 10% is below any plan's peak
    if solver == "save_matmuls":
        assert all(r.save == ("aten.mm.default#0",) for r in p.regions)
    if solver == "sqrt":
        assert [r.modules for r in p.regions] == [("layers.0", "layers.1", "layers.2"),
                                                  ("layers.3", "layers.4", "layers.5")]


def test_unknown_solver(chain6):
    with pytest.raises(ValueError, match="unknown solver 'best'; choose one of auto, chain"):
        plan_for_budget(chain6, budget=0.5, solver="best")


def test_plan_json_round_trip(chain6, tmp_path):
    p = plan_for_budget(chain6, budget=0.7)
    p.save(tmp_path / "plan.json")
    q = Plan.load(tmp_path / "plan.json")
    assert q == p and q.extra == p.extra and q.notes == p.notes
    assert simulate(chain6, q).peak_bytes == p.predicted_peak_bytes


@pytest.mark.slow
def test_96_block_decoder_plans_with_the_chain_solver():
    """Its planning time is a benchmark (``python -m benchmarks.planner_speed``: 5 s target),
    not asserted here: a unit test's wall clock moves with the machine's load."""
    prof = decoder_profile(96, param_bytes=512)  # 2,691 forward ops, 28 per block
    assert len(prof.forward_ops) > 96 * 25
    p = plan_for_budget(prof, budget=0.4)
    assert p.solver == "chain" and p.predicted_peak_bytes <= p.budget_bytes
