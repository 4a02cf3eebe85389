"""memfit.jax.fit: planned steps whose gradients equal plain jax.value_and_grad's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memfit.errors import InfeasibleBudget
from memfit.jax.fit import PlannedStep, fit, plain_step
from memfit.jax.measured import MIN_SLACK
from memfit.jax.verify import compare

from .models_tiny import MODELS
from .xla_counts import xla_flops, xla_peak

BUDGETS = [0.5, "min"]  # 0.7 and 0.3 too: benchmarks/jax_policies.py (CI time)


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    loss_fn, params, batch, aux = MODELS[request.param]()
    ref = plain_step(loss_fn, has_aux=aux)(params, batch)
    return request.param, loss_fn, params, batch, aux, ref


# The tests that ask for the same fit share it (``_fit``), on one xdist worker: conftest.py
# groups them by model and budget (``--dist loadgroup``; a "min" search compiles and runs some
# twenty plans, and three tests asked for it: CI time).
_FITS: dict[tuple, PlannedStep] = {}


def _fit(model, budget, **options) -> PlannedStep:
    """``fit`` of the model at ``budget``, once per worker for the same arguments."""
    name, loss_fn, params, batch, aux, _ = model
    key = (name, budget, tuple(sorted(options.items())))
    if key not in _FITS:
        _FITS[key] = fit(loss_fn, params, batch, budget=budget, has_aux=aux, time_limit_s=2.0, **options)
    return _FITS[key]


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree)


@pytest.mark.slow  # about 10-40 s each on 2 cores: XLA compiles and the MILP searches
@pytest.mark.parametrize("budget", BUDGETS, ids=str)
def test_planned_step_gradients_match_plain(model, budget):
    name, loss_fn, params, batch, aux, ref = model
    try:
        step = _fit(model, budget)
    except InfeasibleBudget as e:
        # tiny models floor the peak high (the conv net's first stage and gradients near
        # 50%, the tiny GPT's embedding and head near 33%): refused with the floor named
        assert budget != "min" and e.min_feasible_bytes > e.budget_bytes, e
        return
    p = step.plan
    assert p.regions, "a budget below the plain peak checkpoints something"
    # a budget in bytes is checked against XLA's peak (NOTE [budgets checked against XLA]);
    # "min" is the model's least peak
    assert step.xla_peak_bytes == xla_peak(step.lower(params, batch)) <= p.budget_bytes
    if budget == "min":  # the least XLA peak of the least-peak plan and JAX's policies
        bare = _fit(model, "min", rounds=0)
        assert bare.xla_peak_bytes is None and bare.plan.predicted_peak_bytes <= bare.plan.budget_bytes
        assert step.xla_peak_bytes == p.budget_bytes
        # of the exact plans (NOTE [JAX plans verified on the batch]): no higher than the
        # model's least-peak plan unless that one changes the result (the tiny GPT's: its
        # first block whole, 1.5e-8 on a LayerNorm scale, at 126,724 B against 170,612 B)
        if bare.verify(params, batch).bitwise:  # within MIN_SLACK of it, the least FLOPs
            assert step.xla_peak_bytes <= xla_peak(bare.lower(params, batch)) * (1 + MIN_SLACK)
    _assert_exact(step(params, batch), ref, name)


def _assert_exact(out, ref, name):
    """Every leaf (loss, aux, gradients) bitwise: ``fit`` returns a plan it ran against the
    plain step (NOTE [JAX plans verified on the batch])."""
    got, want = _leaves(out), _leaves(ref)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert jnp.array_equal(a, b), (name, float(jnp.abs(a - b).max()))


@pytest.mark.slow
def test_an_infeasible_budget_names_the_smallest_peak(model):
    """The smallest XLA peak of the least-peak plan and JAX's policies on every block (NOTE
    [budgets checked against XLA]), what ``"min"`` plans: a byte less is refused naming it;
    given it, the step plans and XLA's peak is within it (the benchmark conv net:
    nothing_saveable on every stage at 4,563,580 B, below the least-peak plan's 5,087,804)."""
    name, loss_fn, params, batch, aux, _ = model
    smallest = _fit(model, "min")
    least = smallest.plan.budget_bytes
    assert least == xla_peak(smallest.lower(params, batch))
    with pytest.raises(InfeasibleBudget) as err:
        fit(loss_fn, params, batch, budget=least - 1, has_aux=aux, time_limit_s=2.0, rounds=1)
    assert err.value.min_feasible_bytes == least
    named = fit(loss_fn, params, batch, budget=least, has_aux=aux, time_limit_s=2.0, rounds=1)
    assert named.xla_peak_bytes == xla_peak(named.lower(params, batch)) <= least
    assert named.verification.bitwise  # NOTE [JAX plans verified on the batch]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_at_a_jax_policys_peak_no_more_recompute(model, policy):
    """Given the XLA peak of JAX's policy on every block as its budget, memfit's step is
    within it and exact; where the policy's own step is exact, with no more recompute FLOPs
    (XLA's cost analysis). Where it is not (the tiny GPT's first block, the tiny conv net's
    last stage, rerun whole: NOTE [JAX plans verified on the batch]) memfit may pay more."""
    from benchmarks.jax_policies import _policy_step

    from memfit.jax.profiler import profile_program
    from memfit.jax.program import trace_program

    name, loss_fn, params, batch, aux, ref = model
    program = trace_program(loss_fn, params, batch)
    theirs = _policy_step(program, profile_program(program, has_aux=aux), policy, aux, keep_barriers=True)
    peak, flops = xla_peak(theirs.lower(params, batch)), xla_flops(theirs.lower(params, batch))
    try:
        mine = fit(loss_fn, params, batch, budget=peak, has_aux=aux, time_limit_s=2.0)
    except InfeasibleBudget as e:
        # below the tiny GPT's floor of gradients, or below its least exact step (its
        # policies' plans rerun the first block whole)
        assert e.min_feasible_bytes > peak and e.budget_bytes == peak
        return
    assert mine.xla_peak_bytes <= peak
    _assert_exact(mine(params, batch), ref, name)
    if compare(theirs(params, batch), ref).bitwise:
        assert xla_flops(mine.lower(params, batch)) <= flops


