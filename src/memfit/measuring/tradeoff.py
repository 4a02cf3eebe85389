"""The memory/time trade-off of one model: plans for several budgets, applied and measured.

``sweep(model, x)`` profiles one step, plans it for each budget (and with each baseline
solver), applies every plan in turn, measures the peak and the step time, and returns a
``memfit.measuring.report.Sweep``: data, which ``print_sweep`` prints and ``Sweep.plot`` draws.

NOTE [sweep leaves the model alone]
    The sweep applies and removes plans on the model itself to time them (no copy: a model
    that barely fits should not be doubled; peaks are metered on twins, NOTE [first step on a
    fresh copy]). Any plan the model carried is lifted first and re-applied at the end
    (``memfit.measuring.twins.lifted_plan``); gradients, buffers and the RNG state are put back
    (``memfit.step.harness.ModelState``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import InfeasibleBudget
from memfit.measuring.report import RowKind, Sweep, SweepRow
from memfit.measuring.twins import lifted_plan, measure_step, repeatable, step_of, twin_step
from memfit.planning.plan import Plan
from memfit.planning.solvers import SolverName
from memfit.profiling.profile import Profile
from memfit.runtime.divergence import CheckArg
from memfit.step.harness import ModelState, Step, model_device
from memfit.units import format_bytes

__all__ = ["sweep", "budget_label", "progress_bar", "time_plan_step", "DEFAULT_BUDGETS", "DEFAULT_BASELINES"]

log = logging.getLogger(__name__)

DEFAULT_BUDGETS: tuple[float | str, ...] = (1.0, 0.8, 0.6, 0.4, "min")
DEFAULT_BASELINES: tuple[str, ...] = ("every_block", "sqrt", "save_matmuls")


def budget_label(budget: float | int | str) -> str:
    """``0.8`` -> ``"80%"``, ``"min"`` -> ``"min"``, bytes -> ``"1.50 GiB"``."""
    if isinstance(budget, float):
        return f"{budget:.0%}"
    if isinstance(budget, int) and not isinstance(budget, bool):
        return format_bytes(budget)
    return str(budget)


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, what: str) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr (nothing if rich is missing or ``enabled`` is false).
    Yields ``advance(description)``; also used by ``memfit.measuring.tuning``."""
    if not enabled:
        yield lambda _d: None
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        yield lambda _d: None
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    with bar:
        task = bar.add_task(what, total=total)

        def advance(desc: str) -> None:
            bar.update(task, advance=1, description=desc)

        yield advance


@dataclass
class _Config:
    """One distinct plan of the sweep: its peak and its timed steps."""

    plan: Plan | None
    peak_bytes: int = 0
    times_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def time_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def spread_s(self) -> float | None:
        return max(self.times_s) - min(self.times_s) if len(self.times_s) > 1 else None


def _meter_config(cfg: _Config, step: Step, device: torch.device) -> None:
    """Peak (and a first time) of the config's first step, on a fresh copy of the plain model.

    NOTE [first step on a fresh copy]
        A training run's first step is the one that runs out of memory, and a model that has
        had other plans applied and removed (or has run steps under this one) can peak lower
        than a freshly planned model does. Each plan is therefore metered like ``verify``
        meters it: applied to a twin, a fresh copy of the plain model, first step.
    """
    m = measure_step(twin_step(step, cfg.plan), seed=0, device=device)
    cfg.peak_bytes = m.peak_bytes
    cfg.times_s.extend(m.times_s)


def _time_config(model: nn.Module, cfg: _Config, step: Callable[[], None], device: torch.device) -> None:
    """Apply the config's plan to the model, time one step, remove the plan."""
    cfg.times_s.append(time_plan_step(model, cfg.plan, step, device))


