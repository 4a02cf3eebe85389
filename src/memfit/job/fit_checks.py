"""What ``memfit.fit`` refuses before it profiles: argument combinations it cannot honour,
each with what to do instead."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from memfit.parallel.distributed import is_distributed

__all__ = ["refuse_fit_arguments"]


def refuse_fit_arguments(model: nn.Module, *, monitor_every: int | None, shapes: Sequence[Any] | None,
                         tune: bool, step: Any, in_flight: int | None, target: str | None,
                         compress: str | None, budget: Any, job: Any, on_meta: bool,
                         lossy_codec: str = "bf16") -> None:
    """Raise ValueError / TypeError for a combination of ``fit``'s arguments it does not support."""
    if monitor_every is not None and (not isinstance(monitor_every, int)
                                      or isinstance(monitor_every, bool) or monitor_every < 1):
        raise ValueError(f"monitor_every must be an int >= 1 (monitor one training call in N), "
                         f"got {monitor_every!r}")
    if (shapes is not None or tune) and in_flight is not None:
        raise ValueError("fit(in_flight=...) plans a stage as profiled: not with shapes= or tune")
    if shapes is not None and (step is not None or tune or is_distributed()):
        raise ValueError("fit(shapes=...) plans each shape from example_inputs, without tuning, "
                         "on one process: not with step=, tune=True or in a distributed job")
    if tune and on_meta:
        raise ValueError(f"fit(tune=True) times real steps, and {type(model).__name__} is on the meta "
                         "device; materialize the model or plan without tune")
    if target is not None and target != "cpu" and not on_meta:
        raise ValueError(f"fit(target={target!r}) plans a model on the meta device for that "
                         f"device; {type(model).__name__} has weights and is profiled where it is "
                         "(move it to the device, or build it under torch.device('meta'))")
    if compress is not None and (tune or job is not None or shapes is not None
                                 or in_flight is not None):
        raise ValueError("fit(compress=...) plans against budget= for one input shape; not "
                         "with tune, a job, shapes or in_flight yet")
    if lossy_codec != "bf16" and compress != "lossy":
        raise ValueError(f"fit(lossy_codec={lossy_codec!r}) chooses the codec of compress='lossy'; "
                         f"got compress={compress!r}: pass compress='lossy' too, or drop lossy_codec")
    if compress == "lossy":
        from memfit.planning.compression import check_lossy_codec

        check_lossy_codec(lossy_codec)
    if tune and budget is None:
        raise TypeError("fit(tune=True) measures plans against budget=: give budget")
    if tune and job is not None:
        raise ValueError("fit(tune=True) with a job is not supported yet: tuning "
                         "measures activation plans against budget=; plan for the device "
                         "without tune")
    if tune and is_distributed():
        raise ValueError("fit(tune=True) in a distributed job is not supported: each rank would "
                         "time its own candidates and could choose another plan; fit without "
                         "tune (one plan per job), or tune on one process and apply its plan "
                         "file on every rank")
