"""Prove a plan: one step of the planned model against its un-checkpointed twin.

``memfit.verify`` is this module's ``verify``. The module is not named ``verify.py``: a module
of a function's name shadows the function on its package as soon as anything imports it
(``memfit/verify.py`` did that to ``memfit.verify``).

``verify(model, x)`` runs one training step of the planned model and one of a plain deep copy,
from the same RNG seed, and compares the loss, the outputs, every parameter and input
gradient, the buffers (BatchNorm statistics) and the RNG state after the step: bitwise on CPU
or with deterministic algorithms, else within the plain step's own run-to-run spread (two
plain runs; NOTE [comparison modes] in ``memfit.measuring.comparison``; ``VerifyReport.comparison`` says
which). It also measures the planned step's peak memory against the plan's prediction and the
budget.

NOTE [verify leaves the model alone]
    Both steps run on twins (``memfit.measuring.twins``): the planned twin is a plain copy with the plan
    applied afresh, the reference twin a plain copy. (A model that cannot be copied, sharded by
    FSDP or wrapped in DDP, runs both steps itself, put back after each: NOTE [models without
    twins] in ``memfit.measuring.twins``; ``VerifyReport.compared`` says which way.) The user's model, its parameters, buffers
    and ``.grad`` are never touched, and the global RNG state is put back (``ModelState``).
    Re-applying the plan to a copy checks the plan itself (what ``model.memfit_plan`` says),
    which is also what a fresh process loading the plan would run.

NOTE [peak tolerance]
    A measured peak passes when it is within ``max(PEAK_RTOL x reference, floor)`` of the
    prediction (and of the budget), ``floor = PEAK_ATOL_BYTES + regions x rng_state_bytes()``;
    the check's text names the tolerance that applied. The floor is what the CPU allocator
    meter sees beyond the prediction on tiny steps, where 3% is a few KiB. Measured on this
    machine (torch 2.13, CPU; hand plans of 0-8 block regions on zoo GPTs of 2-8 layers,
    d_model 32-64, and ``fit(budget="min")`` + ``verify`` on the 27 tiny models of
    ``tests/test_breadth.py``; allocator peak minus predicted peak):
      1. plain steps: 0-64 bytes;
      2. planned steps: 5056 bytes times the number of regions whose forward had run and whose
         recompute had not at the peak (up to every region), plus 0-6.2 KiB, 36 KiB at most
         (BART, 6 regions: 30336 + 6216) on steps of 86 KiB-99 MiB.
    The 5056 bytes are torch's: the non-reentrant checkpoint keeps the CPU RNG state
    (``torch.get_rng_state()``, an mt19937 state of 5056 bytes) from each region's forward to
    its recompute, created outside the dispatcher, so the profile never sees it. The rest is
    kernel scratch and rounding of the tensor model. ``PEAK_ATOL_BYTES`` bounds that remainder
    with room (16 KiB); on steps of hundreds of MiB the 3% dominates and the floor is moot.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.measuring.comparison import Check, Comparison, compare_steps, comparison_for
from memfit.measuring.twins import (
    StepResult,
    UncopyableModel,
    lifted_plan,
    no_twin_reason,
    record_step,
    step_of,
    twin_step,
)
from memfit.measuring.twins import (
    make_step as make_step,  # where tests and benchmarks have imported it from
)
from memfit.planning.plan import Plan
from memfit.step.harness import ModelState, Step, model_device
from memfit.units import format_bytes

__all__ = ["Check", "Comparison", "VerifyReport", "verify", "check_plan_matches", "print_verify", "peak_tolerance", "rng_state_bytes",
           "PEAK_RTOL", "PEAK_ATOL_BYTES", "make_step"]

log = logging.getLogger(__name__)

#: Peak memory may exceed the budget, or differ from the prediction, by this fraction...
PEAK_RTOL = 0.03
#: ...or by this many bytes plus one CPU RNG state per region, if more (NOTE [peak tolerance]).
PEAK_ATOL_BYTES = 16 * 1024


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` found. ``ok`` is true only when every check passed.

    Attributes:
        ok: every check passed.
        bitwise: loss, outputs, gradients and buffers are bit-for-bit equal to the plain step
            (whichever ``comparison`` ran).
        max_abs_diff: the largest absolute difference over all compared floating tensors.
        max_rel_diff: the largest difference relative to the plain value.
        peak_bytes: measured peak activation memory of the planned step.
        plain_peak_bytes: measured peak of the un-checkpointed step.
        predicted_peak_bytes: the plan's prediction (``None`` if there was no plan to apply).
        budget_bytes: the budget checked against (argument, else the plan's), or ``None``.
        bn_stats_equal: buffers (BatchNorm running statistics and counters) are equal.
        checks: every comparison, in order.
        device: where the steps ran.
        solver: the plan's solver.
        tracked_peak_bytes: the planned step's peak as the dispatch-level tracker saw it (the
            meter the profile's prediction is built on; it misses kernel scratch buffers).
        compared: how the two steps ran: ``"twins"`` (deep copies of the model) or ``"in
            place"`` (the model itself, its plan lifted for the plain step: a model sharded by
            FSDP or wrapped in DDP; NOTE [models without twins] in ``memfit.measuring.twins``).
        comparison: how tensors were compared: ``"bitwise"`` (CPU, or deterministic
            algorithms) or ``"within plain spread"`` (a ``Comparison`` value; NOTE [comparison
            modes] in ``memfit.measuring.comparison``); ``"lossy: relative error"`` for a lossy
            plan, whose gradients are not compared (``gradient_rel_error``).
        gradient_rel_error: for a lossy plan (``Plan.lossy``; NOTE [what lossy means] in
            ``memfit.planning.compression``), the largest ``|g - g_plain| / |g_plain|`` (2-norms)
            over parameters; ``bitwise`` is then False and no tensor check is made. None for
            other plans.
    """

    ok: bool
    bitwise: bool
    max_abs_diff: float
    max_rel_diff: float
    peak_bytes: int
    plain_peak_bytes: int
    predicted_peak_bytes: int | None
    budget_bytes: int | None
    bn_stats_equal: bool
    checks: tuple[Check, ...]
    device: str = "cpu"
    solver: str = ""
    tracked_peak_bytes: int = 0
    compared: str = "twins"
    comparison: str = Comparison.BITWISE.value
    gradient_rel_error: float | None = None

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["checks"] = [dataclasses.asdict(c) for c in self.checks]
        for k in ("max_abs_diff", "max_rel_diff"):  # JSON has no inf/nan
            if not math.isfinite(d[k]):
                d[k] = str(d[k])
        return {"kind": "memfit.VerifyReport", **d}

    def __str__(self) -> str:
        head = "PASSED" if self.ok else f"FAILED ({len(self.failures)} of {len(self.checks)} checks)"
        where = "" if self.compared == "twins" else f", {self.compared}"
        lines = [f"memfit verify ({self.solver or 'plan'}, {self.device}{where}, {self.comparison}): {head}"]
        for c in self.checks:
            lines.append(f"  [{'ok' if c.passed else 'FAIL'}] {c.name}: {c.detail}")
        return "\n".join(lines)


