"""Live-storage accounting of a step in a ``TorchDispatchMode``: the dispatch memory meter.

``LiveStorages`` counts the bytes of the storages ops create and when they are freed; it is
the cheap meter of ``memfit.measure`` and the base of the profiler's ``StorageTracker``, which
adds a record per op.

NOTE [storage identity and frees]
    Memory is counted per storage, not per tensor: a view (or an in-place result) shares its
    base's ``UntypedStorage`` and costs nothing. In torch 2.x a storage keeps its Python object
    alive for as long as the C++ ``StorageImpl`` lives (PyObject preservation; checked by
    ``tests/profiling/test_measure.py::test_storage_keeps_its_python_object_and_finalizer_fires_on_free``), so ``t.untyped_storage()`` returns the same object on
    every call and a ``weakref.finalize`` on it fires exactly when the memory is released. The
    live key of a storage is its ``StorageImpl*`` (``memfit._torch.storage_key``); the
    finalizer drops the key before the address can be reused. Storages live before the step that the step only
    reads get ``created_by = None`` and never count as activation memory.

NOTE [wrapper subclasses]
    A wrapper subclass (one that defines ``__tensor_flatten__``: DTensor, the
    ``AsyncCollectiveTensor`` a functional collective returns) holds no memory of its own:
    ``untyped_storage()`` gives a placeholder sized for the wrapper's (global) shape, and the
    bytes live in its inner tensors (a DTensor's ``_local_tensor``, this rank's shard). The
    dispatch mode sees the ops on the wrappers (DTensor runs its local ops below the mode), so
    each wrapper stands for its first inner tensor's storage: a tensor-parallel ``fc``'s
    output counts this rank's half, and a view or re-wrap of it costs nothing. Counting the
    placeholders instead put a 4-block tensor-parallel MLP's profiled peak at 51.7 MB
    against 29.4 MB measured by the allocator.

NOTE [unseen inputs]
    An op input whose storage was never seen is registered as live before the step (kind
    OTHER, ``created_by = None``): a tensor the model keeps outside its parameters and buffers.
    If that storage is then freed during the step it cannot have predated it (nothing outside
    the step would let go of it): it was made inside the step without an op we see -- a Python
    scalar wrapped into a tensor (``x * 0.5`` saves the wrapped 0.5 for backward), a
    ``torch.tensor`` literal -- and is re-labelled an activation (gradient in backward) created
    by the op that first used it. This is how the tracker agrees with the allocator to the byte.

NOTE [wrapped numbers saved for backward]
    A Python number passed where an op's schema takes a Tensor (``att * (1 / sqrt(d))``:
    ``aten.mul.Tensor``) is wrapped into a 0-dim tensor (8 bytes for a float) by torch's
    argument parser, outside any op; a dispatch mode gets the Python number, and autograd saves
    the wrapped tensor (``MulBackward0``'s ``other``) without calling saved-tensor hooks. So
    before this, neither the tracker nor the dispatch meter saw it, and the allocator did: 8
    bytes per such op held from forward to its backward (a 3-layer GPT's peak 24 bytes above
    its profile, and a plan planned within 18 bytes of its budget measured over it). Now the
    op's node is read when the next op starts (autograd attaches it after the op returns):
    ``_saved_<arg>`` of each argument that was such a number, a tensor on the output's device
    whose storage is unseen, is registered as created by the op, and its free is watched as
    any storage's. On a CUDA step the wrapped number is a CPU tensor: not counted; in fake mode
    (meta tensors) it is counted for a CPU target only.

NOTE [op positions while tracing]
    ``pos`` is the index of the op that started last. A free seen while ``pos == i`` (during op
    ``i`` or between ``i`` and ``i + 1``) is recorded as ``freed_after = i``, so the storage
    counts as live at op ``i``. ``live_bytes[i]`` is thus the bytes live when op ``i`` started
    plus what op ``i`` created, the local peak the Profile promises.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from memfit._torch import TorchDispatchMode, op_namespace, op_schema, storage_key
from memfit.profiling.profile import StorageKind, StorageRecord, live_timeline

__all__ = ["LiveStorages", "TracedStorage", "live_timeline", "iter_arg_tensors", "out_tensors",
           "storage_of", "storage_key"]


def iter_arg_tensors(args: Any, kwargs: dict[str, Any] | None = None) -> Iterator[torch.Tensor]:
    """Tensors among an op's arguments (flat, or one level of list/tuple such as ``cat``'s)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b
    if kwargs:
        yield from iter_arg_tensors(kwargs.values())


