"""memfit's points on the trade-off: one profile, plans at a sweep of budgets, applied.

Budgets are a sweep of fractions of the plain peak, the smallest feasible one, and, for each
peer, exactly that peer's measured peak, so that each peer can be compared with the memfit plan
made for the same memory. Identical plans (same regions, same saved ops) are measured once.
At each peer's peak memfit is also tuned (``memfit.measuring.tuning.tune``: the solver's best few plans
and the baselines that fit, timed on a copy of the model, the fastest kept): the
``memfit_tuned@<peer>`` rows, timed again with every other method.

memfit's modules are imported when a run reaches them, so that the peers can be benchmarked
while memfit's own pieces are still missing.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.models import Case
from benchmarks.peers import Family, Method

__all__ = ["BudgetSpec", "MemfitSweep", "plan_key", "build_memfit", "TUNED_PREFIX"]

log = logging.getLogger(__name__)

MIN_FEASIBLE = "min"
TUNED_PREFIX = "memfit_tuned@"  # + the peer's name: memfit tuned at that peer's measured peak


@dataclass(frozen=True)
class BudgetSpec:
    """One budget memfit is asked for.

    ``value``: a fraction (float), bytes (int) or ``"min"`` (the smallest feasible peak).
    ``peer``: the peer whose measured peak this budget is (empty for the sweep).
    """

    name: str
    value: float | int | str
    peer: str = ""


@dataclass
class MemfitSweep:
    """What ``build_memfit`` produced: methods to measure, and what went wrong."""

    methods: list[Method] = field(default_factory=list)
    profile_s: float = 0.0
    plain_predicted_peak_bytes: int = 0
    errors: list[str] = field(default_factory=list)


def plan_key(plan: Any) -> tuple[Any, ...]:
    """What makes two plans run the same step: their regions and saved ops."""
    return tuple((tuple(r.modules), tuple(sorted(r.save))) for r in plan.regions)


def budget_specs(fractions: Sequence[float], peer_peaks: Mapping[str, int], *, include_min: bool = True) -> list[BudgetSpec]:
    """The sweep (fractions, then ``min``) followed by one budget per peer peak."""
    specs = [BudgetSpec(f"memfit_{f:.2f}", float(f)) for f in fractions]
    if include_min:
        specs.append(BudgetSpec("memfit_min", MIN_FEASIBLE))
    specs.extend(BudgetSpec(f"memfit@{peer}", int(peak), peer=peer) for peer, peak in peer_peaks.items())
    return specs


def _plan(planner: Any, prof: Any, spec: BudgetSpec) -> tuple[Any, float]:
    from memfit.errors import InfeasibleBudget

    t0 = time.perf_counter()
    if spec.value == MIN_FEASIBLE:
        try:
            plan = planner.plan_for_budget(prof, budget=1)
        except InfeasibleBudget as e:
            plan = planner.plan_for_budget(prof, budget=int(e.min_feasible_bytes))
    else:
        plan = planner.plan_for_budget(prof, budget=spec.value)
    return plan, time.perf_counter() - t0


def _tune(case: Case, prof: Any, spec: BudgetSpec) -> tuple[Any, float]:
    """memfit's measured choice for ``spec`` (``memfit.measuring.tuning.tune``), on a copy of the model."""
    from memfit.measuring.tuning import tune
    from memfit.step.harness import Step

    model = copy.deepcopy(case.model).train()
    t0 = time.perf_counter()
    plan = tune(Step.of(model, tuple(case.inputs), loss_fn=case.loss_fn), prof, spec.value, progress=False)
    return plan, time.perf_counter() - t0


