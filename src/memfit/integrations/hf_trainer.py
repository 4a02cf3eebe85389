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
    give ``max_length=`` for batches padded to their longest row (NOTE [planning for dynamic
    padding] in ``memfit.integrations.lengths``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import transformers
from torch import nn

from memfit._torch import forward_pre_hook_takes_kwargs, forward_pre_hooks

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
        cb = self.callback
        before = set(forward_pre_hooks(module))
        try:
            self.handle.remove()
            inputs: Any = kwargs if not args else (args if not kwargs else None)
            if inputs is None:
                raise TypeError("MemfitCallback plans from the model's inputs, which must be all "
                                "keyword (as the Trainer passes them) or all positional")
            enable(module, cb.budget, inputs, solver=cb.solver, max_length=cb.max_length,
                   shapes=cb.shapes, on_new_shape=cb.on_new_shape, monitor_every=cb.monitor_every)
        finally:
            self.running = False
        log.info("%s", module.memfit_plan)
        # The model's hooks were gathered before this call, so those ``enable`` just installed
        # (the input guard, CacheOff, the monitor) would miss this first call: run them here,
        # in their order.
        for key, hook in list(forward_pre_hooks(module).items()):
            if key in before:
                continue
            if forward_pre_hook_takes_kwargs(module, key):
                out = hook(module, args, kwargs)
                if out is not None:
                    args, kwargs = out
            else:
                out = hook(module, args)
                if out is not None:
                    args = out if isinstance(out, tuple) else (out,)
        return args, kwargs


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
        max_length: with dynamic padding (a collator padding each batch to its longest row):
            the longest padded length. The step is planned at ``max_length`` tokens (the
            first batch resized: a fractional budget is of that step's plain peak) and every
            length from 1 to it runs a plan that fits, switched without a trace (NOTE
            [planning for dynamic padding] in ``memfit.integrations.lengths``). Default
            None: the first batch's shape only; other shapes re-plan once each.
        shapes: sequence lengths to plan for (ints), as for ``hf.enable``.
        on_new_shape: as for ``memfit.fit`` (default ``"replan"``).
        monitor_every: monitor one training call in N (``memfit.fit``'s ``monitor_every``);
            each log then carries ``memfit/peak_bytes``, ``memfit/step_s`` (of the last
            monitored step) and ``memfit/recompute_overhead`` (the plan in effect's predicted
            recompute time, a fraction of the plain step). Default None: no monitor.

    Example:
        >>> trainer = Trainer(model, args, train_dataset=ds, data_collator=pad_to_longest,
        ...                   callbacks=[MemfitCallback(budget=0.5, max_length=1024)])  # doctest: +SKIP
        >>> trainer.train(); trainer.model.memfit_plan                  # doctest: +SKIP
    """

    def __init__(self, budget: int | float | str, *, solver: SolverName = "auto",
                 max_length: int | None = None, shapes: Sequence[int] | None = None,
                 on_new_shape: str | None = None, monitor_every: int | None = None) -> None:
        self.budget = budget
        self.solver = solver
        self.max_length = max_length
        self.shapes = shapes
        self.on_new_shape = on_new_shape
        self.monitor_every = monitor_every
        self._logged: Any = None  # the monitor record last added to a log
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

    def on_train_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                     **kwargs: Any) -> None:
        records = None if model is None else model.__dict__.get("memfit_monitor")
        if records is not None:
            len(records)  # reading ends the last step's CPU meter, which waits for a next call

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               model: nn.Module | None = None, **kwargs: Any) -> None:
        """Add the monitor's last record, if not logged before, to ``logs`` (and to the
        ``state.log_history`` entry the Trainer made of them). The Trainer calls ``report_to`` loggers' callbacks before
        the ones passed to it: to have them log these keys too, move this callback first
        (``trainer.callback_handler.callbacks.insert(0, trainer.pop_callback(cb))``)."""
        from memfit.runtime.monitor import log_values

        if logs is None or model is None:
            return
        records = model.__dict__.get("memfit_monitor")
        last = records[-1] if records else None
        if last is None or last is self._logged:
            return
        self._logged = last
        values = log_values(model)
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)
