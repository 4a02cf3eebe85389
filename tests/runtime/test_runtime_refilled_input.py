"""An input refilled in place between forward and backward (``x.copy_(next_batch)``, legal for
a plain step that saves no input) gets a memfit error naming the region and the input, not
torch's raw "modified by an inplace operation" (NOTE [the forward's tensors], rule 5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.errors import RecomputeMismatch
from memfit.runtime.segment import checkpoint_segment
from memfit.runtime.wrap import wrap


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 0.5  # saves nothing: the plain step keeps no reference to x
        return h + self.l2(torch.relu(self.l1(h)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("how", ["wrap", "segment"])
def test_an_input_refilled_before_backward_is_named(how: str) -> None:
    net, x = _Net(), torch.randn(8, 16)
    net(x).sum().backward()
    x.copy_(torch.randn(8, 16))  # the plain step allows it
    net(x).sum().backward()  # its saved tensors do not include x
    if how == "wrap":
        wrap(net.blocks[0])
        where = "_Block"
    else:
        checkpoint_segment(net.blocks, [0, 1])
        where = r"ModuleList\[0\.\.1\]"
    loss = net(x).sum()
    x.copy_(torch.randn(8, 16))
    with pytest.raises(RecomputeMismatch, match=rf"input 0 of {where}.*written in place after "
                                                 r"the forward \(version 1 -> 2\)"):
        loss.backward()


def test_an_input_left_alone_passes() -> None:
    net, x = _Net(), torch.randn(512, 16)
    memfit.fit(net, x, budget="min")
    assert net.memfit_plan.regions
    loss = net(x).sum()
    loss.backward()
    assert all(p.grad is not None for p in net.parameters())


def test_an_output_written_in_place_keeps_its_gradient() -> None:
    """The version watch hooks the region's outputs; a caller writing one in place still gets
    the plain step's gradients."""
    torch.manual_seed(0)
    lin, x = nn.Linear(4, 4), torch.randn(3, 4)
    ref = nn.Linear(4, 4)
    ref.load_state_dict(lin.state_dict())
    wrap(lin)
    for net in (lin, ref):
        y = net(x)
        y.mul_(2)
        y.sum().backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad)
    assert torch.equal(lin.bias.grad, ref.bias.grad)