def build_memfit(case: Case, specs: Sequence[BudgetSpec], *, prof: Any = None, tune: bool = True) -> MemfitSweep:
    """Profile the case once, plan for every budget, apply each distinct plan to a fresh copy.

    Budgets memfit cannot meet are recorded as non-applicable methods with the reason
    (``InfeasibleBudget`` gives the smallest feasible peak). With ``tune``, every peer's
    budget is also tuned (``TUNED_PREFIX`` methods, after the others).
    """
    out = MemfitSweep()
    try:
        from memfit.errors import InfeasibleBudget
        from memfit.measuring import calibration
        from memfit.planning import planner
        from memfit.runtime import apply as runtime_apply
    except ImportError as e:
        out.errors.append(f"memfit is not ready: {e}")
        return out

    if prof is None:
        model = copy.deepcopy(case.model).train()
        t0 = time.perf_counter()
        try:
            prof = calibration.profile(model, case.inputs, loss_fn=case.loss_fn)
        except Exception as e:  # noqa: BLE001 - a benchmark records failures and goes on
            out.errors.append(f"memfit.profile failed: {type(e).__name__}: {e}")
            return out
        out.profile_s = time.perf_counter() - t0
    out.plain_predicted_peak_bytes = int(prof.peak_bytes)

    seen: dict[tuple[Any, ...], str] = {}
    tuned = [(BudgetSpec(TUNED_PREFIX + s.peer, s.value, s.peer), True) for s in specs if tune and s.peer]
    for spec, tuning in [*((s, False) for s in specs), *tuned]:
        label = f"memfit {spec.value:.0%}" if isinstance(spec.value, float) else (
            "memfit min" if spec.value == MIN_FEASIBLE else
            f"memfit (tuned) @ {spec.peer}" if tuning else f"memfit @ {spec.peer}")
        info: dict[str, Any] = {"budget_spec": spec.value if not isinstance(spec.value, int) else "bytes",
                                "matched_peer": spec.peer}
        try:
            plan, planning_s = _tune(case, prof, spec) if tuning else _plan(planner, prof, spec)
        except InfeasibleBudget as e:
            out.methods.append(Method(spec.name, label, Family.MEMFIT, reason=(
                f"infeasible: budget {e.budget_bytes} B is below memfit's smallest predicted "
                f"peak {e.min_feasible_bytes} B"), info={**info, "budget_bytes": e.budget_bytes,
                                                        "min_feasible_bytes": e.min_feasible_bytes}))
            continue
        except Exception as e:  # noqa: BLE001
            out.methods.append(Method(spec.name, label, Family.MEMFIT,
                                      reason=f"planning failed: {type(e).__name__}: {e}", info=info))
            continue
        info.update(planning_s=planning_s, budget_bytes=plan.budget_bytes,
                    predicted_peak_bytes=int(plan.predicted_peak_bytes),
                    predicted_recompute_s=float(plan.recompute_s), solver=plan.solver,
                    predicted_step_s=float(plan.predicted_step_s),
                    n_regions=len(plan.regions),
                    n_saved_ops=sum(len(r.save) for r in plan.regions))
        if plan.tuning is not None:
            info["tuning"] = plan.tuning.to_dict()
        key = plan_key(plan)
        if key in seen:
            info["same_plan_as"] = seen[key]
            out.methods.append(Method(spec.name, label, Family.MEMFIT, info=info))
            continue
        model = copy.deepcopy(case.model).train()
        try:
            runtime_apply.apply_plan(model, plan)
        except Exception as e:  # noqa: BLE001
            out.methods.append(Method(spec.name, label, Family.MEMFIT,
                                      reason=f"apply failed: {type(e).__name__}: {e}", info=info))
            continue
        seen[key] = spec.name
        def forward_loss(*inputs: Any, _model: Any = model, _loss_fn: Any = case.loss_fn) -> Any:
            out = _model(*inputs)
            return _loss_fn(out), out

        info["plan"] = plan.to_dict()["regions"]
        out.methods.append(Method(spec.name, label, Family.MEMFIT, model, forward_loss, case.inputs, info=info))
    return out


def is_alias(method: Method) -> bool:
    """A memfit method whose plan equals an earlier one's (measured once, reported twice)."""
    return bool(method.info.get("same_plan_as"))
