"""``memfit plan ... --device-memory 80GiB --optimizer adamw [--max-batch]``: the whole job.

The arguments that describe the job on its device (NOTE [the job's memory] in
``memfit.planning.job``), the plan for them, and the largest batch that fits.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from memfit.cli.models import UsageError, load_from_args
from memfit.cli.output import emit
from memfit.errors import InfeasibleBudget

if TYPE_CHECKING:
    from memfit.job.device_memory import Job

__all__ = ["add_job_arguments", "job_of", "plan_for_job", "run_max_batch"]


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    from memfit.planning.job import SHARDINGS
    from memfit.profiling.optimizer import OPTIMIZER_NAMES

    g = p.add_argument_group("the whole job on one device (instead of, or with, --budget)")
    g.add_argument("--device-memory", metavar="SIZE",
                   help="the device's memory the whole job must fit: weights, gradients, "
                        "optimizer states, activations and a reserve (80GiB, or a preset: h100)")
    g.add_argument("--optimizer", choices=sorted(OPTIMIZER_NAMES),
                   help="the optimizer whose states count (default none)")
    g.add_argument("--optimizer-state-dtype", metavar="DTYPE",
                   help="dtype of the optimizer states (default the parameters'): bfloat16, float32")
    g.add_argument("--master-weights", action="store_true",
                   help="count mixed precision's fp32 master copy of the weights")
    g.add_argument("--world-size", type=int, metavar="N", help="devices the states are sharded over")
    g.add_argument("--sharding", choices=SHARDINGS, default="none",
                   help="what is sharded over --world-size (ZeRO-1/2/3: optimizer, gradients, full)")
    g.add_argument("--grad-accumulation", action="store_true",
                   help="training accumulates gradients over micro-batches: they are held "
                        "through forward and backward, besides the activations")
    g.add_argument("--reserve", metavar="SIZE",
                   help="memory kept for the CUDA context and allocator (default 0 on cpu, "
                        "1GiB + 2%% of the device on a GPU)")
    g.add_argument("--max-batch", action="store_true",
                   help="find the largest batch whose best plan fits --device-memory")
    g.add_argument("--max-overhead", type=float, metavar="FRACTION",
                   help="with --max-batch: the most predicted recompute (0.2 = +20%% step time)")


def job_of(args: argparse.Namespace) -> Job | None:
    """The ``memfit.Job`` the command line describes (None without ``--device-memory``)."""
    from memfit.job.device_memory import Job

    if args.device_memory is None:
        given = [f"--{k.replace('_', '-')}" for k in ("optimizer", "optimizer_state_dtype",
                                                      "world_size", "reserve", "max_overhead")
                 if getattr(args, k) is not None]
        given += ["--master-weights"] if args.master_weights else []
        given += ["--grad-accumulation"] if args.grad_accumulation else []
        given += ["--sharding"] if args.sharding != "none" else []
        given += ["--max-batch"] if args.max_batch else []
        if given:
            raise UsageError(f"{', '.join(given)} count against --device-memory; give it too "
                             "(e.g. --device-memory 80GiB)")
        return None
    if args.world_size is not None and args.world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {args.world_size}")
    return Job(device=args.device_memory, optimizer=args.optimizer,
               state_dtype=args.optimizer_state_dtype, master_weights=args.master_weights,
               world_size=args.world_size, sharding=args.sharding, reserve=args.reserve,
               grad_accumulation=args.grad_accumulation)


def plan_for_job(args: argparse.Namespace, prof: Any, lm: Any) -> Any:
    """The plan for the device; an infeasible job names the largest batch that fits."""
    from memfit.api import plan

    try:
        return plan(prof, job_of(args), budget=args.budget, solver=args.solver)
    except InfeasibleBudget as e:
        raise _with_largest_batch(e, args, lm) from None


def run_max_batch(args: argparse.Namespace) -> int:
    from memfit.job.capacity import largest_batch

    if args.budget is not None:
        raise UsageError("--max-batch searches for --device-memory; drop --budget")
    make = _maker(args)
    target = None if args.target == "cpu" else args.target
    lm = load_from_args(args)
    found = largest_batch(make, job_of(args), target=target, solver=args.solver,
                          loss_fn=lm.loss_fn, max_overhead=args.max_overhead)
    p = found.plan if found.plan.model else dataclasses.replace(found.plan, model=lm.name)
    if args.output:
        p.save(args.output)
    text = str(found) + (f"\nwrote {args.output}" if args.output else "")
    emit(args, text, {**p.to_dict(), "largest_batch": found.batch, "plan_file": args.output,
                      "probes": [dataclasses.asdict(x) for x in found.probes]})
    return 0


def _maker(args: argparse.Namespace) -> Any:
    """``n -> (model, inputs)`` of MODEL at batch ``n`` (one model, built once)."""
    from memfit.zoo.specs import load_model

    first = load_from_args(args)

    def make(n: int) -> tuple[Any, Any, Any]:
        lm = load_model(args.model, input_shapes=args.input_shape, dtype=args.dtype, batch=n,
                        seq_len=args.seq_len)
        return first.model, lm.example_inputs, lm.loss_fn

    try:
        make(1)
    except UsageError as e:
        raise UsageError(f"--max-batch cannot resize the inputs of {args.model}: {e}") from None
    return make


def _with_largest_batch(e: InfeasibleBudget, args: argparse.Namespace, lm: Any) -> InfeasibleBudget:
    """``e`` with the largest batch that fits with the smallest plan, when there is one below
    the batch asked for (computed by ``largest_batch``)."""
    from memfit.job.capacity import batch_of, with_largest_batch

    try:
        make = _maker(args)
    except UsageError:
        return e
    job = job_of(args)
    if job is None:
        return e
    return with_largest_batch(e, make, batch_of(lm.example_inputs), job,
                              target=None if args.target == "cpu" else args.target,
                              solver=args.solver, loss_fn=lm.loss_fn)
