"""Models whose step has an unusual shape: a forward that resizes its buffers (a fresh QAT
model's observers), lazy modules before their first forward, sparse gradients in verify."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import memfit


def _qat_model() -> nn.Module:
    import torch.ao.quantization as Q

    torch.manual_seed(0)
    model = nn.Sequential(Q.QuantStub(), *[
        nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64)) for _ in range(4)
    ], Q.DeQuantStub())
    model.train()
    model.qconfig = Q.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        Q.prepare_qat(model, inplace=True)
    return model


def test_a_fresh_qat_model_fits_and_steps_bitwise() -> None:
    """Its observers' min/max buffers start empty and the first forward resizes them: the
    profile's and the regions' buffer copies are put back with their sizes."""
    model = _qat_model()
    ref = copy.deepcopy(model)
    x = torch.randn(1024, 64)
    memfit.fit(model, x, budget=0.7)
    assert model.memfit_plan.regions
    assert [b.shape for b in model.buffers()] == [b.shape for b in ref.buffers()]  # as found
    for _ in range(3):
        model.zero_grad()
        ref.zero_grad()
        model(x).sum().backward()
        ref(x).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        for a, b in zip(model.buffers(), ref.buffers(), strict=True):
            assert torch.equal(a, b)


def test_lazy_modules_before_their_first_forward_are_refused_clearly() -> None:
    model = nn.Sequential(nn.LazyLinear(64), nn.ReLU(), nn.Linear(64, 64))
    with pytest.raises(ValueError, match=r"uninitialized lazy parameters \(0\.weight, 0\.bias.*"
                                         r"run one forward first"):
        memfit.fit(model, torch.randn(256, 32), budget=0.8)
    model(torch.randn(2, 32))  # after one forward it is an ordinary model
    memfit.profile(model, torch.randn(256, 32))


class _SparseEmbedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 64, sparse=True)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return h


def test_verify_compares_sparse_gradients() -> None:
    model, x = _SparseEmbedder(), torch.randint(0, 100, (64, 32))
    memfit.fit(model, x, budget=0.6)
    result = memfit.verify(model, x)
    assert result.ok and result.bitwise, str(result)
    assert "13 tensors bitwise equal" in str(result)
