"""Which module runs each op: forward hooks on every submodule of the traced model.

NOTE [module paths of backward ops]
    A forward op's module is the innermost module whose forward is running (a stack kept by
    pre/post hooks; the root's path is ``""``, as is code outside the model such as the loss).
    A backward op takes the module of the forward op whose autograd node it runs: a node with
    ``sequence_nr = s`` is created by the autograd kernel just before it redispatches the
    forward op, so that op is the first forward op dispatched while the sequence counter
    (``memfit._torch.peek_sequence_nr()``) was above ``s``. Gradient accumulation
    (``AccumulateGrad``) takes the module owning the parameter. See ``StorageTracker``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from memfit.profiling.profile import ModuleRecord
from memfit.profiling.tracker import StorageTracker
from memfit.step.inputs import (
    InputSignature,
    first_floating_parameter,
    input_signature,
    iter_tensors,
)

__all__ = ["ModuleRecorder", "param_owners"]


@dataclass
class _Mod:
    path: str
    type: str
    parent: str | None
    children: list[str] = field(default_factory=list)
    first_op: int | None = None
    last_op: int | None = None
    calls: int = 0
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    parameter_bytes: int = 0

    def freeze(self, backward_time_s: float) -> ModuleRecord:
        """The frozen record of this module (same fields, plus its backward seconds)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["children"] = tuple(self.children)
        return ModuleRecord(**values, backward_time_s=backward_time_s)


def param_owners(model: torch.nn.Module) -> dict[str, str]:
    """``parameter name -> path of the module that owns it`` (first owner of a tied one)."""
    out: dict[str, str] = {}
    for name, _ in model.named_parameters():
        out[name] = name.rsplit(".", 1)[0] if "." in name else ""
    return out


def _parent(path: str) -> str | None:
    if path == "":
        return None
    return path.rsplit(".", 1)[0] if "." in path else ""


class ModuleRecorder:
    """Registers forward hooks on every module of ``model``; use as a context manager.

    While active, ``current()`` is the path of the innermost running module. ``records()``
    returns the ``ModuleRecord``s (first call of each module) after the step.
    """

    def __init__(self, model: torch.nn.Module, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self.stack: list[str] = []
        self._handles: list[RemovableHandle] = []
        self._mods: dict[str, _Mod] = {}
        self._model = model
        self.root_signature: InputSignature = ()  # NOTE [input signature] in memfit.step.inputs
        for path, mod in model.named_modules():
            pbytes = 0
            seen: set[int] = set()
            for p in mod.parameters():
                if p.layout is torch.strided and id(p) not in seen:
                    seen.add(id(p))
                    pbytes += p.numel() * p.element_size()
            self._mods[path] = _Mod(path=path, type=type(mod).__name__, parent=_parent(path),
                                    parameter_bytes=pbytes)
        for path, m in self._mods.items():
            if m.parent is not None and m.parent in self._mods:
                self._mods[m.parent].children.append(path)

    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def __enter__(self) -> ModuleRecorder:
        for path, mod in self._model.named_modules():
            self._handles.append(mod.register_forward_pre_hook(self._pre(path), with_kwargs=True))
            self._handles.append(
                mod.register_forward_hook(self._post(path), with_kwargs=True, always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _sids(self, obj: Any) -> tuple[int, ...]:
        out: list[int] = []
        for t in iter_tensors(obj):
            sid = self.tracker.sid(t)
            if sid is not None and sid not in out:
                out.append(sid)
        return tuple(out)

    def _pre(self, path: str) -> Any:
        def hook(mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
            self.stack.append(path)
            rec = self._mods[path]
            rec.calls += 1
            if rec.calls == 1 and not self.tracker.backward:
                rec.first_op = self.tracker.pos + 1
                rec.inputs = self._sids((args, kwargs))
                if path == "":
                    self.root_signature = input_signature(args, kwargs, first_floating_parameter(mod))
        return hook

    def _post(self, path: str) -> Any:
        def hook(mod: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self.stack and self.stack[-1] == path:
                self.stack.pop()
            rec = self._mods[path]
            if rec.calls == 1 and rec.last_op is None and not self.tracker.backward:
                if rec.first_op is not None and self.tracker.pos >= rec.first_op:
                    rec.last_op = self.tracker.pos
                else:
                    rec.first_op = None  # ran no op
                rec.outputs = self._sids(output)
        return hook

    def records(self, backward_time_s: dict[str, float] | None = None) -> tuple[ModuleRecord, ...]:
        bt = backward_time_s or {}
        out = []
        for m in self._mods.values():
            prefix = m.path + "." if m.path else ""
            total = sum(t for p, t in bt.items() if p == m.path or p.startswith(prefix))
            out.append(m.freeze(total))
        return tuple(out)
