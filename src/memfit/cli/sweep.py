"""``memfit sweep MODEL``: plan, apply and measure MODEL at several budgets and baselines."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from memfit.cli.models import UsageError, add_model_arguments, budget_arg, load_from_args
from memfit.cli.output import emit

__all__ = ["add_parser", "run", "parse_budgets", "write_outputs"]

BASELINES = ("every_block", "sqrt", "save_matmuls")


def add_parser(subs: Any, common: argparse.ArgumentParser) -> None:
    p = subs.add_parser("sweep", parents=[common], help="measure MODEL's memory/time trade-off",
                        description="Plan MODEL for several budgets and with baseline solvers, apply each "
                                    "plan, and measure its peak memory and step time on this machine.")
    add_model_arguments(p)
    p.add_argument("--budgets", default="1.0,0.8,0.6,0.4,min", type=parse_budgets,
                   help="comma-separated budgets (default 1.0,0.8,0.6,0.4,min)")
    p.add_argument("--baselines", default=",".join(BASELINES),
                   help=f"comma-separated baseline solvers, or none (default {','.join(BASELINES)})")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (default 3)")
    p.add_argument("--out", metavar="DIR", help="write sweep.json and sweep.png to DIR")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def parse_budgets(text: str) -> tuple[Any, ...]:
    """``"1.0,60%,min"`` -> ``(1.0, "60%", "min")``: fractions as floats, the rest validated."""
    out: list[Any] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        b = budget_arg(item)
        try:
            out.append(float(b) if "." in b else b)
        except ValueError:
            out.append(b)
    if not out:
        raise argparse.ArgumentTypeError(f"no budgets in {text!r}; write e.g. 1.0,0.6,min")
    return tuple(out)


def parse_baselines(text: str) -> tuple[str, ...]:
    from memfit.cli.plan import SOLVERS

    if text.strip().lower() in ("", "none"):
        return ()
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in SOLVERS]
    if bad:
        raise UsageError(f"unknown baseline solver {bad[0]!r}; choose from {', '.join(BASELINES)}")
    return names


def write_outputs(s: Any, out: str | Path) -> list[str]:
    """Write ``sweep.json`` and ``sweep.png`` into ``out`` (created); returns the paths."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    paths = [str(s.to_json(d / "sweep.json"))]
    try:
        paths.append(str(s.plot(d / "sweep.png")))
    except ImportError as e:  # matplotlib missing: the JSON is still useful
        paths.append(f"(no plot: {e})")
    return paths


def run(args: argparse.Namespace) -> int:
    from memfit.measuring.tradeoff import sweep

    if args.repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {args.repeats}")
    baselines = parse_baselines(args.baselines)
    lm = load_from_args(args)
    if lm.on_meta:
        raise UsageError(f"{args.model} has no weights (meta device): it can be profiled and planned, "
                         "not swept; use memfit plan --target")
    s = sweep(lm.model, lm.example_inputs, args.budgets, loss_fn=lm.loss_fn, baselines=baselines,
              repeats=args.repeats, progress=not args.no_progress and not args.json, name=lm.name)
    files = write_outputs(s, args.out) if args.out else []
    text = s.summary() + "\n\n" + s.table() + "".join(f"\nwrote {f}" for f in files)
    emit(args, text, {**s.to_dict(), "files": files})
    return 0
