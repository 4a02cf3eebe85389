"""Live-storage accounting of a step, op by op, in a ``TorchDispatchMode``.

NOTE [storage identity and frees]
    Memory is counted per storage, not per tensor: a view (or an in-place result) shares its
    base's ``UntypedStorage`` and costs nothing. In torch 2.x a storage keeps its Python object
    alive for as long as the C++ ``StorageImpl`` lives (PyObject preservation; checked in
    ``tests/profiling/test_tracker.py``), so ``t.untyped_storage()`` returns the same object on
    every call and a ``weakref.finalize`` on it fires exactly when the memory is released. The
    live key of a storage is ``storage._cdata`` (its ``StorageImpl*``); the finalizer drops the
    key before the address can be reused. Storages live before the step that the step only
    reads get ``created_by = None`` and never count as activation memory.

NOTE [unseen inputs]
    An op input whose storage was never seen is registered as live before the step (kind
    OTHER, ``created_by = None``): a tensor the model keeps outside its parameters and buffers.
    If that storage is then freed during the step it cannot have predated it (nothing outside
    the step would let go of it): it was made inside the step without an op we see -- a Python
    scalar wrapped into a tensor (``x * 0.5`` saves the wrapped 0.5 for backward), a
    ``torch.tensor`` literal -- and is re-labelled an activation (gradient in backward) created
    by the op that first used it. This is how the tracker agrees with the allocator to the byte.

NOTE [op positions while tracing]
    ``pos`` is the index of the op that started last. A free seen while ``pos == i`` (during op
    ``i`` or between ``i`` and ``i + 1``) is recorded as ``freed_after = i``, so the storage
    counts as live at op ``i``. ``live_bytes[i]`` is thus the bytes live when op ``i`` started
    plus what op ``i`` created, the local peak the Profile promises.

NOTE [workspace measurement]
    A kernel's internal buffers (NOTE [kernel workspaces] in ``memfit.profiling.profile``) are
    invisible here, so with ``measure_workspace=True`` an op whose name contains ``conv`` or
    ``scaled_dot_product`` (CPU flash attention keeps per-thread scratch buffers) (and
    that writes no input) is run once more right after its real call, inside this handler
    (where the mode is already off, so the rerun is not recorded), under ``torch.no_grad`` and
    the CPU allocator meter (``memfit.profiling.measure.allocator_peak``); its outputs are
    dropped. ``workspace = max(0, allocator peak - bytes of its new output storages)`` is the
    excess over its outputs at the op's local peak. The result is cached per op and argument
    signature (shapes, strides, dtypes, devices, non-tensor arguments), so a network measures
    each distinct convolution once. The rerun is outside the op's timed span. CPU only: on
    CUDA workspaces come from the caching allocator (``torch.cuda.max_memory_allocated``), not
    modelled yet.
"""

from __future__ import annotations

import bisect
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.profiling.profile import StorageKind

__all__ = ["StorageTracker", "OpTimer", "TracedOp", "TracedStorage", "is_random_op", "is_inplace_op",
           "uses_workspace", "measure_workspace", "live_timeline"]

log = logging.getLogger(__name__)

_WORKSPACE_PATTERNS = ("conv", "scaled_dot_product")  # op names whose CPU kernels allocate internal buffers

_RANDOM_NAMES = (
    "bernoulli", "rand", "randn", "randint", "randperm", "native_dropout", "normal", "uniform",
    "exponential", "multinomial", "cauchy", "log_normal", "geometric", "random", "poisson",
    "rrelu_with_noise", "fused_dropout", "_standard_gamma", "binomial",
)
_random_cache: dict[Any, bool] = {}
_inplace_cache: dict[Any, bool] = {}


def is_random_op(func: Any) -> bool:
    """Whether an aten overload consumes the random-number generator."""
    hit = _random_cache.get(func)
    if hit is None:
        base = func._overloadpacket.__name__.lstrip("_").rstrip("_")
        hit = base in {n.lstrip("_") for n in _RANDOM_NAMES} or base.endswith("dropout")
        _random_cache[func] = hit
    return hit


