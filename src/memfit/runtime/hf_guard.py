"""Hugging Face's checkpointing switched on over a memfit plan: refused at the next forward.

NOTE [checkpointed twice]
    ``memfit.fit`` refuses a model whose Hugging Face checkpointing is on, and ``hf.enable``
    takes it over (NOTE [taking over HF checkpointing] in ``memfit.integrations.hf_state``).
    Nothing stops ``model.gradient_checkpointing_enable()`` (or
    ``activation_checkpointing_enable()``) called *after* the plan is applied: it sets
    ``gradient_checkpointing = True`` on the layers memfit already checkpoints, and each is
    then checkpointed twice (recomputed twice in backward, HF's checkpoint inside memfit's),
    silently slower. So ``apply`` puts a forward pre-hook on the planned model that reads the
    flags of the modules that have one (remembered at ``apply``: a flag lookup per such module
    per call, no walk of the model) and raises ``WrapError`` at the first training call (train
    mode, grad enabled: the only calls HF checkpoints) that finds one on. ``unapply`` removes
    the hook. Duck-typed: ``transformers`` is never imported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memfit._torch import forward_pre_hooks, remove_forward_pre_hook
from memfit.errors import WrapError

__all__ = ["HFCheckpointingGuard", "install_guard", "remove_guard"]

FLAG = "gradient_checkpointing"  # the attribute HF's gradient_checkpointing_enable sets


class HFCheckpointingGuard:
    """Forward pre-hook of a planned model (NOTE [checkpointed twice]). Plain data: a deep
    copy of the model copies it pointing at the copy's modules."""

    def __init__(self, model: nn.Module, flagged: list[tuple[str, nn.Module]]) -> None:
        self.model = model
        self.flagged = flagged  # (path, module) of every module with an HF checkpointing flag

    def on(self) -> list[str]:
        """Paths of the flagged modules whose HF checkpointing is on now."""
        return [path or "<root>" for path, m in self.flagged if getattr(m, FLAG, False) is True]

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        paths = self.on()
        if paths:
            shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
            raise WrapError(
                f"{type(self.model).__name__} carries a memfit plan, and Hugging Face gradient "
                f"checkpointing was switched on after it was applied ({shown}): the planned layers "
                "would be checkpointed twice (each recomputed twice in backward). Use one of the "
                "two: memfit.unapply(model) (memfit.integrations.hf.disable(model) after hf.enable) "
                "before gradient_checkpointing_enable(), or model.gradient_checkpointing_disable() "
                "to keep memfit's plan")
        return None

    def __repr__(self) -> str:
        return f"memfit.HFCheckpointingGuard({len(self.flagged)} flagged modules)"


def install_guard(model: nn.Module) -> int | None:
    """Put the guard on ``model`` if any of its modules has an HF checkpointing flag; returns
    the hook's id (for ``remove_guard``), None if no module has one."""
    flagged = [(path, m) for path, m in model.named_modules() if hasattr(m, FLAG)]
    if not flagged:
        return None
    return model.register_forward_pre_hook(HFCheckpointingGuard(model, flagged)).id


def remove_guard(model: nn.Module, key: int | None) -> None:
    """Remove the guard ``install_guard`` put on ``model`` (nothing if ``key`` is None)."""
    if key is not None and key in forward_pre_hooks(model):
        remove_forward_pre_hook(model, key)