def test_offload_is_refused_in_one_line():
    with pytest.raises(ValueError, match="does not offload yet"):
        fit(lambda p, b: jnp.sum(p * b), jnp.ones(3), jnp.ones(3), budget=0.5, offload=True)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.7, "min"], ids=str)
def test_planned_step_peaks_as_planned_on_xla_cpu(model, budget):
    """On the CPU backend the step compiles with jax.checkpoint's barriers kept: XLA's own
    peak is below plain's and within the budget; compiled as JAX compiles (barriers removed)
    the same plan's peak is not below plain's."""
    name, loss_fn, params, batch, aux, ref = model
    step = _fit(model, budget)
    assert step.keep_barriers
    plain = xla_peak(plain_step(loss_fn, has_aux=aux).lower(params, batch))
    peak = xla_peak(step.lower(params, batch))
    assert peak < plain, (peak, plain)
    # checked against XLA's own report (NOTE [budgets checked against XLA]); "min": its least
    assert peak <= step.plan.budget_bytes, (peak, step.plan.budget_bytes)
    bare = PlannedStep(step.program, step.plan, step.profile, has_aux=aux, keep_barriers=False)
    assert xla_peak(bare.lower(params, batch)) >= plain
    _assert_exact(step(params, batch), ref, name)


@pytest.mark.slow
def test_rounds_spend_the_budget_xla_leaves_and_never_pass_it(model):
    """NOTE [budgets checked against XLA]: with rounds the step's XLA peak is within the
    budget and no further below it than the jaxpr-level plan's, at no more predicted
    recompute (measured on the benchmark GPT, 4 layers d=64: XLA at 0.744 of the budget
    without rounds, 0.987 with, +427 M -> +405 M FLOPs)."""
    name, loss_fn, params, batch, aux, _ = model
    bare = _fit(model, 0.7, rounds=0)
    step = _fit(model, 0.7)
    assert bare.xla_peak_bytes is None and step.plan.budget_bytes == bare.plan.budget_bytes
    before = xla_peak(bare.lower(params, batch))
    assert step.xla_peak_bytes <= step.plan.budget_bytes
    if before <= bare.plan.budget_bytes:  # the plain plan fitted: rounds only trade up
        assert before <= step.xla_peak_bytes
        assert step.plan.recompute_s <= bare.plan.recompute_s


