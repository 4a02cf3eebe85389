"""A region whose graph is dropped without backward (a skipped NaN step, a forward with grad
in an evaluation loop) frees its saved outputs with the graph, not when the garbage
collector next runs: no reference cycle holds them."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import memfit
from memfit.runtime.policies import save_matmuls
from memfit.runtime.wrap import wrap

_WIDE = 1024  # the saved matmul outputs are (rows, _WIDE): no other tensor has their size


def _live(numel: int) -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel() == numel)


def _block() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, _WIDE), nn.GELU(), nn.Linear(_WIDE, 64))


@pytest.mark.parametrize("how", ["wrap-checked", "wrap-unchecked", "fit"])
@pytest.mark.slow
def test_saved_outputs_are_freed_with_a_dropped_graph(how: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[_block() for _ in range(4)])
    x = torch.randn(256, 64)
    if how == "fit":
        memfit.fit(model, x, budget=1.0, search=memfit.Search(solver="save_matmuls"))
    else:
        for b in model:
            wrap(b, save_matmuls(), check=how == "wrap-checked")
    model(x).sum().backward()  # a first call imports torch modules (whose frames hold it)
    gc.collect()
    gc.disable()
    try:
        before = _live(256 * _WIDE)
        for _ in range(3):
            out = model(x)
            assert out.requires_grad
            del out  # no backward
        assert _live(256 * _WIDE) == before
    finally:
        gc.enable()
