"""``fit``: profile, plan and apply in one call.

NOTE [re-fitting]
    A model that already carries a plan is un-planned first, so the new profile describes the
    plain model (a profile of a checkpointed model would count its recomputation as forward
    work and its dropped activations as never saved). If planning fails (an infeasible budget),
    the old plan is put back and the model is left as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["fit"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)


def fit(
    model: M,
    example_inputs: Any,
    *,
    budget: int | float | str,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    solver: str = "auto",
) -> M:
    """Make ``model``'s training step fit ``budget``: profile one step, plan, apply the plan.

    Args:
        model: the model to plan, changed in place (the same object is returned).
        example_inputs: inputs of one step: a tensor, a tuple of positional arguments or a dict
            of keyword arguments, of the shapes training will use.
        budget: the cap on peak activation memory: ``int`` bytes, a ``float`` fraction of the
            un-checkpointed peak (``0.6``), a string (``"6GiB"``, ``"60%"``), or ``"min"``:
            the smallest peak any plan reaches.
        loss_fn: output -> scalar loss; default ``output.loss`` if present, else the sum of the
            floating outputs.
        solver: ``"auto"`` (default), ``"chain"``, ``"milp"``, ``"greedy"``, or a baseline
            (``"every_block"``, ``"sqrt"``, ``"save_matmuls"``, ``"none"``).

    Returns:
        ``model`` itself, planned; the ``Plan`` is on ``model.memfit_plan`` (print it for the
        predicted peak and cost). ``memfit.unapply(model)`` removes it.

    Raises:
        memfit.InfeasibleBudget: no plan fits; ``min_feasible_bytes`` is the smallest peak.
        ValueError: Hugging Face's own checkpointing is on, or the inputs pass a KV cache
            (NOTE [Hugging Face models in fit]).

    Example:
        >>> model = memfit.zoo.gpt(n_layer=2, d_model=64, n_head=2, seq_len=32)
        >>> x = torch.randint(0, 512, (2, 32))
        >>> model = memfit.fit(model, x, budget="60%")   # doctest: +SKIP
        >>> print(model.memfit_plan)                     # doctest: +SKIP
    """
    from memfit.integrations.hf_state import cache_off_for_training, refuse_carried_state
    from memfit.planning.planner import plan as make_plan
    from memfit.profiling.inputs import normalize_inputs
    from memfit.profiling.tracer import profile
    from memfit.runtime.apply import apply, unapply

    if not isinstance(model, nn.Module):
        raise TypeError(f"fit expects an nn.Module, got {type(model).__name__}")
    refuse_carried_state(model, normalize_inputs(example_inputs)[1])  # NOTE [Hugging Face models in fit]
    previous = [(path, m, m.__dict__["memfit_plan"]) for path, m in model.named_modules()
                if "_memfit_applied" in m.__dict__]
    for path, m, _ in previous:  # NOTE [re-fitting]
        if m is not model:
            log.warning("memfit: removing the plan on %s (%s, planned before it was wrapped?) "
                        "to re-plan the whole %s", path, type(m).__name__, type(model).__name__)
        unapply(m)
    try:
        with cache_off_for_training(model):
            mode = "fake" if _on_meta(model) else "measure"
            prof = profile(model, example_inputs, loss_fn=loss_fn, mode=mode)
            new_plan = make_plan(prof, budget=budget, solver=solver)
    except BaseException:
        for _, m, old in previous:
            apply(m, old)
        raise
    apply(model, new_plan)
    log.info("%s", new_plan)
    return model


def _on_meta(model: nn.Module) -> bool:
    for p in model.parameters():
        return p.device.type == "meta"
    return False
