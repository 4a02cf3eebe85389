"""``plan()``: the fastest checkpoint plan whose predicted peak fits a memory budget."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from memfit.errors import InfeasibleBudget
from memfit.planning.candidates import PlanningContext
from memfit.planning.collectives import replayed_collectives
from memfit.planning.hidden_host import device_only, plan_hides, rule_4_applies
from memfit.planning.job import (
    JobMemory,
    JobSpec,
    activation_budget,
    job_memory,
    model_memory,
    smallest_world_size,
    step_phase_bytes,
)
from memfit.planning.offload import OffloadSpec, link_of
from memfit.planning.plan import Plan, Region
from memfit.planning.rules import writes_buffers
from memfit.planning.simulate import simulate
from memfit.planning.solvers import BASELINES, Infeasible, Solution, get_solver
from memfit.planning.solvers.offload_route import offload_solver
from memfit.profiling.profile import Profile, is_for_compiler
from memfit.timemodel.devices import DevicePreset
from memfit.units import format_bytes, parse_bytes, resolve_budget

__all__ = ["plan_for_budget", "plan_for_device", "refuse_over_budget", "MAX_RETRIES"]

log = logging.getLogger(__name__)

MAX_RETRIES = 8  # re-solves with a tightened budget when simulate() disagrees with the model


def plan_for_budget(profile: Profile, *, budget: int | float | str | None = None, solver: str = "auto",
         time_limit_s: float = 10.0, offload: bool = False, host_budget: int | str | None = None,
         target: str | DevicePreset | None = None, job: JobSpec | None = None) -> Plan:
    """Find the checkpoint plan with the least recompute time whose peak fits ``budget``.

    Planning reads a :class:`~memfit.profiling.profile.Profile` only (it never runs a model):
    make one with ``memfit.profile(model, x)``, or let ``memfit.fit`` do all three stages.

    Args:
        profile: the profile of one training step.
        budget: peak activation memory allowed: int bytes, float fraction of the
            un-checkpointed peak, a string (``"6GiB"``, ``"60%"``), or ``"min"``: the fastest
            of the plans with the smallest peak any plan of ``solver`` reaches.
        solver: ``"auto"`` (default), ``"chain"``, ``"milp"``, ``"greedy"``, ``"brute"``, or a
            baseline: ``"none"``, ``"every_block"``, ``"sqrt"``, ``"save_matmuls"``.
        time_limit_s: seconds the MILP may search (default 10.0). Past it, ``"auto"`` keeps
            the best plan found (the MILP's, else the chain or greedy solver's).
        offload: also consider keeping op outputs in host memory (``OpPolicy.OFFLOAD``;
            default ``False``; NOTE [offload memory model] and NOTE [offload time model] in
            ``memfit.planning.offload``). ``"milp"`` and ``"brute"`` model it exactly;
            ``"auto"`` uses the MILP when small enough; ``"chain"`` (and ``"auto"`` on a chain)
            also runs the chain DP with offload (NOTE [chain DP with offload]); all but the
            exact solvers finish with the offload pass (NOTE [chain and offload]). On a CPU
            target it is a no-op, logged and noted in the plan: a CPU has no host link.
        host_budget: with ``offload``, the most host memory the plan may hold: int bytes or a
            size (``"64GiB"``); default ``None``: no cap.
        target: the device preset whose host link times the copies (``"v100"``, ``"a100"``, ``"h100"``,
            ``"h200"``); default: the profile's own (its fake-mode target). Needed for a
            profile measured on a GPU.
        job: the device and what else the job keeps on it (``memfit.planning.job.JobSpec``;
            ``memfit.plan`` makes it from a ``memfit.Job``): the
            activation budget is what the device leaves after weights, optimizer states and
            the reserve (NOTE [the job's memory]), capped by ``budget`` if given too; the plan
            carries the breakdown as ``plan.memory``.

    Returns:
        A :class:`~memfit.planning.plan.Plan` whose ``predicted_peak_bytes`` and
        ``recompute_s`` come from :func:`~memfit.planning.simulate.simulate`.

    Raises:
        InfeasibleBudget: no plan fits; the message and ``min_feasible_bytes`` give the smallest
            predicted peak any plan reaches. With ``job``: also when the job does not fit with
            the smallest plan; ``memory`` is that plan's breakdown, the message says what would
            fit (sharding over more devices). A baseline's fixed plan is returned even over the
            budget (with a note), for comparison; ``memfit.fit`` refuses to apply it.
        NoBlocks: (a ``ValueError``) a baseline found no blocks to checkpoint (NOTE [baseline
            blocks] in ``memfit.planning.solvers.baselines``).
        SolverTimeout: only for ``solver="milp"``: it found no plan within ``time_limit_s``
            (``"auto"`` then returns the chain or greedy solver's plan instead).
        ValueError: an unknown solver, a bad budget or host budget, or ``offload=True`` for
            a profile whose host link is unknown (measured on a GPU, no ``target``).

    Example:
        >>> prof = memfit.profile(model, x)            # doctest: +SKIP
        >>> p = plan(prof, budget="60%")               # doctest: +SKIP
        >>> p.predicted_peak_bytes <= p.budget_bytes   # doctest: +SKIP
        True
    """
    if not isinstance(profile, Profile):
        raise TypeError(
            f"plan takes a memfit.Profile, got {type(profile).__name__}; profile the step first "
            "(prof = memfit.profile(model, example_inputs); memfit.plan(prof, budget=...)) or "
            "use memfit.fit(model, example_inputs, budget=...) to profile, plan and apply")
    args = (solver, time_limit_s, offload, host_budget, target)
    if job is None:
        if budget is None:
            raise TypeError("plan needs budget= (a cap on the activation peak) or a job "
                            "(memfit.Job(device='80GiB', ...): the device the whole job must fit)")
        return _plan_activations(profile, budget, *args)
    return plan_for_device(profile, job, budget, *args)


def plan_for_device(profile: Profile, job: JobSpec, budget: int | float | str | None,
                    *args: Any) -> Plan:
    """``plan`` with a ``job`` (NOTE [the job's memory] in ``memfit.planning.job``)."""
    mm = model_memory(profile.parameters, profile.buffer_bytes, job)
    cap = activation_budget(mm, job)
    result: Plan | None = None
    if cap > 0 and step_phase_bytes(mm, job) <= cap:
        wanted = cap if budget is None or _is_min(budget) else min(cap, resolve_budget(budget, profile.peak_bytes))
        try:
            result = _plan_activations(profile, "min" if _is_min(budget) else wanted, *args)
        except InfeasibleBudget:
            result = None
    if result is not None:
        memory = job_memory(mm, job, result.predicted_peak_bytes)
        if memory.fits:
            return dataclasses.replace(result, memory=memory)
    smallest = _plan_activations(profile, "min", *args)
    memory = job_memory(mm, job, smallest.predicted_peak_bytes)
    if memory.fits and budget is not None and not _is_min(budget):  # budget= is the cap that binds
        raise _budget_binds(resolve_budget(budget, profile.peak_bytes), memory, args[0])
    raise _job_infeasible(profile, job, mm, memory)


def _budget_binds(budget_bytes: int, memory: JobMemory, solver: str) -> InfeasibleBudget:
    """The error for ``budget=`` below the smallest peak under a ``device_memory`` that holds
    the job with the smallest plan: the budget is named, not the device; the breakdown is
    that plan's."""
    least = memory.activations_bytes
    return InfeasibleBudget(
        f"budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the smallest peak "
        f"any plan of solver {solver!r} reaches: {format_bytes(least)} ({least} bytes); the "
        f"device ({format_bytes(memory.device_memory_bytes)}) would hold the job with that plan "
        f"({format_bytes(memory.total_bytes)}, {format_bytes(memory.free_bytes)} free). Give a "
        f"budget of at least {least} bytes, or drop budget= to plan for the device alone.\n"
        + "\n".join(memory.lines()),
        budget_bytes=budget_bytes, min_feasible_bytes=least, memory=memory,
        fits_with=(f"a budget of at least {least} bytes",))


def _job_infeasible(profile: Profile, job: JobSpec, mm: Any, memory: JobMemory) -> InfeasibleBudget:
    """The error for a job that does not fit with its smallest plan: the breakdown, the
    shortfall, and the sharding that would fit (computed)."""
    fits_with: list[str] = []
    n = smallest_world_size(profile.parameters, profile.buffer_bytes, job, memory.activations_bytes)
    if n is not None and job.world_size < n and not any(p.sharded for p in profile.parameters):
        fits_with.append(f"full sharding (FSDP / ZeRO-3) over {n} devices")
    step = step_phase_bytes(mm, job)
    what = "step transients" if job.grad_accumulation else "gradients + step transients"
    left = "weights, states and held gradients" if job.grad_accumulation else "weights and states"
    why = (f"its optimizer step alone ({what}, {format_bytes(step)}) needs more than the "
           f"{format_bytes(max(memory.activation_budget_bytes, 0))} the {left} leave"
           if step > memory.activation_budget_bytes
           else f"its smallest plan peaks at {format_bytes(memory.activations_bytes)} of activations")
    return InfeasibleBudget(
        f"the job does not fit {format_bytes(job.device_memory_bytes)}: {why}; with that plan it "
        f"needs {format_bytes(memory.total_bytes)} ({memory.total_bytes} bytes), "
        f"{format_bytes(memory.total_bytes - job.device_memory_bytes)} more than the device has.\n"
        + "\n".join(memory.lines())
        + ("\nWould fit: " + "; ".join(fits_with) if fits_with else ""),
        budget_bytes=max(memory.activation_budget_bytes, 0),
        min_feasible_bytes=memory.activations_bytes, memory=memory, fits_with=tuple(fits_with))


def _plan_activations(profile: Profile, budget: int | float | str, solver: str, time_limit_s: float,
                      offload: bool, host_budget: int | str | None,
                      target: str | DevicePreset | None) -> Plan:
    """``plan`` for an activation budget alone."""
    solve = get_solver(solver)
    notes: list[str] = []
    spec = _offload_spec(profile, offload, host_budget, target, notes)
    if spec is not None and solver not in BASELINES:
        solve = offload_solver(solver)
    ctx = PlanningContext(profile, offload=spec)
    if spec is None and rule_4_applies(profile, ctx.arrays):
        found = _hiding_plan(profile, budget, solver, time_limit_s, target)
        if found is not None:
            return found
    if ctx.arrays.host.note:  # NOTE [host overhead on an async device]
        notes.append(ctx.arrays.host.note)
    if is_for_compiler(profile):  # NOTE [compiled costs] in memfit.profiling.compiled_costs
        notes.append("costs as torch.compile runs the step: pointwise ops and dropout draws fused "
                     "(0 s), no per-op charges; the predicted peak bounds the compiled step's from "
                     "above")
    smallest: tuple[Solution, Any] | None = None
    if solver in BASELINES:  # NOTE [baseline blocks] in memfit.planning.solvers.baselines
        min_budget = _is_min(budget)
        budget_bytes = profile.peak_bytes if min_budget else resolve_budget(budget, profile.peak_bytes)
        sol = solve(ctx, budget_bytes, time_limit_s=time_limit_s)
        result = _finish(profile, sol, budget_bytes, [*notes, *sol.notes])
        if min_budget:  # a baseline has one plan: its peak is the minimum
            return dataclasses.replace(result, budget_bytes=result.predicted_peak_bytes)
        if result.predicted_peak_bytes > budget_bytes:
            result = _with_notes(result, f"exceeds the budget: peak {format_bytes(result.predicted_peak_bytes)} "
                                         f"> {format_bytes(budget_bytes)}")
        return result
    if ctx.arrays.floor_peak() >= profile.peak_bytes:  # NOTE [peak floor] in memfit.planning.arrays
        floor_note = ("no plan peaks below the un-checkpointed step: what no plan drops (gradients, "
                      f"the step's outputs) peaks at {format_bytes(profile.peak_bytes)} too")
        if not _is_min(budget) and resolve_budget(budget, profile.peak_bytes) < profile.peak_bytes:
            raise _infeasible(resolve_budget(budget, profile.peak_bytes), profile.peak_bytes,
                              profile.peak_bytes, solver, floor_note)
        sol = Solution((), profile.peak_bytes, 0.0, "none" if solver == "auto" else solver, (floor_note,))
        return _finish(profile, sol, profile.peak_bytes if _is_min(budget) else resolve_budget(budget, profile.peak_bytes),
                       [*notes, *sol.notes])
    if _is_min(budget):
        smallest = _smallest_plan(ctx, solve, time_limit_s)
        if smallest is None:
            raise _infeasible(1, profile.peak_bytes, profile.peak_bytes, solver)
        budget_bytes = smallest[1].peak_bytes
    else:
        budget_bytes = resolve_budget(budget, profile.peak_bytes)
    if budget_bytes >= profile.peak_bytes:
        sol = Solution((), profile.peak_bytes, 0.0, "none" if solver == "auto" else solver,
                       ("the un-checkpointed peak already fits the budget: nothing to checkpoint",))
        return _finish(profile, sol, budget_bytes, [*notes, *sol.notes])
    target_bytes = budget_bytes
    # At "min" no solve is made: the smallest-peak plan is the fastest the solver finds at its
    # own budget, and a solve at that plan's peak (no looser) searches a subset of the same
    # plans, so it finds none faster (the state cap of a chain aside: NOTE [state cap]).
    for attempt in range(0 if smallest is not None else MAX_RETRIES):
        try:
            sol = solve(ctx, target_bytes, time_limit_s=time_limit_s)
        except Infeasible:
            break
        sim = simulate(profile, Plan(sol.regions, 0, 0.0, None, sol.solver, ""), offload=spec,
                       _arrays=ctx.arrays)
        if sim.peak_bytes <= budget_bytes:
            if attempt:
                notes.append(f"the cost model under-estimated the peak; re-solved {attempt} time(s) "
                             f"with the budget tightened by {format_bytes(budget_bytes - target_bytes)}")
            return _finish(profile, sol, budget_bytes, [*sol.notes, *notes], sim, spec)
        excess = sim.peak_bytes - budget_bytes
        log.info("plan for %d bytes simulates to %d; tightening by %d", budget_bytes, sim.peak_bytes, excess)
        target_bytes -= excess
    # NOTE [smallest feasible] Tightening found nothing: the budget is at or below the smallest
    # peak. The smallest-peak plan, checked by the simulator, is returned if it fits, else its
    # simulated peak is the minimum the error names -- a peak some plan really reaches.
    if smallest is None:
        smallest = _smallest_plan(ctx, solve, time_limit_s)
    if smallest is not None and smallest[1].peak_bytes <= budget_bytes:
        sol, sim = smallest
        return _finish(profile, sol, budget_bytes,
                       [*notes, *sol.notes, "the smallest-peak plan: the budget allows no faster one"], sim, spec)
    min_bytes = smallest[1].peak_bytes if smallest is not None else profile.peak_bytes
    raise _infeasible(budget_bytes, min_bytes, profile.peak_bytes, solver)


def _hiding_plan(profile: Profile, budget: int | float | str, solver: str, time_limit_s: float,
                 target: str | DevicePreset | None) -> Plan | None:
    """NOTE [host overhead on an async device], rule 4: the fastest plan by device seconds,
    if its own host work hides behind its device work; else None."""
    p = _plan_activations(device_only(profile), budget, solver, time_limit_s, False, None, target)
    hides, host_s, device_s = plan_hides(profile, p, p.recompute_s)
    if not hides:
        return None
    kept = [n for n in p.notes if not n.startswith("host overhead on an async device")]
    note = (f"host overhead on an async device hidden for this plan: its host work <= "
            f"{host_s * 1e3:.1f} ms <= its device work {device_s * 1e3:.1f} ms, so its region and "
            "per-op charges count 0 s (NOTE [host overhead on an async device], rule 4)")
    return dataclasses.replace(p, notes=(note, *kept))


def refuse_over_budget(p: Plan) -> None:
    """Raise ``InfeasibleBudget`` if ``p``'s predicted peak exceeds its budget.

    A baseline's fixed plan ignores the budget; ``plan`` returns it anyway (with a note), for
    comparison, and ``memfit.fit`` and ``memfit plan`` call this before they apply or write
    it: they promise a plan that fits. The baseline's peak, the only one it reaches, is then
    ``min_feasible_bytes``.

    Example:
        >>> refuse_over_budget(plan(prof, budget=0.5, solver="every_block"))   # doctest: +SKIP
    """
    if p.budget_bytes is None or p.predicted_peak_bytes <= p.budget_bytes:
        return
    raise InfeasibleBudget(
        f"solver {p.solver!r} gives a fixed plan ({len(p.regions)} regions) whose predicted peak "
        f"{format_bytes(p.predicted_peak_bytes)} ({p.predicted_peak_bytes} bytes) exceeds the "
        f"budget {format_bytes(p.budget_bytes)} ({p.budget_bytes} bytes). Give a budget of at "
        f"least {p.predicted_peak_bytes} bytes, or solver 'auto' to search for a plan that fits",
        budget_bytes=p.budget_bytes, min_feasible_bytes=p.predicted_peak_bytes)


def _is_min(budget: Any) -> bool:
    return isinstance(budget, str) and budget.strip().lower() == "min"


def _smallest_plan(ctx: PlanningContext, solve: Any, time_limit_s: float) -> tuple[Solution, Any] | None:
    """The solver's smallest-peak plan and its simulation, or None if it finds none."""
    try:
        sol = solve(ctx, 1, time_limit_s=time_limit_s)
    except Infeasible as e:
        low = e.min_bytes
        sol = None
        # the solver's own minimum may sit a rounding error below what it can then meet
        for slack in (0, low // 100_000 + 1, low // 10_000 + 1, low // 1000 + 1):
            try:
                sol = solve(ctx, low + slack, time_limit_s=time_limit_s)
                break
            except Infeasible:
                continue
        if sol is None:
            return None
    return sol, simulate(ctx.profile, Plan(sol.regions, 0, 0.0, None, sol.solver, ""), offload=ctx.offload,
                         _arrays=ctx.arrays)


def _infeasible(budget: int, min_bytes: int, plain: int, solver: str, why: str = "") -> InfeasibleBudget:
    frac = f" ({min_bytes / plain:.1%} of the un-checkpointed peak {format_bytes(plain)})" if plain else ""
    return InfeasibleBudget(
        f"budget {format_bytes(budget)} ({budget} bytes) is below the smallest peak any plan of "
        f"solver {solver!r} reaches: {format_bytes(min_bytes)} ({min_bytes} bytes){frac}"
        f"{'; ' + why if why else ''}. "
        f"Give a budget of at least {min_bytes} bytes, or reduce the batch size / sequence length.",
        budget_bytes=budget, min_feasible_bytes=min_bytes,
    )


def _finish(profile: Profile, sol: Solution, budget_bytes: int, notes: list[str],
            sim: Any = None, spec: OffloadSpec | None = None) -> Plan:
    if sim is None:
        sim = simulate(profile, Plan(sol.regions, 0, 0.0, None, sol.solver, ""))  # no offload here
    regions = tuple(
        Region(r.modules, r.ops, float(t), int(b), writes_buffers(profile, r.modules), r.tail_after)
        for r, t, b in zip(sol.regions, sim.region_recompute_s, sim.region_saved_bytes, strict=True)
    )
    types = {m.path: m.type for m in profile.modules}
    replayed = replayed_collectives(profile, regions)
    paths = {p for r in regions for p in r.modules}
    # the shapes of the parameters under its regions: apply refuses a model of another width
    shapes = {p.name: list(p.shape) for p in profile.parameters
              if any(path == "" or p.name.startswith(path + ".") for path in paths)}
    return Plan(
        regions=regions,
        predicted_peak_bytes=sim.peak_bytes,
        recompute_s=sim.recompute_s,
        budget_bytes=budget_bytes,
        solver=sol.solver,
        profile_signature=profile.signature,
        plain_peak_bytes=profile.peak_bytes,
        plain_step_s=profile.step_time_s,
        model=profile.model,
        notes=tuple(notes),
        # the device an offloading plan is for (NOTE [offload on a CPU model] in memfit.runtime.apply)
        extra={"module_types": {p: types[p] for r in regions for p in r.modules},
               "parameter_shapes": shapes,
               # NOTE [collectives in a region] in memfit.planning.rules: what the replay resends
               **({"collectives": replayed.to_dict()} if replayed.count or replayed.saved else {}),
               **({"target": spec.target} if spec is not None and spec.target else {})},
        host_peak_bytes=int(sim.host_peak_bytes),
        input_signature=profile.input_signature,
        extra_flops=int(sim.recompute_flops),
        profile_device=profile.device,
    )


def _with_notes(p: Plan, *more: str) -> Plan:
    return dataclasses.replace(p, notes=(*p.notes, *more))


def _offload_spec(profile: Profile, offload: bool, host_budget: int | str | None,
                  target: str | DevicePreset | None,
                  notes: list[str]) -> OffloadSpec | None:
    """What offload may use, or None (not asked; or a CPU target: NOTE [offload on a CPU])."""
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be True or False, got {offload!r}")
    cap = _host_budget(host_budget)
    if not offload:
        if host_budget is not None:
            raise ValueError(f"host_budget={host_budget!r} was given without offload=True; it caps "
                             "host memory of offloaded activations only. Pass offload=True too, or drop it")
        return None
    link, where = link_of(profile, target)
    if link > 0:
        return OffloadSpec(link, cap, target=where.removeprefix("preset "))
    # NOTE [offload on a CPU] A CPU target has no host link: offload would copy memory to
    # memory. offload=True is then a logged no-op (a plan without offload, with a note), so
    # that one script runs on a laptop and on a GPU box; a GPU profile whose link is unknown
    # is an error instead, since planning it without offload would hide the user's mistake.
    if (target is None and where.startswith("preset")) or (isinstance(target, str) and target.lower() == "cpu"):
        msg = f"offload=True ignored: {where} has no host link to offload over"
        log.info(msg)
        notes.append(msg)
        return None
    raise ValueError(
        f"offload=True needs the host link of the device the plan is for, but the profile was "
        f"measured on {profile.device!r}, which no preset names; pass target='a100', 'h100' or "
        "'h200' (its host link times the copies)")


def _host_budget(value: int | str | None) -> int | None:
    """``host_budget`` as bytes (None: no cap)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"host_budget must be int bytes or a size such as '64GiB', got "
                        f"{type(value).__name__} {value!r}")
    if isinstance(value, str):
        if value.strip().endswith("%"):
            raise ValueError(f"host_budget {value!r} is a percentage, but host memory has no plain "
                             "peak to take a share of; give bytes or a size such as '64GiB'")
        try:
            return parse_bytes(value)
        except ValueError as e:
            raise ValueError(f"cannot parse host_budget {value!r}: {e}") from None
    if value < 0:
        raise ValueError(f"host_budget must be >= 0 bytes, got {value}")
    return value
