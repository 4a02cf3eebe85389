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
    3. Its replay runs each norm's forward without its statistics' updates (their
       ``forward`` replaced while the replay runs, in the replaying thread only: NOTE [a
       norm's forward in a replay]). A norm with scratch statistics (NOTE [scratch
       statistics]) runs ``F.batch_norm`` as torch's forward calls it, on the scratch
       instead of its buffers and without the counter's ``add_``; any other runs rule 2's
       update skipper over its forward (the ``with`` leaves the mode when torch stops the
       replay inside a norm). A region that is a norm itself replays by its class's
       forward: the whole replay, the norm's own ops, runs under the skipper then.
    4. Where a batch norm is in eval mode or another buffer is written, every call is
       watched. As with the divergence check's sampling, a region that starts reading a
       statistic, or writing another buffer (a shared module's, outside its subtree), after
       its finding (a flag flipped mid-training) is seen at its next checked call: until then
       its replays read those buffers as the forward left them. (Rule 6's copies on call are
       not made: their forward pre-hook is global, and another thread's forward of a shared
       model would have its updates put back by this region's replay.)

    Measured on the benchmark UNet3D (base 8, 56^3, batch 2, its 7 blocks checkpointed, 40
    paired steps): memfit's CPU time over torch's every-block checkpoint 1.054 -> 1.028.

NOTE [scratch statistics]
    The update skipper costs each norm of a replay a Python dispatch per op it runs (five on
    the benchmark UNet3D: 0.6 ms a norm under cProfile). ``wrap`` gives every batch norm under
    the module that runs torch's own forward two tensors like its running mean and variance
    (``prepare_scratch``, zeros, allocated then: never inside a step). The replay passes
    them where the forward passed the buffers: the same kernel, its autograd node saving as
    many tensors of the same shapes (torch's checkpoint matches the replay's saves to the
    forward's by count and metadata), its outputs the forward's bits; the kernel's update of
    the statistics goes to the scratch, which nothing reads. 16 bytes a channel of fp32
    statistics stay allocated while the module is wrapped (``drop_scratch`` on unwrap); a
    norm whose buffers moved or changed dtype after ``wrap`` replays under the skipper.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from memfit._torch import (
    check_batch_norm_input,
    module_buffers,
    no_python_dispatch,
    runs_batch_norm_forward,
)

__all__ = ["StatisticsFinding", "NormCounts", "UnwatchedNorms", "training_norms", "prepare_scratch",
           "drop_scratch"]

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
        """Run each norm's forward on its scratch statistics (NOTE [scratch statistics]), else
        under a fresh ``skipper()`` mode, in this thread, until ``replay_exit``."""
        for m in self.norms:
            stack = _skipping(m)
            stack.append(_ON_SCRATCH if _class_forward(m) and _scratch_of(m) is not None else skipper)

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
            ref = weakref.ref(module)

            def skipping(*args: Any, **kwargs: Any) -> Any:
                stack = _stacks().get(key)
                if not stack:
                    return forward(*args, **kwargs)
                if stack[-1] is _ON_SCRATCH:
                    return _on_scratch(ref(), *args, **kwargs)
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


# NOTE [scratch statistics]: per norm, the tensors its replays' kernel updates instead of its
# running mean and variance
_SCRATCH: weakref.WeakKeyDictionary[nn.Module, tuple[torch.Tensor, torch.Tensor]] = weakref.WeakKeyDictionary()


def _ON_SCRATCH() -> Any:  # a skipper stack's entry: replay on the scratch statistics
    raise AssertionError("_ON_SCRATCH marks a replay on scratch statistics; it is not a mode")


def prepare_scratch(root: nn.Module) -> None:
    """At ``wrap``: scratch statistics for every batch norm under ``root`` that runs torch's own
    forward with its running mean and variance (NOTE [scratch statistics])."""
    for m in root.modules():
        if m in _SCRATCH or not (runs_batch_norm_forward(m) and getattr(m, "track_running_stats", False)):
            continue
        bufs = module_buffers(m)
        mean, var = bufs.get("running_mean"), bufs.get("running_var")
        if mean is not None and var is not None and not (is_lazy(mean) or is_lazy(var)):  # a lazy norm: none
            with torch.no_grad():
                _SCRATCH[m] = (torch.zeros_like(mean), torch.zeros_like(var))


def drop_scratch(root: nn.Module) -> None:
    """At ``unwrap``: the scratch statistics of the norms under ``root`` are let go."""
    for m in root.modules():
        _SCRATCH.pop(m, None)


def _class_forward(module: nn.Module) -> bool:
    """Whether the norm runs its class's forward, apart from the replay's replacement (not one
    wrapped by memfit or given an instance forward by another library: those run as they are,
    under the skipper)."""
    with _LOCK:
        entry = _INSTALLED.get(id(module))
    return (entry[0] if entry is not None else module.__dict__.get("forward")) is None


def _scratch_of(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The norm's scratch statistics where they still match its buffers (device, dtype, shape)."""
    found = _SCRATCH.get(module)
    if found is None:
        return None
    bufs = module_buffers(module)
    for t, name in zip(found, ("running_mean", "running_var"), strict=True):
        b = bufs.get(name)
        if b is None or b.device != t.device or b.dtype != t.dtype or b.shape != t.shape:
            return None
    return found


def _on_scratch(module: nn.Module | None, *args: Any, **kwargs: Any) -> Any:
    """A norm's forward in a replay: ``F.batch_norm`` as torch's training forward calls it, the
    scratch statistics in place of its buffers, no counter update (NOTE [scratch statistics])."""
    assert module is not None  # the replaying frame holds the module
    x = args[0] if args else kwargs["input"]
    mean, var = _SCRATCH[module]
    check_batch_norm_input(module, x)
    norm: Any = module
    momentum = 0.0 if norm.momentum is None else norm.momentum  # updates only the scratch
    return torch.nn.functional.batch_norm(x, mean, var, norm.weight, norm.bias, True, momentum, norm.eps)

