"""Fake mode: trace a step on the meta device, so models too big for this machine can be profiled.

NOTE [fake mode]
    The model is never touched: its parameters and buffers are replaced, for the traced call
    only, by fake tensors on the meta device with the same shape, stride and dtype
    (``torch.func.functional_call``, tied weights kept tied), and the example inputs are turned
    into fake tensors too. They have storages of the true size and no data, so every storage's
    bytes, lifetime and saved-for-backward status are exactly those of a real step; op times
    come from the roofline cost model (``costmodel.py``). A model built under
    ``with torch.device("meta")`` works the same way. ``FakeTensorMode`` rather than bare meta
    tensors because libraries skip value checks on fake tensors (Hugging Face's packed-sequence
    check calls ``.item()`` otherwise). Code that must read tensor values still raises.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit._torch import FakeTensorMode
from memfit.profiling.inputs import map_tensors

__all__ = ["meta_like", "meta_state", "meta_inputs", "new_fake_mode"]


def new_fake_mode() -> Any:
    """A ``FakeTensorMode`` for one traced step (the tensors below must be made under it)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with ``t``'s shape, stride, dtype and ``requires_grad`` (a leaf)."""
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
    if t.requires_grad:
        out.requires_grad_(True)
    return out


def meta_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Meta twins of the model's parameters (leaves) and buffers, by name.

    Call it under the fake mode to get fake tensors."""
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        state[name] = meta_like(p)
    for name, b in model.named_buffers():
        state[name] = meta_like(b.detach())
    return state


def meta_inputs(obj: Any) -> Any:
    """The example inputs with every tensor replaced by a meta twin."""
    return map_tensors(lambda t: meta_like(t.detach()) if not t.requires_grad else meta_like(t), obj)
