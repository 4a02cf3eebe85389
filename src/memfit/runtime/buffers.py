"""Module buffers a region's forward writes are updated once per step, and recomputed from the
values the forward saw.

NOTE [buffers written in forward]
    A checkpointed region runs its forward twice: once in forward, once when recomputed in
    backward. Buffers the forward writes in place would be written twice, and worse, the
    recomputation would read the written values: ``spectral_norm`` (both APIs) advances its
    power-iteration vectors ``u``/``v`` every training forward, so a recomputation sees the
    advanced vectors and computes another weight (silently wrong gradients, with torch's own
    checkpoint too); a step counter (``self.calls += 1``) or an EMA buffer read after its
    update does the same; BatchNorm's ``running_mean``/``running_var``/``num_batches_tracked``
    would be updated twice. memfit's rules, per checkpointed call:

    1. While the forward runs, a dispatch mode (``_Watch``) sees every op the region
       dispatches. Just before the first op that writes to the storage of a buffer, it
       copies that buffer (copy-on-write, with dispatch modes off, so that the copy is no op
       of this region or of an enclosing one): the copy holds the buffer's value from before
       the forward. "Writes" is what the op's schema marks ``Tensor(a!)`` (``add_``,
       ``copy_``, ``out=`` variants as ``F.normalize(..., out=u)``), plus the writes
       ``native_batch_norm`` (and its cuDNN/MIOpen variants) make to the running statistics
       in training without declaring them (``memfit.ops.STATISTICS_UPDATES``).
    2. Some writes only *update* a buffer: batch norm's statistics update (the op's outputs
       do not depend on the statistics), and an aten op that returns nothing but the tensors
       it writes and draws no random numbers (``num_batches_tracked.add_(1)``). A buffer
       that the forward touches only through such updates (no op reads it otherwise, before
       or after; batch norm's two statistics count as one) is *unread*: nothing the region
       computes depends on its value. Its copy is dropped when the forward ends, and its
       recomputation does not update it again: a dispatch mode (``_SkipUpdates``) passes
       batch norm no statistics (its outputs are bitwise the same: checked on CPU for
       float32, bfloat16 and channels-last inputs) and returns an update's written tensors
       without running it (values the divergence check does not compare: NOTE [value
       check], rule 6). The forward's update is the only one, at no memory cost from
       forward to backward. BatchNorm's three buffers are unread.
    3. Buffers are matched by storage: those of the modules the region is known to run (all
       their submodules included, parametrizations too) and of every module called inside
       the region while its forward runs (a global forward pre-hook, installed only then,
       that ignores other threads' calls: a shared model's other forwards are not this
       region's).
    4. A buffer replaced during the forward (``self.ema = self.ema * 0.9 + ...``, not in
       place) is found by identity at the end of the forward; the old tensor is kept.
    5. Any other written buffer (a counter read after its increment, spectral norm's
       vectors, statistics a later op reads) keeps its copy. When the recomputation starts,
       those buffers are copied once more (their value *now*, after the forward and whatever
       ran since), given their pre-forward values (replaced ones: the old tensor is put
       back), and recomputed; when it ends, early stop included (torch stops a
       recomputation by raising through the context, so this sits in ``__exit__``), they
       get the values they had when it started.
    6. The watcher costs a Python dispatch per op (+6% CPU time on an every-block GPT 4x128
       step, measured here), so it runs only where a write is possible. A region of a plan
       knows from the profile (``Region.writes_buffers``, NOTE [buffer writes] in
       ``memfit.planning.rules``): it is watched exactly when its forward wrote a buffer
       when profiled (a write that happens only on other steps is then missed). Without that
       (``wrap``, ``memfit.checkpoint`` by hand), it is watched when a module the region is
       known to run has a buffer (BatchNorm, spectral_norm, counters, masks), or when the
       region's modules are not known (the function form). A transformer block has no
       buffer: its forward runs unwatched. A module with buffers that such a region calls
       from outside its subtree (a shared module) is seen by the forward pre-hook; its
       buffers are copied before it runs (copy-on-call, with dispatch modes off so the copy
       is no op of the region) and a copy is kept only if the buffer's version or value
       changed by the end of the forward.

    7. A wrapped region found to write only its batch norms' statistics runs its unchecked
       calls without the watcher and with the skipper inside the norms only (NOTE [batch
       norms without the watcher] in ``memfit.runtime.norm_statistics``).

    Consequence: the recomputation reads exactly what the forward read, and after backward
    every buffer is what the plain step leaves (bitwise), however often backward recomputes
    the region (``retain_graph``). Memory: one copy of each written buffer while the region's
    forward runs; from the forward until the region's autograd graph is freed, one copy of
    each written buffer that is read (rule 5), and one more of each during its
    recomputation; unread buffers (rule 2) and buffers that are only read cost nothing. The
    planner's prediction counts these copies (NOTE [buffer copies] in
    ``memfit.planning.buffer_copies``); a write it cannot see in the profile (one that
    happens only on other steps, rule 6) it does not.

    The watcher and the update skipper sit below the region's own selective-checkpoint and
    recorder modes, so that those see the region's ops as the profile did (op keys and the
    divergence check are unaffected). Writes to tensors that are not registered buffers (a plain
    tensor attribute, a global) are not seen.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from memfit._torch import (
    TorchDispatchMode,
    module_buffers,
    no_python_dispatch,
    op_schema,
    tensor_version,
    written_tensors,
)
from memfit.ops import (
    STATISTICS_UPDATES,
    update_results,
    updates_statistics,
    without_statistics,
    writes_input,
)
from memfit.runtime.norm_statistics import (
    NormCounts,
    StatisticsFinding,
    UnwatchedNorms,
    training_norms,
)

__all__ = ["BufferGuard"]

def _written(func: Any, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], bool]:
    """The tensors ``func`` writes in place (declared or not), and whether the op only
    updates them (rule 2 of the NOTE)."""
    positions = STATISTICS_UPDATES.get(func)
    if positions is not None:
        if not updates_statistics(func, args, kwargs):
            return [], True
        return [args[i] for i in positions
                if i < len(args) and isinstance(args[i], torch.Tensor)], True
    if not writes_input(func):
        return [], False
    return written_tensors(func, args, kwargs), update_results(func) is not None


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int] | None:
    """Identifies the memory a tensor lives in (None: no memory to protect)."""
    if t.device.type == "meta" or t.layout != torch.strided:
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # a storage-less tensor subclass
        return None
    return (t.device, ptr) if ptr else None


class _Watch(TorchDispatchMode):
    """Forward side: snapshots a buffer just before the first op that writes to it, and
    tells updates from reads (rules 1 and 2)."""

    def __init__(self, guard: BufferGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.guard._by_storage:
            self.guard._see_op(func, args, kwargs)
        return func(*args, **kwargs)


class _SkipUpdates(TorchDispatchMode):
    """Recompute side: the updates of the region's unread buffers are not made again
    (rule 2)."""

    def __init__(self, unread: set[tuple[torch.device, int]]) -> None:
        super().__init__()
        self.unread = unread

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in STATISTICS_UPDATES:
            if updates_statistics(func, args, kwargs) and any(
                    _is_in(args[i], self.unread) for i in STATISTICS_UPDATES[func] if i < len(args)):
                args = without_statistics(func, args, kwargs)
        elif skipped_update(func, args, kwargs, self.unread):
            picks = update_results(func)
            assert picks is not None  # skipped_update checked it
            names = [a.name for a in op_schema(func).arguments]
            results = [args[i] if i < len(args) else kwargs[names[i]] for i in picks]
            return None if not results else results[0] if len(results) == 1 else tuple(results)
        return func(*args, **kwargs)


def _is_in(t: Any, storages: set[tuple[torch.device, int]]) -> bool:
    return isinstance(t, torch.Tensor) and _storage_key(t) in storages


def skipped_update(func: Any, args: tuple, kwargs: dict,
                   unread: set[tuple[torch.device, int]]) -> bool:
    """Whether the replay skips this op: an update (``memfit.ops.update_results``) of unread
    buffers only (rule 2), whose written tensors ``_SkipUpdates`` returns without running it."""
    if not unread or func in STATISTICS_UPDATES or not writes_input(func):
        return False
    if update_results(func) is None:
        return False
    written = written_tensors(func, args, kwargs)
    return bool(written) and all(_is_in(t, unread) for t in written)


def _copy_into(buf: torch.Tensor, value: torch.Tensor) -> None:
    """``buf.copy_(value)``, resizing ``buf`` first if the forward resized it (``resize_``:
    the min/max buffers of a fresh QAT observer start empty)."""
    if buf.shape != value.shape:
        buf.resize_(value.shape)
    buf.copy_(value)


class BufferGuard:
    """Per checkpointed call: snapshots the buffers its forward writes, gives the
    recomputation their pre-forward values or skips their updates (NOTE [buffers written in
    forward])."""

    def __init__(self, modules: Iterable[nn.Module] = (), *, watch: bool | None = None,
                 finding: StatisticsFinding | None = None, watched: bool = True) -> None:
        """``finding``: the region's rule-7 record (None: every call as rules 1-6);
        ``watched``: whether this call must watch (a checked call), which renews it."""
        self._known = tuple(modules)
        self._watch_writes = watch  # rule 6; None: decide from the modules' buffers
        self._finding = finding
        self._may_skip_watch = finding is not None and not watched and finding.statistics_only
        self._norms: UnwatchedNorms | None = None  # rule 7: this call runs unwatched
        self._counts: NormCounts | None = None  # rule 7: a watched call's, for the finding
        self._thread = 0  # the forward's thread (rule 3's hook is global)
        self._by_storage: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
        self._named: list[tuple[nn.Module, str, torch.Tensor]] = []  # buffers as first seen
        self._seen: set[int] = set()
        # id(buf) -> (buf, its pre-forward copy): the written buffers the recomputation reads
        self._pre: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._read: set[int] = set()  # buffers an op touched other than by an update (rule 2)
        self._together: list[list[int]] = []  # buffers one batch-norm op updates
        self._unread: set[tuple[torch.device, int]] = set()  # rule 2: storages not updated again
        self._replaced: list[tuple[nn.Module, str, torch.Tensor]] = []  # (module, name, old)
        self._now: list[tuple[list[torch.Tensor], list[torch.Tensor | None]]] = []
        self._skips: list[_SkipUpdates] = []
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._watch: _Watch | None = None
        # rule 6: buffers copied on call in an unwatched forward: (buffer, copy, version)
        self._on_call: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    # ---- forward side ----------------------------------------------------------------
    def _see(self, module: nn.Module) -> None:
        if id(module) in self._seen:
            return
        self._seen.add(id(module))
        for name, buf in module.named_buffers(recurse=False):
            self._named.append((module, name, buf))
            key = _storage_key(buf)
            if key is not None:
                self._by_storage.setdefault(key, []).append(buf)

    def _pre_hook(self, module: nn.Module, args: object) -> None:
        if threading.get_ident() != self._thread:  # the hook is global: another thread's call
            return
        if self._counts is not None:  # rule 7
            self._counts.called(module)
        if self._norms is not None:  # rule 7: the watcher's copies
            self._norms.copy_on_call(module)
        if (self._watch is None and self._watch_writes is None  # rule 6: copy on call
                and self._norms is None and id(module) not in self._seen):
            with no_python_dispatch(), torch.no_grad():
                for _, buf in module.named_buffers(recurse=False):
                    if buf is not None and _storage_key(buf) is not None:
                        self._on_call.append((buf, buf.clone(), tensor_version(buf)))
        self._see(module)

    def _buffers_of(self, t: torch.Tensor) -> list[torch.Tensor]:
        key = _storage_key(t)
        return self._by_storage.get(key, []) if key is not None else []

    def _see_op(self, func: Any, args: tuple, kwargs: dict) -> None:
        written, update = _written(func, args, kwargs)
        updated: list[int] = []
        for t in written:
            bufs = self._buffers_of(t)
            update = update and bool(bufs)  # an op that also writes a non-buffer is replayed
            for buf in bufs:
                if id(buf) not in self._pre:  # rule 1: copy on first write
                    with no_python_dispatch(), torch.no_grad():
                        self._pre[id(buf)] = (buf, buf.detach().clone())
                updated.append(id(buf))
        if update and len(updated) > 1:
            self._together.append(updated)  # skipped in the replay only all together
        elif not update:
            self._read.update(updated)
        if update and self._counts is not None:  # rule 7
            self._counts.updated(updated)
        for t in _tensors(args, kwargs):
            if not any(t is w for w in written):
                self._read.update(id(buf) for buf in self._buffers_of(t))

    def forward_enter(self) -> None:
        self._thread = threading.get_ident()
        for root in self._known:
            for m in root.modules():
                self._see(m)
        self._hook = nn.modules.module.register_module_forward_pre_hook(self._pre_hook)
        watch = self._watch_writes
        if watch is None:
            watch = bool(self._by_storage) or not self._known
        if watch and self._finding is not None:  # rule 7
            norms = training_norms(self._known)
            if norms is not None and self._may_skip_watch:
                self._norms = UnwatchedNorms(norms, self._known)
                self._unread = self._norms.unread(_storage_key)
                return
            if norms is not None:
                self._counts = NormCounts(norms, self._known)
        if watch:  # rule 6
            self._watch = _Watch(self)
            self._watch.__enter__()

    def forward_exit(self) -> None:
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.__exit__(None, None, None)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for module, name, old in self._named:
            current = module_buffers(module).get(name, old)  # a deleted buffer is left alone
            if current is not old and current is not None:  # replaced, not written in place
                self._replaced.append((module, name, old))
        for group in self._together:  # batch norm's statistics: both or neither are read
            if any(i in self._read for i in group):
                self._read.update(group)
        for i, (buf, _) in list(self._pre.items()):  # rule 2: unread, no copy kept
            key = _storage_key(buf)
            if i not in self._read and key is not None:
                del self._pre[i]
                self._unread.add(key)
        with no_python_dispatch():
            for buf, before, version in self._on_call:  # rule 6: keep what was written
                if id(buf) not in self._pre and (tensor_version(buf) != version
                                                 or not torch.equal(buf, before)):
                    self._pre[id(buf)] = (buf, before)
        self._on_call = []
        if self._norms is not None:
            self._norms.forward_end()
        if self._finding is not None and self._counts is not None:  # rule 7: renewed
            self._finding.statistics_only = (not self._pre and not self._replaced
                                             and self._counts.statistics_only(self._unread, _storage_key))
        self._named, self._by_storage, self._seen = [], {}, set()
        self._read, self._together = set(), []

    # ---- recompute side --------------------------------------------------------------
    def replay_skips(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether the replay skips this op, an update of unread buffers (rule 2): its result
        is the buffer as the forward left it, no value the replay computed (NOTE [value
        check], rule 6, in ``memfit.runtime.divergence``)."""
        return skipped_update(func, args, kwargs, self._unread)

    def recompute_enter(self) -> None:
        written = [buf for buf, _ in self._pre.values()]
        replaced = [module_buffers(m)[n] for m, n, _ in self._replaced]
        with torch.no_grad():
            self._now.append(([b.detach().clone() for b in written], replaced))
            for buf, before in self._pre.values():
                _copy_into(buf, before)
        for module, name, old in self._replaced:
            module_buffers(module)[name] = old
        if self._norms is not None and self._norms.scoped:  # rule 7: inside the norms only
            unread = self._unread
            self._norms.replay_enter(lambda: _SkipUpdates(unread))
        elif self._unread:
            skip = _SkipUpdates(self._unread)
            skip.__enter__()
            self._skips.append(skip)

    def recompute_exit(self) -> None:
        if self._norms is not None and self._norms.scoped:
            self._norms.replay_exit()
        elif self._unread:
            self._skips.pop().__exit__(None, None, None)
        now, replaced = self._now.pop()
        with torch.no_grad():
            for (buf, _), value in zip(self._pre.values(), now, strict=True):
                _copy_into(buf, value)
        for (module, name, _), tensor in zip(self._replaced, replaced, strict=True):
            module_buffers(module)[name] = tensor
