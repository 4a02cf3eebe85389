"""``memfit profile MODEL``: trace one training step and summarize where its memory goes."""

from __future__ import annotations

import argparse
from typing import Any

from memfit.cli.models import add_model_arguments, load_from_args, positive_int
from memfit.cli.output import emit
from memfit.profiling.summary import summarize
from memfit.units import format_bytes, format_seconds
from memfit.zoo.specs import LoadedModel

__all__ = ["add_parser", "run", "profile_model"]


def add_parser(subs: Any, common: argparse.ArgumentParser) -> None:
    p = subs.add_parser("profile", parents=[common], help="profile one training step of MODEL",
                        description="Trace one training step (forward, loss, backward) of MODEL and show "
                                    "its peak activation memory, time, and the modules that hold the most.")
    add_model_arguments(p, target=True)
    p.add_argument("-o", "--output", metavar="FILE", help="also write the full profile as JSON to FILE")
    p.add_argument("--top", type=positive_int, default=8, help="modules to list (default 8)")
    p.set_defaults(run=run)


def profile_model(lm: LoadedModel, target: str = "cpu") -> Any:
    """Profile a resolved model: a real measured step, or fake mode for a meta model or a
    ``--target`` other than this machine's CPU."""
    from memfit.measuring.calibration import profile

    mode = "fake" if lm.on_meta or target != "cpu" else "measure"
    return profile(lm.model, lm.example_inputs, loss_fn=lm.loss_fn, mode=mode, target=target)


def _text(name: str, s: dict[str, Any]) -> str:
    how = "measured" if s["mode"] == "measure" else f"fake mode, {s['cost_model']} cost model"
    lines = [
        f"profile of {name} ({s['device']}, {how}): {s['ops']} ops ({s['forward_ops']} forward)",
        f"  peak activation memory  {format_bytes(s['peak_bytes'])}",
        f"  live before the step    {format_bytes(s['baseline_bytes'])} (parameters, buffers, inputs)",
        f"  saved for backward      {format_bytes(s['saved_bytes'])}",
        f"  step time               {format_seconds(s['step_time_s'])} "
        f"(forward {format_seconds(s['forward_time_s'])})",
    ]
    if s["saved_by_module"]:
        lines.append("  saved for backward, by module:")
        w = max(len(r["module"]) for r in s["saved_by_module"])
        lines += [f"    {r['module'].ljust(w)}  {format_bytes(r['saved_bytes']):>10}" for r in s["saved_by_module"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    lm = load_from_args(args)
    prof = profile_model(lm, args.target)
    if args.output:
        prof.save(args.output)
    s = summarize(prof, top=args.top)
    s["name"] = lm.name
    if args.output:
        s["profile_file"] = args.output
    text = _text(lm.name, s) + (f"\nwrote {args.output}" if args.output else "")
    emit(args, text, {"kind": "memfit.ProfileSummary", **s})
    return 0
