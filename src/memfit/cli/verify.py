"""``memfit verify MODEL --plan plan.json``: prove a plan's gradients and peak on MODEL."""

from __future__ import annotations

import argparse
from typing import Any

from memfit.cli.exits import EXIT_OK, EXIT_VERIFY_FAILED, error_object
from memfit.cli.models import add_model_arguments, budget_arg, load_from_args
from memfit.cli.output import emit

__all__ = ["add_parser", "run", "verification_failed"]


def add_parser(subs: Any, common: argparse.ArgumentParser) -> None:
    p = subs.add_parser("verify", parents=[common], help="check a plan against the un-checkpointed step",
                        description="Run one step of MODEL with the plan applied and one without, from "
                                    "the same seed; compare loss, outputs, every gradient and BatchNorm "
                                    "statistics (bitwise on CPU), and the measured peak against the "
                                    "plan's prediction and budget. Exit code 1 if any check fails; "
                                    "2 if the plan was made for another model or input shape.")
    add_model_arguments(p)
    p.add_argument("--plan", required=True, metavar="FILE", help="a plan written by memfit plan -o FILE")
    p.add_argument("--budget", type=budget_arg,
                   help="check the peak against this budget instead of the plan's (60%%, 6GiB, ...)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memfit.cli.models import UsageError
    from memfit.measuring.verification import check_plan_matches, verify
    from memfit.planning.plan import Plan
    from memfit.units import resolve_budget

    plan = Plan.load(args.plan)  # SchemaError -> exit 2
    lm = load_from_args(args)
    if lm.on_meta:
        raise UsageError(f"{args.model} has no weights (meta device): verify runs real steps")
    budget = None
    if args.budget is not None:
        if args.budget == "min":
            raise UsageError("--budget min means nothing to verify; give bytes or a fraction")
        budget = resolve_budget(args.budget, plan.plain_peak_bytes or 1)
    check_plan_matches(plan, lm.model, lm.example_inputs, loss_fn=lm.loss_fn)  # PlanMismatch -> exit 2
    report = verify(lm.model, lm.example_inputs, plan=plan, loss_fn=lm.loss_fn, budget_bytes=budget)
    data = {**report.to_dict(), "model": lm.name, "plan_file": args.plan}
    if not report.ok:
        data["error"] = verification_failed(report.checks)
    emit(args, str(report), data)
    return EXIT_OK if report.ok else EXIT_VERIFY_FAILED


def verification_failed(checks: Any) -> dict[str, Any]:
    """The ``error`` member of a failed verification's JSON object, as every error has one."""
    failed = [c.name for c in checks if not c.passed]
    return error_object("VerificationFailed", f"{len(failed)} check(s) failed: {', '.join(failed)}",
                        EXIT_VERIFY_FAILED)["error"]