def is_inplace_op(func: Any) -> bool:
    """Whether an aten overload writes into one of its arguments (its schema says so)."""
    hit = _inplace_cache.get(func)
    if hit is None:
        hit = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        _inplace_cache[func] = hit
    return hit


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


def _out_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return list(iter_arg_tensors(out))
    return []


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    if t.layout is not torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # storage-less subclasses
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
    workspace_bytes: int = 0       # NOTE [workspace measurement]


@dataclass
class _Packed:
    tensor: torch.Tensor
    sid: int


class StorageTracker(TorchDispatchMode):
    """Counts live storage bytes op by op; optionally records every op.

    Use as a context manager around a step; call ``begin_backward()`` before ``backward()``
    and ``close()`` after leaving it. With ``record_ops=False`` only the running peak is kept
    (the cheap meter of ``measure``).

    Args:
        record_ops: keep a ``TracedOp`` per op (else only the peak).
        time_ops: time each op with ``time.perf_counter``.
        count_flops: count FLOPs with ``torch.utils.flop_counter``'s formulas.
        module_of: returns the path of the innermost module running now.
        param_owner: ``id(parameter) -> module path``, to attribute gradient accumulation.
        measure_workspace: measure kernel workspaces of convolutions on CPU (NOTE [workspace
            measurement]); needs ``record_ops``.
    """

    def __init__(self, *, record_ops: bool = True, time_ops: bool = False, count_flops: bool = True,
                 module_of: Callable[[], str] | None = None,
                 param_owner: dict[int, str] | None = None,
                 measure_workspace: bool = False) -> None:
        super().__init__()
        self.measure_workspace = measure_workspace
        self._ws_cache: dict[Any, int] = {}
        self.workspace_runs = 0        # isolated reruns done (cache misses)
        self.workspace_s = 0.0         # seconds spent in them
        self.record_ops = record_ops
        self.time_ops = time_ops
        self.count_flops = count_flops
        self.module_of: Callable[[], str] = module_of or (lambda: "")
        self.param_owner = param_owner or {}
        self.pos = -1
        self.backward = False
        self.n_forward: int | None = None
        self.storages: list[TracedStorage] = []
        self.ops: list[TracedOp] = []
        self.peak_bytes = 0          # max of live_timeline(), set by close()
        self._in_op = False
        self._provisional: dict[int, int] = {}  # sid -> op where a storage was first seen
        self._live_key: dict[int, int] = {}     # StorageImpl* -> sid, live storages only
        self._finalizers: list[weakref.finalize] = []
        self._pending_unpack: list[int] = []
        self._seq: list[int] = []               # autograd sequence_nr peek at each forward op
        self._node: Any = None
        self._node_info: tuple[str, int | None] = ("", None)
        self._closed = False

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
        key = st._cdata
        rec = TracedStorage(nbytes=st.nbytes(), kind=kind, created_by=created_by)
        self.storages.append(rec)
        self._live_key[key] = sid
        self._finalizers.append(weakref.finalize(st, self._on_free, key, sid))
        return sid

    def register(self, t: torch.Tensor, kind: StorageKind) -> int | None:
        """Register a storage live before the step (parameter, buffer, input)."""
        st = _storage(t)
        if st is None:
            return None
        sid = self._live_key.get(st._cdata)
        return sid if sid is not None else self._new(st, kind, None)

    def sid(self, t: torch.Tensor) -> int | None:
        """The id of a tensor's storage; one unseen so far was live before the step (OTHER)."""
        st = _storage(t)
        if st is None:
            return None
        sid = self._live_key.get(st._cdata)
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
        self.backward = True
        self.n_forward = self.pos + 1

    def close(self) -> None:
        """Stop watching frees: storages still live keep ``freed_after = None``."""
        self._closed = True
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self._live_key.clear()
        self._node = None
        if self._pending_unpack and self.pos >= 0:
            self._resolve_unpacks(self.pos)
        if self.n_forward is None:
            self.n_forward = self.pos + 1
        self._provisional.clear()
        self.peak_bytes = max(live_timeline(self.storages, self.pos + 1,
                                            [op.workspace_bytes for op in self.ops]), default=0)

    # ---- saved tensors -------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        sid = self.sid(t)
        if sid is None:
            return t
        self.storages[sid].saved = True
        return _Packed(t, sid)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Packed):
            if self.storages[packed.sid].first_unpack is None:
                self._pending_unpack.append(packed.sid)
            return packed.tensor
        return packed

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _resolve_unpacks(self, at: int) -> None:
        for sid in self._pending_unpack:
            if self.storages[sid].first_unpack is None:
                self.storages[sid].first_unpack = at
        self._pending_unpack.clear()

    # ---- backward attribution -------------------------------------------------------------
    def _backward_origin(self) -> tuple[str, int | None]:
        """Module path and forward op of the autograd node now running (see tracer NOTE)."""
        node = torch._C._current_autograd_node()
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
            j = bisect.bisect_right(self._seq, node._sequence_nr())
            if j < len(self._seq):
                info = (self.ops[j].module, j)
        self._node, self._node_info = node, info
        return info

    # ---- the dispatch hook ---------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func._namespace == "prim":  # metadata queries (a fake tensor's device): no op
            return func(*args, **kwargs)
        i = self.pos + 1
        self.pos = i
        if self._pending_unpack:
            self._resolve_unpacks(i)
        self._in_op = True
        try:
            return self._dispatch(i, func, args, kwargs)
        finally:
            self._in_op = False

    def _dispatch(self, i: int, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if not self.record_ops:
            for t in iter_arg_tensors(args, kwargs):
                self.sid(t)  # an unseen input is not new memory (NOTE [unseen inputs])
            out = func(*args, **kwargs)
            for t in _out_tensors(out):
                st = _storage(t)
                if st is not None and st._cdata not in self._live_key:
                    self._new_output(st, i)
            return out

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
            self._seq.append(torch._C._autograd._get_sequence_nr())
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        dt = time.perf_counter() - t0 if self.time_ops else 0.0
        outs = _out_tensors(out)
        metas = []
        aliased = True
        for t in outs:
            st = _storage(t)
            if st is None:
                continue
            sid = self._live_key.get(st._cdata)
            if sid is None:
                sid = self._new_output(st, i)
                aliased = False
            elif sid not in in_sids:
                aliased = False
            metas.append((sid, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
        if not self.backward:
            for sid in in_sids:
                self.storages[sid].last_forward_use = i
            for sid, _, _ in metas:
                self.storages[sid].last_forward_use = i
        inplace = is_inplace_op(func)
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
        ws = 0
        if self.measure_workspace and not inplace and uses_workspace(func):
            ws = self._workspace(func, args, kwargs, ins)
        self.ops.append(TracedOp(
            name=str(func), module=module, backward=self.backward, inputs=tuple(in_sids),
            outputs=tuple(metas), time_s=dt, inplace=inplace, random=is_random_op(func),
            flops=flops, bytes_moved=moved, forward_op=fwd, workspace_bytes=ws))
        return out

    def _workspace(self, func: Any, args: Any, kwargs: dict[str, Any], ins: list[torch.Tensor]) -> int:
        if any(t.device.type != "cpu" or type(t) not in (torch.Tensor, torch.nn.Parameter) for t in ins):
            return 0  # CUDA workspaces are not modelled; subclasses (fake tensors) have none
        try:
            key = (str(func), _arg_key(args), _arg_key(kwargs))
            hash(key)
        except TypeError:
            key = None
        hit = self._ws_cache.get(key) if key is not None else None
        if hit is None:
            t0 = time.perf_counter()
            try:
                hit = measure_workspace(func, args, kwargs)
            except RuntimeError as e:  # another profiler active: the meter cannot start
                log.warning("workspace of %s not measured (%s); further ops are not measured", func, e)
                self.measure_workspace = False
                return 0
            self.workspace_runs += 1
            self.workspace_s += time.perf_counter() - t0
            if key is not None:
                self._ws_cache[key] = hit
        return hit

    def _new_output(self, st: torch.UntypedStorage, i: int) -> int:
        kind = StorageKind.GRADIENT if self.backward else StorageKind.ACTIVATION
        return self._new(st, kind, i)


def uses_workspace(func: Any) -> bool:
    """Whether the tracer measures an op's kernel workspace (NOTE [workspace measurement])."""
    name = func._overloadpacket.__name__
    return any(p in name for p in _WORKSPACE_PATTERNS)


def measure_workspace(func: Any, args: Any, kwargs: dict[str, Any]) -> int:
    """Bytes ``func`` allocates inside itself beyond its new outputs, per the CPU allocator.

    Runs ``func(*args, **kwargs)`` once under ``torch.no_grad`` and the allocator meter; the
    outputs are dropped. Call it where no dispatch mode would record the rerun.

    Example:
        >>> x, w = torch.randn(1, 2, 8, 8, 8), torch.randn(4, 2, 3, 3, 3)
        >>> conv = torch.ops.aten.convolution.default
        >>> measure_workspace(conv, (x, w, None, [1] * 3, [1] * 3, [1] * 3, False, [0] * 3, 1), {}) > 0
        True
    """
    from memfit.profiling.measure import allocator_peak

    held = {st._cdata for t in iter_arg_tensors(args, kwargs) if (st := _storage(t)) is not None}
    out_bytes: list[int] = []

    def rerun() -> None:
        out = func(*args, **kwargs)
        seen: set[int] = set()
        total = 0
        for t in _out_tensors(out):
            st = _storage(t)
            if st is not None and st._cdata not in held and st._cdata not in seen:
                seen.add(st._cdata)
                total += st.nbytes()
        out_bytes.append(total)

    with torch.no_grad():
        peak = allocator_peak(rerun)
    return max(0, peak - out_bytes[0])


def _arg_key(x: Any) -> Any:
    """A hashable signature of op arguments: tensors by shape, strides, dtype and device."""
    if isinstance(x, torch.Tensor):
        strides = x.stride() if x.layout is torch.strided else ()
        return ("T", tuple(x.shape), tuple(strides), x.dtype, x.device.type, x.layout)
    if isinstance(x, (list, tuple)):
        return tuple(_arg_key(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((str(k), _arg_key(v)) for k, v in x.items()))
    return x


def live_timeline(storages: Any, n_ops: int, workspace: Sequence[int] | None = None) -> list[int]:
    """Bytes of activation/gradient storages live at each op: ``created_by <= i`` and not
    ``freed_after < i``, plus ``workspace[i]`` (the Profile's ``live_bytes`` contract, NOTE
    [storage lifetimes]). Takes ``StorageRecord``s or ``TracedStorage``s."""
    delta = [0] * (n_ops + 1)
    for s in storages:
        if s.created_by is None or s.kind not in (StorageKind.ACTIVATION, StorageKind.GRADIENT):
            continue
        delta[min(s.created_by, n_ops)] += s.nbytes
        end = n_ops if s.freed_after is None else min(s.freed_after + 1, n_ops)
        delta[end] -= s.nbytes
    out, live = [], 0
    for i in range(n_ops):
        live += delta[i]
        out.append(live + (workspace[i] if workspace is not None and i < len(workspace) else 0))
    return out


def _flop_formula(func: Any) -> Callable[..., int] | None:
    from torch.utils.flop_counter import flop_registry

    return flop_registry.get(func._overloadpacket)


class OpTimer(TorchDispatchMode):
    """Times every op of a step with ``time.perf_counter`` and nothing else (cheap repeats)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.times.append(time.perf_counter() - t0)
        self.names.append(func.__name__)
        return out
