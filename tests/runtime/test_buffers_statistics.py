"""Rule 7 of NOTE [buffers written in forward]: a wrapped region whose watched call found that
its forward writes only its batch norms' statistics, none of them read, runs its unchecked
calls unwatched; gradients, outputs and every buffer stay bitwise those of the plain step."""

from __future__ import annotations

import copy

import pytest
import torch
from runtime_helpers import assert_bitwise_twin, dispatch_counter
from torch import nn

from memfit.planning.plan import Plan, Region
from memfit.runtime import buffers
from memfit.runtime.apply import apply_plan
from memfit.runtime.divergence import DivergenceCheck

D = 16


class NormBlock(nn.Module):
    """Linear, BatchNorm, tanh; ``kind`` says what else the forward does with the norm."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D, momentum=None if kind == "cumulative" else 0.1)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.lin(x))
        if self.kind == "twice":
            h = self.bn(h)                      # the same norm called twice: two updates
        elif self.kind == "reads_stats":
            h = h * self.bn.running_var         # a statistic read after its update
        return torch.tanh(h)


class NormNet(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.blocks = nn.ModuleList(NormBlock(kind) for _ in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _plan(*regions: tuple[str, ...]) -> Plan:
    return Plan(regions=tuple(Region(r) for r in regions), predicted_peak_bytes=0,
                recompute_s=0.0, budget_bytes=None, solver="test", profile_signature="")


PLAN = _plan(("blocks.0",), ("blocks.1",))
# a norm wrapped inside a wrapped block: its forward also runs in the block's replay
NESTED = _plan(("blocks.0",), ("blocks.1",), ("blocks.1.bn",))


def _pair(kind: str, check: object, plan: Plan = PLAN) -> tuple[NormNet, NormNet]:
    torch.manual_seed(0)
    twin = NormNet(kind).train()
    model = copy.deepcopy(twin)
    apply_plan(model, plan, check=check)
    return model, twin


def _watched_calls(monkeypatch) -> list[int]:
    seen = [0]
    real = buffers._Watch.__enter__

    def counting(self):
        seen[0] += 1
        return real(self)

    monkeypatch.setattr(buffers._Watch, "__enter__", counting)
    return seen


def _x() -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()


# (kind, check, watched forward calls of the 2 regions over 5 steps)
CASES = [
    ("plain", False, 2),      # the first call watches, the other 4 find what it found
    ("twice", False, 2),
    ("plain", True, 6),       # calls 0-2 are checked, and checked calls watch
    ("plain", DivergenceCheck(first_calls=1, every=2), 6),   # calls 0, 2, 4
    ("reads_stats", False, 10),   # a statistic is read: every call keeps rule 5's copy
    ("cumulative", False, 10),    # momentum=None reads num_batches_tracked
]


@pytest.mark.parametrize(("kind", "check", "watched"), CASES)
def test_statistics_only_regions_run_unwatched_and_bitwise(kind, check, watched, monkeypatch):
    seen = _watched_calls(monkeypatch)
    model, twin = _pair(kind, check)
    assert_bitwise_twin(model, twin, (_x(),), steps=5)
    assert seen[0] == watched
    calls = 10 if kind == "twice" else 5
    assert [int(b.bn.num_batches_tracked) for b in model.blocks] == [calls, calls]


def test_eval_mode_calls_are_watched_and_training_resumes_unwatched(monkeypatch):
    """In eval mode a norm reads its statistics: those calls are watched; back in training,
    the regions run unwatched again (the finding is kept over the eval calls)."""
    seen = _watched_calls(monkeypatch)
    model, twin = _pair("plain", False)
    assert_bitwise_twin(model, twin, (_x(),), steps=2)
    assert seen[0] == 2
    model.eval(), twin.eval()
    assert_bitwise_twin(model, twin, (_x(),), steps=2)
    assert seen[0] == 6
    model.train(), twin.train()
    assert_bitwise_twin(model, twin, (_x(),), steps=2)
    assert seen[0] == 6


def test_retain_graph_replays_twice_without_updating_the_statistics(monkeypatch):
    seen = _watched_calls(monkeypatch)
    model, twin = _pair("plain", False)
    assert_bitwise_twin(model, twin, (_x(),), steps=2)
    for m in (model, twin):
        loss = m(_x()).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
    assert seen[0] == 2  # the third call ran unwatched, and was replayed twice
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), (_, c) in zip(model.named_buffers(), twin.named_buffers(), strict=True):
        assert torch.equal(b, c), name
    assert [int(b.bn.num_batches_tracked) for b in model.blocks] == [3, 3]


def test_a_checked_call_renews_the_finding(monkeypatch):
    """A region that starts reading its statistics after the finding: the next checked call
    watches, finds the read, and every later call is watched again."""
    seen = _watched_calls(monkeypatch)
    model, twin = _pair("plain", DivergenceCheck(first_calls=1, every=3))
    assert_bitwise_twin(model, twin, (_x(),), steps=3)   # calls 0 (checked), 1, 2
    assert seen[0] == 2
    for m in (model, twin):
        for b in m.blocks:
            b.kind = "reads_stats"
    assert_bitwise_twin(model, twin, (_x(),), steps=3)   # call 3 checked; 4 and 5 watched
    assert seen[0] == 8


def test_a_norm_wrapped_inside_a_wrapped_block(monkeypatch):
    seen = _watched_calls(monkeypatch)
    model, twin = _pair("plain", False, NESTED)
    assert_bitwise_twin(model, twin, (_x(),), steps=5)
    assert seen[0] == 3  # the first call of each region
    assert [int(b.bn.num_batches_tracked) for b in model.blocks] == [5, 5]


def _allocations(model: nn.Module) -> list[int]:
    """The CPU allocator's alloc (+) and free (-) sizes, in order, of one step."""
    from torch.profiler import ProfilerActivity, profile

    from memfit._torch import cpu_memory_events

    for p in model.parameters():
        p.grad = None
    x = _x()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x).square().mean().backward()
    return [n for _, n in cpu_memory_events(prof)]


