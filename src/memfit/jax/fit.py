"""fit: profile, plan and apply in one call, for a JAX training step (the step itself:
``memfit.jax.step``, NOTE [a plan as a JAX policy]); of the plans within the budget, the
cheapest that XLA fits and that keeps the plain step's outputs (NOTE [budgets checked
against XLA] in ``memfit.jax.measured``, NOTE [JAX plans verified on the batch] in
``memfit.jax.verify``)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax

from memfit.errors import InfeasibleBudget
from memfit.jax.measured import (
    OnXla,
    least_on_xla,
    least_peak_on_xla,
    measured_rounds,
    near_least,
    policy_plans,
)
from memfit.jax.profiler import profile_program
from memfit.jax.program import trace_program
from memfit.jax.step import PlannedStep, plain_step, region_specs
from memfit.jax.verify import Reference
from memfit.planning.effects import resolve_span
from memfit.planning.nesting import unnesting
from memfit.planning.plan import Plan
from memfit.planning.planner import plan_for_budget, refuse_over_budget
from memfit.planning.rules import refusing
from memfit.profiling.profile import Profile
from memfit.units import format_bytes

__all__ = ["fit", "PlannedStep", "plain_step", "region_specs"]


def fit(loss_fn: Callable[..., Any], params: Any, batch: Any, *,
        budget: int | float | str, has_aux: bool = False, solver: str = "auto",
        time_limit_s: float = 10.0, offload: bool = False, model: str = "",
        keep_barriers: bool | None = None, rounds: int = 3) -> PlannedStep:
    """Profile the step, plan it for ``budget`` and return the planned, jitted step.

    Args:
        loss_fn: ``loss_fn(params, batch) -> loss`` (``(loss, aux)`` with ``has_aux``).
        params: the pytree of float arrays to differentiate.
        batch: the pytree of inputs (example values: shapes and dtypes are what counts).
        budget: peak activation memory allowed, as in ``memfit.fit``: int bytes, a float
            fraction of the un-checkpointed peak, a string (``"6MiB"``, ``"60%"``) or
            ``"min"``.
        has_aux: ``loss_fn`` returns ``(loss, aux)`` (default False).
        solver: ``memfit.plan``'s solver (default ``"auto"``).
        time_limit_s: seconds the MILP may search (default 10.0).
        offload: refused (NOTE [a plan as a JAX policy]); default False.
        model: a name for reports.
        keep_barriers: compile the step with jax.checkpoint's optimization barriers kept
            (NOTE [barriers kept on XLA CPU] in ``memfit.jax.program``). None (default): on
            the CPU backend, where XLA otherwise removes them, merges the recompute into the
            forward and the plan saves no memory; elsewhere as JAX compiles.
        rounds: for a budget in bytes (or a fraction, a string), how many times to plan
            again with the budget scaled by what XLA reports for the compiled step (NOTE
            [budgets checked against XLA] in ``memfit.jax.measured``); 0: the jaxpr-level
            plan as it is. Default 3. ``"min"`` is never re-planned. With rounds, the plans
            compiled are run on ``params`` and ``batch`` against the plain step, and of those
            within the budget the cheapest bitwise equal to it is returned (NOTE [JAX plans
            verified on the batch] in ``memfit.jax.verify``; ``step.verification``).

    Returns:
        A :class:`PlannedStep`: ``loss, grads = step(params, batch)``; ``step.plan``;
        ``step.verify(params, batch)`` checks another batch.

    Raises:
        InfeasibleBudget: no plan fits; ``min_feasible_bytes`` is the smallest peak (with
            ``rounds``: the XLA peak of the step ``budget="min"`` returns, the least of the
            exact steps found).
        ValueError: ``offload=True``, or a step with no backward.

    Example:
        >>> step = memfit.jax.fit(loss_fn, params, batch, budget=0.5)   # doctest: +SKIP
        >>> loss, grads = step(params, batch)                           # doctest: +SKIP
    """
    if offload:
        raise ValueError("memfit.jax does not offload yet: the JAX CPU backend's host memory is "
                         "its device memory (an offloading policy compiles to the peak of saving); "
                         "plan without offload=True")
    program = trace_program(loss_fn, params, batch)
    profile = profile_program(program, has_aux=has_aux, model=model)
    if keep_barriers is None:
        keep_barriers = jax.default_backend() == "cpu"
    kept = keep_barriers

    checks = OnXla(params, batch, Reference(loss_fn, params, batch, has_aux=has_aux) if rounds > 0 else None)

    def choose(prof: Profile, budget: int | float | str) -> PlannedStep:
        def build(q: Plan) -> PlannedStep:
            return PlannedStep(program, q, prof, has_aux=has_aux, keep_barriers=kept, loss_fn=loss_fn)

        def replan(b: int | str) -> Plan:
            return plan_for_budget(prof, budget=b, solver=solver, time_limit_s=time_limit_s)

        measured = rounds > 0 and budget != "min"
        try:
            p = replan(budget)  # type: ignore[arg-type]
        except InfeasibleBudget as e:
            if not measured:
                raise
            # NOTE [budgets checked against XLA]: the least-peak plan and JAX's policies, on XLA
            least = replan("min")
            tried = [least, *near_least(replan, least), *policy_plans(prof, e.budget_bytes)]
            steps = [build(dataclasses.replace(q, budget_bytes=e.budget_bytes)) for q in tried]
            return least_on_xla(steps, e.budget_bytes, checks)
        refuse_over_budget(p)
        step = build(p)
        if budget == "min" and rounds > 0:  # the least XLA peak of it, plans near it and JAX's policies
            near = [*near_least(replan, p), *policy_plans(prof, p.budget_bytes or 0)]
            return least_peak_on_xla([step, *map(build, near)], checks)
        if not measured or p.budget_bytes is None:
            return step
        return measured_rounds(step, p.budget_bytes, replan, build, checks, rounds,
                               alternatives=policy_plans(prof, p.budget_bytes))

    def settle(budget: int | float | str) -> PlannedStep:
        """NOTE [JAX plans verified on the batch]: a region that changes the result is
        refused (NOTE [refused spans]) and the step chosen again; a budget no exact step
        fits raises ``InfeasibleBudget``."""
        prof, step = profile, choose(profile, budget)
        for _ in range(REFUSALS):
            if checks.exact(step):
                return step
            spans, unnest = inexact_spans(step, checks)
            if not spans and not unnest:
                break
            prof = unnesting(refusing(prof, spans), unnest)
            step = choose(prof, budget)
        if checks.exact(step):
            return step
        if budget != "min":
            raise InfeasibleBudget("no exact step found", budget_bytes=step.plan.budget_bytes or 0,
                                   min_feasible_bytes=0)
        warnings.warn(f"memfit.jax: no plan of least peak found gives outputs bitwise equal to the "
                      f"plain step on this batch; the returned step's: {step.verification} (NOTE [JAX "
                      "plans verified on the batch]; step.verification)", stacklevel=3)
        return step

    try:
        return settle(budget)
    except InfeasibleBudget as e:
        if rounds == 0 or budget == "min" or e.budget_bytes is None:
            raise
        # the smallest peak named is what budget="min" returns (its refusals may find an
        # exact step below the peaks the budget's own search tried)
        least = settle("min")
        if least.xla_peak_bytes is not None and least.xla_peak_bytes <= e.budget_bytes:
            least.plan = dataclasses.replace(least.plan, budget_bytes=e.budget_bytes)
            return least
        peak = least.xla_peak_bytes or 0
        raise InfeasibleBudget(
            f"budget {format_bytes(e.budget_bytes)} ({e.budget_bytes} bytes): XLA reports every "
            f"planned step whose outputs are the plain step's above it, the smallest at "
            f"{format_bytes(peak)} ({peak} bytes; NOTE [budgets checked against XLA] in "
            f"memfit.jax.measured, NOTE [JAX plans verified on the batch]). Give a budget of at "
            f"least {peak} bytes, or budget='min' (rounds=0: the jaxpr-level plan, unchecked)",
            budget_bytes=e.budget_bytes, min_feasible_bytes=peak,
            fits_with=(f"a budget of at least {peak} bytes",)) from None


# how many times ``fit`` refuses the regions of a step whose result changed and chooses again
REFUSALS = 6


def inexact_spans(step: PlannedStep, checks: OnXla) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The op spans of ``step``'s top-level regions that change the result on their own (each
    region alone, with the regions nested in it, compiled and run against the plain step:
    NOTE [JAX plans verified on the batch]), and the spans of those that change it only with
    their nested regions (``memfit.planning.nesting.unnesting``: the region alone keeps the
    result)."""
    refuse: list[tuple[int, int]] = []
    unnest: list[tuple[int, int]] = []
    plan = step.plan
    for r in (q for q in plan.regions if plan.outer_of(q) is None):
        group = tuple(q for q in plan.regions if q is r or any(o is r for o in plan.outers_of(q)))
        if checks.exact(_alone(step, group)):
            continue
        span = resolve_span(step.profile, r.modules)
        exact_alone = len(group) > 1 and checks.exact(_alone(step, (r,)))
        (unnest if exact_alone else refuse).append((span.first_op, span.last_op))
    return refuse, unnest


def _alone(step: PlannedStep, regions: tuple[Any, ...]) -> PlannedStep:
    return PlannedStep(step.program, dataclasses.replace(step.plan, regions=regions), step.profile,
                       has_aux=step.has_aux, keep_barriers=step.keep_barriers, loss_fn=step.loss_fn)
