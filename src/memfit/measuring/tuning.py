"""Measured plan selection: time the best few plans on the model itself and keep the fastest.

memfit's solvers are exact on its time model, and the model can be 10% off on real recompute
costs; a hand rule (sqrt segments) the model predicts slower can then run faster. ``tune``
closes that gap by measurement: it asks the planner for a few distinct plans that fit the
budget, adds every baseline plan that fits, times them all on the model in interleaved rounds,
and returns the fastest, with what it measured on ``Plan.tuning``.

NOTE [measured selection]
    1. Candidates: the solver's plan for the budget; the other exact solvers' plans (``chain``,
       ``milp``); re-solves at slightly lower budgets (``RESOLVE_FRACTIONS``), until
       ``max_plans`` distinct planner plans; then each baseline (``every_block``, ``sqrt``,
       ``save_matmuls``) whose predicted peak fits the budget. Two candidates with the same
       regions and per-op decisions are one plan (``plan_key``), named after both sources.
       Every candidate's plan records the user's budget as ``budget_bytes``: the one chosen is
       the plan for that budget; a re-solve's own lower budget is kept on the record
       (``TunedCandidate.solved_budget_bytes``).
    2. Each candidate is applied to the model itself and removed after each step
       (``memfit.measuring.tradeoff.time_plan_step``), the model's plan lifted and its gradients, buffers
       and RNG put back at the end (NOTE [sweep leaves the model alone] in ``memfit.measuring.tradeoff``).
    3. Each candidate first runs one warm-up step with the default check: it is the region's
       first, checked call, so a candidate whose recomputation diverges is dropped here, not
       chosen. Timed steps run unchecked, which is how calls 3..99 of the default check run
       (NOTE [check sampling] in ``memfit.runtime.divergence``): re-applied each round, a plan
       under the default check would time only first, checked calls (+35% on a GPT block).
    4. Rounds are interleaved, the order rotated one place each round, so that every candidate
       runs at every position of a round (NOTE [interleaving] in ``benchmarks/harness.py``);
       the garbage collector runs between steps, never inside a timed one. Medians decide;
       a tie keeps the earlier candidate (the solver's plan first).
    5. Time limit (default ``DEFAULT_LIMIT_STEPS`` profiled plain steps): candidates are
       ordered by predicted step time after the solver's plan, and the slowest predicted are
       left out until the warm-up and ``MIN_ROUNDS`` rounds fit the limit (two candidates are
       always kept); the rounds are as many as fit, at most ``max_rounds``. While timing,
       a round that would pass the limit (judged by the last round's measured length) is not
       started; one timed round always runs. Each cut is logged and noted on the record.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from memfit.errors import InfeasibleBudget, SolverTimeout
from memfit.measuring.tradeoff import DEFAULT_BASELINES, progress_bar, time_plan_step
from memfit.measuring.twins import lifted_plan, repeatable
from memfit.planning.plan import Plan, TunedCandidate, Tuning
from memfit.planning.solvers import SolverName
from memfit.profiling.profile import Profile
from memfit.step.harness import ModelState, Step, model_device
from memfit.units import format_bytes, format_seconds

__all__ = ["tune", "candidates", "time_candidates", "Candidate", "plan_key", "DEFAULT_LIMIT_STEPS",
           "DEFAULT_MAX_ROUNDS", "DEFAULT_MAX_PLANS", "MIN_ROUNDS", "RESOLVE_FRACTIONS", "EXACT_SOLVERS"]

log = logging.getLogger(__name__)

DEFAULT_LIMIT_STEPS = 10.0  # default time limit, in profiled plain steps
DEFAULT_MAX_ROUNDS = 5      # timed steps per candidate at most
DEFAULT_MAX_PLANS = 3       # distinct planner plans at most (baselines come on top)
MIN_ROUNDS = 2              # timed rounds a candidate must fit to be kept (NOTE rule 5)
RESOLVE_FRACTIONS = (0.97, 0.93, 0.88)  # lower budgets re-solved for other plans (rule 1)
EXACT_SOLVERS = ("chain", "milp")


@dataclass(frozen=True)
class Candidate:
    """A plan to time, and how it was found (``TunedCandidate.name``)."""

    name: str
    plan: Plan
    solved_budget_bytes: int | None = None  # the budget it was solved for, if not the user's

    @property
    def predicted_s(self) -> float:
        """Predicted step seconds: the profiled plain step plus the plan's recompute."""
        return self.plan.plain_step_s + self.plan.recompute_s


