"""``MemfitCallback``: a memory budget for a ``transformers.Trainer`` run.

Imports ``transformers`` at the top: reach it through ``memfit.integrations.hf.MemfitCallback``,
which imports this module on first access.

NOTE [planning on the first real batch]
    No callback event receives the batch (``on_step_begin`` gets only the trainer's state), and
    drawing one from the train dataloader in ``on_train_begin`` would advance its sampler's
    random generator, changing the data order of the run. So ``on_train_begin`` puts a forward
    pre-hook on the model, and the first training call (train mode, grad enabled) plans with
    exactly the keyword arguments the Trainer passes (``num_items_in_batch`` included) under
    its autocast state, before its forward runs; then the hook removes itself. ``fit`` leaves
    parameters, gradients, buffers and the RNG state as it found them, so the run is bitwise
    the run it would have been without memfit. The plan's budget holds for that batch's shape:
    pad to a fixed length (``padding="max_length"``) for it to hold on every step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import transformers
from torch import nn

from memfit._torch import forward_pre_hooks
from memfit.integrations.hf_state import CacheOff, cache_module

if TYPE_CHECKING:
    from memfit.planning.solvers import SolverName

__all__ = ["MemfitCallback"]

log = logging.getLogger(__name__)


class _PlanOnFirstCall:
    """Forward pre-hook: plan with the first training call's inputs, then step aside."""

    def __init__(self, callback: MemfitCallback, model: nn.Module) -> None:
        self.callback = callback
        self.model = model
        self.handle: Any = None
        self.running = False

    def __call__(self, module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        import torch

        from memfit.integrations.hf_enable import enable

        if self.running or not (module.training and torch.is_grad_enabled()):
            return None
        self.running = True
        try:
            self.handle.remove()
            inputs: Any = kwargs if not args else (args if not kwargs else None)
            if inputs is None:
                raise TypeError("MemfitCallback plans from the model's inputs, which must be all "
                                "keyword (as the Trainer passes them) or all positional")
            enable(module, self.callback.budget, inputs, solver=self.callback.solver)
        finally:
            self.running = False
        log.info("%s", module.memfit_plan)
        # The model's own hooks were gathered before this call, so the CacheOff hook ``enable``
        # just installed would miss this first call: run it here.
        target = cache_module(module)
        if target is module:
            for hook in forward_pre_hooks(module).values():
                if isinstance(hook, CacheOff):
                    return hook(module, args, kwargs)
        return None


class MemfitCallback(transformers.TrainerCallback):  # type: ignore[misc]
    """Plan the Trainer's model for ``budget`` on the first batch and apply it before the
    first step (NOTE [planning on the first real batch]).

    With ``TrainingArguments(gradient_checkpointing=True)`` (``activation_checkpointing`` in
    transformers 5) also set, memfit takes over the
    checkpointing (a warning says so): both would checkpoint the same layers twice.

    Args:
        budget: the cap on peak activation memory: ``int`` bytes, a fraction of the plain peak
            (``0.5``), ``"6GiB"``, ``"50%"`` or ``"min"``.
        solver: as for ``memfit.fit`` (default ``"auto"``).

    Example:
        >>> trainer = Trainer(model, args, train_dataset=ds,
        ...                   callbacks=[MemfitCallback(budget=0.5)])   # doctest: +SKIP
        >>> trainer.train(); trainer.model.memfit_plan                  # doctest: +SKIP
    """

    def __init__(self, budget: int | float | str, *, solver: SolverName = "auto") -> None:
        self.budget = budget
        self.solver = solver
        self._hook: _PlanOnFirstCall | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        from memfit.integrations.hf_enable import take_over_hf_checkpointing

        if model is None:
            raise ValueError("MemfitCallback needs the model; the Trainer passes it to callbacks")
        # transformers 5 renamed it activation_checkpointing (the old name mirrors the new one)
        for name in ("activation_checkpointing", "gradient_checkpointing"):
            if getattr(args, name, None):
                log.warning("memfit: TrainingArguments(%s=True) and MemfitCallback both "
                            "checkpoint; memfit's plan replaces Hugging Face's checkpointing "
                            "(set %s=False to silence this)", name, name)
                break
        take_over_hf_checkpointing(model)
        if "memfit_plan" in model.__dict__ or self._hook is not None:
            return  # planned already (a second train() call)
        hook = _PlanOnFirstCall(self, model)
        hook.handle = model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
        self._hook = hook
