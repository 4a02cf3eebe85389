"""``torch.func.functional_call`` on a planned model (NOTE [the forward's tensors] in
``memfit.runtime.bindings``): the replay reads the caller's tensors, not the model's own,
bitwise, on every call, and the model's own tensors are in place after backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

import memfit
from memfit.runtime.policies import save_matmuls
from memfit.runtime.wrap import wrap


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.BatchNorm1d(64))
        for _ in range(6)
    ])


def _caller_tensors(model: nn.Module, step: int) -> tuple[dict, dict]:
    params = {n: (p.detach() * (1.0 + 0.01 * (step + 1))).requires_grad_()
              for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    twin = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    return {**params, **buffers}, {**twin, **{n: b.clone() for n, b in buffers.items()}}


def _assert_functional_steps_equal(model: nn.Module, ref: nn.Module, x: torch.Tensor) -> None:
    own = {n: p for n, p in model.named_parameters()}
    for step in range(5):  # past the sampled checks (NOTE [check sampling])
        tensors, tensors_ref = _caller_tensors(model, step)
        functional_call(model, tensors, (x,)).sum().backward()
        functional_call(ref, tensors_ref, (x,)).sum().backward()
        for name, p in own.items():
            assert torch.equal(tensors[name].grad, tensors_ref[name].grad), f"step {step}: {name}"
            assert p.grad is None, f"step {step}: the model's own {name} got a gradient"
            assert dict(model.named_parameters())[name] is p  # own tensors back in place
        for name, _ in model.named_buffers():  # running statistics updated in the caller's
            assert torch.equal(tensors[name], tensors_ref[name]), f"step {step}: {name}"


@pytest.mark.slow
def test_functional_call_on_a_fitted_model_is_bitwise() -> None:
    model = _mlp()
    ref = copy.deepcopy(model)
    x = torch.randn(1024, 64)
    memfit.fit(model, x, budget=0.5)
    assert model.memfit_plan.regions, "the test needs a plan that checkpoints"
    _assert_functional_steps_equal(model, ref, x)


@pytest.mark.parametrize("policy", [None, save_matmuls()], ids=["recompute-all", "save-matmuls"])
def test_functional_call_on_wrapped_blocks_is_bitwise(policy) -> None:
    model = _mlp()
    ref = copy.deepcopy(model)
    for block in model:
        wrap(block, policy)
    _assert_functional_steps_equal(model, ref, torch.randn(64, 64))


def test_a_plain_step_after_functional_call_reads_the_models_own_tensors() -> None:
    model = _mlp()
    ref = copy.deepcopy(model)
    for block in model:
        wrap(block)
    x = torch.randn(64, 64)
    tensors, _ = _caller_tensors(model, 0)
    functional_call(model, tensors, (x,)).sum().backward()
    model(x).sum().backward()
    ref(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


class _Supervised(nn.Module):
    """A block that stores a side output in a list its siblings share, as MONAI's DynUNet
    skip layers store their supervision heads, and one in a tensor attribute."""

    def __init__(self, heads: list[torch.Tensor], i: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 8)
        self.heads, self.i = heads, i
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)                       # (batch, 64)
        self.heads[self.i] = self.head(y)      # (batch, 8)
        self.last = y.tanh()
        return y


class _Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads: list[torch.Tensor] = [torch.zeros(1)] * 3
        self.blocks = nn.ModuleList(_Supervised(self.heads, i) for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.sum() + sum(h.square().sum() for h in self.heads) + self.blocks[0].last.sum()


@pytest.mark.parametrize("policy", [None, save_matmuls()], ids=["recompute-all", "save-matmuls"])
def test_what_a_replay_stores_in_module_attributes_is_the_forwards_after_it(policy) -> None:
    # NOTE [the forward's tensors], rule 6: the replay's own head would keep its autograd
    # graph, and every tensor that graph saved, alive until the next forward
    model, ref = _Deep(), _Deep()
    for block in model.blocks:
        wrap(block, policy)
    x = torch.randn(32, 64)
    loss = model(x)
    stored = list(model.heads), [b.last for b in model.blocks]
    loss.backward()
    ref(x).backward()
    assert model.heads is model.blocks[0].heads  # the shared list itself kept
    assert all(a is b for a, b in zip(model.heads, stored[0], strict=True))
    assert all(b.last is t for b, t in zip(model.blocks, stored[1], strict=True))
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