# VerifyReport.comparison of a lossy plan: no bitwise claim is made (NOTE [what lossy means]).
LOSSY_COMPARISON = "lossy: relative error"


def rng_state_bytes() -> int:
    """Bytes of the CPU RNG state each checkpointed region holds (5056 on torch 2.13)."""
    return int(torch.get_rng_state().numel())


def peak_tolerance(reference: int, n_regions: int, rtol: float = PEAK_RTOL,
                   atol_bytes: int | None = None) -> tuple[int, str]:
    """Allowed excess over ``reference`` bytes, and what set it (NOTE [peak tolerance]).

    Example:
        >>> peak_tolerance(100 * 2**20, 4)[1]
        '3% of 100.00 MiB'
    """
    rel = int(rtol * reference)
    floor = atol_bytes if atol_bytes is not None else PEAK_ATOL_BYTES + n_regions * rng_state_bytes()
    if rel >= floor:
        return rel, f"{rtol:.0%} of {format_bytes(reference)}"
    if atol_bytes is not None:
        return floor, f"floor {format_bytes(floor)}, above {rtol:.0%}"
    return floor, (f"floor {format_bytes(PEAK_ATOL_BYTES)} + {n_regions} region RNG state"
                   f"{'s' if n_regions != 1 else ''} of {rng_state_bytes()} B, above {rtol:.0%}")


