"""Module buffers mutated in forward (BatchNorm statistics) are updated once per step.

NOTE [BatchNorm once]
    A checkpointed region runs its forward twice: once in forward, once when recomputed in
    backward. torch's checkpoint lets both runs update BatchNorm's ``running_mean``,
    ``running_var`` and ``num_batches_tracked`` (also under a selective policy that saves
    ``native_batch_norm``: the counter increment is a separate op). memfit undoes the second
    update: the recompute context snapshots the buffers the forward changed and restores
    them when the recomputation ends, early stop included (torch stops a recomputation by
    raising through the context, so the restore sits in ``__exit__``).

    Which buffers? ``native_batch_norm`` writes the running statistics without declaring it
    in its schema, so neither the version counter nor the schema shows that write. memfit
    therefore watches the *modules*: the ones the region is known to run, and every module
    called inside it during the forward (a global forward pre-hook, installed only while
    the region's forward runs). Of those, the buffers of a module that changed a buffer's
    version during the forward, or that has a ``running_mean``/``running_var`` buffer, are
    snapshotted. The snapshot is taken at the start of the recomputation, so it costs memory
    only for the duration of one region's recomputation.

    Recompute runs with the buffers as the forward left them (as torch does); a module whose
    output depends on a buffer it mutates would compute other values in recomputation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from memfit.runtime import segment as _internals

__all__ = ["BufferGuard"]

_STAT_NAMES = ("running_mean", "running_var")


class BufferGuard:
    """Tracks the modules a region runs; restores their mutated buffers after recomputation."""

    def __init__(self, modules: Iterable[nn.Module] = ()) -> None:
        self._versions: dict[nn.Module, list[int]] = {}
        self._known = tuple(modules)
        self._mutable: list[torch.Tensor] = []
        self._snapshots: list[list[torch.Tensor]] = []
        self._hook: torch.utils.hooks.RemovableHandle | None = None

    # ---- forward side ----------------------------------------------------------------
    def _see(self, module: nn.Module) -> None:
        if module not in self._versions:
            self._versions[module] = [
                _internals.tensor_version(b) for b in module.buffers(recurse=False)
            ]

    def _pre_hook(self, module: nn.Module, args: object) -> None:
        self._see(module)

    def forward_enter(self) -> None:
        for m in self._known:
            self._see(m)
        self._hook = nn.modules.module.register_module_forward_pre_hook(self._pre_hook)

    def forward_exit(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        mutable: list[torch.Tensor] = []
        for module, versions in self._versions.items():
            buffers = [b for b in module.buffers(recurse=False) if b is not None]
            names = {n for n, _ in module.named_buffers(recurse=False)}
            changed = len(buffers) != len(versions) or any(
                _internals.tensor_version(b) != v for b, v in zip(buffers, versions, strict=False)
            )
            if changed or any(n in names for n in _STAT_NAMES):
                mutable.extend(buffers)
        self._versions = {}
        self._mutable = mutable

    # ---- recompute side --------------------------------------------------------------
    def recompute_enter(self) -> None:
        with torch.no_grad():
            self._snapshots.append([b.clone() for b in self._mutable])

    def recompute_exit(self) -> None:
        snapshot = self._snapshots.pop()
        with torch.no_grad():
            for buf, saved in zip(self._mutable, snapshot, strict=True):
                buf.copy_(saved)
