"""fit: profile, plan and apply in one call; re-fitting re-plans the plain model."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit import zoo
from memfit.api import fit
from memfit.errors import InfeasibleBudget
from memfit.profiling.tracer import profile


@pytest.fixture()
def gpt_and_inputs():
    # activations dominate at this size, so budgets down to about half the plain peak fit
    model = zoo.gpt(n_layer=3, d_model=32, n_head=2, seq_len=32, vocab_size=64)
    return model, zoo.example_inputs(model, batch=4)


def test_fit_returns_the_same_model_planned(gpt_and_inputs):
    model, x = gpt_and_inputs
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out = fit(model, x, budget=0.7)
    assert out is model
    plan = model.memfit_plan
    assert isinstance(plan, memfit.Plan) and plan.regions
    assert plan.budget_bytes == int(0.7 * plan.plain_peak_bytes)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.profile_signature == profile(zoo.gpt(n_layer=3, d_model=32, n_head=2, seq_len=32, vocab_size=64),
                                             x, repeats=1).signature
    # weights and buffers untouched, state_dict keys unchanged
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_refit_replans_the_plain_model(gpt_and_inputs):
    model, x = gpt_and_inputs
    fit(model, x, budget=0.7)
    first = model.memfit_plan
    fit(model, x, budget="min")
    second = model.memfit_plan
    assert second is not first
    assert second.predicted_peak_bytes < first.predicted_peak_bytes
    # the second profile saw the plain model: same plain peak and op signature as the first
    assert second.plain_peak_bytes == first.plain_peak_bytes
    assert second.profile_signature == first.profile_signature
    # back to 70%: profiled plain again (a profile of the planned model would see the
    # recomputation and a lower peak), so the budget is 70% of the same plain peak
    fit(model, x, budget=0.7)
    third = model.memfit_plan
    assert third.plain_peak_bytes == first.plain_peak_bytes
    assert third.budget_bytes == first.budget_bytes
    assert third.predicted_peak_bytes <= third.budget_bytes


def test_fit_with_an_infeasible_budget_keeps_the_old_plan(gpt_and_inputs):
    model, x = gpt_and_inputs
    fit(model, x, budget=0.7)
    old = model.memfit_plan
    with pytest.raises(InfeasibleBudget) as e:
        fit(model, x, budget=1000)
    assert e.value.budget_bytes == 1000
    assert e.value.min_feasible_bytes > 1000
    assert model.memfit_plan is old


def test_fit_then_verify_is_bitwise(gpt_and_inputs):
    model, x = gpt_and_inputs
    report = memfit.verify(memfit.fit(model, x, budget=0.6), x)
    assert report.bitwise and report.max_abs_diff == 0.0, str(report)
    assert report.peak_bytes < report.plain_peak_bytes


def test_fit_rejects_a_non_module():
    with pytest.raises(TypeError, match="nn.Module, got function"):
        fit(lambda x: x, torch.ones(1), budget=0.5)


def test_fit_is_public():
    assert memfit.fit is fit
