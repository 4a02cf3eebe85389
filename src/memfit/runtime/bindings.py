"""The forward's tensors: a region's replay reads the parameter and buffer tensors its forward
read, also when the caller swapped them for the call.

NOTE [the forward's tensors]
    ``torch.func.functional_call(model, params, x)`` puts the caller's tensors into the
    model's parameter and buffer slots for the call and puts the model's own back when the
    call returns. A checkpointed region's replay runs later, in backward, and would read the
    model's own tensors: other values than the forward's (its gradients with respect to the
    caller's tensors silently wrong), or the same values by chance. The rules, per
    checkpointed call:

    1. When the forward starts, the region keeps a reference to the tensor in each parameter
       and buffer slot of the modules it is known to run (all their submodules); when it
       ends, it drops the slots whose tensor the forward itself replaced (``self.ema =
       ...``: NOTE [buffers written in forward] rule 4 handles those).
    2. When the replay starts, each kept slot that holds another tensor than the forward's
       gets the forward's back for the replay, and its current tensor again when the replay
       ends (early stop included). Identity is compared, not values: one pointer per slot.
    3. The forward's tensors are the caller's (or the model's): they stay alive as long as
       the region's autograd graph does, as they would with the plain step's graph, which
       holds the same tensors as leaves or saved inputs.
    4. Tensors the region reaches other than through its modules' slots (a closure's, a
       global's) are not seen: the function form ``memfit.checkpoint(fn, ...)`` knows only
       the modules ``fn`` is bound to.
    5. The region's tensor inputs are kept for its replay (torch's checkpoint saves them),
       where the plain step may keep none of them (``h = x * 0.5`` saves nothing). A caller
       that refills its batch in place before backward (``x.copy_(next_batch)``: legal for
       such a plain step) would get torch's raw "modified by an inplace operation" from the
       replay. So ``watch_inputs`` notes each input's version when the forward ends and hooks
       the region's outputs: the first gradient that reaches one checks the versions and
       raises ``RecomputeMismatch`` naming the region, the input and what to do, before the
       replay reads anything. One version read per input and one hook per output and call;
       no memory.
    6. What the replay stores in its modules' plain attributes is put back as the forward
       left it when the replay ends (early stop included): a tensor attribute, and the
       items of a list or dict attribute that holds tensors (the container itself kept, as
       others may share it). The replay runs with autograd on, and torch's recompute hook
       keeps each tensor it saves in the replay's graph, so a tensor the replay leaves
       reachable keeps that whole graph alive until the next forward overwrites it. MONAI's
       DynUNet with deep supervision stores each supervision head's output in a list shared
       by its skip layers (``self.heads[i] = self.super_head(upout)``): its smallest plan
       +1%, replaying the skip layer with the inner head, measured 125,754,924 B against
       109,808,916 B predicted (+14.5%, the replay's 15.9 MB of recomputed and cached
       activations live to the end of backward); 109,808,916 B with the forward's head put
       back. The attributes are read when the replay starts: one pass over the modules'
       ``__dict__``; names and values other than tensors and their containers are left alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from memfit._torch import module_buffers, module_parameters, tensor_version
from memfit.errors import RecomputeMismatch

__all__ = ["ForwardTensors", "watch_inputs"]

_Slot = tuple[dict, str, "torch.Tensor | None"]


class ForwardTensors:
    """The parameter and buffer tensors one checkpointed call's forward ran with
    (NOTE [the forward's tensors])."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._modules = tuple(modules)
        self._slots: list[_Slot] = []
        self._swapped: list[_Slot] = []
        self._attrs: list[tuple[dict, str, Any, Any]] = []

    def forward_enter(self) -> None:
        slots: list[_Slot] = []
        seen: set[int] = set()
        for top in self._modules:
            for m in top.modules():
                if id(m) in seen:
                    continue
                seen.add(id(m))
                for d in (module_parameters(m), module_buffers(m)):
                    for name, t in d.items():
                        slots.append((d, name, t))
        self._slots = slots

    def forward_exit(self) -> None:
        # rule 1: a slot the forward itself refilled is the buffer guard's (rule 4 there)
        self._slots = [s for s in self._slots if s[0].get(s[1]) is s[2]]

    def replay_enter(self) -> None:
        self._attrs = _tensor_attributes(self._modules)  # rule 6
        swapped = []
        for d, name, t in self._slots:
            now = d.get(name)
            if now is not t:
                swapped.append((d, name, now))
                d[name] = t
        self._swapped = swapped

    def replay_exit(self) -> None:
        for d, name, now in self._swapped:
            d[name] = now
        self._swapped = []
        for d, name, value, items in self._attrs:  # rule 6
            if d.get(name) is not value:
                d[name] = value
            if isinstance(value, list) and not _same_items(value, items):
                value[:] = items
            elif isinstance(value, dict) and not _same_items(list(value.items()), items):
                value.clear()
                value.update(items)
        self._attrs = []


# a module's own state, not attributes its forward sets (NOTE [the forward's tensors], rule 6)
# and the attributes every nn.Module is made with (its hook tables and flags: no tensors)
_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                           *vars(nn.Module())})


def _tensor_attributes(modules: Iterable[nn.Module]) -> list[tuple[dict, str, Any, Any]]:
    """The plain attributes of ``modules`` and their submodules that hold tensors: (the
    module's ``__dict__``, name, value, a copy of its items where it is a list or dict)."""
    found: list[tuple[dict, str, Any, Any]] = []
    seen: set[int] = set()
    for top in modules:
        for m in top.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            for name, value in vars(m).items():
                if name in _MODULE_STATE or not _tensors(value):
                    continue
                if id(value) in seen and not isinstance(value, torch.Tensor):
                    continue  # a container shared by several modules: put back once
                seen.add(id(value))
                items = (list(value) if isinstance(value, list)
                         else list(value.items()) if isinstance(value, dict) else None)
                found.append((vars(m), name, value, items))
    return found


def _same_items(now: list[Any], then: list[Any]) -> bool:
    return len(now) == len(then) and all(
        a is b or (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)
                   and all(x is y for x, y in zip(a, b, strict=True)))
        for a, b in zip(now, then, strict=True))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def watch_inputs(name: str, inputs: Any, outputs: Any) -> None:
    """Raise a clear error if an input of the region is written in place between its forward
    and its replay (NOTE [the forward's tensors], rule 5)."""
    # weakly: a reference here would keep each input until the outputs' graph is freed, past
    # the moment torch's checkpoint frees it (it is dead then, and can be written no more)
    kept = [(i, weakref.ref(t), tensor_version(t)) for i, t in enumerate(_tensors(inputs))]
    targets = [t for t in _tensors(outputs) if t.requires_grad]
    if not kept or not targets:
        return

    def check(grad: torch.Tensor) -> None:
        for i, ref, version in kept:
            t = ref()
            if t is None:
                continue
            now = tensor_version(t)
            if now != version:
                raise RecomputeMismatch(
                    f"input {i} of {name} ({str(t.dtype).replace('torch.', '')}"
                    f"{list(t.shape)}) was written in place after the forward (version "
                    f"{version} -> {now}): the plan keeps that tensor for the region's replay "
                    "in backward, which would read the new values. Give the next batch a new "
                    "tensor instead of copying it into this one before backward (or call "
                    "backward first)"
                )

    for t in targets:
        t.register_hook(check)