def test_unwatched_calls_allocate_what_the_watched_ones_do():
    """The watcher's copies of the statistics (made before a norm's first write, dropped at
    the forward's end: the memory model's NOTE [buffer copies]) are made in unwatched calls
    too, so an unchecked step allocates and frees the same bytes in the same order either
    way. (A checked call also runs the divergence check, which allocates.)"""
    model, _ = _pair("plain", False)
    findings = [b.__dict__["_memfit_wrap"].statistics for b in model.blocks]
    _allocations(model)  # the first call: watched
    unwatched = _allocations(model)
    for f in findings:  # forget the finding: the next call watches (unchecked) and renews it
        f.statistics_only = False
    watched = _allocations(model)
    assert all(f.statistics_only for f in findings)
    # the statistics' copies and the norms' own C-float tensors, allocated and freed alike
    # (the watcher's dispatch also wraps add_'s scalar in a transient 8-byte tensor)
    c_floats = [[n for n in events if abs(n) == 4 * D] for events in (watched, unwatched)]
    assert c_floats[0] == c_floats[1]
    assert watched.count(4 * D) == unwatched.count(4 * D) > 0
    assert _peak(unwatched) == _peak(watched)
    assert _allocations(model) == unwatched


def _peak(events: list[int]) -> int:
    live = peak = 0
    for n in events:
        live += n
        peak = max(peak, live)
    return peak


def _skipper_ops(monkeypatch) -> list[int]:
    """Ops dispatched through rule 2's update skipper (a Python mode over a norm's forward)."""
    return dispatch_counter(monkeypatch, buffers._SkipUpdates)


@pytest.mark.parametrize("kind", ["plain", "twice"])  # "cumulative" is watched every call
def test_unwatched_replays_run_their_norms_on_scratch_statistics(kind, monkeypatch):
    """NOTE [scratch statistics]: after the watched first call, a replay runs each norm's
    ``F.batch_norm`` on the scratch wrap made, no op through the skipper; bitwise the plain
    step's (statistics and counters included). A norm whose buffers changed dtype after wrap,
    or that is wrapped itself, replays under the skipper, bitwise too."""
    from memfit.runtime import norm_statistics

    skipped = _skipper_ops(monkeypatch)
    model, twin = _pair(kind, False)
    assert all(b.bn in norm_statistics._SCRATCH for b in model.blocks)
    assert_bitwise_twin(model, twin, (_x(),), steps=1)  # watched: its replay skips by the mode
    assert skipped[0] > 0
    skipped[0] = 0
    assert_bitwise_twin(model, twin, (_x(),), steps=3)
    assert skipped[0] == 0
    calls = 8 if kind == "twice" else 4
    assert [int(b.bn.num_batches_tracked) for b in model.blocks] == [calls, calls]

    for plan, dtype in ((NESTED, torch.float32), (PLAN, torch.float64)):
        # blocks.1.bn wrapped itself (its own forward); buffers cast after wrap (no scratch)
        model, twin = _pair(kind, False, plan)
        model.to(dtype), twin.to(dtype)
        x = _x().detach().to(dtype).requires_grad_()
        assert_bitwise_twin(model, twin, (x,), steps=1)
        skipped[0] = 0
        assert_bitwise_twin(model, twin, (x,), steps=2)
        assert skipped[0] > 0


def test_unwrap_lets_the_scratch_go():
    from memfit.runtime import norm_statistics
    from memfit.runtime.apply import unapply

    model, _ = _pair("plain", False)
    norms = [b.bn for b in model.blocks]
    assert all(n in norm_statistics._SCRATCH for n in norms)
    unapply(model)
    assert not any(n in norm_statistics._SCRATCH for n in norms)


def test_a_lazy_norm_gets_no_scratch():
    """A lazy norm's buffers are uninitialized at wrap: wrap gives it none (it replays under the
    skipper), and wrapping does not touch them."""
    from memfit.runtime import norm_statistics
    from memfit.runtime.wrap import unwrap, wrap

    block = nn.Sequential(nn.Linear(4, 4), nn.LazyBatchNorm1d(), nn.BatchNorm1d(4))
    wrap(block)
    assert block[1] not in norm_statistics._SCRATCH and block[2] in norm_statistics._SCRATCH
    unwrap(block)
    assert block[2] not in norm_statistics._SCRATCH
