"""A pipeline stage's plan: one micro-batch's profile, planned for the micro-batches it holds.

NOTE [pipeline stage memory model]
    A stage of a pipeline schedule runs the forward of several micro-batches before the
    backward of the first of them (GPipe: all of them; 1F1B: stage i of p holds up to p - i),
    so at its peak it holds ``k`` micro-batches' activations at once (``k`` = ``in_flight``,
    ``memfit.parallel.pipeline.in_flight``). From one profile of one micro-batch's step (forward of the
    stage module, loss or a sum of its output, backward) and a plan, memfit predicts the
    stage's peak over the whole schedule step as

        stage peak = (k - 1) * held + step peak + kept

    where, for that plan (``simulate``):
      1. ``held`` is the activation memory live at the end of the micro-batch's forward (the
         loss included): what the stage keeps for the micro-batch's backward, its output
         (kept by the stage) and, inside checkpointed regions, only what the regions save;
      2. ``step peak`` is the plan's predicted peak of one micro-batch's step (forward and
         backward), which holds its own ``held``;
      3. ``kept`` (``extra_bytes``): what the schedule itself keeps besides the held
         micro-batches. Measured with torch's ``Schedule1F1B``: one micro-batch's output on a
         stage that sends forward and one input gradient on a stage that sends back, each
         kept by the Python reference to its finished send (``send_work``, ``bwd_sends`` in
         ``_step_microbatches``) while the next backward runs; ``ScheduleGPipe`` keeps its
         sends until the step ends too, but only outputs of micro-batches it holds anyway at
         its peak (the first backward): 0 there (``memfit.parallel.pipeline.kept_by_sends``);
      4. weights, gradients and the stage's buffers (the receive buffers torch's
         ``PipelineStage`` allocates per micro-batch on its first step) are static: counted
         once, before the step, outside the budget, like every memfit budget. Gradients are
         static when they exist before the step (zeroed, not ``None``): the profile then
         sees each micro-batch's backward accumulate into them, as every micro-batch after
         the first does in a pipeline.
    Every micro-batch's step peak comes while ``k - 1`` others are held: a 1F1B stage runs a
    backward (or, after one, a forward) with ``k - 1`` micro-batches forwarded and not yet
    backwarded; a GPipe stage runs its last forward and first backward with ``n - 1`` held.
    A plan's budget is per micro-batch, so the stage's planner solves for a grid of
    per-micro-batch budgets and keeps the candidate with the least recompute whose stage peak
    fits the stage budget (:func:`plan_stage`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfit.errors import InfeasibleBudget
from memfit.planning.plan import Plan
from memfit.planning.simulate import Simulation, simulate
from memfit.profiling.profile import Profile
from memfit.units import format_bytes, resolve_budget

__all__ = ["StagePeak", "held_bytes", "stage_peak", "stage_candidates", "plan_stage"]

GRID_STEPS = 16  # per-micro-batch budgets the candidates are planned for


@dataclass(frozen=True)
class StagePeak:
    """A plan's predicted stage peak (NOTE [pipeline stage memory model]), bytes."""

    in_flight: int
    held_bytes: int       # one micro-batch's activations kept from its forward to its backward
    step_peak_bytes: int  # one micro-batch's step peak
    peak_bytes: int       # (in_flight - 1) * held_bytes + step_peak_bytes + extra_bytes
    extra_bytes: int = 0  # kept by the schedule (its sends) besides the held micro-batches


def held_bytes(profile: Profile, sim: Simulation) -> int:
    """Activation bytes live at the end of the step's forward (its last forward op), per
    ``sim`` (the simulation of a plan of ``profile``)."""
    held = 0
    for live, pos in zip(sim.live_bytes, sim.positions, strict=True):
        if pos < profile.n_forward:
            held = live
        else:
            break
    return int(held)


def stage_peak(profile: Profile, plan: Plan, in_flight: int, *, extra_bytes: int = 0) -> StagePeak:
    """The stage peak of ``plan`` when the stage holds ``in_flight`` micro-batches and the
    schedule keeps ``extra_bytes`` (bytes, default 0) besides them.

    Example:
        >>> stage_peak(profile, memfit.plan(profile, budget="min"), 4).peak_bytes  # doctest: +SKIP
    """
    _check_in_flight(in_flight)
    sim = simulate(profile, plan)
    held = held_bytes(profile, sim)
    peak = (in_flight - 1) * held + int(sim.peak_bytes) + extra_bytes
    return StagePeak(in_flight, held, int(sim.peak_bytes), peak, extra_bytes)


