"""``memfit plan MODEL --budget B``: the fastest checkpoint plan whose peak fits B."""

from __future__ import annotations

import argparse
from typing import Any

from memfit.cli.cost import add_cost_arguments, check_cost_arguments, run_cost
from memfit.cli.job import add_job_arguments, job_of, plan_for_job, run_max_batch
from memfit.cli.models import UsageError, add_model_arguments, budget_arg, load_from_args
from memfit.cli.output import emit
from memfit.cli.profile import profile_model
from memfit.planning.compression import DEFAULT_LOSSY_CODEC, LOSSY_CODECS

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
    p.add_argument("--budget", type=budget_arg,
                   help="cap on peak activation memory: 60%%, 0.6 (of the un-checkpointed peak), "
                        "6GiB, 500MB, bytes, or min (the smallest any plan reaches)")
    add_job_arguments(p)
    p.add_argument("--solver", choices=SOLVERS, default="auto", help="solver (default auto)")
    p.add_argument("--tune", action="store_true",
                   help="time the solver's best few plans and the baseline plans that fit on the "
                        "model and keep the fastest measured (memfit.measuring.tuning; CPU models only)")
    p.add_argument("--tune-limit", type=float, default=None, metavar="SECONDS",
                   help="seconds of stepping --tune may spend (default: 10 plain steps)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar for --tune")
    p.add_argument("--compress", choices=("lossless", "lossy"),
                   help="also keep saved tensors outside the regions packed where that is faster "
                        "than recomputing: lossless (exact codecs; the step stays bitwise) or lossy "
                        "(also --lossy-codec on fp32 activations; gradients change)")
    p.add_argument("--lossy-codec", choices=(*LOSSY_CODECS, "none"), default=None,
                   help="with --compress lossy: the codec of the fp32 activations (default bf16; "
                        "none: no codec on them, the batch-norm variants alone)")
    add_cost_arguments(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write the plan as JSON to FILE "
                   "(for memfit verify --plan, or memfit.Plan.load)")
    p.set_defaults(run=run)


def _check_compress(args: argparse.Namespace) -> None:
    """--compress and --lossy-codec against the other options: exit 2 before any profiling."""
    if args.lossy_codec is not None and args.compress != "lossy":
        raise UsageError(f"--lossy-codec {args.lossy_codec} chooses the codec of --compress lossy; "
                         "add --compress lossy, or drop --lossy-codec")
    if args.compress is not None:
        clash = [flag for flag, on in (("--tune", args.tune), ("--device-memory", args.device_memory),
                                       ("--max-batch", args.max_batch)) if on]
        if clash or args.budget is None:
            raise UsageError(f"--compress {args.compress} plans against --budget alone; "
                             + (f"not with {', '.join(clash)}" if clash else "give --budget"))


def run(args: argparse.Namespace) -> int:
    if args.budget is None and args.device_memory is None:
        raise UsageError("give --budget (a cap on the activation peak) or --device-memory (the "
                         "device the whole job must fit, e.g. 80GiB)")
    job_of(args)  # job arguments without --device-memory, or bad ones: exit 2 before profiling
    check_cost_arguments(args)
    _check_compress(args)
    if args.max_batch:
        return run_max_batch(args)
    lm = load_from_args(args)
    if args.tune and args.device_memory is not None:
        raise UsageError("--tune measures plans against --budget; plan for --device-memory "
                         "without --tune")
    if args.tune and (lm.on_meta or args.target != "cpu"):
        raise UsageError("--tune times real steps on this machine: give a model with weights and "
                         "no --target, or plan without --tune")
    if args.compress is not None and (lm.on_meta or args.target != "cpu"):
        raise UsageError("--compress weighs codec times measured on this machine: give a model "
                         "with weights and no --target, or plan without --compress")
    if args.tune_limit is not None and args.tune_limit <= 0:
        raise UsageError(f"--tune-limit must be positive seconds, got {args.tune_limit}")
    prof = profile_model(lm, args.target)
    from memfit.planning.planner import plan_for_budget, refuse_over_budget

    if args.tune:
        from memfit.measuring.tuning import tune
        from memfit.step.harness import Step

        step = Step.of(lm.model, lm.example_inputs, loss_fn=lm.loss_fn)
        p = tune(step, prof, args.budget, solver=args.solver, time_limit_s=args.tune_limit,
                 progress=not args.no_progress and not args.json)
    elif args.device_memory is not None:
        p = plan_for_job(args, prof, lm)
        refuse_over_budget(p)
    elif args.compress is not None:
        from memfit.measuring.codec_cost import codec_costs_for
        from memfit.planning.compress_pass import choose

        codec = None if args.lossy_codec == "none" else args.lossy_codec or DEFAULT_LOSSY_CODEC
        p = choose(prof, lambda b: plan_for_budget(prof, budget=b, solver=args.solver), args.budget,
                   mode=args.compress, lossy_codec=codec,
                   costs=codec_costs_for(args.compress, codec, prof),
                   solve_on=lambda q, b: plan_for_budget(q, budget=b, solver=args.solver))
        refuse_over_budget(p)
    else:
        p = plan_for_budget(prof, budget=args.budget, solver=args.solver)
        refuse_over_budget(p)  # a baseline's fixed plan may not fit: exit 3, no plan written
    if not p.model:
        import dataclasses

        p = dataclasses.replace(p, model=lm.name)
    cost = run_cost(args, p)
    if args.output:
        p.save(args.output)
    text = (str(p) + ("".join(f"\n{line}" for line in cost.run_lines()) if cost is not None else "")
            + (f"\nwrote {args.output}" if args.output else ""))
    emit(args, text, {**p.to_dict(), "plan_file": args.output,
                      **({"run_cost": cost.to_dict()} if cost is not None else {})})
    return 0
