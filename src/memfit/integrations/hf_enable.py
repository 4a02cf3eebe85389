"""``enable`` / ``disable``: a budget on a Hugging Face model, the budgeted counterpart of
``gradient_checkpointing_enable()`` (NOTE [the KV cache under checkpointing] and NOTE [taking
over HF checkpointing] in ``memfit.integrations.hf_state``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from memfit.integrations.hf_config import example_input_ids
from memfit.integrations.hf_state import (
    remove_cache_off,
    restore_hf_checkpointing,
    suspend_hf_checkpointing,
)

if TYPE_CHECKING:
    from memfit.planning.solvers import SolverName

__all__ = ["enable", "disable", "training_inputs", "take_over_hf_checkpointing"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)


def training_inputs(model: nn.Module, *, batch_size: int | None = None,
                   seq_len: int | None = None) -> dict[str, torch.Tensor]:
    """``{"input_ids", "labels"}`` of ``batch_size`` x ``seq_len`` for a causal LM's step.

    ``batch_size`` defaults to 1, ``seq_len`` to the config's ``max_position_embeddings``
    (capped at 4096); labels are the ids themselves (the model shifts them), so the output
    carries the loss the Trainer differentiates.

    Example:
        >>> training_inputs(torch.nn.Linear(2, 2), batch_size=2, seq_len=4)["input_ids"].shape
        torch.Size([2, 4])
    """
    ids = example_input_ids(model, batch=1 if batch_size is None else batch_size, seq_len=seq_len)
    return {"input_ids": ids, "labels": ids}


def enable(model: M, budget: int | float | str, example_inputs: Any = None, *,
           batch_size: int | None = None, seq_len: int | None = None,
           solver: SolverName = "auto", max_length: int | None = None,
           shapes: Sequence[int] | None = None, on_new_shape: str | None = None,
           monitor_every: int | None = None) -> M:
    """Plan ``model``'s training step for ``budget`` and apply it: the budgeted counterpart of
    ``model.gradient_checkpointing_enable()``.

    Caching is turned off for calls with grad (train or eval mode) (logged once), and if
    HF's own checkpointing is on, memfit takes it over (logged; ``disable`` switches it back on).
    Works on any ``PreTrainedModel`` and on a ``peft.PeftModel``, whose plan then counts only the
    gradients of the parameters that train (call it after ``get_peft_model``).

    Args:
        model: a ``transformers.PreTrainedModel`` (or a ``PeftModel``), changed in place.
        budget: the cap on peak activation memory: ``int`` bytes, a fraction of the plain peak
            (``0.5``), ``"6GiB"``, ``"50%"`` or ``"min"``.
        example_inputs: the inputs of one training step (a dict of keyword arguments, as the
            Trainer passes them); default ``training_inputs(model, batch_size=..., seq_len=...)``.
        batch_size: rows of the default inputs (default 1); only without ``example_inputs``.
        seq_len: tokens per row of the default inputs (default the config's
            ``max_position_embeddings``, at most 4096); only without ``example_inputs``.
        solver: as for ``memfit.fit`` (default ``"auto"``).
        max_length: for batches padded to their longest row: the longest padded length; the
            step is planned at ``max_length`` tokens (the inputs resized, a fractional budget
            taken of that step's plain peak) and every length from 1 to it is covered (NOTE
            [planning for dynamic padding] in ``memfit.integrations.lengths``). Default
            None: the inputs' own length only.
        shapes: sequence lengths to plan for (ints), every length between the shortest and
            the longest covered; with ``max_length``, it is one of them.
        on_new_shape, monitor_every: as for ``memfit.fit`` (defaults ``"replan"``, no
            monitor).

    Returns:
        ``model``, planned; the plan is ``model.memfit_plan``.

    Raises:
        ValueError: ``example_inputs`` given together with ``batch_size``/``seq_len``.
        memfit.InfeasibleBudget: no plan fits the budget.

    Example:
        >>> model = LlamaForCausalLM(LlamaConfig(...))                      # doctest: +SKIP
        >>> hf.enable(model, budget=0.5, batch_size=8, seq_len=1024)        # doctest: +SKIP
        >>> hf.disable(model)                                               # doctest: +SKIP
    """
    from memfit.api import fit
    from memfit.job.fit_options import Search, Training

    if example_inputs is not None and (batch_size is not None or seq_len is not None):
        raise ValueError("give example_inputs or batch_size/seq_len, not both: batch_size and "
                         "seq_len only shape the default inputs")
    if example_inputs is None:
        example_inputs = training_inputs(model, batch_size=batch_size, seq_len=seq_len)
    others = None
    if max_length is not None or shapes is not None:
        from memfit.integrations.lengths import length_shapes

        example_inputs, others = length_shapes(example_inputs, max_length=max_length,
                                               shapes=shapes)
    take_over_hf_checkpointing(model)
    try:
        fit(model, example_inputs, budget=budget, search=Search(solver=solver),
            training=Training(on_new_shape=on_new_shape, shapes=others,
                              monitor_every=monitor_every))
    except BaseException:
        restore_hf_checkpointing(model)
        raise
    return model


def take_over_hf_checkpointing(model: nn.Module) -> list[str]:
    """Switch HF's own checkpointing off (logged) so memfit's plan replaces it; ``disable``
    switches it back on. Returns the paths it was on for."""
    paths = suspend_hf_checkpointing(model)
    if paths:
        log.warning("memfit: %s had Hugging Face gradient checkpointing on for %d modules; "
                    "memfit's plan replaces it (memfit.integrations.hf.disable turns it back on)",
                    type(model).__name__, len(paths))
    return paths


def disable(model: M) -> M:
    """Undo ``enable``: remove the plan, the training-time ``use_cache=False``, and switch HF's
    own checkpointing back on if ``enable`` took it over.

    Example:
        >>> hf.disable(model)            # doctest: +SKIP
    """
    from memfit.runtime.apply import unapply
    from memfit.runtime.marks import applied_plan

    for m in list(model.modules()):
        if applied_plan(m) is not None:
            unapply(m)
    remove_cache_off(model)
    restore_hf_checkpointing(model)
    return model
