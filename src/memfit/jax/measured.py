"""A JAX plan's budget checked against what XLA reports for the compiled step, in rounds.

NOTE [budgets checked against XLA]
    memfit plans a JAX step for its jaxpr-level peak (NOTE [a jaxpr as a Profile] in
    ``memfit.jax.profiler``), which is not XLA's: XLA fuses elementwise chains and schedules
    its own buffers. Measured on the models of ``memfit.jax.models`` (docs/jax.md): XLA's
    peak of a planned step was 0.74-0.90 of the budget on a GPT (memory the plan could have
    spent on less recompute) and up to 1.05 on a 3D conv net (over). So for a budget in
    bytes, ``fit`` compiles the planned step and reads ``memory_analysis()`` (temp + output
    - alias bytes, as the tests and benchmarks count XLA's peak) and plans again, up to
    ``rounds`` times: the model's budget scaled by ``budget / XLA peak`` until a step above
    and one within the budget are seen, then halved between their model budgets (XLA's
    ratio to the model differs from plan to plan); it stops within 2% below the budget. It returns the plan of least predicted recompute among those XLA reports
    within the budget; none within, the least-peak plan if XLA reports it within; else
    ``InfeasibleBudget`` naming the smallest XLA peak seen. A budget under the model's least
    peak names the larger of that and XLA's peak of the least-peak plan: given that budget,
    the least-peak plan fits.
    ``"min"`` is not re-planned (it asks for the least peak, not a budget).
    The plan returned keeps the user's budget as ``budget_bytes``; its
    ``predicted_peak_bytes`` is the jaxpr-level model's (it may exceed the budget where XLA's
    peak is lower), and the step's ``xla_peak_bytes`` is XLA's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from memfit.errors import InfeasibleBudget
from memfit.planning.plan import Plan
from memfit.units import format_bytes

__all__ = ["xla_peak_bytes", "measured_rounds", "infeasible_on_xla"]

NEAR = 0.98  # a round within 2% below the budget ends the search


def xla_peak_bytes(lowered: Any) -> int:
    """XLA's peak of a lowered step: temp + output - alias bytes of ``memory_analysis()``."""
    m = lowered.compile().memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def measured_rounds(first: Any, budget_bytes: int, replan: Callable[[int | str], Plan],
                    build: Callable[[Plan], Any], params: Any, batch: Any, rounds: int) -> Any:
    """The step of least predicted recompute whose XLA peak is within ``budget_bytes``,
    from ``first`` and up to ``rounds`` re-plans (NOTE [budgets checked against XLA]).

    Args:
        first: the planned step at ``budget_bytes`` (a ``PlannedStep``).
        replan: model budget in bytes (or ``"min"``) -> Plan (raises ``InfeasibleBudget``).
        build: Plan -> step.

    Raises:
        InfeasibleBudget: no step seen fits; ``min_feasible_bytes`` is the smallest XLA peak
            seen (the budget that, given, plans at least that step).
    """
    step, model_budget = first, budget_bytes
    fitting: list[Any] = []
    seen: list[int] = []
    measured: dict[Any, int] = {}  # XLA's peak by the plan's regions: the same plan, no recompile
    lo: int | None = None  # the largest model budget whose step XLA reports within the budget
    hi: int | None = None  # the smallest whose step it reports above
    for k in range(rounds + 1):
        peak = measured.get(step.plan.regions)
        if peak is None:
            peak = measured[step.plan.regions] = xla_peak_bytes(step.lower(params, batch))
            seen.append(peak)
            if peak <= budget_bytes:
                fitting.append(step)
        step.xla_peak_bytes = peak
        if peak <= budget_bytes:
            lo = model_budget if lo is None else max(lo, model_budget)
        else:
            hi = model_budget if hi is None else min(hi, model_budget)
        if k == rounds or NEAR * budget_bytes <= peak <= budget_bytes or peak == 0:
            break
        # scaled by XLA's ratio until both sides are seen, then halved between them
        if lo is not None and hi is not None:
            if hi - lo <= 0.005 * budget_bytes:
                break
            nxt = (lo + hi) // 2
        else:
            nxt = int(model_budget * budget_bytes / peak)
        try:
            plan = replan(nxt)
        except InfeasibleBudget:
            break  # under the model's least peak: the least-peak plan is tried below
        model_budget = nxt
        note = (f"budget checked against XLA's memory_analysis(): planned for {format_bytes(nxt)} "
                f"of jaxpr-level peak (NOTE [budgets checked against XLA])")
        step = build(dataclasses.replace(plan, budget_bytes=budget_bytes, notes=(*plan.notes, note)))
    if not fitting:  # the least-peak plan is the last to try
        step = build(dataclasses.replace(replan("min"), budget_bytes=budget_bytes))
        step.xla_peak_bytes = peak = xla_peak_bytes(step.lower(params, batch))
        if peak <= budget_bytes:
            return step
        seen.append(peak)
        least = min(seen)
        raise InfeasibleBudget(
            f"budget {format_bytes(budget_bytes)} ({budget_bytes} bytes): XLA reports every planned "
            f"step above it, the smallest at {format_bytes(least)} ({least} bytes; NOTE [budgets "
            f"checked against XLA] in memfit.jax.measured). Give a budget of at least {least} "
            "bytes, or budget='min'",
            budget_bytes=budget_bytes, min_feasible_bytes=least, fits_with=(f"a budget of at least {least} bytes",))
    return min(fitting, key=lambda s: (s.plan.recompute_s, s.xla_peak_bytes))


def infeasible_on_xla(error: InfeasibleBudget, least: Any, params: Any, batch: Any) -> InfeasibleBudget:
    """``error`` (the model's: no plan under the budget) naming the larger of the model's
    least peak and XLA's peak of the least-peak step ``least`` (NOTE [budgets checked against
    XLA])."""
    xla = xla_peak_bytes(least.lower(params, batch))
    if xla <= error.min_feasible_bytes:
        return error
    return InfeasibleBudget(
        f"budget {format_bytes(error.budget_bytes)} ({error.budget_bytes} bytes) is below the "
        f"smallest peak memfit can plan: XLA reports {format_bytes(xla)} ({xla} bytes) for the "
        f"least-peak plan, whose jaxpr-level peak is {format_bytes(error.min_feasible_bytes)} (NOTE "
        f"[budgets checked against XLA] in memfit.jax.measured). Give a budget of at least {xla} "
        "bytes, or budget='min'",
        budget_bytes=error.budget_bytes, min_feasible_bytes=xla, fits_with=(f"a budget of at least {xla} bytes",))
