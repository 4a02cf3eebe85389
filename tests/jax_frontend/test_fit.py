"""memfit.jax.fit: planned steps whose gradients equal plain jax.value_and_grad's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memfit.errors import InfeasibleBudget
from memfit.jax.fit import fit, plain_step

from .models_tiny import MODELS

BUDGETS = [0.5, "min"]  # 0.7 and 0.3 too: benchmarks/jax_policies.py (CI time)


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    loss_fn, params, batch, aux = MODELS[request.param]()
    ref = plain_step(loss_fn, has_aux=aux)(params, batch)
    return request.param, loss_fn, params, batch, aux, ref


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree)


@pytest.mark.slow  # about 10-40 s each on 2 cores: XLA compiles and the MILP searches
@pytest.mark.parametrize("budget", BUDGETS, ids=str)
def test_planned_step_is_bitwise_plain(model, budget):
    """Unfenced (JAX's own jax.checkpoint): bitwise plain."""
    name, loss_fn, params, batch, aux, ref = model
    try:
        step = fit(loss_fn, params, batch, budget=budget, has_aux=aux, time_limit_s=2.0, fenced=False)
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
    same = [bool(jnp.array_equal(a, b)) for a, b in zip(got, want, strict=True)]
    if not all(same):
        # NOTE [bitwise on XLA CPU] in docs/jax.md: a region that is a LayerNorm alone
        # changes how XLA CPU fuses its reductions: 1 ulp (float32) differences
        alone = [r.name for r in p.regions if r.name.rsplit(".", 1)[-1].startswith("ln")]
        assert alone, f"gradients differ with regions {[r.name for r in p.regions]}"
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=2.5e-7)


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


# NOTE [a fenced recompute]: the fenced backward's gradients differ from plain by a few units
# in the last place; stated bound 2^-18 of the largest gradient (measured: 1.2e-8 of 0.033 on
# the conv net, 6e-8 of 0.5-scale leaves on the GPT: 2^-21 to 2^-23)
FENCED_REL = 2.0**-18
# XLA CPU's reported peak (temp + output) of the fenced plans on the tiny models, measured:
# GPT 0.755 / 0.858 / 0.927 of the budget at 0.7 / 0.5 / "min"; the conv net 0.953 at 0.7
# and 1.172 at "min" (its smallest plan: XLA keeps more around the convolutions than the
# jaxpr-level model says; stated in docs/jax.md)
XLA_OVER_BUDGET = {("gpt", 0.7): 1.05, ("gpt", "min"): 1.05, ("conv3d", 0.7): 1.05, ("conv3d", "min"): 1.20}


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.7, "min"], ids=str)
def test_fenced_plan_peaks_as_planned_on_xla_cpu(model, budget):
    name, loss_fn, params, batch, aux, ref = model
    step = fit(loss_fn, params, batch, budget=budget, has_aux=aux, time_limit_s=2.0, fenced=True)
    assert step.fenced and all(r.fenced for r in step.regions)
    plain = _xla_peak(plain_step(loss_fn, has_aux=aux).lower(params, batch))
    peak = _xla_peak(step.lower(params, batch))
    # below the plain step's XLA peak, and within the stated factor of the budget
    assert peak < plain, (peak, plain)
    assert peak <= XLA_OVER_BUDGET[(name, budget)] * step.plan.budget_bytes, (peak, step.plan.budget_bytes)
    got, want = _leaves(step(params, batch)), _leaves(ref)
    scale = max(float(jnp.abs(b).max()) for b in want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=FENCED_REL * scale)