def test_nested_policy_plans_cut_each_stage_after_its_convolutions():
    """NOTE [budgets checked against XLA]: beside JAX's policies, every child scope with its
    parts nested inside it; the parts are its chain's blocks, or its sub-modules cut after
    each that runs a convolution (the ReLU between two blocks is the stage's own code, in the
    segment ``bn0..conv1``). No compile: the plans as memfit simulates them."""
    from memfit.jax.measured import NESTED, NESTED_AT_DOTS, policy_plans
    from memfit.jax.profiler import profile_program
    from memfit.jax.program import trace_program
    from memfit.planning.simulate import simulate

    loss_fn, params, batch, aux = MODELS["conv3d"]()
    prof = profile_program(trace_program(loss_fn, params, batch), has_aux=aux)
    plans = {p.solver: p for p in policy_plans(prof, 0)}
    s = "ConvNet3D.stage_1"
    at_dots = [r.name for r in plans[NESTED_AT_DOTS].regions if r.name.startswith(s)]
    assert at_dots == [s, f"{s}.conv0", f"{s}.bn0..{s}.conv1", f"{s}.bn1"]
    by_chain = [r.name for r in plans[NESTED].regions if r.name.startswith(s)]
    assert by_chain == [s, f"{s}.conv0..{s}.bn0", f"{s}.conv1..{s}.bn1"]
    flat = plans["nothing_saveable"]
    for p in (plans[NESTED], plans[NESTED_AT_DOTS]):
        sim = simulate(prof, p)
        assert sim.peak_bytes == p.predicted_peak_bytes < flat.predicted_peak_bytes
        assert len(sim.recompute_points) == len(p.regions)


@pytest.mark.slow  # the benchmark's conv net: about 30 s
def test_parts_lower_the_benchmark_conv_nets_peak_and_its_recompute():
    """NOTE [segments nested in a block] on ``memfit.jax.models.conv3d()``, against
    ``nothing_saveable`` on every stage (4,563,580 B, 1.529 GFLOPs; what ``fit`` returned at
    0.5 and at "min" before): every stage nested at its dots, a lower XLA peak at no more
    FLOPs (measured 3,515,580 B at 1.529); at "min" lower still (a stage with its parts
    nested: 3,515,068 B, 1.478 GFLOPs; now the nested prefixes of NOTE [regions nested
    deeper], 2,730,196 B at 1.819); at 0.5 the chain DP's plan with parts, fewer FLOPs within
    the budget (4,039,364 B, 1.300 GFLOPs). All bitwise."""
    from memfit.jax.measured import NESTED_AT_DOTS, policy_plans, xla_report
    from memfit.jax.models import conv3d
    from memfit.jax.profiler import profile_program
    from memfit.jax.program import trace_program

    loss_fn, params, batch, aux = conv3d()
    program = trace_program(loss_fn, params, batch)
    prof = profile_program(program, has_aux=aux)
    every_stage = next(p for p in policy_plans(prof, 0) if p.solver == "nothing_saveable")
    flat = PlannedStep(program, every_stage, prof, has_aux=aux, keep_barriers=True, loss_fn=loss_fn)
    flat_peak, flat_flops = xla_report(flat.lower(params, batch))
    ref = plain_step(loss_fn, has_aux=aux)(params, batch)

    least = fit(loss_fn, params, batch, budget="min", has_aux=aux, time_limit_s=5.0)
    assert least.xla_peak_bytes == xla_peak(least.lower(params, batch)) < flat_peak
    assert any(r.is_segment and least.plan.outer_of(r) is not None for r in least.plan.regions)
    at_dots = next(p for p in policy_plans(prof, 0) if p.solver == NESTED_AT_DOTS)
    nested = PlannedStep(program, at_dots, prof, has_aux=aux, keep_barriers=True, loss_fn=loss_fn)
    peak, flops = xla_report(nested.lower(params, batch))
    # every stage nested at its dots: measured 3,515,580 B and 256 FLOPs more than flat's
    assert peak < flat_peak and flops <= flat_flops * (1 + 1e-6)
    assert least.xla_peak_bytes <= peak * (1 + MIN_SLACK)
    _assert_exact(least(params, batch), ref, "conv3d min")

    half = fit(loss_fn, params, batch, budget=0.5, has_aux=aux, time_limit_s=5.0)
    assert half.xla_peak_bytes <= half.plan.budget_bytes < flat_peak * 1.05
    assert half.xla_flops < flat_flops
    assert any(r.is_segment for r in half.plan.regions)  # a part: bn0..conv1 with the ReLU
    _assert_exact(half(params, batch), ref, "conv3d 0.5")