def _collective_job() -> bool:
    """Whether this process is a rank of an initialised ``torch.distributed`` job."""
    from memfit.parallel.distributed import is_distributed

    return is_distributed()


# NOTE [peaks in a distributed job] In a rank of a torch.distributed job the CPU allocator's
# peak also holds what the collective backend allocates inside its calls (gloo's send and
# receive buffers), which no plan can drop and no dispatch-level meter sees: on 2 gloo ranks
# with FSDP2 (tests/distributed) the allocator read +4.7% to +6.7% over the prediction while
# the tensors' peak was within 512 B of it. There verify checks the tensors' peak (the meter
# the profile's prediction is built on) against the prediction and the budget, and names the
# allocator's figure in the check's text.
def _peak_checks(peak: int, plain_peak: int, predicted: int | None, budget: int | None,
                 rtol: float, tracked: int = 0, n_regions: int = 0,
                 atol_bytes: int | None = None, meter: str = "") -> list[Check]:
    checks = []
    seen_by = f" ({meter})" if meter else ""
    if budget is not None:
        tol, why = peak_tolerance(budget, n_regions, rtol, atol_bytes)
        ok = peak <= budget + tol
        checks.append(Check(
            "peak within budget", ok,
            f"measured {format_bytes(peak)}{seen_by} {'<=' if ok else '>'} budget {format_bytes(budget)} "
            f"+ {format_bytes(tol)} ({why})"))
    if predicted is not None:
        tol, why = peak_tolerance(predicted, n_regions, rtol, atol_bytes)
        err = (peak - predicted) / predicted if predicted else (0.0 if peak == 0 else math.inf)
        checks.append(Check(
            "peak matches prediction", abs(peak - predicted) <= tol,
            f"measured {format_bytes(peak)}{seen_by} vs predicted {format_bytes(predicted)} ({err:+.1%}, "
            f"{peak - predicted:+d} B; tolerance {format_bytes(tol)}: {why}; "
            f"tensors alone {format_bytes(tracked)})"))
    saved = 1 - peak / plain_peak if plain_peak else 0.0
    checks.append(Check("peak vs plain step", True,
                        f"{format_bytes(peak)} vs {format_bytes(plain_peak)} un-checkpointed ({saved:.0%} saved)"))
    return checks


