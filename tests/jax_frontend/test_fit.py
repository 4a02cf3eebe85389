"""memfit.jax.fit: planned steps whose gradients equal plain jax.value_and_grad's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memfit.errors import InfeasibleBudget
from memfit.jax.fit import PlannedStep, fit, plain_step

from .models_tiny import MODELS

BUDGETS = [0.5, "min"]  # 0.7 and 0.3 too: benchmarks/jax_policies.py (CI time)
# What the recompute changes in the gradients: XLA fuses a recomputed reduction (a norm's
# statistics) apart from the forward's and may round it differently, so a plan that really
# recomputes is not bitwise on XLA CPU; stated bound 2^-18 of the largest gradient.
RECOMPUTED_REL = 2.0**-18


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    loss_fn, params, batch, aux = MODELS[request.param]()
    ref = plain_step(loss_fn, has_aux=aux)(params, batch)
    return request.param, loss_fn, params, batch, aux, ref


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree)


@pytest.mark.slow  # about 10-40 s each on 2 cores: XLA compiles and the MILP searches
@pytest.mark.parametrize("budget", BUDGETS, ids=str)
def test_planned_step_gradients_match_plain(model, budget):
    name, loss_fn, params, batch, aux, ref = model
    try:
        step = fit(loss_fn, params, batch, budget=budget, has_aux=aux, time_limit_s=2.0)
    except InfeasibleBudget as e:
        # tiny models floor the peak high (the conv net's first stage and gradients near
        # 50%, the tiny GPT's embedding and head near 33%): refused with the floor named
        assert budget != "min" and e.min_feasible_bytes > e.budget_bytes, e
        return
    p = step.plan
    assert p.regions, "a budget below the plain peak checkpoints something"
    assert p.predicted_peak_bytes <= p.budget_bytes
    out = step(params, batch)
    got, want = _leaves(out), _leaves(ref)
    assert len(got) == len(want)
    # NOTE [bitwise on XLA CPU] in docs/jax.md: bitwise where XLA rounds the recomputed
    # reductions as the forward's, else within RECOMPUTED_REL of the largest gradient
    scale = max(float(jnp.abs(b).max()) for b in want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=RECOMPUTED_REL * scale)


@pytest.mark.slow
def test_an_infeasible_budget_names_the_smallest_peak(model):
    name, loss_fn, params, batch, aux, _ = model
    with pytest.raises(InfeasibleBudget) as err:
        fit(loss_fn, params, batch, budget=0.01, has_aux=aux, time_limit_s=2.0)
    smallest = fit(loss_fn, params, batch, budget="min", has_aux=aux, time_limit_s=2.0)
    assert err.value.min_feasible_bytes == smallest.plan.predicted_peak_bytes


def test_offload_is_refused_in_one_line():
    with pytest.raises(ValueError, match="does not offload yet"):
        fit(lambda p, b: jnp.sum(p * b), jnp.ones(3), jnp.ones(3), budget=0.5, offload=True)


def _xla_peak(lowered) -> int:
    m = lowered.compile().memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


# XLA CPU's reported peak (temp + output) of the planned steps on the tiny models, against
# the plan's budget (NOTE [barriers kept on XLA CPU]); measured: GPT 0.747 / 0.918 of the
# budget at 0.7 / "min", the conv net 0.936 / 1.117 (its smallest plan: XLA holds more around
# the convolutions' backward than the jaxpr-level model counts; docs/jax.md)
XLA_OVER_BUDGET = {("gpt", 0.7): 1.05, ("gpt", "min"): 1.05, ("conv3d", 0.7): 1.05, ("conv3d", "min"): 1.15}


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.7, "min"], ids=str)
def test_planned_step_peaks_as_planned_on_xla_cpu(model, budget):
    """On the CPU backend the step compiles with jax.checkpoint's barriers kept: XLA's own
    peak is below plain's and within the budget; compiled as JAX compiles (barriers removed)
    the same plan's peak is not below plain's."""
    name, loss_fn, params, batch, aux, ref = model
    step = fit(loss_fn, params, batch, budget=budget, has_aux=aux, time_limit_s=2.0)
    assert step.keep_barriers
    plain = _xla_peak(plain_step(loss_fn, has_aux=aux).lower(params, batch))
    peak = _xla_peak(step.lower(params, batch))
    assert peak < plain, (peak, plain)
    assert peak <= XLA_OVER_BUDGET[(name, budget)] * step.plan.budget_bytes, (peak, step.plan.budget_bytes)
    bare = PlannedStep(step.program, step.plan, step.profile, has_aux=aux, keep_barriers=False)
    assert _xla_peak(bare.lower(params, batch)) >= plain
    got, want = _leaves(step(params, batch)), _leaves(ref)
    scale = max(float(jnp.abs(b).max()) for b in want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=RECOMPUTED_REL * scale)
