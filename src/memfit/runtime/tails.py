"""A region's tail at run time: its saves kept as the plain step keeps them (NOTE [region tails]
in ``memfit.planning.tails``).

``wrap`` gives a region whose plan names ``tail_after`` a ``RegionTail``: a forward hook on
that sub-module pushes, during the region's forward only, the saved-tensor hooks that were in
effect outside the region, above the checkpoint's own; the region's forward pops them when it
returns. With no hooks outside, a save keeps a detached alias of the tensor (the same storage
and values; an output saved by its own op then makes no reference cycle through its
``grad_fn``). A backward that builds a graph (``create_graph=True``) would lose the alias's
history, so reading one there raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit._torch import outer_saved_tensors_hooks
from memfit.errors import MemfitError

__all__ = ["RegionTail"]


class RegionTail:
    """The tail of one wrapped region: ``boundary`` is the sub-module it starts after."""

    def __init__(self, boundary: nn.Module, name: str) -> None:
        self.boundary = boundary
        self.name = name
        self._calls: list[_TailCall] = []
        self._handle = boundary.register_forward_hook(self._after_boundary)

    def remove(self) -> None:
        self._handle.remove()

    def around(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (the region's forward) for one checkpointed call: its first run (the forward)
        arms the tail; the checkpoint's replays run ``fn`` as it is."""
        call = _TailCall(outer_saved_tensors_hooks(), self.name)
        calls = self._calls

        def tailed(*args: Any, **kwargs: Any) -> Any:
            call.runs += 1
            if call.runs > 1:
                return fn(*args, **kwargs)
            calls.append(call)
            try:
                return fn(*args, **kwargs)
            finally:
                call.pop()
                calls.remove(call)

        return tailed

    def _after_boundary(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._calls:
            self._calls[-1].push()


class _TailCall:
    def __init__(self, outer: tuple[Any, Any] | None, name: str) -> None:
        self.outer = outer
        self.name = name
        self.runs = 0
        self._hooks: Any = None

    def push(self) -> None:
        if self._hooks is not None:
            return
        pack, unpack = self.outer if self.outer is not None else (_alias, self._read)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()

    def pop(self) -> None:
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def _read(self, t: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise MemfitError(
                f"region {self.name}: a backward that builds a graph (create_graph=True) read a "
                "tensor its tail saved (NOTE [region tails] in memfit.planning.tails), whose "
                "history memfit does not keep; plan without tails for double backward "
                "(memfit.Search(tails=False))")
        return t


def _alias(t: torch.Tensor) -> torch.Tensor:
    return t.detach()
