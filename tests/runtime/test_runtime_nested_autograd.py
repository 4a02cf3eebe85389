"""Regions that run autograd themselves, or run under a user's profiling tools: a backward
inside the region's forward (forces from an energy, a gradient penalty), ``record_function``
ranges (``nn.DataParallel`` opens one), backward under ``FlopCounterMode``. The divergence
check passes them (no false ``RecomputeMismatch``) and the step is the plain one, bitwise."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import memfit
from memfit.runtime.wrap import wrap


class _Forces(nn.Module):
    """Forces as the gradient of a learned energy: a backward inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.energy = nn.Sequential(nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        e = self.energy(pos).sum()
        forces, = torch.autograd.grad(-e, pos, create_graph=True)
        return forces


@pytest.mark.parametrize("check", ["always", True])
def test_a_backward_inside_the_forward_is_checked_and_bitwise(check) -> None:
    torch.manual_seed(0)
    net = _Forces()
    ref = copy.deepcopy(net)
    wrap(net, check=check)
    pos = torch.randn(16, 3, requires_grad=True)
    for _ in range(3):
        net.zero_grad()
        ref.zero_grad()
        net(pos).pow(2).sum().backward()
        ref(pos).pow(2).sum().backward()
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            if q.grad is None:  # the energy's last bias does not reach the forces
                assert p.grad is None
            else:
                assert torch.equal(p.grad, q.grad)


class _Ranged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.profiler.record_function("block"):
            return x + self.l2(torch.relu(self.l1(x)))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Ranged() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            with torch.autograd.profiler.record_function("loop"):
                x = b(x)
        return x


def test_record_function_ranges_and_a_flop_counter_pass_the_check() -> None:
    model = _Stack()
    ref = copy.deepcopy(model)
    x = torch.randn(512, 64)
    memfit.fit(model, x, budget=0.7)
    assert model.memfit_plan.regions
    for _ in range(2):  # checked calls (NOTE [check sampling])
        model.zero_grad()
        ref.zero_grad()
        loss = model(x).sum()
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        assert counter.get_total_flops() > 0
        ref(x).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
