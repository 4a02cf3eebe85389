"""Batch norm statistics without the buffer watcher: rule 7 of NOTE [buffers written in
forward] (``memfit.runtime.buffers``).

NOTE [batch norms without the watcher]
    A batch norm's statistics are the one buffer write nearly every CNN region makes, and the
    buffer watcher and the update skipper cost it a Python dispatch per op of both passes (on
    this project's 2-core CPU 0.1-0.2 ms per op: a UNet3D of 7 regions ran +10 ms in forward
    and +11 ms in its replays, a step 5.4% over torch's own checkpoint of the same blocks in
    CPU time). So:

    1. A wrapped region's watched call finds (``NormCounts``) whether its forward wrote
       nothing but the statistics of its batch norms, each by the norm's own forward (one
       update of each of its three buffers per call of the norm), none of them read; the
       region keeps the answer (``StatisticsFinding``). A checked call (NOTE [check
       sampling] in ``memfit.runtime.divergence``; with ``check=False``, the first call)
       watches and renews it.
    2. An unchecked call of such a region runs unwatched (``UnwatchedNorms``) when every
       module of it that has buffers runs torch's own batch-norm forward
       (``runs_batch_norm_forward``) in training with its three buffers: what the watcher
       would find is known (those buffers unread, rule 2), and the copies it would make
       before each norm's first write and drop when the forward ends are made as each norm
       is called (counter, mean, variance: the order torch's forward writes them), so that
       the step's memory is the memory model's (NOTE [buffer copies] in
       ``memfit.planning.buffer_copies``).
    3. Its replay runs rule 2's update skipper inside the norms' forwards only (their
       ``forward`` replaced while the replay runs, skipping in the replaying thread only:
       NOTE [a norm's forward in a replay]; the ``with`` leaves the mode when torch stops
       the replay inside a norm). A region that is a norm itself replays by its
       class's forward: the whole replay, the norm's own ops, runs under the skipper then.
    4. Where a batch norm is in eval mode or another buffer is written, every call is
       watched. As with the divergence check's sampling, a region that starts reading a
       statistic, or writing another buffer (a shared module's, outside its subtree), after
       its finding (a flag flipped mid-training) is seen at its next checked call: until then
       its replays read those buffers as the forward left them. (Rule 6's copies on call are
       not made: their forward pre-hook is global, and another thread's forward of a shared
       model would have its updates put back by this region's replay.)

    Measured on the benchmark UNet3D (base 8, 56^3, batch 2, its 7 blocks checkpointed, 40
    paired steps): memfit's CPU time over torch's every-block checkpoint 1.054 -> 1.028.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from memfit._torch import module_buffers, no_python_dispatch, runs_batch_norm_forward

__all__ = ["StatisticsFinding", "NormCounts", "UnwatchedNorms", "training_norms"]

STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
_WRITE_ORDER = ("num_batches_tracked", "running_mean", "running_var")  # torch's forward: add_ first


class StatisticsFinding:
    """One wrapped region's finding from its last watched call (rule 1): whether its forward
    wrote only the unread statistics of its batch norms."""

    def __init__(self) -> None:
        self.statistics_only = False

    def __repr__(self) -> str:
        return f"StatisticsFinding(statistics_only={self.statistics_only})"


def training_norms(modules: Iterable[nn.Module]) -> list[nn.Module] | None:
    """The batch norms of ``modules`` (subtrees) when every module with a buffer runs torch's
    own batch-norm forward in training with its three statistics (rule 2); else None."""
    norms: list[nn.Module] = []
    seen: set[int] = set()
    for root in modules:
        for m in root.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            bufs = module_buffers(m)
            if not any(b is not None for b in bufs.values()):
                continue
            if not (runs_batch_norm_forward(m) and m.training and getattr(m, "track_running_stats", False)
                    and len(bufs) == 3 and all(bufs.get(n) is not None for n in STATISTICS)):
                return None
            norms.append(m)
    return norms or None


def _buffers(norms: Iterable[nn.Module]) -> list[torch.Tensor]:
    return [b for m in norms for b in module_buffers(m).values() if b is not None]


class NormCounts:
    """A watched call's counts for rule 1: the calls of each module and the updates of each
    buffer its forward made."""

    def __init__(self, norms: list[nn.Module], roots: Iterable[nn.Module]) -> None:
        self.norms = norms
        self._roots = {id(m) for m in roots}
        self._calls: dict[int, int] = {}
        self._updates: dict[int, int] = {}

    def called(self, module: nn.Module) -> None:
        self._calls[id(module)] = self._calls.get(id(module), 0) + 1

    def updated(self, buffer_ids: Iterable[int]) -> None:
        for i in buffer_ids:
            self._updates[i] = self._updates.get(i, 0) + 1

    def statistics_only(self, unread: set[Any], storage_key: Callable[[torch.Tensor], Any]) -> bool:
        """Whether the unread buffers are exactly the norms' and each norm's forward made its
        updates (a root's call is the region's own, made before the pre-hook was in). The
        caller has checked that no buffer was read or replaced."""
        bufs = {id(m): [b for b in module_buffers(m).values() if b is not None] for m in self.norms}
        if unread != {storage_key(b) for b in _buffers(self.norms)}:
            return False
        return all(self._updates.get(id(b)) == self._calls.get(id(m), 0) + (id(m) in self._roots)
                   for m in self.norms for b in bufs[id(m)])


class UnwatchedNorms:
    """An unwatched call's batch norms (rules 2 and 3)."""

    def __init__(self, norms: list[nn.Module], roots: Iterable[nn.Module]) -> None:
        self.norms = norms
        root_ids = {id(m) for m in roots}
        # a norm that is the region replays by its class's forward: skip in the whole replay
        self.scoped = not any(id(m) in root_ids for m in norms)
        self._uncopied = {id(m) for m in norms}
        self._copies: list[torch.Tensor | None] = []
        for m in norms:  # a root was called before the guard's pre-hook was installed
            if id(m) in root_ids:
                self.copy_on_call(m)

    def unread(self, storage_key: Callable[[torch.Tensor], Any]) -> set[Any]:
        """The storages the watcher would have found unread: the norms' buffers."""
        return {key for b in _buffers(self.norms) if (key := storage_key(b)) is not None}

    def copy_on_call(self, module: nn.Module) -> None:
        """A module's call in the forward: a norm's first call copies its buffers, as the
        watcher does before its first write (rule 2)."""
        if id(module) not in self._uncopied:
            return
        self._uncopied.discard(id(module))
        bufs = module_buffers(module)
        with no_python_dispatch(), torch.no_grad():
            self._copies.extend(bufs[n].detach().clone() for n in _WRITE_ORDER)  # type: ignore[union-attr]

    def forward_end(self) -> None:
        """Drop the copies, in the order they were made (as the watcher drops its own)."""
        copies, self._copies, self._uncopied = self._copies, [], set()
        for i in range(len(copies)):
            copies[i] = None

    def replay_enter(self, skipper: Callable[[], Any]) -> None:
        """Run each norm's forward under a fresh ``skipper()`` mode, in this thread, until
        ``replay_exit``."""
        for m in self.norms:
            _skipping(m).append(skipper)

    def replay_exit(self) -> None:
        for m in self.norms:
            _unskipping(m)


