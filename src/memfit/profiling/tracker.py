"""The profiler's op recorder: live-storage accounting plus one record per op.

``StorageTracker`` extends the dispatch meter (``memfit.profiling.storages.LiveStorages``,
whose NOTEs on storage identity, unseen inputs and op positions apply here) with what a
Profile needs per op: its name, module, input and output storages, time, FLOPs, bytes moved,
whether it writes an input or consumes the RNG (``memfit.ops``), the forward op a backward op
belongs to, and its kernel workspace (``memfit.profiling.workspace``). It also marks the
storages autograd saves for backward and when backward first reads them.
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfit import ops
from memfit._torch import current_autograd_node, node_sequence_nr, op_packet, peek_sequence_nr
from memfit.profiling.storages import (
    LiveStorages,
    TracedStorage,
    iter_arg_tensors,
    live_timeline,
    out_tensors,
    storage_key,
    storage_of,
)
from memfit.profiling.timer import OpTimer
from memfit.profiling.workspace import WorkspaceMeter

__all__ = ["StorageTracker", "OpTimer", "TracedOp", "TracedStorage", "live_timeline",
           "iter_arg_tensors", "op_flags"]


@dataclass
class TracedOp:
    name: str
    module: str
    backward: bool
    inputs: tuple[int, ...]
    outputs: tuple[tuple[int, tuple[int, ...], str], ...]
    time_s: float
    inplace: bool
    random: bool
    flops: int
    bytes_moved: int
    forward_op: int | None = None  # for a backward op: the forward op whose node it runs
    workspace_bytes: int = 0       # NOTE [workspace measurement] in memfit.profiling.workspace
    packs: int = 0                 # tensors autograd saved after this forward op's dispatch
    next_packs: int = 0            # ... while another module ran (the next op's inputs)


@dataclass(eq=False)
class _Packed:
    tensor: torch.Tensor
    sid: int
    save: list[int | None] | None = None  # its entry in the storage's ``saves``


class StorageTracker(LiveStorages):
    """Counts live storage bytes op by op; optionally records every op.

    Use as a context manager around a step; call ``begin_backward()`` before ``backward()``
    and ``close()`` after leaving it. With ``record_ops=False`` only the running peak is kept
    (the dispatch meter, ``LiveStorages``).

    Args:
        record_ops: keep a ``TracedOp`` per op (else only the peak).
        time_ops: time each op with ``time.perf_counter``.
        count_flops: count FLOPs with ``torch.utils.flop_counter``'s formulas.
        module_of: returns the path of the innermost module running now.
        param_owner: ``id(parameter) -> module path``, to attribute gradient accumulation.
        measure_workspace: measure the kernel workspaces of every op on CPU (NOTE [workspace
            measurement]); needs ``record_ops``.
        autocast_devices: device types the step runs autocast on, to mark the casts its
            cache keeps (NOTE [autocast-cached storages] in ``memfit.profiling.profile``).
    """

    def __init__(self, *, record_ops: bool = True, time_ops: bool = False, count_flops: bool = True,
                 module_of: Callable[[], str] | None = None,
                 param_owner: dict[int, str] | None = None,
                 measure_workspace: bool = False,
                 autocast_devices: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.autocast_devices = autocast_devices
        self._meter = WorkspaceMeter() if measure_workspace and record_ops else None
        self._new_bytes: list[int] = []  # per op: bytes of the storages it created
        self.record_ops = record_ops
        self.time_ops = time_ops
        self.count_flops = count_flops
        self.module_of: Callable[[], str] = module_of or (lambda: "")
        self.param_owner = param_owner or {}
        self.ops: list[TracedOp] = []
        self._pending_unpack: list[int] = []
        self._pending_saves: list[list[int | None]] = []
        self._seq: list[int] = []               # autograd sequence_nr peek at each forward op
        self._node: Any = None
        self._node_info: tuple[str, int | None] = ("", None)

    @property
    def workspace_measured(self) -> bool:
        """Whether kernel workspaces were measured (NOTE [workspace measurement])."""
        return self._meter is not None and self._meter.enabled

    @property
    def workspace_s(self) -> float:
        """Seconds spent starting, stopping and reading the workspace meter."""
        return self._meter.seconds if self._meter is not None else 0.0

    # ---- phases --------------------------------------------------------------------------
    def __enter__(self) -> StorageTracker:
        if self._meter is not None:
            self._meter.start()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._meter is not None:
                self._meter.stop()

    def _finish(self) -> None:
        self._node = None
        if (self._pending_unpack or self._pending_saves) and self.pos >= 0:
            self._resolve_unpacks(self.pos)
        if self._meter is not None:  # NOTE [workspace measurement]
            for op, ws in zip(self.ops, self._meter.workspaces(self._new_bytes), strict=True):
                op.workspace_bytes = ws

    def _workspaces(self) -> Sequence[int]:
        return [op.workspace_bytes for op in self.ops]

    # ---- saved tensors -------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        # every pack counts, tracked storage or not: torch's checkpoint counts them all to
        # stop its replay (NOTE [region memory model] in memfit.planning.effects)
        by = -1  # the forward op that saved it (NOTE [saved tensors] in memfit.profiling.profile)
        if self.record_ops and not self.backward and 0 <= self.pos < len(self.ops):
            op = self.ops[self.pos]
            if self.module_of() == op.module:
                op.packs += 1
                by = self.pos
            else:  # the next op's inputs, saved in its own module
                op.next_packs += 1
                by = self.pos + 1
        sid = self.sid(t)
        if sid is None:
            return t
        self.storages[sid].saved = True
        if by < 0:
            return _Packed(t, sid)
        entry: list[int | None] = [by, None, None]
        self.storages[sid].saves.append(entry)
        packed = _Packed(t, sid, entry)
        # autograd drops the packed object when the node holding it has run
        self._finalizers.append(weakref.finalize(packed, self._on_release, entry))
        return packed

    def _on_release(self, entry: list[int | None]) -> None:
        if not self._closed:
            entry[2] = self.pos

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Packed):
            if self.storages[packed.sid].first_unpack is None:
                self._pending_unpack.append(packed.sid)
            if packed.save is not None and packed.save[1] is None:
                self._pending_saves.append(packed.save)
            return packed.tensor
        return packed

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _resolve_unpacks(self, at: int) -> None:
        for sid in self._pending_unpack:
            if self.storages[sid].first_unpack is None:
                self.storages[sid].first_unpack = at
        self._pending_unpack.clear()
        for entry in self._pending_saves:
            if entry[1] is None:
                entry[1] = at
        self._pending_saves.clear()

    # ---- backward attribution -------------------------------------------------------------
    def _backward_origin(self) -> tuple[str, int | None]:
        """Module path and forward op of the autograd node now running (see tracer NOTE)."""
        node = current_autograd_node()
        if node is None:
            return "", None
        if node is self._node:
            return self._node_info
        info: tuple[str, int | None] = ("", None)
        var = getattr(node, "variable", None)  # AccumulateGrad
        if isinstance(var, torch.Tensor):
            info = (self.param_owner.get(id(var), ""), None)
        else:
            # The node with sequence_nr s was created just before the forward op whose
            # sequence peek is s + 1 was dispatched: the first forward op with peek > s.
            j = bisect.bisect_right(self._seq, node_sequence_nr(node))
            if j < len(self._seq):
                info = (self.ops[j].module, j)
        self._node, self._node_info = node, info
        return info

    # ---- the dispatch hook ---------------------------------------------------------------
    def _op_starts(self, i: int) -> None:
        if self._pending_unpack or self._pending_saves:
            self._resolve_unpacks(i)

    def _dispatch(self, i: int, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if not self.record_ops:
            return super()._dispatch(i, func, args, kwargs)

        ins = list(iter_arg_tensors(args, kwargs))
        in_sids = []
        for t in ins:
            sid = self.sid(t)
            if sid is not None and sid not in in_sids:
                in_sids.append(sid)
        if self.backward:
            module, fwd = self._backward_origin()
        else:
            module, fwd = self.module_of(), None
            self._seq.append(peek_sequence_nr())
        if self._meter is not None:
            with self._meter.span():  # NOTE [workspace measurement]
                t0 = time.perf_counter()
                out = func(*args, **kwargs)
                dt = time.perf_counter() - t0 if self.time_ops else 0.0
        else:
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            dt = time.perf_counter() - t0 if self.time_ops else 0.0
        outs = out_tensors(out)
        metas = []
        aliased = True
        new_bytes = 0
        for t in outs:
            st = storage_of(t)
            if st is None:
                continue
            sid = self._live_key.get(storage_key(st))
            if sid is None:
                sid = self._new_output(st, i)
                new_bytes += self.storages[sid].nbytes
                aliased = False
            elif sid not in in_sids:
                aliased = False
            metas.append((sid, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
        if not self.backward:
            for sid in in_sids:
                self.storages[sid].last_forward_use = i
            for sid, _, _ in metas:
                self.storages[sid].last_forward_use = i
            if (self.autocast_devices and not aliased and metas
                    and ops.is_cached_cast(func, args, out, self.autocast_devices)):
                self.storages[metas[0][0]].autocast_cached = True
        inplace, random = op_flags(func, args, kwargs)
        flops = 0
        if self.count_flops:
            formula = _flop_formula(func)
            if formula is not None:
                try:
                    flops = int(formula(*args, **kwargs, out_val=out))
                except Exception:  # a formula that cannot read these args: no estimate
                    flops = 0
        moved = 0
        if inplace or not aliased or not outs:
            moved = sum(t.numel() * t.element_size() for t in ins) + sum(
                t.numel() * t.element_size() for t in outs)
        self._note_numbers(i, func, args, kwargs, outs)  # NOTE [wrapped numbers saved for backward]
        self._new_bytes.append(new_bytes)
        self.ops.append(TracedOp(
            name=str(func), module=module, backward=self.backward, inputs=tuple(in_sids),
            outputs=tuple(metas), time_s=dt, inplace=inplace,
            random=random, flops=flops, bytes_moved=moved,
            forward_op=fwd))
        return out


def op_flags(func: Any, args: Any = None, kwargs: dict[str, Any] | None = None) -> tuple[bool, bool]:
    """``(inplace, random)`` as the profiler records them for this call of ``func`` (the facts
    of ``memfit.ops``; without ``args``, for any call)."""
    return ops.writes_input(func), ops.is_random(func, args, kwargs)


def _flop_formula(func: Any) -> Callable[..., int] | None:
    from torch.utils.flop_counter import flop_registry

    return flop_registry.get(op_packet(func))
