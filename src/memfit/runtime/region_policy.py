"""The per-call policy function torch's selective checkpoint asks: op occurrences counted
(NOTE [op keys] in ``memfit.runtime.policies``), NOTE [forced recompute] enforced, and the
recomputation answered from the forward's decisions on torch's queued layout (NOTE
[selective-checkpoint layouts] in ``memfit._torch``)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from memfit._torch import (
    SAC_INDEXED,
    SAC_OP_OUTPUT,
    TorchDispatchMode,
    sac_forget,
    sac_is_recompute,
    sac_op_output,
    written_tensors,
)
from memfit.ops import is_view, must_recompute, op_name, writes_input
from memfit.planning.plan import OpPolicy
from memfit.profiling.storages import storage_of
from memfit.runtime.policies import Policy

__all__ = ["RegionPolicy", "OutputTap"]

_SAVE, _OFFLOAD = OpPolicy.SAVE, OpPolicy.OFFLOAD


class RegionPolicy:
    """The per-call policy function handed to ``create_selective_checkpoint_contexts``: counts
    op occurrences (NOTE [op keys], from 0 in each call), enforces NOTE [forced recompute];
    on torch's queued layout answers the recomputation from the forward's decisions (NOTE
    [selective-checkpoint layouts] in ``memfit._torch``)."""

    def __init__(self, policy: Policy, recorder: Any = None, *, generators: Any = None) -> None:
        self.policy = policy
        self.generators = generators  # an unwatched call's (NOTE [explicit generators] rule 3)
        self.recorder = recorder  # the forward's OpRecorder, fed here (no mode of its own)
        self.counts: dict[str, int] = {}
        self._caching_mode: Any = None  # set by the caller (the caching_mode property)
        self.offloads: set[tuple[Any, int]] = set()  # (op, k) whose outputs go to the host
        # Saved entries by storage: data_ptr -> (weak reference to it, [(op, index)]); the
        # reference tells it from a later storage at its address (an offloaded output's dies
        # at its last use in the forward; a write into the next one must not count).
        self._saved: dict[int, tuple[weakref.ref, list[tuple[Any, int]]]] = {}
        # Queued layout: (op name, k) -> position of its entry in the op's QueuedEntries while
        # the cache holds it; the recomputation's own occurrence counts.
        self.positions: dict[tuple[str, int], int] = {}
        self._queued: dict[str, int] = {}
        self._replay_counts: dict[str, int] = {}
        self.storage: Any = None  # the queued layout's storage dict (set by the caller)
        # Before torch 2.12: the op asked about last, whose output OutputTap hands over.
        self._pending: tuple[Any, tuple, dict, int | None] | None = None

    @property
    def caching_mode(self) -> Any:
        """Held weakly: it holds this policy, and a cycle would outlive a graph dropped unused."""
        return None if self._caching_mode is None else self._caching_mode()

    @caching_mode.setter
    def caching_mode(self, mode: Any) -> None:
        self._caching_mode = None if mode is None else weakref.ref(mode)
        if mode is not None and not SAC_INDEXED:
            self.storage = getattr(mode, "storage", None)

    def replay_enter(self) -> None:
        """A recomputation starts: its occurrences count from 0 (queued layout)."""
        self._replay_counts = {}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if sac_is_recompute(ctx):
            return self._replayed(op)
        name = op_name(op)
        k = self.counts.get(name, 0)
        self.counts[name] = k + 1
        if not SAC_OP_OUTPUT:
            self._pending = (op, args, kwargs, None)
        elif self.recorder is not None:
            self.recorder.note(op, sac_op_output(ctx), args, kwargs)
        if must_recompute(op, args, kwargs):
            if self.generators is not None and kwargs.get("generator") is not None:
                self.generators.saw_unwatched(op)
            if self._saved and writes_input(op):
                self._forget_written(op, args, kwargs)
            return CheckpointPolicy.MUST_RECOMPUTE
        decision = self.policy.decide(op, name, k, args, kwargs)
        if decision is _SAVE or decision is _OFFLOAD:
            if decision is _OFFLOAD and not is_view(op):  # in-place ops returned above
                self.offloads.add((op, k))
            if not SAC_INDEXED:
                self.positions[(name, k)] = self._queued.get(name, 0)
                self._queued[name] = self.positions[(name, k)] + 1
            if self._caching_mode is not None:
                if SAC_OP_OUTPUT:
                    for t in _tensors(sac_op_output(ctx)):
                        self._note_saved(storage_of(t), op, k)
                else:
                    self._pending = (op, args, kwargs, k)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def took_output(self, op: Any, out: Any) -> None:
        """The output of the op the policy was asked about last (before torch 2.12, from
        ``OutputTap``: the policy is asked before the op runs)."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not op:  # an op torch asks no policy about
            return
        _, args, kwargs, saved_k = pending
        if self.recorder is not None:
            self.recorder.note(op, out, args, kwargs)
        if saved_k is not None:
            for t in _tensors(out):
                self._note_saved(storage_of(t), op, saved_k)

    def _replayed(self, op: Any) -> CheckpointPolicy:
        """The recomputation's answer on the queued layout: the forward's decision for this
        occurrence, once (NOTE [selective-checkpoint layouts])."""
        name = op_name(op)
        k = self._replay_counts.get(name, 0)
        self._replay_counts[name] = k + 1
        pos = self.positions.pop((name, k), None)
        entries = None if self.storage is None else self.storage.get(op)
        if pos is None or entries is None or list.__getitem__(entries, pos) is None:
            return CheckpointPolicy.PREFER_RECOMPUTE
        entries.cursor = pos
        return CheckpointPolicy.MUST_SAVE

    def _note_saved(self, storage: torch.UntypedStorage | None, op: Any, k: int) -> None:
        # A DTensor's storage is its local tensor's (NOTE [wrapper subclasses] in
        # memfit.profiling.storages): the wrapper's own placeholder has no data pointer.
        if storage is None:
            return
        ptr = storage.data_ptr()
        held = self._saved.get(ptr)
        if ptr and (held is None or held[0]() is not storage):  # none, or one freed since
            held = self._saved[ptr] = (weakref.ref(storage), [])
        if held is not None:
            held[1].append((op, k))

    def _forget_written(self, op: Any, args: tuple, kwargs: dict) -> None:
        """A saved tensor written in place later in the forward must be recomputed instead:
        the cache would hand the recomputation the written value (torch raises)."""
        for t in written_tensors(op, args, kwargs):
            storage = storage_of(t)  # NOTE [storage identity and frees] (profiling)
            if storage is None:
                continue
            ptr = storage.data_ptr()
            held = self._saved.get(ptr)
            if held is not None and held[0]() is storage:
                del self._saved[ptr]
                mode = self.caching_mode
                for saved_op, index in held[1] if mode is not None else ():
                    position = self.positions.pop((op_name(saved_op), index), None)
                    sac_forget(mode, saved_op, index, position)


class OutputTap(TorchDispatchMode):
    """Hands each op's output to the region policy after the op ran (torch before 2.12 asks
    the policy before the op runs: NOTE [selective-checkpoint layouts] in ``memfit._torch``);
    entered just above torch's caching mode."""

    def __init__(self, policy: RegionPolicy) -> None:
        super().__init__()
        self.policy = policy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.policy.took_output(func, out)
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in value if isinstance(v, torch.Tensor)] if isinstance(value, (tuple, list)) else []