def plan_key(plan: Plan) -> tuple[Any, ...]:
    """What makes two plans run the same step: their regions' modules and per-op decisions."""
    return tuple((r.modules, r.ops) for r in plan.regions)


def candidates(profile: Profile, budget: int | float | str, *, solver: SolverName = "auto",
               baselines: Sequence[str] = DEFAULT_BASELINES, max_plans: int = DEFAULT_MAX_PLANS,
               solver_time_limit_s: float = 10.0) -> tuple[list[Candidate], list[str]]:
    """The distinct plans measured selection times (NOTE [measured selection], rule 1).

    Args:
        profile: the profile of the step.
        budget: as ``memfit.plan`` takes it (bytes, fraction, ``"60%"``, ``"min"``).
        solver: the planner's solver for the first plan (default ``"auto"``).
        baselines: baseline solvers whose plans are added when their predicted peak fits.
        max_plans: distinct planner plans at most (default 3), baselines not counted.
        solver_time_limit_s: seconds each solve may take (default 10.0).

    Returns:
        The candidates (the solver's plan first) and notes on what was left out.

    Raises:
        InfeasibleBudget: the solver finds no plan for the budget.

    Example:
        >>> cands, notes = candidates(memfit.profile(model, x), "60%")   # doctest: +SKIP
    """
    from memfit.planning.planner import plan_for_budget
    from memfit.planning.solvers.baselines import NoBlocks

    if max_plans < 1:
        raise ValueError(f"max_plans must be at least 1, got {max_plans}")
    first = plan_for_budget(profile, budget=budget, solver=solver, time_limit_s=solver_time_limit_s)
    budget_bytes = first.budget_bytes if first.budget_bytes is not None else profile.peak_bytes
    found: dict[tuple[Any, ...], Candidate] = {plan_key(first): Candidate(solver, first)}
    notes: list[str] = []
    if not first.regions:
        return list(found.values()), ["the un-checkpointed step fits the budget: nothing to choose"]

    def add(name: str, p: Plan) -> None:
        solved = None
        if p.budget_bytes != budget_bytes:  # a re-solve at a lower budget: the plan is for the user's
            solved, p = p.budget_bytes, dataclasses.replace(p, budget_bytes=budget_bytes)
        key = plan_key(p)
        if key in found:
            c = found[key]
            found[key] = dataclasses.replace(c, name=f"{c.name}={name}")
        else:
            found[key] = Candidate(name, p, solved)

    tries: list[tuple[str, str, int]] = [(s, s, budget_bytes) for s in EXACT_SOLVERS if s != solver]
    tries += [(f"{solver}@{f:.0%}", solver, int(budget_bytes * f)) for f in RESOLVE_FRACTIONS]
    for name, s, b in tries:
        if len(found) >= max_plans:
            break
        try:
            add(name, plan_for_budget(profile, budget=b, solver=s, time_limit_s=solver_time_limit_s))
        except (InfeasibleBudget, SolverTimeout, ValueError) as e:  # ValueError: chain's NotAChain
            log.info("tune: no %s plan for %s: %s", name, format_bytes(b), str(e).split(";")[0])
    for base in baselines:
        try:
            p = plan_for_budget(profile, budget=budget_bytes, solver=base)
        except NoBlocks:
            notes.append(f"left out {base}: found no blocks to checkpoint")
            continue
        if p.predicted_peak_bytes > budget_bytes:
            notes.append(f"left out {base}: predicted peak {format_bytes(p.predicted_peak_bytes)} "
                         f"> budget {format_bytes(budget_bytes)}")
            continue
        add(base, p)
    return list(found.values()), notes


