"""``memfit.profiling.storages``: a wrapper subclass counts as its inner tensor's storage
(NOTE [wrapper subclasses]), so the dispatch meter counts a DTensor's local bytes once."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from memfit.profiling.storages import LiveStorages, storage_of


class Wrapped(torch.Tensor):
    """The smallest traceable wrapper subclass: one inner tensor, ops run on it."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> Wrapped:
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)  # type: ignore[return-value]

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["elem"], None

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = tree_map(lambda t: t.elem if isinstance(t, Wrapped) else t, (args, kwargs or {}))
        out = func(*unwrap[0], **unwrap[1])
        return tree_map(lambda t: Wrapped(t) if isinstance(t, torch.Tensor) else t, out)


def test_a_wrapper_is_its_inner_tensors_storage():
    x = torch.randn(64, 32)
    w = Wrapped(x)
    assert storage_of(w) is x.untyped_storage()
    assert storage_of(torch.randn(2)) is not None


def test_the_meter_counts_wrapped_bytes_once():
    x = Wrapped(torch.randn(64, 32))   # 8192 B, live before the step
    meter = LiveStorages()
    with meter:
        y = x * 2                      # 8192 B made inside the wrapper
        z = y.view(32, 64)             # a view of the wrapper: nothing new
    meter.close()
    assert meter.peak_bytes == 64 * 32 * 4
    assert storage_of(z) is storage_of(y)
