"""Kept draws: a region's random op whose result is kept for the replay instead of drawn again.

NOTE [kept draws]
    A random op inside a checkpointed region must run again in its replay: torch's checkpoint
    rewinds the generator to its state at the call, and a replay that skipped one draw would
    give every later random op of the region other numbers (NOTE [forced recompute] in
    ``memfit.runtime.policies``). On CPU that is expensive: dropout draws its mask with
    ``bernoulli_`` at about 8 ns per element (measured, torch 2.13, 2 cores: 8.7 ms of a zoo
    GPT block's 42 ms forward for the attention's 1M-element mask), the largest part of
    replaying an attention block.

    So a plan may *keep a draw*: ``OpPolicy.SAVE`` on an occurrence of an op in
    :data:`memfit.ops.KEPT_DRAW_OPS` (``bernoulli_``, in place, results 0 or 1). The forward
    runs it, then keeps a one-byte-per-element copy of what it wrote (``tensor != 0``) and the
    state of the generator it drew from, just after the draw. The replay does not draw: it
    writes the copy back into the tensor it is given (a fresh one, made again by the replay's
    ``empty_like``) and sets the generator to the kept state, so every later random op of the
    replay draws exactly what the forward drew after that point; the copy and the state are
    dropped there. Bitwise the same: a Bernoulli draw is 0 or 1 in any dtype, and the ops
    after it (dropout's ``div_`` and ``mul``) run again on the same values.

    1. Only draws from the device's default generator (no ``generator=`` argument) of CPU and
       CUDA tensors are kept; any other call runs as before, in both passes (the forward
       keeps nothing, so the replay finds nothing to write back).
    2. Only what torch's checkpoint rewinds is restored: the replay runs inside its
       ``fork_rng``, which puts the generators back when the replay ends.
    3. Memory: the copy (one byte per element) and the generator state (5,056 B on CPU;
       host memory on a GPU) live from the draw in forward to its step in the replay; the
       tensor drawn into is dropped and made again by the replay as before. The planner
       counts both (``memfit.planning.effects``, NOTE [region memory model]).
    4. The keeper is a dispatch mode below torch's selective-checkpoint modes in both passes
       (so the selective cache counts and sees ``bernoulli_`` as usual: always "recompute"),
       above the buffer guard's; it makes its copies with Python dispatch off, so no mode
       sees them as ops of the region. A region keeping draws always runs with a
       selective-checkpoint policy (its plan's ``by_key``), which the time model charges.
    5. Under ``torch.compile`` the compiled backward replays the region inside its graph and
       draws again: nothing is kept there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from memfit._torch import TorchDispatchMode, no_python_dispatch
from memfit.ops import KEPT_DRAW_OPS, overload_named

__all__ = ["DrawKeeper", "draw_overloads"]


def draw_overloads() -> dict[Any, str]:
    """The overloads of :data:`memfit.ops.KEPT_DRAW_OPS` this torch has, by overload."""
    return {op: name for name in KEPT_DRAW_OPS if (op := overload_named(name)) is not None}


_OVERLOADS = draw_overloads()


def _generator(t: torch.Tensor) -> torch.Generator | None:
    """The default generator a draw into ``t`` uses (None: a device memfit does not keep)."""
    if t.device.type == "cpu":
        return torch.default_generator
    if t.device.type == "cuda":
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None


class DrawKeeper:
    """The kept draws of one checkpointed call (NOTE [kept draws]).

    Args:
        keys: the occurrences to keep, as ``(overload name, k)`` with ``k`` counted as the
            plan's op keys count (NOTE [op keys] in ``memfit.runtime.policies``).
    """

    def __init__(self, keys: Iterable[tuple[str, int]]) -> None:
        self.keys = frozenset(keys)
        self.kept: dict[tuple[str, int], tuple[torch.Tensor, torch.Generator, torch.Tensor]] = {}

    def forward_mode(self) -> TorchDispatchMode:
        return _KeepDraws(self)

    def recompute_mode(self) -> TorchDispatchMode:
        return _ReplayDraws(self)


class _Counting(TorchDispatchMode):
    """Counts the draw ops by name; the counts restart each time the mode is entered."""

    def __init__(self, keeper: DrawKeeper) -> None:
        super().__init__()
        self.keeper = keeper
        self.counts: dict[str, int] = {}

    def __enter__(self) -> Any:
        self.counts = {}
        return super().__enter__()

    def occurrence(self, func: Any) -> tuple[str, int] | None:
        """``(name, k)`` of this call if it is a draw op, else None."""
        name = _OVERLOADS.get(func)
        if name is None:
            return None
        k = self.counts.get(name, 0)
        self.counts[name] = k + 1
        return name, k


class _KeepDraws(_Counting):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        key = self.occurrence(func)
        if key is not None and key in self.keeper.keys and kwargs.get("generator") is None:
            target = args[0]
            gen = _generator(target)
            if gen is not None:
                with no_python_dispatch():
                    self.keeper.kept[key] = (torch.ne(target, 0), gen, gen.get_state())
        return out


class _ReplayDraws(_Counting):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        key = self.occurrence(func)
        entry = self.keeper.kept.pop(key, None) if key is not None else None
        if entry is None:
            return func(*args, **(kwargs or {}))
        values, gen, state = entry
        target = args[0]
        with no_python_dispatch():
            target.copy_(values)
            gen.set_state(state)
        return target