def time_plan_step(model: nn.Module, plan: Plan | None, step: Callable[[], None], device: torch.device,
                   *, check: CheckArg = False, clock: Callable[[], float] | None = None) -> float:
    """Apply ``plan`` to ``model`` (``None``: none), time one call of ``step``, remove the plan.

    The plan is applied with ``check=False`` by default: each round applies it afresh, so with
    the default check every timed step would be one of a region's first checked calls (+35% on
    a GPT block), while a training run pays the sampled check's steady state, 1.000x of
    unchecked (NOTE [check sampling], ``benchmarks/results/check_cost.md``). ``verify`` runs
    the check; pass ``check=True`` for a step that should run it (a warm-up).

    Args:
        clock: seconds (default ``time.perf_counter``); CUDA work is synchronised before and
            after the timed call.

    Returns:
        The wall seconds of the call.
    """
    from memfit.profiling.measure import time_step
    from memfit.runtime.apply import apply_plan, unapply

    if plan is not None:
        apply_plan(model, plan, check=check)
    try:
        return time_step(step, device, clock)
    finally:
        if plan is not None:
            unapply(model)


def sweep(
    model: nn.Module,
    example_inputs: Any = None,
    budgets: Sequence[float | int | str] = DEFAULT_BUDGETS,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    baselines: Sequence[str] = DEFAULT_BASELINES,
    repeats: int = 3,
    progress: bool = True,
    solver: SolverName = "auto",
    name: str | None = None,
    step: Step | None = None,
) -> Sweep:
    """Plan, apply and measure ``model`` at several budgets and with baseline solvers.

    Args:
        model: the model (left as it was: NOTE [sweep leaves the model alone]).
        example_inputs: the step's inputs (tensor, tuple or dict).
        budgets: fractions of the plain peak (``0.6``), bytes (``int``), strings (``"6GiB"``,
            ``"60%"``), or ``"min"``: the smallest peak any plan reaches.
        loss_fn: output -> scalar loss; default the profiler's default loss.
        baselines: baseline solvers measured as extra rows (``"every_block"``, ``"sqrt"``,
            ``"save_matmuls"``); ``()`` for none.
        repeats: timed steps per configuration (median), after one metered step.
        progress: show a progress bar on stderr (needs rich).
        solver: memfit's solver for the budget rows (default ``"auto"``).
        name: the model's name in tables and plots (default its class name).
        step: the step to measure instead of ``example_inputs`` and ``loss_fn``: a
            ``memfit.step.harness.Step`` of ``model`` made with inputs (its autocast state included);
            a step given as a callable cannot run on the twins peaks are metered on and
            raises ``TypeError``.

    Returns:
        A ``Sweep``: a plain row, one row per budget, one per baseline. A budget no plan fits,
        or a baseline that finds no blocks to checkpoint, gives a row with ``error`` set
        instead of raising.

    Example:
        >>> s = sweep(memfit.zoo.gpt(n_layer=2, d_model=64, seq_len=32), x, (1.0, 0.5))  # doctest: +SKIP
        >>> print_sweep(s)                                                                # doctest: +SKIP
    """
    from memfit.measuring.calibration import profile as make_profile

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if isinstance(budgets, (str, int, float)):
        raise TypeError(f"budgets must be a sequence such as (1.0, 0.6, 'min'), got {budgets!r}")
    device = model_device(model)
    if device.type == "meta":
        raise ValueError("sweep measures real steps; a model on the meta device can be planned, not swept")
    the_step = step_of(model, example_inputs, loss_fn, step)
    label = name or type(model).__name__
    configs = _Configs(the_step, device)
    total = 2 + len(budgets) + len(baselines) + (repeats - 1)
    # NOTE [sweep leaves the model alone]
    with ModelState(model, the_step.inputs) as state, lifted_plan(model), \
            progress_bar(progress, total, f"sweep {label}") as advance:
        state.clear_grads()  # every measured step starts without gradients
        prof = make_profile(the_step, device=device)
        run = repeatable(the_step.with_input_copies(), seed=0)
        advance("profiled")
        planned = _plan_and_meter(prof, configs, budgets, baselines, solver, advance)
        # NOTE [interleaved timing]: the remaining timed steps go round the configs in turn,
        # so that a slow spell of a shared machine spreads over all of them.
        for r in range(repeats - 1):
            for cfg in configs.all():
                _time_config(model, cfg, run, device)
            advance(f"timing round {r + 2} of {repeats}")
    plain = configs.of(None)
    rows = [SweepRow("plain", RowKind.PLAIN, "none", predicted_peak_bytes=prof.peak_bytes,
                     measured_peak_bytes=plain.peak_bytes, step_time_s=plain.time_s, overhead=0.0,
                     predicted_overhead=0.0, step_spread_s=plain.spread_s, extra_flops=0)]
    rows += [_row(p, configs, plain.time_s) for p in planned]
    return Sweep(tuple(rows), label, str(device), plain.peak_bytes, plain.time_s, repeats)


