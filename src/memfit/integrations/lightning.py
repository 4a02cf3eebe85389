"""Lightning: ``MemfitCallback`` plans a ``LightningModule``'s ``training_step`` for a budget.

``lightning`` is imported on first access to ``MemfitCallback`` (this module itself imports
without it), so ``import memfit.integrations.lightning`` never fails; using the class without
``lightning`` installed raises an ``ImportError`` that says what to install.

NOTE [planning a training_step]
    1. ``on_train_batch_start`` is the first event that receives the batch (already moved to
       the module's device); the callback plans there, once, with
       ``memfit.fit(module, step=lambda: module.training_step(batch, batch_idx))``, so the plan
       sees the shapes, the code path and the loss of the run, and is applied before that
       batch's ``training_step`` runs.
    2. The step is profiled inside the precision plugin's ``train_step_context()``, the context
       the strategy wraps around ``training_step``: with ``precision="bf16-mixed"`` the profile
       runs the autocast kernels the run will (NOTE [autocast is part of the step]).
    3. Profiling runs ``training_step`` several times. ``fit`` puts back gradients, buffers
       and the RNG state after each run; ``self.log`` and ``self.log_dict`` do nothing while
       it runs, so no profiling value reaches the trainer's metrics or loggers.
    4. Consequence: the run with the callback is bitwise the run without it (weights, logged
       values), as the test checks. Not restored: state that ``training_step`` keeps outside
       the module's parameters and buffers (a ``torchmetrics`` metric updated there, a Python
       counter), which the profiling runs update too.
    5. Manual optimization is refused: its ``training_step`` steps the optimizer itself, which
       a profiling run must not do. Plan such a module with ``memfit.fit(module, step=...)``
       on a function that returns the loss without stepping.

Example:
    >>> from memfit.integrations.lightning import MemfitCallback
    >>> trainer = lightning.Trainer(callbacks=[MemfitCallback(budget=0.5)])   # doctest: +SKIP
    >>> trainer.fit(module, loader); print(module.memfit_plan)               # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from memfit.planning.solvers import SolverName

__all__ = ["MemfitCallback"]  # noqa: F822 (made on first access, by __getattr__)

log = logging.getLogger(__name__)

_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    if name == "MemfitCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _callback_class() -> type:
    global _CLASS
    if _CLASS is None:
        try:
            from lightning.pytorch import Callback
        except ImportError as e:
            raise ImportError(
                "memfit.integrations.lightning.MemfitCallback needs Lightning (lightning>=2.4), "
                f"which did not import ({e}); install it with `pip install 'memfit[lightning]'`"
            ) from e
        _CLASS = type("MemfitCallback", (_MemfitCallbackBase, Callback), {
            "__module__": __name__, "__doc__": _MemfitCallbackBase.__doc__})
    return _CLASS


class _MemfitCallbackBase:
    """Plan the ``LightningModule``'s ``training_step`` for ``budget`` on the first training
    batch and apply it before that step (NOTE [planning a training_step]).

    The plan is on ``module.memfit_plan`` afterwards (``memfit.unapply(module)`` removes it)
    and on ``callback.plan``. Its budget holds for the first batch's shapes, or with
    ``max_length=``, for batches padded to any length up to it (NOTE [planning for dynamic
    padding] in ``memfit.integrations.lengths``, rule 4).

    Args:
        budget: the cap on peak activation memory: ``int`` bytes, a fraction of the plain peak
            (``0.5``), ``"6GiB"``, ``"50%"`` or ``"min"``.
        solver: as for ``memfit.fit`` (default ``"auto"``).
        max_length: the longest sequence length (dimension 1 of the batch's tensors): the
            step is planned on the first batch resized to it (a fractional budget is of that
            step's plain peak), and runs that plan at every length. Default None: the first
            batch's shapes.
        monitor_every: monitor one training step in N (``memfit.fit``'s ``monitor_every``,
            started at the batch's start; records on ``module.memfit_monitor``; Lightning
            zeroes the last step's gradients after the forward, so from the second step on a
            peak is measured above a start that holds them, and reads below the plan's
            prediction by up to their size), and log
            ``memfit/peak_bytes``, ``memfit/step_s`` and ``memfit/recompute_overhead`` of
            each new record through ``module.log``. Default None: no monitor.

    Example:
        >>> trainer = lightning.Trainer(max_steps=100, callbacks=[MemfitCallback(budget=0.5)])  # doctest: +SKIP
        >>> trainer.fit(module, loader); print(module.memfit_plan)  # doctest: +SKIP
    """

    def __init__(self, budget: int | float | str, *, solver: SolverName = "auto",
                 max_length: int | None = None, monitor_every: int | None = None) -> None:
        super().__init__()
        if max_length is not None and (not isinstance(max_length, int)
                                       or isinstance(max_length, bool) or max_length < 1):
            raise ValueError(f"max_length must be an int >= 1, got {max_length!r}")
        self.budget = budget
        self.solver = solver
        self.max_length = max_length
        self.monitor_every = monitor_every
        self.plan: Any = None
        self.monitor: Any = None
        self._logged: Any = None  # the monitor record last logged

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        from memfit.api import fit
        from memfit.job.fit_options import Search

        if self.plan is not None or "memfit_plan" in pl_module.__dict__:
            self._monitor_batch(pl_module, batch)
            return  # planned already (a second fit, or a module planned by hand)
        if not pl_module.automatic_optimization:
            raise ValueError(
                f"{type(pl_module).__name__} uses manual optimization (automatic_optimization="
                "False): its training_step steps the optimizer, which memfit's profiling runs "
                "must not do. Plan it with memfit.fit(module, step=...) on a function that "
                "returns the loss without stepping, before trainer.fit")

        planned = batch
        if self.max_length is not None:  # NOTE [planning for dynamic padding], rule 4
            from memfit.integrations.lengths import inputs_at_length

            planned = inputs_at_length(batch, self.max_length)

        def step() -> Any:
            return _loss_of(pl_module.training_step(planned, batch_idx))

        with _logging_off(pl_module), trainer.precision_plugin.train_step_context():
            fit(pl_module, step=step, budget=self.budget, search=Search(solver=self.solver))
        self.plan = pl_module.memfit_plan
        log.info("memfit: planned %s's training_step on batch %d: %s",
                 type(pl_module).__name__, batch_idx, self.plan)
        if self.monitor_every is not None:
            from memfit.runtime.monitor import Monitor

            self.monitor = Monitor(pl_module, self.monitor_every, planned=((planned,), {}))
            pl_module.__dict__["memfit_monitor"] = self.monitor.records
        self._monitor_batch(pl_module, batch)

    def _monitor_batch(self, pl_module: Any, batch: Any) -> None:
        # the training_step does not call the module's forward: the monitor (NOTE [monitoring
        # a training run] in memfit.runtime.monitor) starts here, its step being the batch's
        if self.monitor is not None:
            self.monitor(pl_module, (batch,), {})

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.flush()  # the last step's CPU meter would wait for a next step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Log the monitor's new record: ``memfit/peak_bytes`` (float64, exact to the byte),
        ``memfit/step_s`` and ``memfit/recompute_overhead``, through ``pl_module.log``."""
        import torch

        from memfit.runtime.monitor import log_values

        if self.monitor is None:
            return
        records = self.monitor.records
        last = records[-1] if records else None
        if last is None or last is self._logged:
            return
        self._logged = last
        for key, value in log_values(pl_module).items():
            pl_module.log(key, torch.tensor(value, dtype=torch.float64), on_step=True,
                          on_epoch=False, batch_size=1)


def _loss_of(out: Any) -> Any:
    """The loss a ``training_step`` returns: the tensor, or ``out["loss"]``."""
    if isinstance(out, Mapping):
        if "loss" not in out:
            raise TypeError(f"training_step returned a dict without 'loss' (keys {sorted(out)}); "
                            "return the loss, or a dict with a 'loss' entry")
        return out["loss"]
    return out


@contextlib.contextmanager
def _logging_off(module: nn.Module) -> Iterator[None]:
    """``module.log`` and ``module.log_dict`` do nothing inside the block (instance attributes
    shadowing the methods, deleted on the way out)."""
    names = [n for n in ("log", "log_dict") if n not in module.__dict__]

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    for n in names:
        object.__setattr__(module, n, nothing)
    try:
        yield
    finally:
        for n in names:
            object.__delattr__(module, n)
