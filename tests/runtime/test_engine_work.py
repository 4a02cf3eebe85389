"""NOTE [engine work in a region]: an engine's parameter gathers that run in a region's forward
but not in its replay (or the other way round) are not the region's computation. A fake
ZeRO-3 engine gathers each Linear's weight in a forward pre-hook, on a schedule of calls;
without ``engine_work`` the replay diverges, with it the step is bitwise its plain twin's."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from runtime_helpers import assert_bitwise_twin
from torch import nn

from memfit._torch import TorchDispatchMode
from memfit.errors import RecomputeMismatch
from memfit.runtime import policies as P
from memfit.runtime.engine_work import engine_work, hide_engine_work, is_engine_work
from memfit.runtime.wrap import wrap


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 8)
        return self.down(torch.tanh(self.up(x)))


class FakeZero3:
    """Gathers a Linear's weight (a fresh buffer filled from the whole value kept here: the
    ops of an all-gather, the same values) in that Linear's forward pre-hook, on the calls
    ``gathers(call)`` says; ``quantized``: the gather dequantizes with a matmul (ZeRO++'s
    ``zero_quantized_weights`` computes in its gather; here with ``addmm``, the op the
    region's Linears run). ``prefetch``: ``up``'s hook also
    gathers ``down``'s weight, as ZeRO-3's prefetch does."""

    def __init__(self, block: Block, gathers: Callable[[int], bool], *, hide: bool,
                 quantized: bool = False, prefetch: bool = False) -> None:
        self.block, self.gathers, self.quantized = block, gathers, quantized
        self.calls: dict[str, int] = {}
        self.prefetch = prefetch
        self.whole = {name: m.weight.detach().clone()
                      for name, m in (("up", block.up), ("down", block.down))}
        hook = engine_work(self.pre_hook) if hide else self.pre_hook
        block.up.register_forward_pre_hook(lambda m, args: hook("up"))
        block.down.register_forward_pre_hook(lambda m, args: hook("down"))

    def pre_hook(self, name: str) -> None:
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        if self.gathers(call):
            self.gather(name)
            if self.prefetch and name == "up":
                self.gather("down")

    @torch.no_grad()
    def gather(self, name: str) -> None:
        weight = getattr(self.block, name).weight
        value = self.whole[name]
        buffer = torch.empty(value.numel())  # (out * in,): what the all-gather fills
        if self.quantized:  # dequantize: 0 + value @ I, the same bits; addmm, as Linear's
            eye = torch.eye(value.shape[1])
            buffer.view(value.shape).copy_(torch.addmm(torch.zeros(value.shape[1]), value, eye))
        else:
            buffer.narrow(0, 0, value.numel()).copy_(value.reshape(-1))
        weight.data = buffer.view(value.shape)


# Which calls of a Linear's pre-hook gather: call 0 is the forward, call 1 its replay.
SCHEDULES = {
    "forward-only": lambda call: call == 0,  # persistent: gathered once, whole in the replay
    "replay-only": lambda call: call == 1,  # released after the forward, gathered again
}


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


@pytest.mark.parametrize("prefetch", [False, True], ids=["own", "prefetch"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_gathers_in_one_pass_only_are_not_the_regions(schedule: str, prefetch: bool) -> None:
    torch.manual_seed(0)
    plain = Block()
    x = torch.randn(4, 8)
    hidden = copy.deepcopy(plain)
    FakeZero3(hidden, SCHEDULES[schedule], hide=True, prefetch=prefetch)
    wrap(hidden, check="always")
    assert_bitwise_twin(hidden, plain, (x,))

    shown = copy.deepcopy(plain)
    FakeZero3(shown, SCHEDULES[schedule], hide=False, prefetch=prefetch)
    wrap(shown, check="always")
    with pytest.raises(RecomputeMismatch, match="diverged from its forward"):
        _step(shown, x)


def test_a_computing_gather_does_not_shift_the_selective_cache() -> None:
    """The gather's matmul runs in the forward only: seen by torch's selective cache, the
    replay's first matmul would take the gather's saved output (wrong values, or torch's
    mismatch error); hidden, the region saves and replays its own two matmuls."""
    torch.manual_seed(0)
    plain = Block()
    x = torch.randn(4, 8)
    hidden = copy.deepcopy(plain)
    FakeZero3(hidden, SCHEDULES["forward-only"], hide=True, quantized=True)
    wrap(hidden, P.save_matmuls(), check=False)
    assert_bitwise_twin(hidden, plain, (x,))

    shown = copy.deepcopy(plain)
    FakeZero3(shown, SCHEDULES["forward-only"], hide=False, quantized=True)
    wrap(shown, P.save_matmuls(), check=False)
    torch.manual_seed(0)
    twin = copy.deepcopy(plain)
    try:
        _step(shown, x)
    except RuntimeError:
        return  # torch's own mismatch error: the shift was caught
    _step(twin, x)
    assert not all(torch.equal(a.grad, b.grad) for a, b in zip(shown.parameters(), twin.parameters(),
                                                                strict=True))


def test_hide_engine_work_wraps_once_and_restores_the_modes() -> None:
    class Engine:
        def gather(self) -> torch.Tensor:
            return torch.ones(2) * 2

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    engine = Engine()
    assert hide_engine_work(engine, "gather")
    first = engine.gather
    assert hide_engine_work(engine, "gather") and engine.gather is first  # once
    assert is_engine_work(engine.gather) and not hide_engine_work(engine, "missing")
    with Count() as count:
        gathered = engine.gather()
        hidden = count.ops
        torch.ones(2).sum()
    assert torch.equal(gathered, torch.full((2,), 2.0))
    assert hidden == 0
    assert count.ops == 2  # ones, sum: the mode was back after the engine's work
