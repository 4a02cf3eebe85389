"""The memory/time trade-off of one model: plans for several budgets, measured, tabled, plotted.

``sweep(model, x)`` profiles one step, plans it for each budget (and with each baseline
solver), applies every plan in turn, measures the peak and the step time, and returns a
``Sweep``: data only. ``Sweep.table()`` formats it, ``print_sweep`` prints it,
``Sweep.to_json`` and ``Sweep.plot`` write it (matplotlib is imported there, on first use).

NOTE [sweep leaves the model alone]
    The sweep applies and removes plans on the model itself (no copy: a model that barely fits
    should not be doubled). Any plan the model carried is removed first and re-applied at the
    end; gradients and buffers are restored from a snapshot and the RNG state is forked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import platform
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.errors import InfeasibleBudget, SchemaError
from memfit.planning.plan import Plan
from memfit.units import format_bytes, format_seconds

__all__ = ["RowKind", "SweepRow", "Sweep", "sweep", "print_sweep", "SWEEP_SCHEMA_VERSION"]

log = logging.getLogger(__name__)

SWEEP_SCHEMA_VERSION = 1
DEFAULT_BUDGETS: tuple[float | str, ...] = (1.0, 0.8, 0.6, 0.4, "min")
DEFAULT_BASELINES: tuple[str, ...] = ("every_block", "sqrt", "save_matmuls")


class RowKind(str, enum.Enum):
    PLAIN = "plain"        # no checkpointing: the reference
    MEMFIT = "memfit"      # memfit's solver at a budget
    BASELINE = "baseline"  # a fixed baseline solver (every block, sqrt(n) segments, ...)


@dataclass(frozen=True)
class SweepRow:
    """One configuration of the sweep and what it measured.

    ``overhead`` is the measured step time over the plain step's, minus one (0.25 = +25%).
    ``step_spread_s`` is the spread (max - min) of the row's timed repeats, seconds (``None``
    with a single repeat): NOTE [noisy overhead].
    ``error`` says why a row has no plan (an infeasible budget, a solver that failed).
    """

    label: str
    kind: RowKind
    solver: str
    budget: str = ""
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    step_time_s: float | None = None
    overhead: float | None = None
    predicted_overhead: float | None = None
    n_regions: int = 0
    error: str | None = None
    plan: Plan | None = dataclasses.field(default=None, compare=False)
    step_spread_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        d["kind"] = self.kind.value
        d["plan"] = self.plan.to_dict() if self.plan is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepRow:
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["kind"] = RowKind(d["kind"])
        kw["plan"] = Plan.from_dict(d["plan"]) if d.get("plan") else None
        return cls(**kw)


@dataclass(frozen=True)
class Sweep:
    """A model's memory/time trade-off: one row per configuration. See ``sweep``.

    Example:
        >>> s = memfit.sweep(model, x)            # doctest: +SKIP
        >>> print(s.table()); s.plot("sweep.png")  # doctest: +SKIP
    """

    rows: tuple[SweepRow, ...]
    model: str
    device: str
    plain_peak_bytes: int
    plain_step_s: float
    repeats: int
    torch_version: str = torch.__version__
    machine: str = dataclasses.field(default_factory=platform.machine)
    schema_version: int = SWEEP_SCHEMA_VERSION

    @property
    def memfit_rows(self) -> tuple[SweepRow, ...]:
        return tuple(r for r in self.rows if r.kind is RowKind.MEMFIT)

    @property
    def baseline_rows(self) -> tuple[SweepRow, ...]:
        return tuple(r for r in self.rows if r.kind is RowKind.BASELINE)

    # ---- text ----------------------------------------------------------------------------
    def table(self, style: str = "markdown") -> str:
        """The rows as a table: ``"markdown"`` (default) or ``"plain"`` (aligned columns)."""
        if style not in ("markdown", "plain"):
            raise ValueError(f"table style must be 'markdown' or 'plain', got {style!r}")
        head = ["config", "solver", "budget", "predicted peak", "measured peak", "vs plain",
                "step time", "overhead", "regions"]
        body = []
        for r in self.rows:
            if r.error is not None:
                body.append([r.label, r.solver, _b(r.budget_bytes), "-", "-", "-", "-", "-", r.error])
                continue
            frac = (f"{r.measured_peak_bytes / self.plain_peak_bytes:.0%}"
                    if r.measured_peak_bytes is not None and self.plain_peak_bytes else "-")
            body.append([
                r.label, r.solver, _b(r.budget_bytes), _b(r.predicted_peak_bytes), _b(r.measured_peak_bytes),
                frac, format_seconds(r.step_time_s) if r.step_time_s is not None else "-",
                self._overhead_cell(r), str(r.n_regions),
            ])
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        numeric = {3, 4, 5, 6, 7, 8}

        def fmt(row: list[str]) -> str:
            cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
            return ("| " + " | ".join(cells) + " |") if style == "markdown" else "  ".join(cells)

        lines = [fmt(head)]
        if style == "markdown":
            lines.append("|" + "|".join(("-" * (w + 1) + ":") if i in numeric else ("-" * (w + 2))
                                        for i, w in enumerate(widths)) + "|")
        else:
            lines.append("  ".join("-" * w for w in widths))
        lines += [fmt(b) for b in body]
        return "\n".join(lines)

    def _overhead_cell(self, r: SweepRow) -> str:
        """NOTE [noisy overhead] A step time differs from the plain one only by more than the
        repeats of either spread; when it does not, the overhead is marked ``~`` and ``noisy``,
        with the larger spread as a fraction of the plain step, instead of read as a result."""
        if r.overhead is None:
            return "-"
        plain = self.rows[0] if self.rows and self.rows[0].kind is RowKind.PLAIN else None
        spreads = [x.step_spread_s for x in (r, plain) if x is not None and x.step_spread_s is not None]
        if r.kind is RowKind.PLAIN or not spreads or self.plain_step_s <= 0:
            return f"{r.overhead:+.1%}"
        spread = max(spreads) / self.plain_step_s
        if spread < abs(r.overhead):
            return f"{r.overhead:+.1%}"
        return f"~{r.overhead:+.0%} (noisy: repeats spread {spread:.0%})"

    def summary(self) -> str:
        """Two lines: the plain step, and the smallest peak a memfit plan reached at what cost."""
        lines = [f"{self.model} on {self.device}: plain step {format_seconds(self.plain_step_s)}, "
                 f"peak {format_bytes(self.plain_peak_bytes)} (median of {self.repeats})"]
        rows = [r for r in self.memfit_rows if r.measured_peak_bytes is not None and r.overhead is not None]
        if rows and self.plain_peak_bytes:
            best = min(rows, key=lambda r: (r.measured_peak_bytes, r.overhead))
            peak = best.measured_peak_bytes or 0
            lines.append(f"smallest memfit peak: {format_bytes(peak)} ({peak / self.plain_peak_bytes:.0%} of "
                         f"plain) at {best.overhead:+.1%} step time (budget {best.label})")
        return "\n".join(lines)

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": "memfit.Sweep"}
        for f in dataclasses.fields(self):
            d[f.name] = getattr(self, f.name)
        d["rows"] = [r.to_dict() for r in self.rows]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sweep:
        if not isinstance(data, dict) or data.get("kind") != "memfit.Sweep":
            raise SchemaError("not a memfit sweep (missing kind 'memfit.Sweep')")
        if data.get("schema_version") != SWEEP_SCHEMA_VERSION:
            raise SchemaError(f"sweep schema version {data.get('schema_version')!r} is not supported "
                              f"(this memfit reads {SWEEP_SCHEMA_VERSION})")
        try:
            kw = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
            kw["rows"] = tuple(SweepRow.from_dict(r) for r in data["rows"])
            return cls(**kw)
        except (KeyError, TypeError, ValueError) as e:
            raise SchemaError(f"corrupt memfit sweep: {type(e).__name__}: {e}") from None

    def to_json(self, path: str | Path) -> Path:
        """Write the sweep (every row, with its plan) as JSON; returns the path."""
        p = Path(path)
        p.write_text(json.dumps(self.to_dict(), indent=1))
        return p

    @classmethod
    def load(cls, path: str | Path) -> Sweep:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except OSError as e:
            raise SchemaError(f"cannot read sweep file {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise SchemaError(f"{path}: not valid JSON ({e})") from None

    # ---- plot ----------------------------------------------------------------------------
    def plot(self, path: str | Path) -> Path:
        """Plot measured peak memory against step time; memfit's plans as a curve, baselines as
        labelled points. Writes a PNG (or any format matplotlib infers from ``path``)."""
        try:
            import matplotlib
        except ImportError:
            raise ImportError("plotting needs matplotlib: pip install 'memfit[plot]'") from None
        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

        mib = 1024**2
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
        try:
            # memfit's curve joins its budgets in order of memory, from the plain step down
            ours = sorted(((r.step_time_s, r.measured_peak_bytes / mib, r.label) for r in self.memfit_rows
                           if r.measured_peak_bytes is not None and r.step_time_s), key=lambda p: -p[1])
            if ours:
                curve = [(self.plain_step_s, self.plain_peak_bytes / mib), *((t, m) for t, m, _ in ours)]
                ax.plot([p[0] for p in curve], [p[1] for p in curve], "o-", color="tab:blue",
                        label="memfit (budgets)")
                for t, m, text in ours:
                    ax.annotate(text, (t, m), textcoords="offset points", xytext=(5, 5), fontsize=8,
                                color="tab:blue")
            markers = iter("sD^vP*X")
            for r in self.baseline_rows:
                if r.measured_peak_bytes is None or not r.step_time_s:
                    continue
                ax.plot([r.step_time_s], [r.measured_peak_bytes / mib], next(markers, "x"),
                        color="tab:orange", label=r.label)
                ax.annotate(r.label, (r.step_time_s, r.measured_peak_bytes / mib),
                            textcoords="offset points", xytext=(5, -10), fontsize=8, color="tab:orange")
            ax.plot([self.plain_step_s], [self.plain_peak_bytes / mib], "k*", markersize=10,
                    label="no checkpointing")
            ax.set_xlabel("step time (s)")
            ax.set_ylabel("peak activation memory (MiB)")
            name = self.model if len(self.model) <= 60 else self.model[:57] + "..."
            ax.set_title(f"{name}: memory vs time ({self.device})", fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            p = Path(path)
            fig.savefig(p)
        finally:
            plt.close(fig)
        return p


def _b(n: int | None) -> str:
    return format_bytes(n) if n is not None else "-"


def budget_label(budget: float | int | str) -> str:
    """``0.8`` -> ``"80%"``, ``"min"`` -> ``"min"``, bytes -> ``"1.50 GiB"``."""
    if isinstance(budget, float):
        return f"{budget:.0%}"
    if isinstance(budget, int) and not isinstance(budget, bool):
        return format_bytes(budget)
    return str(budget)


# ---- the sweep ------------------------------------------------------------------------------
@contextlib.contextmanager
def _progress(enabled: bool, total: int, what: str) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr (nothing if rich is missing or ``enabled`` is false).
    Yields ``advance(description)``."""
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


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[Plan | None]:
    """See NOTE [sweep leaves the model alone]. Yields the plan the model carried."""
    from memfit.runtime.apply import apply, unapply
    from memfit.verification import model_device

    original: Plan | None = getattr(model, "memfit_plan", None)
    grads = {n: p.grad for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    device = model_device(model)
    devices = [device] if device.type not in ("cpu", "meta") else []
    if original is not None:
        unapply(model)
    for p in model.parameters():  # every measured step starts without gradients
        p.grad = None
    try:
        with torch.random.fork_rng(devices=devices, **({"device_type": device.type} if devices else {})):
            yield original
    finally:
        if getattr(model, "memfit_plan", None) is not None:
            unapply(model)
        for n, p in model.named_parameters():
            p.grad = grads.get(n)
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
        if original is not None:
            apply(model, original)


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


def _meter_config(model: nn.Module, cfg: _Config, example_inputs: Any,
                  loss_fn: Callable[[Any], torch.Tensor] | None, device: torch.device) -> None:
    """Peak (and a first time) of the config's first step, on a fresh copy of the plain model.

    NOTE [first step on a fresh copy]
        A training run's first step is the one that runs out of memory, and a model that has
        had other plans applied and removed (or has run steps under this one) can peak lower
        than a freshly planned model does. Each plan is therefore metered like ``verify``
        meters it: applied to a fresh copy of the plain model, first step.
    """
    import copy

    from memfit.profiling.measure import measure
    from memfit.runtime.apply import apply
    from memfit.verification import make_step

    twin = copy.deepcopy(model)
    if cfg.plan is not None:
        apply(twin, cfg.plan)
    m = measure(make_step(twin, example_inputs, loss_fn=loss_fn, seed=0), device=device, repeats=1)
    cfg.peak_bytes = m.peak_bytes
    cfg.times_s.extend(m.times_s)


def _time_config(model: nn.Module, cfg: _Config, step: Callable[[], None], device: torch.device) -> None:
    """Apply the config's plan to the model, time one step, remove the plan."""
    from memfit.profiling.measure import time_step
    from memfit.runtime.apply import apply, unapply

    if cfg.plan is not None:
        apply(model, cfg.plan)
    try:
        cfg.times_s.append(time_step(step, device))
    finally:
        if cfg.plan is not None:
            unapply(model)


def sweep(
    model: nn.Module,
    example_inputs: Any,
    budgets: Sequence[float | int | str] = DEFAULT_BUDGETS,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    baselines: Sequence[str] = DEFAULT_BASELINES,
    repeats: int = 3,
    progress: bool = True,
    solver: str = "auto",
    name: str | None = None,
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

    Returns:
        A ``Sweep``: a plain row, one row per budget, one per baseline. A budget no plan fits
        gives a row with ``error`` set instead of raising.

    Example:
        >>> s = sweep(memfit.zoo.gpt(n_layer=2, d_model=64, seq_len=32), x, (1.0, 0.5))  # doctest: +SKIP
        >>> print_sweep(s)                                                                # doctest: +SKIP
    """
    from memfit.planning.planner import plan as make_plan
    from memfit.profiling.tracer import profile as make_profile
    from memfit.verification import make_step, model_device

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if isinstance(budgets, (str, int, float)):
        raise TypeError(f"budgets must be a sequence such as (1.0, 0.6, 'min'), got {budgets!r}")
    device = model_device(model)
    if device.type == "meta":
        raise ValueError("sweep measures real steps; a model on the meta device can be planned, not swept")
    label = name or type(model).__name__
    configs: dict[tuple[Any, ...], _Config] = {}  # identical plans are measured once
    planned: list[tuple[str, RowKind, str, str, Plan | InfeasibleBudget]] = []


    def key(plan: Plan | None) -> tuple[Any, ...]:
        return ("plain",) if plan is None or not plan.regions else tuple(plan.regions)

    total = 2 + len(budgets) + len(baselines) + (repeats - 1)
    with _state_kept(model), _progress(progress, total, f"sweep {label}") as advance:
        prof = make_profile(model, example_inputs, loss_fn=loss_fn, device=device)
        step = make_step(model, example_inputs, loss_fn=loss_fn, seed=0)

        def config(plan: Plan | None) -> _Config:
            if key(plan) not in configs:
                configs[key(plan)] = _Config(plan)
                _meter_config(model, configs[key(plan)], example_inputs, loss_fn, device)
            return configs[key(plan)]

        advance("profiled")
        plain = config(None)
        advance("measured the plain step")

        def add(row_label: str, kind: RowKind, solver_name: str, budget: Any, spec: str) -> None:
            try:
                p = make_plan(prof, budget=budget, solver=solver_name)
            except InfeasibleBudget as e:
                planned.append((row_label, kind, solver_name, spec, e))
                return
            config(p)
            planned.append((row_label, kind, solver_name, spec, p))

        for b in budgets:
            spec = budget_label(b)
            add(spec, RowKind.MEMFIT, solver, b, spec)
            advance(f"budget {spec}")
        for base in baselines:
            # A baseline ignores the budget; the plain peak lets any of them through.
            add(base, RowKind.BASELINE, base, prof.peak_bytes, "")
            advance(f"baseline {base}")
        # NOTE [interleaved timing]: the remaining timed steps go round the configs in turn,
        # so that a slow spell of a shared machine spreads over all of them.
        for r in range(repeats - 1):
            for cfg in configs.values():
                _time_config(model, cfg, step, device)
            advance(f"timing round {r + 2} of {repeats}")

    plain_s = plain.time_s
    rows = [SweepRow("plain", RowKind.PLAIN, "none", predicted_peak_bytes=prof.peak_bytes,
                     measured_peak_bytes=plain.peak_bytes, step_time_s=plain_s, overhead=0.0,
                     predicted_overhead=0.0, step_spread_s=plain.spread_s)]
    for row_label, kind, solver_name, spec, result in planned:
        if isinstance(result, InfeasibleBudget):
            rows.append(SweepRow(row_label, kind, solver_name, spec, result.budget_bytes,
                                 error=f"infeasible: smallest feasible {format_bytes(result.min_feasible_bytes)}"))
            continue
        cfg = configs[key(result)]
        t = cfg.time_s
        rows.append(SweepRow(
            row_label, kind, result.solver, spec, result.budget_bytes if kind is RowKind.MEMFIT else None,
            result.predicted_peak_bytes, cfg.peak_bytes, t, t / plain_s - 1 if plain_s > 0 else None,
            result.overhead, len(result.regions), None, result, cfg.spread_s))
    return Sweep(tuple(rows), label, str(device), plain.peak_bytes, plain_s, repeats)


def print_sweep(s: Sweep, *, style: str = "markdown") -> None:
    """Print a sweep's summary and table (``sweep`` returns data and prints nothing)."""
    print(s.summary())
    print(s.table(style))