# NOTE [a norm's forward in a replay] rule 3 replaces a norm's ``forward`` while a replay runs,
# and a model may be shared by threads (NOTE [segments and threads] in memfit.runtime.segment):
# the replacement is installed by the first replay that needs it in any thread and removed by
# the last, and skips only in the threads whose replay asked (a thread-local stack per norm),
# so that another thread's forward of the same norm updates its statistics as usual.
_LOCK = threading.Lock()
_INSTALLED: dict[int, list[Any]] = {}  # id(norm) -> [its instance forward before (None: none), users]
_LOCAL = threading.local()


def _stacks() -> dict[int, list[Callable[[], Any]]]:
    stacks = getattr(_LOCAL, "stacks", None)
    if stacks is None:
        stacks = _LOCAL.stacks = {}
    return stacks


def _skipping(module: nn.Module) -> list[Callable[[], Any]]:
    """This thread's skipper stack for ``module``, its forward replaced if not already."""
    with _LOCK:
        entry = _INSTALLED.get(id(module))
        if entry is None:
            before = module.__dict__.get("forward")
            forward = module.forward
            key = id(module)

            def skipping(*args: Any, **kwargs: Any) -> Any:
                stack = _stacks().get(key)
                if not stack:
                    return forward(*args, **kwargs)
                with stack[-1]():
                    return forward(*args, **kwargs)

            module.__dict__["forward"] = skipping
            entry = _INSTALLED[id(module)] = [before, 0]
        entry[1] += 1
    return _stacks().setdefault(id(module), [])


def _unskipping(module: nn.Module) -> None:
    stack = _stacks().get(id(module))
    if stack:
        stack.pop()
    with _LOCK:
        entry = _INSTALLED[id(module)]
        entry[1] -= 1
        if entry[1] == 0:
            del _INSTALLED[id(module)]
            if entry[0] is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = entry[0]