def _number_for_tensor(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[str, ...]:
    """The names of ``func``'s Tensor arguments given a Python number (wrapped into a tensor
    by torch's argument parser: NOTE [wrapped numbers saved for backward])."""
    if not any(isinstance(a, (int, float, complex)) for a in (*args, *kwargs.values())):
        return ()
    schema = op_schema(func)
    if schema is None:
        return ()
    names = []
    for k, arg in enumerate(schema.arguments):
        value = args[k] if k < len(args) else kwargs.get(arg.name)
        if isinstance(value, (int, float, complex)) and isinstance(arg.type, torch.TensorType):
            names.append(arg.name)
    return tuple(names)


def out_tensors(out: Any) -> list[torch.Tensor]:
    """Tensors an op returned (one, or a flat/one-level list or tuple of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return list(iter_arg_tensors(out))
    return []


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """A strided tensor's storage; None for sparse layouts and storage-less subclasses. A
    wrapper subclass's (NOTE [wrapper subclasses]) is its first inner tensor's."""
    if t.layout is not torch.strided:
        return None
    inner = _inner_tensor(t)
    if inner is not None:
        return storage_of(inner)
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # storage-less subclasses
        return None


def _inner_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """The first inner tensor of a wrapper subclass (``__tensor_flatten__``), else None."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None:
        return None
    try:
        names, _ = flatten(t)
    except Exception:  # a subclass that cannot flatten now: its own storage, as before
        return None
    for name in names:
        inner = getattr(t, name, None)
        if isinstance(inner, torch.Tensor):
            return inner
    return None


@dataclass
class TracedStorage:
    """Mutable twin of ``StorageRecord`` while the step runs."""

    nbytes: int
    kind: StorageKind
    created_by: int | None = None
    freed_after: int | None = None
    saved: bool = False
    first_unpack: int | None = None
    last_forward_use: int | None = None
    autocast_cached: bool = False
    # NOTE [saved tensors] in memfit.profiling.profile: [op, first unpack, released after]
    saves: list[list[int | None]] = field(default_factory=list)
    released_after: int | None = None  # NOTE [Python releases] in memfit.profiling.profile

    def freeze(self, sid: int) -> StorageRecord:
        """The frozen record of this storage, numbered ``sid`` (same fields, plus ``id``)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["saves"] = tuple((int(op), u, r) for op, u, r in self.saves)  # type: ignore[arg-type]
        return StorageRecord(id=sid, **values)


class LiveStorages(TorchDispatchMode):
    """Counts live storage bytes op by op; ``peak_bytes`` is their maximum.

    Use as a context manager around a step; call ``begin_backward()`` before ``backward()``
    (optional: it only labels what backward creates as gradients) and ``close()`` after
    leaving it.

    Example:
        >>> m = torch.nn.Linear(8, 8); x = torch.randn(4, 8)
        >>> meter = LiveStorages()
        >>> with meter:
        ...     m(x).sum().backward()
        >>> meter.close(); meter.peak_bytes > 0
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self.pos = -1
        self.backward = False
        self.n_forward: int | None = None
        self.storages: list[TracedStorage] = []
        self.peak_bytes = 0          # max of live_timeline(), set by close()
        self._in_op = False
        self._provisional: dict[int, int] = {}  # sid -> op where a storage was first seen
        self._live_key: dict[int, int] = {}     # StorageImpl* -> sid, live storages only
        self._finalizers: list[weakref.finalize] = []
        self._closed = False
        # ops that took a Python number for a Tensor: (op, argument names, outputs); NOTE
        # [wrapped numbers saved for backward]
        self._wrapped: list[tuple[int, tuple[str, ...], list[weakref.ref[torch.Tensor]]]] = []
        # a fake step on the meta device for a CPU target: its wrapped numbers (CPU tensors)
        # are in the target's memory
        self.host_numbers = False

    # ---- storages ------------------------------------------------------------------------
    def _on_free(self, key: int, sid: int) -> None:
        if self._closed:
            return
        if self._live_key.get(key) == sid:
            del self._live_key[key]
        rec = self.storages[sid]
        first = self._provisional.pop(sid, None)
        if first is not None and rec.created_by is None:
            # First seen during the step and freed in it: made during the step outside any op
            # (a Python scalar wrapped into a tensor, a torch.tensor literal). NOTE [unseen inputs]
            rec.created_by = first
            rec.kind = (StorageKind.GRADIENT if self.n_forward is not None and first >= self.n_forward
                        else StorageKind.ACTIVATION)
        rec.freed_after = max(self.pos, rec.created_by if rec.created_by is not None else -1)

    def _new(self, st: torch.UntypedStorage, kind: StorageKind, created_by: int | None) -> int:
        sid = len(self.storages)
        key = storage_key(st)
        rec = TracedStorage(nbytes=st.nbytes(), kind=kind, created_by=created_by)
        self.storages.append(rec)
        self._live_key[key] = sid
        self._finalizers.append(weakref.finalize(st, self._on_free, key, sid))
        return sid

    def _new_output(self, st: torch.UntypedStorage, i: int) -> int:
        kind = StorageKind.GRADIENT if self.backward else StorageKind.ACTIVATION
        return self._new(st, kind, i)

    def register(self, t: torch.Tensor, kind: StorageKind) -> int | None:
        """Register a storage live before the step (parameter, buffer, input)."""
        st = storage_of(t)
        if st is None:
            return None
        sid = self._live_key.get(storage_key(st))
        return sid if sid is not None else self._new(st, kind, None)

    def sid(self, t: torch.Tensor) -> int | None:
        """The id of a tensor's storage; one unseen so far was live before the step (OTHER)."""
        st = storage_of(t)
        if st is None:
            return None
        sid = self._live_key.get(storage_key(st))
        if sid is None:
            sid = self._new(st, StorageKind.OTHER, None)
            if not self._closed and (self.pos >= 0 or self._in_op):
                self._provisional[sid] = self.pos if self._in_op else self.pos + 1
        return sid

    @property
    def baseline_bytes(self) -> int:
        return sum(s.nbytes for s in self.storages if s.created_by is None)

    # ---- phases --------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self._saved_numbers()
        self.backward = True
        self.n_forward = self.pos + 1

    def close(self) -> None:
        """Stop watching frees: storages still live keep ``freed_after = None``."""
        self._saved_numbers()
        self._closed = True
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self._live_key.clear()
        self._finish()
        if self.n_forward is None:
            self.n_forward = self.pos + 1
        self._provisional.clear()
        self.peak_bytes = max(live_timeline(self.storages, self.pos + 1, self._workspaces()),
                              default=0)

    def _finish(self) -> None:
        """Subclasses' end-of-step work, once frees are no longer watched."""

    def _workspaces(self) -> Sequence[int] | None:
        """Kernel workspace bytes per op, added to the timeline (none here)."""
        return None

    # ---- the dispatch hook ---------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if op_namespace(func) == "prim":  # metadata queries (a fake tensor's device): no op
            return func(*args, **kwargs)
        if self._wrapped:
            self._saved_numbers()
        i = self.pos + 1
        self.pos = i
        self._op_starts(i)
        self._in_op = True
        try:
            return self._dispatch(i, func, args, kwargs)
        finally:
            self._in_op = False

    def _op_starts(self, i: int) -> None:
        """Subclasses' work before op ``i`` runs."""

    def _dispatch(self, i: int, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        for t in iter_arg_tensors(args, kwargs):
            self.sid(t)  # an unseen input is not new memory (NOTE [unseen inputs])
        out = func(*args, **kwargs)
        outs = out_tensors(out)
        for t in outs:
            st = storage_of(t)
            if st is not None and storage_key(st) not in self._live_key:
                self._new_output(st, i)
        self._note_numbers(i, func, args, kwargs, outs)
        return out

    def _note_numbers(self, i: int, func: Any, args: Any, kwargs: dict[str, Any],
                      outs: list[torch.Tensor]) -> None:
        """Op ``i`` took a Python number for a Tensor argument: read what its node saved when
        the next op starts (NOTE [wrapped numbers saved for backward])."""
        numbers = _number_for_tensor(func, args, kwargs)
        if numbers and outs:
            self._wrapped.append((i, numbers, [weakref.ref(t) for t in outs]))

    def _saved_numbers(self) -> None:
        """Register the wrapped numbers the nodes of the ops in ``_wrapped`` saved (NOTE
        [wrapped numbers saved for backward])."""
        pending, self._wrapped = self._wrapped, []
        for i, names, refs in pending:
            t = next((x for x in (r() for r in refs) if x is not None and x.grad_fn is not None), None)
            if t is None:
                continue
            for name in names:
                try:
                    v = getattr(t.grad_fn, f"_saved_{name}")
                except (AttributeError, RuntimeError):  # not saved, or released already
                    continue
                if not isinstance(v, torch.Tensor) or (
                        v.device != t.device and not (self.host_numbers and t.device.type == "meta")):
                    continue
                st = storage_of(v)
                if st is not None and storage_key(st) not in self._live_key:
                    sid = self._new(st, StorageKind.GRADIENT if self.backward else StorageKind.ACTIVATION, i)
                    if not self.backward:
                        self.storages[sid].last_forward_use = i