def stage_candidates(profile: Profile, *, solver: str = "auto", time_limit_s: float = 10.0,
                     steps: int = GRID_STEPS) -> tuple[Plan, ...]:
    """The plans :func:`plan_stage` chooses from: no checkpointing, the smallest-peak plan,
    and ``solver``'s plan for each of ``steps`` per-micro-batch budgets evenly spaced between
    their peaks. One set for every ``in_flight``, so a stage holding fewer micro-batches
    never gets a slower plan than one holding more (its feasible set is larger)."""
    from memfit.planning.planner import plan_for_budget

    none = plan_for_budget(profile, budget=profile.peak_bytes, solver="none")
    smallest = plan_for_budget(profile, budget="min", solver=solver, time_limit_s=time_limit_s)
    out = [none, smallest]
    lo, hi = smallest.predicted_peak_bytes, none.predicted_peak_bytes
    for i in range(1, steps + 1):
        b = lo + (hi - lo) * i // (steps + 1)
        try:
            out.append(plan_for_budget(profile, budget=b, solver=solver, time_limit_s=time_limit_s))
        except InfeasibleBudget:
            continue
    return tuple(out)


def plan_stage(profile: Profile, *, budget: int | float | str, in_flight: int,
               solver: str = "auto", time_limit_s: float = 10.0,
               candidates: tuple[Plan, ...] | None = None, extra_bytes: int = 0) -> Plan:
    """The plan with the least recompute whose stage peak, holding ``in_flight``
    micro-batches, fits ``budget`` (NOTE [pipeline stage memory model]).

    Args:
        profile: the profile of one micro-batch's step of the stage module.
        budget: the cap on the stage's activation peak over the whole schedule step: int
            bytes, a float fraction (or ``"60%"``) of the un-checkpointed stage peak
            (``(in_flight - 1) * held + peak`` of the plain step), or a size (``"2GiB"``).
        in_flight: micro-batches whose activations the stage holds at once, >= 1
            (``memfit.parallel.pipeline.in_flight``).
        solver, time_limit_s: as ``memfit.planning.planner.plan_for_budget``.
        candidates: the plans to choose from (default :func:`stage_candidates`), to plan
            one profile for several counts or budgets without solving again.
        extra_bytes: bytes the schedule keeps besides the held micro-batches (default 0;
            ``memfit.parallel.pipeline.kept_by_sends``), inside the budget.

    Returns:
        The plan; its ``budget_bytes`` and ``predicted_peak_bytes`` are per micro-batch, and
        ``plan.extra["pipeline"]`` holds ``in_flight``, ``held_bytes``, ``stage_peak_bytes``
        and ``stage_budget_bytes``.

    Raises:
        InfeasibleBudget: no candidate's stage peak fits; ``min_feasible_bytes`` is the
            smallest stage peak of the candidates.
        ValueError: ``in_flight`` below 1.

    Example:
        >>> p = plan_stage(profile, budget="50%", in_flight=4)          # doctest: +SKIP
        >>> p.extra["pipeline"]["stage_peak_bytes"] <= p.extra["pipeline"]["stage_budget_bytes"]  # doctest: +SKIP
        True
    """
    _check_in_flight(in_flight)
    if candidates is None:
        candidates = stage_candidates(profile, solver=solver, time_limit_s=time_limit_s)
    peaks = [stage_peak(profile, p, in_flight, extra_bytes=extra_bytes) for p in candidates]
    cap = resolve_budget(budget, peaks[0].peak_bytes)  # candidates[0]: no checkpointing
    fits = [(p.recompute_s, i) for i, (p, sp) in enumerate(zip(candidates, peaks, strict=True))
            if sp.peak_bytes <= cap]
    if not fits:
        low = min(peaks, key=lambda sp: sp.peak_bytes)
        raise InfeasibleBudget(
            f"no plan fits the stage budget {format_bytes(cap)} holding {in_flight} "
            f"micro-batches: the smallest stage peak is {format_bytes(low.peak_bytes)} "
            f"({in_flight - 1} x {format_bytes(low.held_bytes)} held + "
            f"{format_bytes(low.step_peak_bytes)} step peak + {format_bytes(extra_bytes)} kept by "
            "the schedule); raise the budget, use more "
            "stages or smaller micro-batches", budget_bytes=cap, min_feasible_bytes=low.peak_bytes)
    _, i = min(fits)
    return _with_stage(candidates[i], peaks[i], cap)


def _with_stage(plan: Plan, peak: StagePeak, cap: int) -> Plan:
    info = {"in_flight": peak.in_flight, "held_bytes": peak.held_bytes,
            "stage_peak_bytes": peak.peak_bytes, "stage_budget_bytes": cap,
            "extra_bytes": peak.extra_bytes}
    return dataclasses.replace(plan, extra={**plan.extra, "pipeline": info})


def _check_in_flight(in_flight: int) -> None:
    if not isinstance(in_flight, int) or isinstance(in_flight, bool) or in_flight < 1:
        raise ValueError(f"in_flight must be an int >= 1 (micro-batches the stage holds at "
                         f"once), got {in_flight!r}")
