"""``memfit plan ... --steps N --gpus G [--price-per-gpu-hour X] [--board-power W]``: the run's cost.

The arguments of ``Plan.cost`` (NOTE [run cost] in ``memfit.planning.runcost``) on the command
line: the plan's extra GPU-hours, energy and cost over a run of N steps on G devices of the
``--target``.
"""

from __future__ import annotations

import argparse
from typing import Any

from memfit.cli.models import UsageError, positive_int

__all__ = ["add_cost_arguments", "check_cost_arguments", "run_cost"]


def add_cost_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what the plan's recompute costs over a training run")
    g.add_argument("--steps", type=positive_int, metavar="N",
                   help="training steps of the run: prints its extra GPU-hours, energy and cost")
    g.add_argument("--gpus", type=positive_int, metavar="G",
                   help="devices of the --target running the step, each its own batch (default 1)")
    g.add_argument("--price-per-gpu-hour", type=_non_negative, metavar="X",
                   help="price of one device-hour, any currency: adds the run's extra cost")
    g.add_argument("--board-power", type=_positive, metavar="W",
                   help="watts per device for every extra second (default the --target's "
                        "datasheet board power; required for --target cpu)")


def check_cost_arguments(args: argparse.Namespace) -> None:
    """Exit 2 before any profiling for cost options that cannot be used."""
    extra = [f"--{k.replace('_', '-')}" for k in ("gpus", "price_per_gpu_hour", "board_power")
             if getattr(args, k) is not None]
    if args.steps is None:
        if extra:
            raise UsageError(f"{', '.join(extra)} price a run; give its length too (--steps 100000)")
        return
    if args.max_batch:
        raise UsageError("--steps prices a plan's recompute; give it without --max-batch")
    if args.target == "cpu" and args.board_power is None:
        raise UsageError("--steps on --target cpu needs --board-power (watts per device): a CPU's "
                         "draw depends on the machine, so memfit has no default for it")


def run_cost(args: argparse.Namespace, plan: Any) -> Any:
    """The ``RunCost`` of ``plan`` for the command line's run, or None without ``--steps``."""
    if args.steps is None:
        return None
    return plan.cost(args.steps, args.gpus or 1, target=args.target, board_power_w=args.board_power,
                     price_per_gpu_hour=args.price_per_gpu_hour)


def _number(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _positive(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of watts, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a price >= 0, got {text!r}")
    return value
