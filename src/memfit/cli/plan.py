"""``memfit plan MODEL --budget B``: the fastest checkpoint plan whose peak fits B."""

from __future__ import annotations

import argparse
from typing import Any

from memfit.cli.models import add_model_arguments, budget_arg, load_from_args
from memfit.cli.output import emit
from memfit.cli.profile import profile_model

__all__ = ["add_parser", "run", "SOLVERS"]

def _solver_names() -> tuple[str, ...]:
    from memfit.planning.solvers import solver_names

    return solver_names()


SOLVERS = _solver_names()


def add_parser(subs: Any, common: argparse.ArgumentParser) -> None:
    p = subs.add_parser("plan", parents=[common], help="plan MODEL for a memory budget",
                        description="Profile MODEL and find the checkpoint plan with the least "
                                    "recomputation whose peak activation memory fits the budget.")
    add_model_arguments(p, target=True)
    p.add_argument("--budget", required=True, type=budget_arg,
                   help="cap on peak activation memory: 60%%, 0.6 (of the un-checkpointed peak), "
                        "6GiB, 500MB, bytes, or min (the smallest any plan reaches)")
    p.add_argument("--solver", choices=SOLVERS, default="auto", help="solver (default auto)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the plan as JSON to FILE "
                   "(for memfit verify --plan, or memfit.Plan.load)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    lm = load_from_args(args)
    prof = profile_model(lm, args.target)
    from memfit.planning.planner import plan

    p = plan(prof, budget=args.budget, solver=args.solver)
    if not p.model:
        import dataclasses

        p = dataclasses.replace(p, model=lm.name)
    if args.output:
        p.save(args.output)
    text = str(p) + (f"\nwrote {args.output}" if args.output else "")
    emit(args, text, {**p.to_dict(), "plan_file": args.output})
    return 0