@dataclass(frozen=True)
class _Planned:
    """One row of the sweep before it is timed: what was asked, and the plan or the error."""

    label: str
    kind: RowKind
    solver: str
    spec: str
    result: Any  # Plan, InfeasibleBudget or NoBlocks


class _Configs:
    """The sweep's distinct plans (identical plans are measured once), each metered on a fresh
    twin when first seen (NOTE [first step on a fresh copy])."""

    def __init__(self, step: Step, device: torch.device) -> None:
        self.step, self.device = step, device
        self._by_key: dict[tuple[Any, ...], _Config] = {}

    @staticmethod
    def key(plan: Plan | None) -> tuple[Any, ...]:
        return ("plain",) if plan is None or not plan.regions else tuple(plan.regions)

    def of(self, plan: Plan | None) -> _Config:
        """The config of ``plan`` (``None``: the plain step), metered if new."""
        k = self.key(plan)
        if k not in self._by_key:
            self._by_key[k] = _Config(plan)
            _meter_config(self._by_key[k], self.step, self.device)
        return self._by_key[k]

    def all(self) -> list[_Config]:
        return list(self._by_key.values())


def _plan_and_meter(prof: Profile, configs: _Configs, budgets: Sequence[float | int | str],
                    baselines: Sequence[str], solver: SolverName,
                    advance: Callable[[str], None]) -> list[_Planned]:
    """Meter the plain step, then plan every budget and baseline and meter each new plan: the
    rows, in order."""
    from memfit.planning.planner import plan_for_budget
    from memfit.planning.solvers.baselines import NoBlocks

    configs.of(None)
    advance("measured the plain step")
    planned: list[_Planned] = []

    def add(row_label: str, kind: RowKind, solver_name: str, budget: Any, spec: str) -> None:
        try:
            p = plan_for_budget(prof, budget=budget, solver=solver_name)
        except (InfeasibleBudget, NoBlocks) as e:
            planned.append(_Planned(row_label, kind, solver_name, spec, e))
            return
        configs.of(p)
        planned.append(_Planned(row_label, kind, solver_name, spec, p))

    for b in budgets:
        spec = budget_label(b)
        add(spec, RowKind.MEMFIT, solver, b, spec)
        advance(f"budget {spec}")
    for base in baselines:
        # A baseline ignores the budget; the plain peak lets any of them through.
        add(base, RowKind.BASELINE, base, prof.peak_bytes, "")
        advance(f"baseline {base}")
    return planned


def _row(planned: _Planned, configs: _Configs, plain_s: float) -> SweepRow:
    """The table row of one planned config: its measured peak and time, or why it has none."""
    label, kind, solver_name, spec, result = (planned.label, planned.kind, planned.solver,
                                              planned.spec, planned.result)
    if isinstance(result, InfeasibleBudget):
        return SweepRow(label, kind, solver_name, spec, result.budget_bytes,
                        error=f"infeasible: smallest feasible {format_bytes(result.min_feasible_bytes)}")
    if not isinstance(result, Plan):  # NoBlocks: not a peer at +0.0%, it planned nothing
        return SweepRow(label, kind, solver_name, spec, None, error="found no blocks to checkpoint")
    cfg = configs.of(result)
    t = cfg.time_s
    return SweepRow(
        label, kind, result.solver, spec, result.budget_bytes if kind is RowKind.MEMFIT else None,
        result.predicted_peak_bytes, cfg.peak_bytes, t, t / plain_s - 1 if plain_s > 0 else None,
        result.overhead, len(result.regions), None, result, cfg.spread_s, result.extra_flops)
