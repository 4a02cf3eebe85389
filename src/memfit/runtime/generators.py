"""Explicit generators: a region's replay draws what its forward drew from every generator.

NOTE [explicit generators]
    torch's checkpoint rewinds the default generators (CPU and each device's) for the replay
    and puts them back afterwards. A random op given its own ``torch.Generator``
    (``torch.randn(shape, generator=g)``: diffusion noise, seeded augmentation) is not
    covered: the replay draws from ``g`` where the forward left it, so it computes other
    numbers (wrong gradients, silently once the divergence check stops sampling), and it
    advances ``g`` a second time, so the step leaves ``g`` elsewhere than the plain step.
    The rules:

    1. A *watching* call runs a dispatch mode in both passes that sees every op's
       ``generator=`` argument before the op runs. The forward keeps each generator's state
       just before the region's first draw from it; the replay, before its first draw from
       that generator, notes where the generator is and sets it to the kept state; when the
       replay ends (early stop included) each generator goes back where it was, so the step
       leaves it where the plain step does. The states are taken and set with Python
       dispatch off (no op of the region).
    2. A region's calls are watched by the same schedule as the divergence check, and more:
       a call the check samples (``wrap``'s first 3 calls, then one in 100), the first call
       of every region (also with ``check=False``), every call of the function form
       (``memfit.checkpoint`` has no identity across calls), and every call of a region
       once any watched call saw a generator. So a region that never draws from an explicit
       generator pays for no mode after its first calls.
    3. A region that starts drawing from one only in an unwatched call (a branch taken at
       step 1000) has no kept state. With a selective policy the region's policy function
       sees the argument (after the op ran) and the replay raises ``RecomputeMismatch``
       before it computes anything, naming the region; without a policy that call goes
       unseen until the next watched call. Pass ``check="always"`` to such a region.
    4. Memory: each kept state (5,056 B for a CPU generator; a CUDA generator's state is
       host memory) lives from the region's forward to its replay. The planner does not
       model it: a region drawing from an explicit CPU generator peaks that much above the
       prediction per call in flight.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit._torch import TorchDispatchMode, no_python_dispatch
from memfit.errors import RecomputeMismatch

__all__ = ["GeneratorReplay", "generator_of"]


def generator_of(kwargs: dict | None) -> torch.Generator | None:
    """The explicit generator an op was given (its ``generator=`` argument), if any."""
    if not kwargs:
        return None
    g = kwargs.get("generator")
    return g if isinstance(g, torch.Generator) else None


class GeneratorReplay:
    """The explicit generators of one checkpointed call (NOTE [explicit generators]).

    Args:
        name: the region, for error messages.
        on_seen: called once, in the forward, when the call first draws from an explicit
            generator (the region's sampler watches its later calls).
    """

    def __init__(self, name: str, on_seen: Any = None) -> None:
        self.name = name
        self._on_seen = on_seen
        self._kept: dict[int, tuple[torch.Generator, torch.Tensor]] = {}  # forward's states
        self._entry: dict[int, tuple[torch.Generator, torch.Tensor]] = {}  # replay's, to undo
        self.unwatched: str | None = None  # an op that drew in an unwatched forward (rule 3)

    def forward_mode(self) -> TorchDispatchMode:
        return _Keep(self)

    def recompute_mode(self) -> TorchDispatchMode:
        return _Rewind(self)

    def keep(self, g: torch.Generator) -> None:
        """Forward: keep ``g``'s state before the call's first draw from it."""
        if id(g) in self._kept:
            return
        with no_python_dispatch():
            self._kept[id(g)] = (g, g.get_state())
        if self._on_seen is not None:
            self._on_seen()

    def rewind(self, g: torch.Generator) -> None:
        """Replay: before the first draw from ``g``, set it to the forward's kept state."""
        if id(g) in self._entry:
            return
        kept = self._kept.get(id(g))
        with no_python_dispatch():
            self._entry[id(g)] = (g, g.get_state())
            if kept is not None:
                g.set_state(kept[1])

    def saw_unwatched(self, op: Any) -> None:
        """An op of an unwatched forward drew from an explicit generator (rule 3)."""
        if self.unwatched is None:
            self.unwatched = str(op)
            if self._on_seen is not None:
                self._on_seen()

    def replay_enter(self) -> None:
        self._entry = {}
        if self.unwatched is not None:
            raise RecomputeMismatch(
                f"{self.name} drew from an explicit torch.Generator ({self.unwatched}, "
                "generator=...) in a call memfit did not watch, so its replay cannot draw "
                "what the forward drew and its gradients would be wrong. Regions are watched "
                "on their first calls and whenever the divergence check samples them: pass "
                "check=\"always\" to this region (NOTE [explicit generators] in "
                "memfit.runtime.generators)"
            )

    def replay_exit(self) -> None:
        """Put every generator the replay drew from back where the replay found it."""
        with no_python_dispatch():
            for g, state in self._entry.values():
                g.set_state(state)
        self._entry = {}


class _Keep(TorchDispatchMode):
    def __init__(self, replay: GeneratorReplay) -> None:
        super().__init__()
        self.replay = replay

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        g = generator_of(kwargs)
        if g is not None:
            self.replay.keep(g)
        return func(*args, **(kwargs or {}))


class _Rewind(TorchDispatchMode):
    def __init__(self, replay: GeneratorReplay) -> None:
        super().__init__()
        self.replay = replay

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        g = generator_of(kwargs)
        if g is not None:
            self.replay.rewind(g)
        return func(*args, **(kwargs or {}))
