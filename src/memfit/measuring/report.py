"""A model's memory/time trade-off as data: ``Sweep`` and its rows, tables, JSON and plot.

``memfit.sweep`` (in ``memfit.measuring.tradeoff``) measures the trade-off and returns a ``Sweep``: data
only. ``Sweep.table()`` formats it, ``print_sweep`` prints it, ``Sweep.to_json`` and
``Sweep.plot`` write it (matplotlib is imported there, on first use).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfit.errors import SchemaError
from memfit.planning.plan import Plan
from memfit.units import format_bytes, format_flops, format_seconds

__all__ = ["RowKind", "SweepRow", "Sweep", "print_sweep", "SWEEP_SCHEMA_VERSION"]

log = logging.getLogger(__name__)

SWEEP_SCHEMA_VERSION = 1


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
    ``extra_flops`` is the FLOPs the plan's recompute adds to one step (``Plan.extra_flops``;
    0 for the plain row, None where not known: no plan, or rows written before the field).
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
    extra_flops: int | None = None

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
        >>> print(s); s.plot("sweep.png")         # doctest: +SKIP
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
                "step time", "overhead", "extra FLOPs", "regions"]
        body = []
        for r in self.rows:
            if r.error is not None:
                body.append([r.label, r.solver, _b(r.budget_bytes), "-", "-", "-", "-", "-", "-", r.error])
                continue
            frac = (f"{r.measured_peak_bytes / self.plain_peak_bytes:.0%}"
                    if r.measured_peak_bytes is not None and self.plain_peak_bytes else "-")
            body.append([
                r.label, r.solver, _b(r.budget_bytes), _b(r.predicted_peak_bytes), _b(r.measured_peak_bytes),
                frac, format_seconds(r.step_time_s) if r.step_time_s is not None else "-",
                self._overhead_cell(r), format_flops(r.extra_flops) if r.extra_flops is not None else "-",
                str(r.n_regions),
            ])
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        numeric = {3, 4, 5, 6, 7, 8, 9}

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

    def __str__(self) -> str:
        """``print(sweep)``: the summary, then the rows as an aligned table."""
        return f"{self.summary()}\n{self.table('plain')}"

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


def print_sweep(s: Sweep, *, style: str = "markdown") -> None:
    """Print a sweep's summary and table (``sweep`` returns data and prints nothing)."""
    print(s.summary())
    print(s.table(style))
