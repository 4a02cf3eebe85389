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
       copies that buffer (copy-on-write): the copy holds the buffer's value from before the
       forward. "Writes" is what the op's schema marks ``Tensor(a!)`` (``add_``, ``copy_``,
       ``out=`` variants as ``F.normalize(..., out=u)``), plus the writes ``native_batch_norm``
       (and its cuDNN/MIOpen variants) make to the running statistics in training without
       declaring them (``_UNDECLARED_WRITES``).
    2. Those batch-norm writes only *update* the statistics: the op's outputs do not depend
       on them. A buffer written only that way, and read by no later op of the forward, does
       not need its pre-forward value in the recomputation (whatever it computes there is
       overwritten by rule 5), so its copy is dropped when the forward ends. BatchNorm's
       running statistics thus cost memory only while the region's forward runs (as before
       memfit generalised this, they cost nothing from forward to backward);
       ``num_batches_tracked`` (``add_``, 8 bytes) keeps its copy.
    3. Buffers are matched by storage: those of the modules the region is known to run (all
       their submodules included, parametrizations too) and of every module called inside
       the region while its forward runs (a global forward pre-hook, installed only then).
    4. A buffer replaced during the forward (``self.ema = self.ema * 0.9 + ...``, not in
       place) is found by identity at the end of the forward; the old tensor is kept.
    5. When the recomputation starts, the written buffers are copied once more (their value
       *now*, after the forward and whatever ran since), given their pre-forward values
       (replaced ones: the old tensor is put back), and recomputed; when it ends, early stop
       included (torch stops a recomputation by raising through the context, so this sits in
       ``__exit__``), they get the values they had when it started.

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

    Consequence: the recomputation reads exactly what the forward read, and after backward
    every buffer is what the plain step leaves (bitwise), however often backward recomputes
    the region (``retain_graph``). Memory: one copy of each buffer the forward wrote and the
    recomputation may read (rule 2), held from the forward until the region's autograd graph
    is freed, plus one copy of every written buffer during its recomputation; buffers that
    are only read cost nothing. The planner's prediction counts these copies (NOTE [buffer
    copies] in ``memfit.planning.effects``); a write it cannot see in the profile (one that
    happens only on other steps, rule 6) it does not.

    The watcher sits below the region's own selective-checkpoint and recorder modes, so the
    copies are not ops of the region (op keys and the divergence check are unaffected); an
    *enclosing* region (nested plans) does see a nested region's copies, in its forward and
    in its recomputation alike. Writes to tensors that are not registered buffers (a plain
    tensor attribute, a global) are not seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from memfit._torch import (
    TorchDispatchMode,
    module_buffers,
    no_python_dispatch,
    tensor_version,
    written_tensors,
)
from memfit.ops import writes_input

__all__ = ["BufferGuard"]

_aten = torch.ops.aten
# Ops that write the running statistics (argument positions) when ``training`` (argument 5)
# is true without marking them ``(a!)`` in their schema.
_UNDECLARED_WRITES: dict[Any, tuple[int, ...]] = {
    _aten.native_batch_norm.default: (3, 4),
    _aten.cudnn_batch_norm.default: (3, 4),
    _aten.miopen_batch_norm.default: (3, 4),
}
_TRAINING_ARG = 5


