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
    and on ``callback.plan``. Its budget holds for the first batch's shapes: keep batches one
    shape (``drop_last=True``, padding to a fixed length) for it to hold on every step.

    Args:
        budget: the cap on peak activation memory: ``int`` bytes, a fraction of the plain peak
            (``0.5``), ``"6GiB"``, ``"50%"`` or ``"min"``.
        solver: as for ``memfit.fit`` (default ``"auto"``).

    Example:
        >>> trainer = lightning.Trainer(max_steps=100, callbacks=[MemfitCallback(budget=0.5)])  # doctest: +SKIP
        >>> trainer.fit(module, loader); print(module.memfit_plan)  # doctest: +SKIP
    """

    def __init__(self, budget: int | float | str, *, solver: SolverName = "auto") -> None:
        super().__init__()
        self.budget = budget
        self.solver = solver
        self.plan: Any = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        from memfit.api import fit

        if self.plan is not None or "memfit_plan" in pl_module.__dict__:
            return  # planned already (a second fit, or a module planned by hand)
        if not pl_module.automatic_optimization:
            raise ValueError(
                f"{type(pl_module).__name__} uses manual optimization (automatic_optimization="
                "False): its training_step steps the optimizer, which memfit's profiling runs "
                "must not do. Plan it with memfit.fit(module, step=...) on a function that "
                "returns the loss without stepping, before trainer.fit")

        def step() -> Any:
            return _loss_of(pl_module.training_step(batch, batch_idx))

        with _logging_off(pl_module), trainer.precision_plugin.train_step_context():
            fit(pl_module, step=step, budget=self.budget, solver=self.solver)
        self.plan = pl_module.memfit_plan
        log.info("memfit: planned %s's training_step on batch %d: %s",
                 type(pl_module).__name__, batch_idx, self.plan)


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
