"""``profile`` with a calibrated time model: trace the step, then time a few baseline plans.

The tracer (``memfit.profiling``) decides nothing and applies nothing; timing a plan needs the
planner and the runtime, so the calibration runs here, above all three stages, and the public
``memfit.profile`` is this module's :func:`profile`.

NOTE [calibrated steady state]
    The time model predicts a planned step in the steady state of apply's default check
    (``check=True``: each region's first 3 calls checked, then one in 100): an unchecked call,
    which runs exactly as ``check=False`` with a call counter (NOTE [check sampling] in
    ``memfit.runtime.divergence``). The first calls, and one in 100 after them, cost more
    (measured: ops and values +35% on a GPT step). The calibration therefore times each plan
    applied with ``STEADY_CHECK`` (the default's sampler, no call checked): the code path of
    the default's unchecked calls, reached without the 4 warm-up steps per plan that the
    default itself would need (NOTE [calibration cost]).

NOTE [calibration cost]
    Profiling already costs about 4.5 plain steps (``memfit.profiling.tracer.trace``). The
    calibration times one step of every-block checkpointing (``every_block`` baseline) and
    one of every block saving its matmuls (``save_matmuls``; skipped when it is the same
    plan) per round, and from the second round on a plain step too, interleaved (NOTE
    [interleaving] in ``benchmarks.harness``), the order rotated each round. The first round
    warms up and is not counted: a plan's first step pays one-time costs (measured once on
    the zoo GPT: save-matmuls' first step 60 ms, 7% of the step, slower than its next ones),
    and a plain step timed between checkpointed ones is the step a training run's timings are
    compared with (the profile's own plain step, timed after the tracer's, ran 5% faster
    there). ``rounds`` (default 4) counts the warm-up round; medians of the counted rounds
    decide (three, so that one outlying step does not: with one counted step, three
    benchmark runs of the zoo GPT fitted common scales 0.90, 0.98 and 1.13, and the plans
    and their predicted step times, -8% to +1% of measured, moved with them), and the
    profile's ``step_time_s`` becomes the median of the interleaved plain steps. The
    default costs about 13 plain steps on the zoo GPT (2 suffices for a first look: one
    counted step, about 6 plain steps). The fixed charges come
    from NOTE [measured dispatch charges] (``memfit.measuring.dispatch_cost``, about 1.3 s once per
    process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from memfit.planning.plan import Plan
from memfit.profiling.measure import time_step
from memfit.profiling.profile import Profile
from memfit.profiling.tracer import ProfileMode, trace
from memfit.runtime.divergence import DivergenceCheck
from memfit.runtime.marks import carries_plan, plans_suspended
from memfit.step.harness import ModelState, Step, model_device
from memfit.step.inputs import LossFn
from memfit.timemodel.calibration import SEPARATE_SPREAD, Calibration, TimedPlan, fit_calibration

__all__ = ["profile", "calibrate", "STEADY_CHECK", "MIN_BLOCKS"]

log = logging.getLogger(__name__)

# NOTE [calibrated steady state]: apply's default sampler with no call checked
STEADY_CHECK = DivergenceCheck(first_calls=0, every=0)
# fewer checkpointable blocks than this: too little recompute to tell from timing noise
MIN_BLOCKS = 2
_PLANS = ("every_block", "save_matmuls")


def profile(
    model: torch.nn.Module | Step,
    example_inputs: Any = None,
    *,
    loss_fn: LossFn | None = None,
    mode: ProfileMode | str = ProfileMode.MEASURE,
    device: str | torch.device | None = None,
    repeats: int = 3,
    target: str = "cpu",
    calibrate_time: bool = True,
    rounds: int = 4,
) -> Profile:
    """Trace one forward + loss + backward of ``model`` into a Profile; in measure mode, also
    calibrate its recompute time model on a few timed steps (NOTE [calibration] in
    ``memfit.timemodel``).

    A model that carries a memfit plan (``fit``, ``apply``, ``wrap``) is traced plainly, the
    plan suspended and left exactly as it was (NOTE [suspended plans] in ``memfit.runtime.marks``):
    the profile is of the plain step, ``extra["plan_suspended"]`` is True, and the time model is
    the default one (baseline plans are not timed on a planned model).

    Args:
        model, example_inputs, loss_fn, mode, device, repeats, target: as
            :func:`memfit.profiling.tracer.trace`.
        calibrate_time: time baseline plans and fit the time model (measure mode only;
            default True). False, or fake mode: the default time model (today's constants).
        rounds: timed steps per baseline plan, the first a warm-up (default 4, about 13 plain
            steps of extra time: NOTE [calibration cost]); 1 counts the cold first steps.

    Example:
        >>> m = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
        >>> p = profile(m, torch.randn(32, 64))
        >>> p.calibration.source.value in ("fit", "default")
        True
    """
    planned = carries_plan(model.model if isinstance(model, Step) else model)
    # NOTE [suspended plans]: the plain step, whatever plan the model carries
    with plans_suspended() if planned else contextlib.nullcontext():
        prof = trace(model, example_inputs, loss_fn=loss_fn, mode=mode, device=device,
                             repeats=repeats, target=target)
    if planned:
        log.info("profile: %s carries a memfit plan; traced its plain step (the plan suspended)",
                 prof.model)
        prof = dataclasses.replace(prof, extra={**prof.extra, "plan_suspended": True})
    if not calibrate_time or prof.mode != ProfileMode.MEASURE.value:
        return prof
    step = model if isinstance(model, Step) else Step.of(model, example_inputs, loss_fn=loss_fn)
    return calibrate(prof, step, rounds=rounds)


def calibrate(prof: Profile, step: Step, *, rounds: int = 4) -> Profile:
    """``prof`` with its time model fitted to timed steps of baseline plans of ``step``.

    The model is left as found (grads, buffers, RNG state; the plans are removed). Where the
    plans cannot be timed or tell nothing (fewer than ``MIN_BLOCKS`` blocks, a model that
    already carries a plan, a plan that fails), the profile gets the default time model and
    the reason.

    In a distributed job every rank calls it: the baseline plans are made on rank 0 and
    given to every rank (``plan_once``), since their timed steps run the job's collectives
    (tensor parallelism) and every rank must run the same regions.

    A failure of the calibration itself (a baseline plan the simulator rejects, a step that
    fails once planned) is logged and gives the default time model with the reason: it never
    fails the profile.

    Raises:
        ValueError: ``rounds`` below 1.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    t0 = time.perf_counter()
    plain_s = prof.step_time_s
    try:
        cal, plain_s = _calibration(prof, step, rounds)
    except Exception as e:  # noqa: BLE001 - a failed calibration must not fail the profile
        log.info("calibration failed (%s: %s); default time model", type(e).__name__, e)
        cal = Calibration.default(f"calibration failed: {type(e).__name__}: {str(e)[:300]}")
    wall = time.perf_counter() - t0
    log.info("calibrated %s in %.3fs (%.1f plain steps): %s", prof.model, wall,
             wall / prof.step_time_s if prof.step_time_s > 0 else float("nan"), _describe(cal))
    extra = {**prof.extra, "calibration_wall_s": wall}
    if plain_s != prof.step_time_s:
        extra["traced_step_time_s"] = prof.step_time_s
    return dataclasses.replace(prof, calibration=cal, step_time_s=plain_s, extra=extra)


def _calibration(prof: Profile, step: Step, rounds: int) -> tuple[Calibration, float]:
    """The fitted calibration and the plain step's seconds (NOTE [calibration cost])."""
    from memfit.measuring.dispatch_cost import measure_dispatch_charges
    from memfit.parallel.distributed import plan_once
    from memfit.planning.planner import plan_for_budget
    from memfit.planning.simulate import time_terms
    from memfit.planning.solvers.baselines import NoBlocks

    model = step.model
    plain = prof.step_time_s
    if carries_plan(model):
        return Calibration.default("the model carries a memfit plan (suspended while tracing): "
                                   "baseline plans are not timed on it"), plain
    plans: dict[str, Plan] = {}
    for name in _PLANS:
        try:  # one plan per job: the timed steps run the ranks' collectives together
            p = plan_once(functools.partial(plan_for_budget, prof, budget=1.0, solver=name))
        except NoBlocks:
            return Calibration.default("no checkpointable blocks: no recompute to time"), plain
        if name == "every_block" and len(p.regions) < MIN_BLOCKS:
            return Calibration.default(f"{len(p.regions)} checkpointable block(s), fewer than "
                                       f"{MIN_BLOCKS}: too little recompute to time"), plain
        if all(tuple(p.regions) != tuple(q.regions) for q in plans.values()):
            plans[name] = p
    terms = {name: time_terms(prof, p) for name, p in plans.items()}  # before any step runs
    charges = measure_dispatch_charges(model_device(model))
    prior = dataclasses.replace(prof.calibration or Calibration(), region_s=charges.region_s,
                                op_s=charges.op_s, selective_op_s=charges.selective_op_s,
                                keep_s_per_element=charges.keep_s_per_element,
                                charges_measured=charges.measured)
    times = _time_plans(step, plans, rounds)
    skip = 1 if rounds > 1 else 0  # NOTE [calibration cost]: round 0 warms up
    plain = statistics.median(times.pop("plain") or [prof.step_time_s])
    counted = {name: times[name][skip:] for name in plans}
    rows = [TimedPlan(name, terms[name], statistics.median(ts) - plain, statistics.median(ts))
            for name, ts in counted.items()]
    # NOTE [calibration]: two scales only from repeated steps that agree
    separate = all(len(ts) >= 2 and (max(ts) - min(ts)) <= SEPARATE_SPREAD * statistics.median(ts)
                   for ts in counted.values())
    return fit_calibration(rows, prior=prior, separate_scales=separate, hold=charges.measured), plain


def _time_plans(step: Step, plans: dict[str, Plan], rounds: int) -> dict[str, list[float]]:
    """Step times of each plan (and of the plain step after the first round), interleaved."""
    from memfit.parallel.distributed import rank_agreement
    from memfit.runtime.apply import apply_plan, unapply

    model = step.model
    names: list[str | None] = [None, *plans]
    out: dict[str, list[float]] = {"plain": [], **{n: [] for n in plans}}
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    gc_was_enabled = gc.isenabled()
    with ModelState(model, step.inputs) as keep:
        try:
            gc.disable()  # a collection inside one plan's window would be charged to it
            for r in range(rounds):
                for i in range(len(names)):
                    name = names[(r + i) % len(names)]
                    if name is None and r == 0:
                        continue  # the profile's own plain step is the first round's
                    if name is not None:
                        # as memfit.apply does: a collective in a distributed job
                        apply_plan(model, plans[name], check=STEADY_CHECK, agree=rank_agreement())
                    try:
                        out[name or "plain"].append(_timed(lambda: keep.run(step), dev))
                    finally:
                        if name is not None:
                            unapply(model)
        finally:
            if gc_was_enabled:
                gc.enable()
    return out


def _timed(fn: Callable[[], None], dev: torch.device) -> float:
    gc.collect()  # an earlier step's garbage is not this one's time
    return time_step(fn, dev)


def _describe(cal: Calibration) -> str:
    if cal.fitted:
        return (f"matmul x{cal.matmul_scale:.3f}, other x{cal.other_scale:.3f} "
                f"(fitted: {', '.join(cal.fitted)})")
    return f"default time model ({cal.reason})"