def _written(func: Any, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], bool]:
    """The tensors ``func`` writes in place (declared or not), and whether the op only
    updates them (its outputs do not depend on their values: rule 2 of the NOTE)."""
    positions = _UNDECLARED_WRITES.get(func)
    if positions is not None:
        training = args[_TRAINING_ARG] if len(args) > _TRAINING_ARG else kwargs.get("training")
        if not training:
            return [], True
        return [args[i] for i in positions
                if i < len(args) and isinstance(args[i], torch.Tensor)], True
    return (written_tensors(func, args, kwargs) if writes_input(func) else []), False


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
    """Forward side: snapshots a buffer just before the first op that writes to it."""

    def __init__(self, guard: BufferGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        guard = self.guard
        if guard._by_storage:
            written, update_only = _written(func, args, kwargs)
            if guard._update_only:
                guard._before_read(args, kwargs, written if update_only else ())
            for t in written:
                guard._before_write(t, update_only)
        return func(*args, **kwargs)


class BufferGuard:
    """Per checkpointed call: snapshots the buffers its forward writes, gives the
    recomputation their pre-forward values (NOTE [buffers written in forward])."""

    def __init__(self, modules: Iterable[nn.Module] = (), *, watch: bool | None = None) -> None:
        self._known = tuple(modules)
        self._watch_writes = watch  # rule 6; None: decide from the modules' buffers
        self._by_storage: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
        self._named: list[tuple[nn.Module, str, torch.Tensor]] = []  # buffers as first seen
        self._seen: set[int] = set()
        # id(buf) -> (buf, its pre-forward copy; None: restored after recomputation only)
        self._pre: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._update_only: set[int] = set()  # written by update-only ops alone, not read since
        self._replaced: list[tuple[nn.Module, str, torch.Tensor]] = []  # (module, name, old)
        self._now: list[tuple[list[torch.Tensor], list[torch.Tensor | None]]] = []
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
        if (self._watch is None and self._watch_writes is None  # rule 6: copy on call
                and id(module) not in self._seen):
            with no_python_dispatch(), torch.no_grad():
                for _, buf in module.named_buffers(recurse=False):
                    if buf is not None and _storage_key(buf) is not None:
                        self._on_call.append((buf, buf.clone(), tensor_version(buf)))
        self._see(module)

    def _before_write(self, t: torch.Tensor, update_only: bool) -> None:
        key = _storage_key(t)
        if key is None:
            return
        for buf in self._by_storage.get(key, ()):
            if id(buf) not in self._pre:
                self._pre[id(buf)] = (buf, buf.detach().clone())
                if update_only:
                    self._update_only.add(id(buf))
            elif not update_only:  # a read-modify-write: the recomputation reads the value
                self._update_only.discard(id(buf))

    def _before_read(self, args: tuple, kwargs: dict, skip: Sequence[torch.Tensor]) -> None:
        for t in _tensors(args, kwargs):
            if any(t is s for s in skip):
                continue
            key = _storage_key(t)
            for buf in self._by_storage.get(key, ()) if key is not None else ():
                self._update_only.discard(id(buf))

    def forward_enter(self) -> None:
        for root in self._known:
            for m in root.modules():
                self._see(m)
        self._hook = nn.modules.module.register_module_forward_pre_hook(self._pre_hook)
        watch = self._watch_writes
        if watch is None:
            watch = bool(self._by_storage) or not self._known
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
        for i in self._update_only:  # rule 2: the recomputation needs no pre-forward value
            self._pre[i] = (self._pre[i][0], None)
        with no_python_dispatch():
            for buf, before, version in self._on_call:  # rule 6: keep what was written
                if id(buf) not in self._pre and (tensor_version(buf) != version
                                                 or not torch.equal(buf, before)):
                    self._pre[id(buf)] = (buf, before)
        self._on_call = []
        self._named, self._by_storage, self._seen, self._update_only = [], {}, set(), set()

    # ---- recompute side --------------------------------------------------------------
    def recompute_enter(self) -> None:
        written = [buf for buf, _ in self._pre.values()]
        replaced = [module_buffers(m)[n] for m, n, _ in self._replaced]
        with torch.no_grad():
            self._now.append(([b.detach().clone() for b in written], replaced))
            for buf, before in self._pre.values():
                if before is not None:
                    buf.copy_(before)
        for module, name, old in self._replaced:
            module_buffers(module)[name] = old

    def recompute_exit(self) -> None:
        now, replaced = self._now.pop()
        with torch.no_grad():
            for (buf, _), value in zip(self._pre.values(), now, strict=True):
                buf.copy_(value)
        for (module, name, _), tensor in zip(self._replaced, replaced, strict=True):
            module_buffers(module)[name] = tensor