def test_the_chain_dp_nests_parts_where_regions_are_op_runs():
    """NOTE [segments nested in a block]: on a JAX profile (``OP_RUNS``) a stage may be
    checkpointed with its parts inside it, the parts its chain's blocks or its sub-modules cut
    after each convolution; the chain DP's least peak falls below the one without, and
    ``simulate`` predicts the DP's plan exactly. Without ``OP_RUNS`` (a torch profile) no
    partition is offered."""
    import dataclasses

    from memfit.jax.profiler import profile_program
    from memfit.jax.program import trace_program
    from memfit.planning.candidates import PlanningContext
    from memfit.planning.nesting import OP_RUNS
    from memfit.planning.plan import Plan
    from memfit.planning.simulate import simulate
    from memfit.planning.solvers import chain

    loss_fn, params, batch, aux = MODELS["conv3d"]()
    prof = profile_program(trace_program(loss_fn, params, batch), has_aux=aux)
    s = "ConvNet3D.stage_1"
    ctx = PlanningContext(prof)
    parts = [[rm.span.modules for rm in p] for p in ctx.part_partitions(s)]
    assert parts == [[(f"{s}.conv0", f"{s}.bn0"), (f"{s}.conv1", f"{s}.bn1")],
                     [(f"{s}.bn0", f"{s}.conv1"), (f"{s}.bn1",)]]  # conv0 alone drops nothing
    torch_like = dataclasses.replace(prof, extra={k: v for k, v in prof.extra.items() if k != OP_RUNS})
    assert PlanningContext(torch_like).part_partitions(s) == []
    lo = chain.min_peak(ctx)
    assert lo < chain.min_peak(PlanningContext(torch_like))
    sol = chain.solve(ctx, lo)
    plan = Plan(sol.regions, 0, 0.0, None, "chain", "")
    assert simulate(prof, plan).peak_bytes == sol.predicted_peak_bytes == lo
    assert any(r.is_segment and plan.outer_of(r) is not None for r in plan.regions)
    # between that peak and the plain one: every plan's peak is simulate's; some keep a
    # stage and checkpoint its parts alone
    alone = False
    for budget in np.linspace(lo, prof.peak_bytes, 7).astype(int)[1:-1]:
        sol = chain.solve(ctx, int(budget))
        plan = Plan(sol.regions, 0, 0.0, None, "chain", "")
        assert simulate(prof, plan).peak_bytes == sol.predicted_peak_bytes <= budget
        names = {r.name for r in plan.regions}
        alone |= any(r.is_segment and plan.outer_of(r) is None and r.modules[0].rsplit(".", 1)[0] not in names
                     for r in plan.regions)
    assert alone
