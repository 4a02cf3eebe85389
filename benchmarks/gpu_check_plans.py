"""``benchmarks.gpu_check``'s first part for one case: memfit's plans made with ``memfit.fit`` at
three budgets and for the device's memory, each checked against the plain step.

Per plan: the predicted peak from the real-device profile (``plan.predicted_peak_bytes``) and
from a fake-mode profile of the same model built on the meta device
(``memfit.simulate(fake_profile, plan)``), the measured peak, the budget; loss, gradients,
buffers (BatchNorm statistics) and RNG states after a seeded step against the plain step's,
bitwise, under ``torch.use_deterministic_algorithms(True)``; and ``memfit.verify``'s verdict.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

import memfit
from benchmarks.gpu_check_steps import Outcome, Runner, compare, deterministic
from benchmarks.peers import Family, Method
from memfit.errors import InfeasibleBudget

__all__ = ["Setup", "setup", "fit_rows", "plan_at", "FRACTIONS"]

log = logging.getLogger(__name__)

FRACTIONS = (0.7, 0.5, 0.3)


class Setup:
    """What every part of a case shares: the runner, both profiles, the plain step's method,
    its seeded outcome, and the device memory plans are fitted to."""

    def __init__(self, runner: Runner, prof: Any, fake: Any, plain: Method, ref: Outcome,
                 card_bytes: int, card_how: str, target: str) -> None:
        self.runner, self.prof, self.fake, self.plain, self.ref = runner, prof, fake, plain, ref
        self.card_bytes, self.card_how, self.target = card_bytes, card_how, target


def _synthetic_card(prof: Any) -> int:
    """On a CPU, the device memory ``fit(device_memory=...)`` and ``largest_batch`` are given:
    halfway between the whole job (AdamW) with no plan and with the smallest plan, so that the
    plan must checkpoint where checkpointing can lower the job at all (no reserve: a CPU has
    none)."""
    totals = []
    for how in ({"solver": "none"}, {"budget": "min"}):
        memory = memfit.plan(prof, device_memory=1 << 50, optimizer="adamw", **how).memory
        assert memory is not None
        totals.append(memory.total_bytes - memory.reserve_bytes)
    return sum(totals) // 2


def setup(runner: Runner, target: str) -> Setup:
    """Profile the case on its device and in fake mode for ``target``; run the plain step."""
    case, device = runner.case, runner.device
    meta = torch.device("meta")
    with runner.autocast():
        prof = memfit.profile(runner.base, runner.inputs, loss_fn=case.loss_fn, device=device)
        fake = memfit.profile(case.build(meta), case.inputs(meta, case.batch), loss_fn=case.loss_fn,
                              mode="fake", target=target)
    plain = runner.method("plain", runner.fresh(), Family.NONE)
    with deterministic():
        ref = runner.seeded(plain)
    if device.type == "cuda":
        card, how = torch.cuda.mem_get_info(device)[1], "torch.cuda.mem_get_info total"
    else:
        card, how = _synthetic_card(prof), "synthetic on CPU: plain job less half the droppable activations"
    return Setup(runner, prof, fake, plain, ref, int(card), how, target)


def plan_at(prof: Any, budget: int) -> tuple[Any, str]:
    """memfit's plan for ``budget`` bytes, or for the smallest feasible peak if that is above it
    (said in the note)."""
    try:
        return memfit.plan(prof, budget=budget), ""
    except InfeasibleBudget as e:
        least = int(e.min_feasible_bytes)
        return memfit.plan(prof, budget=least), f"{budget} B infeasible: planned at the least peak {least} B"


def _fit(s: Setup, **how: Any) -> tuple[torch.nn.Module, str]:
    """A fresh copy of the model through ``memfit.fit(**how)`` (an infeasible budget refitted
    at the smallest feasible peak, said in the note)."""
    r = s.runner
    model = r.fresh()
    with r.autocast():
        try:
            memfit.fit(model, r.inputs, loss_fn=r.case.loss_fn, **how)
            return model, ""
        except InfeasibleBudget as e:
            if "budget" not in how:
                raise
            least = int(e.min_feasible_bytes)
            memfit.fit(model, r.inputs, loss_fn=r.case.loss_fn, budget=least)
            return model, f"{how['budget']:.0%} infeasible: fitted at the least peak {least} B"


def _verify(s: Setup, model: torch.nn.Module) -> dict[str, Any]:
    r = s.runner
    with r.autocast(), deterministic() as ops:
        rep = memfit.verify(model, r.inputs, loss_fn=r.case.loss_fn)
    return {"ok": rep.ok, "bitwise": rep.bitwise, "comparison": rep.comparison,
            "peak_bytes": rep.peak_bytes, "bn_stats_equal": rep.bn_stats_equal,
            "failures": [f"{c.name}: {c.detail}" for c in rep.failures], "nondeterministic_ops": ops}


def _fake_peak(s: Setup, plan: Any) -> tuple[int | None, str]:
    try:
        return int(memfit.simulate(s.fake, plan).peak_bytes), ""
    except Exception as e:  # noqa: BLE001 - the fake profile may not fit the device's plan: recorded
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def check_method(s: Setup, method: Method) -> dict[str, Any]:
    """Bitwise against the plain step (deterministic mode) and the measured peak."""
    with deterministic() as ops:
        got = compare(s.ref, s.runner.seeded(method))
    return {**got, "nondeterministic_ops": ops, "measured_peak_bytes": s.runner.peak(method)}


def fit_rows(s: Setup, fractions: tuple[float, ...] = FRACTIONS) -> tuple[list[dict[str, Any]], dict[str, Method]]:
    """The plain step twice (the device's own run-to-run agreement), then ``fit`` at each
    fraction of the plain peak and at the device's memory (AdamW), each checked."""
    plain_row = {"plan": "plain", "how": "no plan (run twice)", "budget_bytes": None,
                 "predicted_peak_bytes": s.prof.peak_bytes, "fake_predicted_peak_bytes": s.fake.peak_bytes,
                 **check_method(s, s.plain)}
    rows, methods = [plain_row], {}
    hows: list[tuple[str, dict[str, Any]]] = [(f"memfit_{f:.0%}", {"budget": f}) for f in fractions]
    hows.append(("memfit@device", {"device_memory": s.card_bytes, "optimizer": "adamw"}))
    for name, how in hows:
        row: dict[str, Any] = {"plan": name, "how": "fit(" + ", ".join(f"{k}={v!r}" for k, v in how.items()) + ")"}
        rows.append(row)
        try:
            model, row["note"] = _fit(s, **how)
            plan = memfit.applied_plan(model)
            assert plan is not None
            fake, fake_error = _fake_peak(s, plan)
            row.update(solver=plan.solver, regions=len(plan.regions), budget_bytes=plan.budget_bytes,
                       predicted_peak_bytes=plan.predicted_peak_bytes, fake_predicted_peak_bytes=fake,
                       predicted_overhead=plan.overhead)
            if fake_error:
                row["fake_error"] = fake_error
            if plan.memory is not None:
                row["job"] = plan.memory.to_dict()
            methods[name] = s.runner.method(name, model)
            row.update(check_method(s, methods[name]))
            row["verify"] = _verify(s, model)
        except Exception as e:  # noqa: BLE001 - one plan's failure is recorded; the others go on
            log.exception("%s: %s failed", s.runner.case.name, name)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return rows, methods