def _schedule(cands: list[Candidate], limit_s: float, max_rounds: int) -> tuple[int, int]:
    """How many candidates (from the front) and rounds fit ``limit_s`` (NOTE rule 5)."""
    n = len(cands)
    while n > min(2, len(cands)) and sum(c.predicted_s for c in cands[:n]) * (1 + MIN_ROUNDS) > limit_s:
        n -= 1
    per_round = sum(c.predicted_s for c in cands[:n])
    rounds = math.floor(limit_s / per_round) - 1 if per_round > 0 else max_rounds
    return n, max(1, min(max_rounds, rounds))


def time_candidates(step: Step, cands: Sequence[Candidate], *, time_limit_s: float,
                    max_rounds: int = DEFAULT_MAX_ROUNDS, progress: bool = True,
                    clock: Callable[[], float] = time.perf_counter,
                    notes: Sequence[str] = ()) -> Plan:
    """Time ``cands`` on ``step``'s model, interleaved; return the fastest plan, with the record.

    Args:
        step: the step to time, of the model the plans are for (left as found: NOTE
            [measured selection], rule 2).
        cands: the plans, the preferred first (ties keep the earlier one).
        time_limit_s: seconds of stepping allowed (NOTE rule 5).
        max_rounds: timed steps per candidate at most (default 5).
        progress: a progress bar on stderr when it is a terminal (needs rich).
        clock: seconds (default ``time.perf_counter``); tests inject their own.
        notes: notes to keep on the record (what was left out before timing).

    Returns:
        The fastest candidate's plan with ``tuning`` set (``Tuning``).

    Raises:
        ValueError: no candidates, or ``max_rounds`` below 1.
        Exception: the first candidate's error, when every candidate failed its warm-up.
    """
    if not cands:
        raise ValueError("time_candidates needs at least one candidate")
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be at least 1, got {max_rounds}")
    order = [cands[0], *sorted(cands[1:], key=lambda c: c.predicted_s)]
    n, rounds = _schedule(order, time_limit_s, max_rounds)
    kept_notes = list(notes)
    if n < len(order):
        cut = ", ".join(c.name for c in order[n:])
        kept_notes.append(f"not timed (time limit {format_seconds(time_limit_s)}): {cut}")
        log.info("tune: %s leaves time for %d of %d candidates; not timing %s",
                 format_seconds(time_limit_s), n, len(order), cut)
    timed, untimed = order[:n], order[n:]
    model = step.model
    device = model_device(model)
    times: dict[str, list[float]] = {c.name: [] for c in timed}
    failed: dict[str, BaseException] = {}
    gc_was_enabled = gc.isenabled()
    start = clock()
    show = progress and sys.stderr.isatty()
    with ModelState(model, step.inputs) as state, lifted_plan(model), \
            progress_bar(show, len(timed) * (1 + rounds), "tune") as advance:
        state.clear_grads()
        run = repeatable(step.with_input_copies(), seed=0)
        gc.disable()  # a collection inside one candidate's step would be charged to it
        try:
            for c in timed:  # warm-up: the first, checked call of each (NOTE rule 3)
                gc.collect()
                try:
                    time_plan_step(model, c.plan, run, device, check=True, clock=clock)
                except Exception as e:  # noqa: BLE001 - a failing candidate is dropped, not chosen
                    log.warning("tune: candidate %s failed its warm-up step: %s: %s", c.name, type(e).__name__, e)
                    failed[c.name] = e
                advance(f"tune: warm-up {c.name}")
            live = [c for c in timed if c.name not in failed]
            if not live:
                raise failed[timed[0].name]
            last_round_s = 0.0
            done = 0
            for r in range(rounds):
                if r and clock() - start + last_round_s > time_limit_s:
                    kept_notes.append(f"stopped after {r} of {rounds} rounds: time limit "
                                      f"{format_seconds(time_limit_s)}")
                    log.info("tune: time limit %s reached after %d rounds", format_seconds(time_limit_s), r)
                    break
                t0 = clock()
                for i in range(len(live)):
                    c = live[(r + i) % len(live)]  # rotated one place each round (NOTE rule 4)
                    gc.collect()
                    times[c.name].append(time_plan_step(model, c.plan, run, device, clock=clock))
                    advance(f"tune: round {r + 1} of {rounds}")
                last_round_s = clock() - t0
                done = r + 1
        finally:
            if gc_was_enabled:
                gc.enable()
    spent = clock() - start
    medians = {name: statistics.median(ts) for name, ts in times.items() if ts}
    best = min((c for c in timed if c.name in medians), key=lambda c: medians[c.name])
    record = Tuning(
        candidates=tuple(
            TunedCandidate(c.name, c.plan.solver, c.plan.predicted_peak_bytes, c.predicted_s,
                           medians.get(c.name), len(times.get(c.name, ())),
                           note=(f"failed: {type(failed[c.name]).__name__}: {str(failed[c.name])[:200]}"
                                 if c.name in failed else "not timed: time limit" if c in untimed else ""),
                           solved_budget_bytes=c.solved_budget_bytes)
            for c in cands),
        chosen=best.name, time_limit_s=float(time_limit_s), spent_s=float(spent), notes=tuple(kept_notes))
    log.info("tune: chose %s (%s median over %d rounds) of %d candidates in %s", best.name,
             format_seconds(medians[best.name]), done, len(medians), format_seconds(spent))
    return dataclasses.replace(best.plan, tuning=record)