def verify(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    plan: Plan | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    budget_bytes: int | None = None,
    seed: int = 0,
    peak_rtol: float = PEAK_RTOL,
    peak_atol_bytes: int | None = None,
    step: Step | None = None,
    comparison: Comparison | str | None = None,
) -> VerifyReport:
    """Check that a plan changes memory, not results: one step against the un-checkpointed twin.

    The planned step (``plan``, else ``model.memfit_plan``) and a plain step run from the same
    RNG seed on deep copies; loss, outputs, parameter and input gradients, buffers and the RNG
    state after the step must be bitwise equal on CPU or with deterministic algorithms, else
    within the plain step's run-to-run spread (the plain step runs twice: NOTE [comparison
    modes] in ``memfit.measuring.comparison``), and the measured peak must stay within tolerance of the prediction and under the budget (``peak_rtol``,
    or a floor of bytes on tiny steps: NOTE [peak tolerance]). The
    model, its parameters, buffers, ``.grad`` and the RNG state are left as they were (NOTE
    [verify leaves the model alone]).

    Args:
        model: the model, planned (``memfit.fit``/``apply``) or plain with ``plan`` given.
        example_inputs: the inputs the plan was made for (tensor, tuple or dict).
        plan: the plan to check; default ``model.memfit_plan``.
        loss_fn: output -> scalar loss; default the profiler's default loss.
        budget_bytes: the budget to check the measured peak against, bytes; default the plan's.
        seed: the RNG seed both steps start from.
        peak_rtol: allowed relative excess over the budget and error of the prediction (0.03).
        peak_atol_bytes: allowed absolute excess and error, bytes, when larger than
            ``peak_rtol``'s; default ``PEAK_ATOL_BYTES`` plus one CPU RNG state per region.
        step: the step to run instead of ``example_inputs`` and ``loss_fn``: a
            ``memfit.step.harness.Step`` of ``model`` made with inputs (its autocast state included);
            a step given as a callable cannot run on the twins and raises ``TypeError``.
        comparison: ``"bitwise"`` or ``"within plain spread"`` (a ``Comparison``) to force
            one; default ``comparison_for(device)``: bitwise on CPU or with
            ``torch.use_deterministic_algorithms(True)``, else within plain spread.

    Returns:
        A ``VerifyReport``; ``print(report)`` explains every check.

    Example:
        >>> model = memfit.fit(memfit.zoo.gpt(n_layer=2, d_model=64), x, budget="60%")  # doctest: +SKIP
        >>> report = memfit.verify(model, x)                                            # doctest: +SKIP
        >>> report.ok, report.bitwise                                                    # doctest: +SKIP
        (True, True)
    """
    plan = _plan_of(model, plan)
    device = model_device(model)
    if device.type == "meta":
        raise ValueError("cannot verify a model on the meta device (no weights): verification runs "
                         "real steps; build the model on a real device")
    the_step = step_of(model, example_inputs, loss_fn, step)
    budget = budget_bytes if budget_bytes is not None else plan.budget_bytes
    mode = _mode(comparison, device)
    ref, ref2, got, compared = _run_steps(the_step, plan, seed, device, mode)
    if isinstance(got, Check):
        applied = Check("plan applies to the model", True, f"{len(plan.regions)} regions")
        return VerifyReport(False, False, math.inf, math.inf, 0, ref.peak_bytes, plan.predicted_peak_bytes,
                            budget, False, (applied, got) if got.name != applied.name else (got,),
                            str(device), plan.solver, compared=compared, comparison=mode.value)

    checks = [Check("plan applies to the model", True,
                    f"{len(plan.regions)} region{'s' if len(plan.regions) != 1 else ''} ({plan.solver})")]
    tensor_checks, total, bn_ok = compare_steps(got, ref, mode, ref2)
    rel = gradient_rel_error(got, ref) if plan.lossy else None
    if rel is not None:  # a lossy plan: no bitwise claim, the gradients' error reported
        tensor_checks = [Check("lossy plan: gradients' relative error reported, not compared", True,
                               f"largest |g - g_plain| / |g_plain| over parameters {rel:.3g}")]
    checks += tensor_checks
    checks += _peak_checks_of(got, ref, plan, budget, peak_rtol, peak_atol_bytes)
    ok = all(c.passed for c in checks)
    report = VerifyReport(
        ok=ok, bitwise=total.bitwise and rel is None, max_abs_diff=total.max_abs, max_rel_diff=total.max_rel,
        peak_bytes=got.peak_bytes, plain_peak_bytes=ref.peak_bytes,
        predicted_peak_bytes=plan.predicted_peak_bytes, budget_bytes=budget, bn_stats_equal=bn_ok,
        checks=tuple(checks), device=str(device), solver=plan.solver,
        tracked_peak_bytes=got.tracked_peak_bytes, compared=compared,
        comparison=mode.value if rel is None else LOSSY_COMPARISON, gradient_rel_error=rel,
    )
    log.info("%s", report)
    return report


