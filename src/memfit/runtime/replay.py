"""The recorded calls of an open chain segment and their replay (NOTE [chain segments] in
``memfit.runtime.segment``, rules 2 and 3).

While a segment's checkpoint is open, each block call is recorded with its arguments encoded:
an argument that is the output of an earlier block of the segment (or an element of it)
becomes ``Out(call, index)``, a tensor passed into the checkpoint ``In(i)``, and any other
tensor is held by reference with its version counter. ``Replay`` is the checkpoint's
recompute function: it re-calls the blocks in order with ``Out``/``In`` resolved against the
recomputed outputs and the checkpoint's saved inputs.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit._torch import tensor_version
from memfit.errors import RecomputeMismatch

__all__ = ["OpenCheckpoint", "ThreadState", "Replay", "map_tensors"]


@dataclass(frozen=True)
class Out:
    """Placeholder: the recomputed output of the segment's call ``call`` (element ``index``)."""

    call: int
    index: int | str | None


@dataclass(frozen=True)
class In:
    """Placeholder: the i-th tensor passed to the checkpoint (saved by torch)."""

    i: int


@dataclass
class Call:
    """One block call of an open segment, its arguments encoded."""

    module: nn.Module
    args: Any
    kwargs: Any


@dataclass
class OpenCheckpoint:
    """State of a segment checkpoint open in the current forward."""

    gen: Any
    contexts: Any
    start: int
    last: int = -1
    boundary: int = 0
    calls: list[Call] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)
    input_ids: dict[int, int] = field(default_factory=dict)
    outputs: dict[int, tuple[weakref.ref, int, int | str | None]] = field(default_factory=dict)
    held: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    # The saved-tensor hooks in effect outside the checkpoint, and the context that puts them
    # back in effect between two blocks (NOTE [chain segments], rule 5).
    outer_hooks: tuple[Any, Any] | None = None
    between: Any = None

    def add_input(self, t: torch.Tensor) -> torch.Tensor:
        """Note a tensor passed into the checkpoint (once per tensor)."""
        if id(t) not in self.input_ids:
            self.input_ids[id(t)] = len(self.inputs)
            self.inputs.append(t)
        return t

    def encode(self, value: Any) -> Any:
        """``value`` with its tensors replaced by ``Out``/``In`` placeholders where they are
        a block's output or a checkpoint input; other tensors are held (with their version)."""
        def one(t: torch.Tensor) -> Any:
            entry = self.outputs.get(id(t))
            if entry is not None and entry[0]() is t:
                return Out(entry[1], entry[2])
            i = self.input_ids.get(id(t))
            if i is not None and self.inputs[i] is t:
                return In(i)
            self.held.append((t, tensor_version(t)))
            return t

        return map_tensors(value, one)

    def add_call(self, pos: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Record block ``pos``'s call."""
        self.calls.append(Call(module, self.encode(args), self.encode(kwargs)))
        self.last = pos

    def add_output(self, output: Any) -> None:
        """Record the output of the last call, so later calls can refer to it."""
        index = len(self.calls) - 1

        def register(t: torch.Tensor, key: int | str | None) -> None:
            self.outputs[id(t)] = (weakref.ref(t), index, key)

        if isinstance(output, torch.Tensor):
            register(output, None)
        elif isinstance(output, (tuple, list)):
            for i, v in enumerate(output):
                if isinstance(v, torch.Tensor):
                    register(v, i)
        elif isinstance(output, dict):
            for k, v in output.items():
                if isinstance(v, torch.Tensor):
                    register(v, k)


class ThreadState(threading.local):
    """Per-thread state of a segment (NOTE [segments and threads] in memfit.runtime.segment)."""

    open: OpenCheckpoint | None = None
    replaying: int = 0


def map_tensors(value: Any, fn: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in its tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if type(value) is dict:
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


def _resolve(value: Any, inputs: Sequence[torch.Tensor], outs: list[Any]) -> Any:
    if isinstance(value, In):
        return inputs[value.i]
    if isinstance(value, Out):
        out = outs[value.call]
        return out if value.index is None else out[value.index]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_resolve(v, inputs, outs) for v in value)
    if isinstance(value, list):
        return [_resolve(v, inputs, outs) for v in value]
    if type(value) is dict:
        return {k: _resolve(v, inputs, outs) for k, v in value.items()}
    return value


class Replay:
    """The recompute function of one segment checkpoint: re-calls its blocks in order.

    Args:
        name: the segment's name, for errors.
        state: the segment's per-thread state; its ``replaying`` count silences the
            segment's hooks in the thread running the replay.
        calls: the recorded calls (filled while the forward runs).
        held: tensors passed to the blocks by reference, with their versions then.
    """

    def __init__(self, name: str, state: ThreadState, calls: list[Call],
                 held: list[tuple[torch.Tensor, int]]) -> None:
        self.name, self.state, self.calls, self.held = name, state, calls, held

    def __call__(self, *inputs: torch.Tensor) -> None:
        for t, version in self.held:
            if tensor_version(t) != version:
                raise RecomputeMismatch(
                    f"segment {self.name}: a tensor passed to one of its blocks "
                    f"(shape {list(t.shape)}) was modified in place after the forward "
                    f"(version {version} -> {tensor_version(t)}), so the recomputation "
                    "cannot replay it; avoid in-place updates of tensors fed to the blocks"
                )
        outs: list[Any] = []
        self.state.replaying += 1
        try:
            for call in self.calls:
                args = _resolve(call.args, inputs, outs)
                kwargs = _resolve(call.kwargs, inputs, outs)
                outs.append(call.module(*args, **kwargs))
        finally:
            self.state.replaying -= 1