def tune(step: Step, profile: Profile, budget: int | float | str, *, solver: SolverName = "auto",
         baselines: Sequence[str] = DEFAULT_BASELINES, max_plans: int = DEFAULT_MAX_PLANS,
         time_limit_s: float | None = None, max_rounds: int = DEFAULT_MAX_ROUNDS,
         progress: bool = True, clock: Callable[[], float] = time.perf_counter,
         solver_time_limit_s: float = 10.0) -> Plan:
    """The fastest measured of the plans that fit ``budget`` (NOTE [measured selection]).

    Args:
        step: the step ``profile`` describes (``memfit.step.harness.Step``), run on its model.
        profile: the profile of ``step``.
        budget: bytes, a fraction of the plain peak, a string (``"60%"``, ``"6GiB"``) or
            ``"min"``.
        solver: the planner's solver for the first candidate (default ``"auto"``).
        baselines: baselines added when their predicted peak fits (default all three).
        max_plans: distinct planner plans at most (default 3).
        time_limit_s: seconds of stepping allowed; default ``DEFAULT_LIMIT_STEPS`` (10) times
            the profiled plain step.
        max_rounds: timed steps per candidate at most (default 5).
        progress: a progress bar on stderr when it is a terminal (default True; needs rich).
        clock: the timer (seconds), default ``time.perf_counter``.
        solver_time_limit_s: seconds each solve may take (default 10.0).

    Returns:
        The chosen ``Plan``, ``plan.tuning`` recording every candidate and its median.

    Raises:
        InfeasibleBudget: no plan fits the budget.

    Example:
        >>> step = memfit.step.harness.Step.of(model, x)                   # doctest: +SKIP
        >>> p = tune(step, memfit.profile(step), "60%"); print(p)  # doctest: +SKIP
    """
    cands, notes = candidates(profile, budget, solver=solver, baselines=baselines, max_plans=max_plans,
                              solver_time_limit_s=solver_time_limit_s)
    limit = DEFAULT_LIMIT_STEPS * profile.step_time_s if time_limit_s is None else float(time_limit_s)
    if limit <= 0:
        raise ValueError(f"time_limit_s must be positive, got {limit}")
    if len(cands) == 1 and not cands[0].plan.regions:
        p = cands[0].plan
        c = TunedCandidate(cands[0].name, p.solver, p.predicted_peak_bytes, cands[0].predicted_s,
                           note="nothing to checkpoint: not timed")
        return dataclasses.replace(p, tuning=Tuning((c,), c.name, limit, 0.0, tuple(notes)))
    log.info("tune: %d candidates, time limit %s", len(cands), format_seconds(limit))
    return time_candidates(step, cands, time_limit_s=limit, max_rounds=max_rounds, progress=progress,
                           clock=clock, notes=notes)