def gradient_rel_error(got: StepResult, ref: StepResult) -> float:
    """The largest ``|g - g_ref| / scale`` (2-norms) over the parameters both steps gave a
    gradient; ``scale`` is ``|g_ref|``, floored at 2^-10 of the parameter's even share of the
    whole reference gradient (``|G_ref| * sqrt(n / N)``, n its elements of N): a gradient that
    is 0 but for rounding (a convolution's bias before a batch norm) is compared with the
    gradient around it, not with its own noise (where every reference gradient is 0: the
    absolute norm)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, r in ref.param_grads.items():
        g = got.param_grads.get(name)
        if g is not None and r is not None:
            pairs.append((g.double(), r.double()))
    total = sum(r.numel() for _, r in pairs)
    whole = sum(float(r.square().sum()) for _, r in pairs) ** 0.5
    worst = 0.0
    for g, r in pairs:
        floor = 2.0**-10 * whole * (r.numel() / total) ** 0.5 if total else 0.0
        scale = max(float(r.norm()), floor)
        diff = float((g - r).norm())
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def _plan_of(model: nn.Module, plan: Plan | None) -> Plan:
    """The plan to verify: ``plan``, else the one the model carries."""
    plan = plan if plan is not None else getattr(model, "memfit_plan", None)
    if plan is None:
        raise ValueError("the model carries no plan (model.memfit_plan is not set); pass plan=..., "
                         "or plan it first with memfit.fit(model, inputs, budget=...)")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a memfit.Plan, got {type(plan).__name__}")
    return plan


def _run_steps(step: Step, plan: Plan, seed: int, device: torch.device, mode: Comparison
               ) -> tuple[StepResult, StepResult | None, StepResult | Check, str]:
    """The plain step (twice when comparing within its spread) and the planned step, on twins
    or, for a model without one, on the model itself (NOTE [verify leaves the model alone]);
    the planned step is the check that failed if the plan did not apply or run. Also how they
    ran: ``"twins"`` or ``"in place"``."""
    model = step.model
    reason = no_twin_reason(model)
    got: StepResult | Check
    # NOTE [verify leaves the model alone]: twins, or the model itself with its .grad, buffers
    # and RNG state put back (NOTE [models without twins] in memfit.measuring.twins)
    with ModelState(model, step.inputs, buffers=False):
        if reason is None:
            try:
                ref = record_step(twin_step(step, None), seed=seed, device=device)
                ref2 = (record_step(twin_step(step, None), seed=seed, device=device)
                        if mode is Comparison.WITHIN_PLAIN_SPREAD else None)
            except UncopyableModel as e:
                reason = str(e)
            else:
                got = _planned_on_twin(step, plan, seed, device)
        if reason is not None:
            log.info("verify: comparing on %s itself, its plan lifted for the plain step (%s)",
                     type(model).__name__, reason)
            ref, ref2, got = _in_place(step, plan, seed, device, mode)
    return ref, ref2, got, "twins" if reason is None else "in place"


def _peak_checks_of(got: StepResult, ref: StepResult, plan: Plan, budget: int | None,
                    rtol: float, atol_bytes: int | None) -> list[Check]:
    """The planned step's peak against the prediction, the budget and the plain step: the
    allocator's peak, or in a distributed job the tensors' (NOTE [peaks in a distributed job])."""
    if _collective_job() and got.tracked_peak_bytes:  # NOTE [peaks in a distributed job]
        log.info("verify: peak checks on the tensors' peak (%d B); the allocator's, %d B, also "
                 "holds the collective backend's buffers", got.tracked_peak_bytes, got.peak_bytes)
        return _peak_checks(got.tracked_peak_bytes, ref.tracked_peak_bytes or ref.peak_bytes,
                            plan.predicted_peak_bytes, budget,
                            rtol, got.tracked_peak_bytes, len(plan.regions), atol_bytes,
                            meter=f"tensors; allocator {format_bytes(got.peak_bytes)} with the "
                                  "collective backend's buffers")
    return _peak_checks(got.peak_bytes, ref.peak_bytes, plan.predicted_peak_bytes, budget, rtol,
                        got.tracked_peak_bytes, len(plan.regions), atol_bytes)


def check_plan_matches(plan: Plan, model: nn.Module, example_inputs: Any = None, *,
                       loss_fn: Callable[[Any], torch.Tensor] | None = None) -> None:
    """Raise ``PlanMismatch`` unless ``plan`` was made for ``model`` on ``example_inputs``.

    A plan carries the op-sequence signature of the profile it was planned from; the model's
    forward on these inputs (traced once, far less than a profile) must have the same. A plan
    without a signature (made by hand) passes. ``verify`` itself runs any plan that applies
    and reports what it measures; ``memfit verify`` checks first, so that another model's plan
    is bad input, not a failed verification.

    Args:
        plan: the plan to check.
        model: the model to verify it on.
        example_inputs: the step's inputs (tensor, tuple or dict).
        loss_fn: output -> scalar loss; default the profiler's default loss.

    Raises:
        PlanMismatch: the signatures differ (another model, other input shapes, or another
            loss).

    Example:
        >>> check_plan_matches(model.memfit_plan, model, x)   # doctest: +SKIP
    """
    from memfit.errors import PlanMismatch
    from memfit.profiling.tracer import forward_signature

    if not plan.profile_signature:
        return
    sig, n_ops = forward_signature(model, example_inputs, loss_fn=loss_fn)
    if sig != plan.profile_signature:
        raise PlanMismatch(
            f"the plan is for another model: it was made for {plan.model or 'a model'} (profile "
            f"signature {plan.profile_signature}), and this {type(model).__name__} on these inputs "
            f"runs another forward (signature {sig}, {n_ops} forward ops: another model, other "
            "input shapes, or another device's kernels). Plan this model with these input shapes, "
            "or verify the model and inputs the plan was made for")


def _mode(comparison: Comparison | str | None, device: torch.device) -> Comparison:
    if comparison is None:
        return comparison_for(device)
    try:
        return Comparison(comparison)
    except ValueError:
        raise ValueError(f"comparison must be one of {[c.value for c in Comparison]} (or None: chosen by "
                         f"device and determinism), got {comparison!r}") from None


def _planned_on_twin(step: Step, plan: Plan, seed: int, device: torch.device) -> StepResult | Check:
    """The planned step on a planned twin, or the check that failed."""
    try:
        planned = twin_step(step, plan)
    except MemfitError as e:
        return Check("plan applies to the model", False, f"{type(e).__name__}: {e}")
    try:
        return record_step(planned, seed=seed, device=device)
    except MemfitError as e:
        return Check("planned step runs", False, f"{type(e).__name__}: {e}")


def _in_place(step: Step, plan: Plan, seed: int, device: torch.device,
              mode: Comparison) -> tuple[StepResult, StepResult | None, StepResult | Check]:
    """The plain step (twice when comparing within its spread) and the planned step on the
    model itself (NOTE [models without twins] in ``memfit.measuring.twins``), its state put back after
    each; the model keeps the plan it carried. In
    a distributed job a collective: the steps run the model's collectives, and ``apply``
    checks that every rank holds ``plan`` (``PlansDiffer`` instead of a deadlock)."""
    from memfit.parallel.distributed import rank_agreement
    from memfit.runtime.apply import apply_plan

    state = ModelState(step.model, step.inputs)
    with lifted_plan(step.model), state:
        ref = record_step(step.with_input_copies(), seed=seed, device=device)
        state.restore()
        ref2 = None
        if mode is Comparison.WITHIN_PLAIN_SPREAD:
            ref2 = record_step(step.with_input_copies(), seed=seed, device=device)
            state.restore()
        try:
            apply_plan(step.model, plan, agree=rank_agreement())
        except MemfitError as e:
            return ref, ref2, Check("plan applies to the model", False, f"{type(e).__name__}: {e}")
        try:
            return ref, ref2, record_step(step.with_input_copies(), seed=seed, device=device)
        except MemfitError as e:
            return ref, ref2, Check("planned step runs", False, f"{type(e).__name__}: {e}")
        finally:
            state.restore()


def print_verify(report: VerifyReport) -> None:
    """Print a ``VerifyReport`` (``verify`` returns data and prints nothing)."""
    print(report)
