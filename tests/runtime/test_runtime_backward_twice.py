"""Backward more than once through planned regions: ``retain_graph=True`` and double backward
(``create_graph=True``, gradient penalties) work with every plan memfit makes, selective
plans and kept dropout masks included, bitwise as the plain step. A replay puts what it took
from the selective-checkpoint cache back as "recompute" (``memfit._torch.sac_rearm``), so the
next backward recomputes those ops; a kept draw is drawn again from the rewound generator."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memfit
from memfit.planning.plan import OpPolicy
from memfit.runtime.policies import by_key, save_matmuls
from memfit.runtime.wrap import wrap
from memfit.zoo import example_inputs, gpt


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Dropout(0.1),
                                         nn.Linear(64, 16)) for _ in range(3)])


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _retain_twice(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(5)
    loss = model(x).pow(2).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    return _grads(model)


def _penalty(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(5)
    x = x.detach().clone().requires_grad_()
    g, = torch.autograd.grad(model(x).pow(2).sum(), x, create_graph=True)
    (g.pow(2).sum()).backward()
    return [g.detach(), *_grads(model)]


@pytest.mark.parametrize("step", [_retain_twice, _penalty], ids=["retain-graph", "create-graph"])
@pytest.mark.parametrize("how", ["save-matmuls", "fit"])
def test_backward_twice_through_a_selective_plan_is_bitwise(step, how: str) -> None:
    model = _mlp()
    ref = copy.deepcopy(model)
    x = torch.randn(64, 16)
    if how == "fit":
        memfit.fit(model, x, budget=1.0, search=memfit.Search(solver="save_matmuls"))
        assert any(r.ops for r in model.memfit_plan.regions), "the plan must save ops"
    else:
        for b in model:
            wrap(b, save_matmuls())
    for _ in range(2):
        model.zero_grad()
        ref.zero_grad()
        got, want = step(model, x), step(ref, x)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_retain_graph_with_kept_dropout_masks_is_bitwise() -> None:
    model = gpt(n_layer=2, d_model=64, n_head=2, seq_len=32)
    inputs = (example_inputs(model, batch=2, seed=0), example_inputs(model, batch=2, seed=1))
    ref = copy.deepcopy(model)
    keep = by_key({"aten.bernoulli_.float#0": OpPolicy.SAVE, "aten.bernoulli_.float#1": OpPolicy.SAVE})
    assert keep.kept_draws()
    for block in model.blocks:
        wrap(block, keep)
    grads = []
    for net in (model, ref):
        torch.manual_seed(9)
        loss = net(*inputs)
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append(_grads(net))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
