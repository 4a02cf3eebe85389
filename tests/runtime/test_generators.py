"""Explicit generators (NOTE [explicit generators] in ``memfit.runtime.generators``): a region
drawing from its own ``torch.Generator`` replays the forward's draws, bitwise, and leaves the
generator where the plain step leaves it, on every call, also past the sampled checks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memfit
from memfit.errors import RecomputeMismatch
from memfit.runtime.policies import save_matmuls
from memfit.runtime.wrap import wrap


class _Noisy(nn.Module):
    """A block adding noise drawn from its own generator (diffusion noise, augmentation)."""

    def __init__(self, g: torch.Generator, *, from_call: int = 0) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.g = g
        self.from_call = from_call  # draws only from this call on
        self.calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(h))
        if self.calls >= self.from_call:
            h = h + 0.1 * torch.randn(h.shape, generator=self.g) * h
        return h


class _Stack(nn.Module):
    def __init__(self, g: torch.Generator, n: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Noisy(g) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _twins(n: int = 6) -> tuple[_Stack, _Stack, torch.Generator, torch.Generator]:
    torch.manual_seed(0)
    g, g_ref = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    model = _Stack(g, n)
    ref = copy.deepcopy(model)
    for b in ref.blocks:
        b.g = g_ref
    return model, ref, g, g_ref


def _assert_steps_equal(model: nn.Module, ref: nn.Module, g: torch.Generator,
                        g_ref: torch.Generator, x: torch.Tensor, *, steps: int,
                        reseed: bool) -> None:
    for step in range(steps):
        if reseed:
            g.manual_seed(step)
            g_ref.manual_seed(step)
        model.zero_grad()
        ref.zero_grad()
        model(x).sum().backward()
        ref(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"step {step}: {name}"
        assert torch.equal(g.get_state(), g_ref.get_state()), f"step {step}: generator"


@pytest.mark.parametrize("reseed", [True, False], ids=["reseeded", "one-stream"])
@pytest.mark.slow
def test_fit_with_an_explicit_generator_is_bitwise_past_the_sampled_checks(reseed: bool) -> None:
    model, ref, g, g_ref = _twins()
    x = torch.randn(2048, 64)
    memfit.fit(model, x, budget=0.5)
    g.manual_seed(1)
    g_ref.manual_seed(1)
    # 6 steps: the first 3 are checked, the rest run unchecked (NOTE [check sampling])
    _assert_steps_equal(model, ref, g, g_ref, x, steps=6, reseed=reseed)


@pytest.mark.parametrize("policy", [None, save_matmuls()], ids=["recompute-all", "save-matmuls"])
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_wrapped_blocks_with_an_explicit_generator_are_bitwise(policy, check) -> None:
    model, ref, g, g_ref = _twins(3)
    for b in model.blocks:
        wrap(b, policy, check=check)
    x = torch.randn(256, 64, requires_grad=False)
    _assert_steps_equal(model, ref, g, g_ref, x, steps=5, reseed=False)


def test_the_function_form_replays_an_explicit_generator_unchecked() -> None:
    lin = nn.Linear(8, 8)
    g, g_ref = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x = torch.randn(4, 8)

    def noisy(h: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        h = lin(h)
        return h * torch.rand(h.shape, generator=gen)

    for _ in range(3):
        lin.zero_grad()
        memfit.checkpoint(noisy, x, g, check=False).sum().backward()
        got = lin.weight.grad.clone()
        lin.zero_grad()
        noisy(x, g_ref).sum().backward()
        assert torch.equal(got, lin.weight.grad)
        assert torch.equal(g.get_state(), g_ref.get_state())


def test_a_generator_first_drawn_in_an_unwatched_call_raises_instead_of_a_wrong_gradient() -> None:
    g = torch.Generator().manual_seed(0)
    block = _Noisy(g, from_call=1)  # call 0 (watched) draws nothing; call 1 is unwatched
    wrap(block, save_matmuls(), check=False)
    x = torch.randn(16, 64)
    block(x).sum().backward()
    block.calls += 1
    with pytest.raises(RecomputeMismatch, match=r"explicit torch\.Generator .*check=\"always\""):
        block(x).sum().backward()
    # the sampler has learned: the next call is watched and exact
    g_ref = torch.Generator()
    ref = copy.deepcopy(block.lin)
    g_ref.set_state(g.get_state())
    block.zero_grad()
    block(x).sum().backward()
    h = torch.tanh(ref(x))
    (h + 0.1 * torch.randn(h.shape, generator=g_ref) * h).sum().backward()
    assert torch.equal(block.lin.weight.grad, ref.weight.grad)
    assert torch.equal(g.get_state(), g_ref.get_state())
