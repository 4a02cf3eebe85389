"""Fake mode: trace a step on the meta device, so models too big for this machine can be profiled.

NOTE [fake mode]
    The model is never touched: its parameters and buffers are replaced, for the traced call
    only, by fake tensors on the meta device with the same shape, stride and dtype
    (``torch.func.functional_call``, tied weights kept tied), and the example inputs are turned
    into fake tensors too. They have storages of the true size and no data, so every storage's
    bytes, lifetime and saved-for-backward status are exactly those of a real step; op times
    come from the roofline cost model (``memfit.timemodel.devices``). A model built under
    ``with torch.device("meta")`` works the same way. ``FakeTensorMode`` rather than bare meta
    tensors because libraries skip value checks on fake tensors (Hugging Face's packed-sequence
    check calls ``.item()`` otherwise). Code that must read tensor values still raises.

NOTE [fake mode under autocast]
    Autocast acts on the tensors of its device type only, and there is no autocast for the
    meta device: a step made under ``torch.autocast("cpu", ...)`` was traced in float32, with
    none of its casts (a 4-layer GPT in bf16 profiled 5.31 MB against 3.41 MB measured, 56%
    over, and 92 ops short). So when the step runs autocast on a device type (recorded in the
    step, or around the call), the fake tensors are made on that device type instead: fake
    tensors of a CPU or CUDA device that hold no memory either, and the autocast kernels run
    as in the real step (that GPT: traced to the byte of the measured peak).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from memfit._torch import FakeTensorMode
from memfit.step.inputs import map_tensors

__all__ = ["meta_like", "meta_state", "meta_inputs", "new_fake_mode", "fake_device"]


def new_fake_mode() -> Any:
    """A ``FakeTensorMode`` for one traced step (the tensors below must be made under it)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_device(autocast_devices: Iterable[str]) -> str:
    """The device type of the fake tensors: the one the step runs autocast on, else meta
    (NOTE [fake mode under autocast])."""
    types = set(autocast_devices)
    if types == {"cpu"} or (types == {"cuda"} and torch.cuda.is_available()):
        return types.pop()
    return "meta"


def meta_like(t: torch.Tensor, device: str = "meta") -> torch.Tensor:
    """A tensor of ``device`` (meta; under the fake mode, a fake tensor of that device type)
    with ``t``'s shape, stride, dtype and ``requires_grad`` (a leaf)."""
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    if t.requires_grad:
        out.requires_grad_(True)
    return out


def meta_state(model: torch.nn.Module, device: str = "meta") -> dict[str, torch.Tensor]:
    """Meta twins of the model's parameters (leaves) and buffers, by name.

    Call it under the fake mode to get fake tensors."""
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        state[name] = meta_like(p, device)
    for name, b in model.named_buffers():
        state[name] = meta_like(b.detach(), device)
    return state


def meta_inputs(obj: Any, device: str = "meta") -> Any:
    """The example inputs with every tensor replaced by a meta twin."""
    return map_tensors(lambda t: meta_like(t if t.requires_grad else t.detach(), device), obj)
