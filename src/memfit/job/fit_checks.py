"""What ``memfit.fit`` refuses before it profiles: argument combinations it cannot honour,
each with what to do instead."""

from __future__ import annotations

from typing import Any

from torch import nn

from memfit.job.fit_options import Parallel, Search, Training
from memfit.parallel.distributed import is_distributed

__all__ = ["refuse_fit_arguments"]


def refuse_fit_arguments(model: nn.Module, budget: Any, job: Any, search: Search,
                         training: Training, parallel: Parallel, *, stepped: bool,
                         on_meta: bool) -> None:
    """Raise ValueError / TypeError for a combination of ``fit``'s arguments it does not
    support (each value alone was checked when made: ``memfit.job.fit_options``)."""
    tune, shapes, in_flight = search.tune, training.shapes, parallel.in_flight
    if (shapes is not None or tune) and in_flight is not None:
        raise ValueError("fit(parallel=Parallel(in_flight=...)) plans a stage as profiled: not "
                         "with Training(shapes=...) or Search(tune=True)")
    if shapes is not None and (stepped or tune or is_distributed()):
        raise ValueError("Training(shapes=...) plans each shape from example_inputs, without "
                         "tuning, on one process: not with step=, Search(tune=True) or in a "
                         "distributed job")
    if tune and on_meta:
        raise ValueError(f"Search(tune=True) times real steps, and {type(model).__name__} is on "
                         "the meta device; materialize the model or plan without tune")
    if search.target is not None and search.target != "cpu" and not on_meta:
        raise ValueError(f"Search(target={search.target!r}) plans a model on the meta device for "
                         f"that device; {type(model).__name__} has weights and is profiled where "
                         "it is (move it to the device, or build it under torch.device('meta'))")
    if search.compress is not None and (tune or job is not None or shapes is not None
                                        or in_flight is not None):
        raise ValueError("Search(compress=...) plans against budget= for one input shape; not "
                         "with tune, a job, Training(shapes=...) or Parallel(in_flight=...) yet")
    if tune and budget is None:
        raise TypeError("Search(tune=True) measures plans against budget=: give budget")
    if tune and job is not None:
        raise ValueError("Search(tune=True) with a job is not supported yet: tuning "
                         "measures activation plans against budget=; plan for the device "
                         "without tune")
    if tune and is_distributed():
        raise ValueError("Search(tune=True) in a distributed job is not supported: each rank "
                         "would time its own candidates and could choose another plan; fit "
                         "without tune (one plan per job), or tune on one process and apply its "
                         "plan file on every rank")
    if in_flight is not None and (job is not None or budget is None):
        raise TypeError("fit(parallel=Parallel(in_flight=...)) needs budget=, without a job")
    if job is None and budget is None:
        raise TypeError("fit needs budget= (a cap on the activation peak) or a job "
                        "(memfit.Job(device='80GiB', ...): the device the whole job must fit)")
