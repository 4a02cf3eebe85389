"""Buffers a region's forward writes (NOTE [buffers written in forward]): recomputed from their
pre-forward values, updated once, bitwise equal to the plain step and over optimizer steps."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from runtime_helpers import assert_bitwise_twin, dispatch_counter
from torch import nn

import memfit
from memfit.planning.plan import Plan, Region
from memfit.runtime.apply import apply_plan
from memfit.runtime.buffers import _storage_key

D = 16


class Block(nn.Module):
    """Linear, BatchNorm, tanh, plus one kind of buffer the forward writes."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        lin = nn.Linear(D, D)
        if kind == "spectral_norm":
            lin = nn.utils.parametrizations.spectral_norm(lin)
        elif kind == "spectral_norm_legacy":
            lin = nn.utils.spectral_norm(lin)
        self.lin = lin
        self.bn = nn.BatchNorm1d(D, momentum=None if kind == "cumulative" else 0.1)
        self.kind = kind
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(D))
        self.register_buffer("noise", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.lin(x))                                    # (batch, D)
        if self.kind == "counter":
            self.calls += 1                                          # a step counter: in place
            h = h * (self.calls / 4)                                 # a schedule read after it
        elif self.kind == "ema":
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * x.mean(0))             # EMA of the input
            h = h - self.ema
        elif self.kind == "reads_stats":
            h = h * self.bn.running_var                              # read after its update
        elif self.kind == "unread_ema":
            self.calls += 1                                          # a counter, read below
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * x.mean(0))             # updated twice, never read
            h = h * (1 + 0 * self.calls)
        elif self.kind == "noise":
            with torch.no_grad():
                self.noise.uniform_()                                # drawn, never read
            h = F.dropout(h, 0.5)                                    # the next draw
        return torch.tanh(h)


class Net(nn.Module):
    def __init__(self, kind: str, *, by_hand: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.blocks = nn.ModuleList(Block(kind) for _ in range(2))
        self.head = nn.Linear(D, 1)
        self.by_hand = by_hand  # memfit.checkpoint each block from the loop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = memfit.checkpoint(block, h) if self.by_hand else block(h)
        return self.head(h)


# "cumulative": BatchNorm with momentum=None reads num_batches_tracked after its increment;
# "noise": a random write to a buffer nothing reads must still draw in the replay;
# "unread_ema": two updates of a buffer nothing reads, which the replay skips (issue #39)
KINDS = ["spectral_norm", "spectral_norm_legacy", "counter", "ema", "reads_stats", "cumulative",
         "noise", "unread_ema"]

PLANS = {
    "wrap": (Region(("blocks.0",)), Region(("blocks.1",))),
    "segment": (Region(("blocks.0", "blocks.1")),),
    "nested": (Region(("blocks.0",)), Region(("blocks.0.lin",)), Region(("blocks.1",)),
               Region(("blocks.1.bn",))),
}


def _plan(regions: tuple[Region, ...]) -> Plan:
    return Plan(regions=regions, predicted_peak_bytes=0, recompute_s=0.0, budget_bytes=None,
                solver="test", profile_signature="")


def _pair(kind: str, how: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    twin = Net(kind).train()
    model = copy.deepcopy(twin)
    if how == "checkpoint":
        model.by_hand = True
    else:
        apply_plan(model, _plan(PLANS[how]))
    return model, twin


def _x() -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("how", ["checkpoint", *PLANS])
@pytest.mark.parametrize("kind", KINDS)
def test_written_buffers_bitwise_and_batchnorm_once(kind, how):
    model, twin = _pair(kind, how)
    assert_bitwise_twin(model, twin, (_x().requires_grad_(),), steps=2)
    assert [int(b.bn.num_batches_tracked) for b in model.blocks] == [2, 2]
    if kind in ("counter", "unread_ema"):
        assert [int(b.calls) for b in model.blocks] == [2, 2]


def _adamw_steps(model: nn.Module, n: int) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(n):
        torch.manual_seed(s)
        loss = model(_x()).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("how", ["checkpoint", *PLANS])
@pytest.mark.parametrize("kind", KINDS)
def test_three_adamw_steps_equal_plain(kind, how):
    model, twin = _pair(kind, how)
    for a, b in zip(_adamw_steps(model, 3), _adamw_steps(twin, 3), strict=True):
        assert torch.equal(a, b)
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    for (name, p), (_, q) in zip(model.named_buffers(), twin.named_buffers(), strict=True):
        assert torch.equal(p, q), name


class EmaBlock(nn.Module):
    """Issue #39's block: a call counter read in the output, an EMA buffer updated twice in
    place (``mul_`` then ``add_``) and never read."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("m", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = torch.tanh(self.lin(x))                                  # (batch, d)
        self.m.mul_(0.9).add_(y.detach().mean(0), alpha=0.1)
        return y * (1 + 0 * self.calls)


class EmaNet(nn.Module):
    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EmaBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)                                         # a residual loop
        return self.head(x)


def test_fit_min_over_unread_buffer_updates_trains_like_plain():
    """The replay skips the EMA's two updates (rule 2) and the value check does not compare
    them: a false RecomputeMismatch at blocks.2's ``mul_`` before (issue #39)."""
    torch.manual_seed(0)
    twin = EmaNet()
    model = copy.deepcopy(twin)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    memfit.fit(model, x, budget="min")
    assert any("blocks.2" in r.modules for r in model.memfit_plan.regions)  # replayed there
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    for s in range(3):
        outs = [m(x) for m in (model, twin)]
        for out in outs:
            out.square().mean().backward()
        assert torch.equal(outs[0], outs[1]), f"step {s}: outputs differ"
        for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"step {s}: grad of {name} differs"
        for (name, b), (_, c) in zip(model.named_buffers(), twin.named_buffers(), strict=True):
            assert torch.equal(b, c), f"step {s}: buffer {name} differs"
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert [int(b.calls) for b in model.blocks] == [3, 3, 3, 3]


def test_torch_checkpoint_gets_spectral_norm_wrong():
    # The failure memfit fixes: torch's checkpoint recomputes the weight from advanced vectors.
    torch.manual_seed(0)
    model = Net("spectral_norm").train()
    twin = copy.deepcopy(model)
    x = _x()
    h = model.inp(x)
    for block in model.blocks:
        h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
    model.head(h).sum().backward()
    twin(x).sum().backward()
    differ = [n for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(),
                                          strict=True) if not torch.equal(p.grad, q.grad)]
    assert "blocks.0.lin.parametrizations.weight.original" in differ


def test_fit_plan_over_spectral_norm_trains_like_plain():
    torch.manual_seed(0)
    model = Net("spectral_norm").train()
    twin = copy.deepcopy(model)
    # every block: on a step of 8 KiB no budgeted plan checkpoints anything, since each
    # checkpoint keeps a 5 KiB RNG state (NOTE [region state bytes]); for the same reason
    # every_block peaks above the plain step, so its budget is its own peak ("min"): fit
    # refuses a baseline plan over the budget
    memfit.fit(model, _x(), budget="min", search=memfit.Search(solver="every_block"))
    covered = {p for r in model.memfit_plan.regions for p in r.modules}
    assert covered & {"blocks.0", "blocks.0.lin", "blocks.1", "blocks.1.lin"}, covered
    report = memfit.verify(model, _x())
    assert report.bitwise and report.bn_stats_equal, str(report)
    for a, b in zip(_adamw_steps(model, 3), _adamw_steps(twin, 3), strict=True):
        assert torch.equal(a, b)
    for (name, p), (_, q) in zip(model.state_dict().items(), twin.state_dict().items(),
                                 strict=True):
        assert torch.equal(p, q), name


class Replaces(nn.Module):
    """An EMA kept by replacing the buffer (not in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("ema", torch.zeros(D))
        self.register_buffer("noise", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)
        return torch.tanh(self.lin(x) - self.ema)


def test_replaced_buffer_is_put_back_for_the_recompute():
    torch.manual_seed(0)
    twin = nn.Sequential(nn.Linear(8, D), Replaces(), nn.Linear(D, 1))
    model = copy.deepcopy(twin)
    apply_plan(model, _plan((Region(("1",)),)))
    assert_bitwise_twin(model, twin, (_x(),), steps=2)


def test_retain_graph_recomputes_twice_from_the_same_values():
    torch.manual_seed(0)
    model = Net("counter")
    twin = copy.deepcopy(model)
    model.by_hand = True
    x = _x()
    for m in (model, twin):
        loss = m(x).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert [int(b.calls) for b in model.blocks] == [1, 1]


def test_only_written_buffers_are_copied():
    from memfit.runtime.buffers import BufferGuard

    block = Block("counter")
    guard = BufferGuard((block,))
    guard.forward_enter()
    try:
        block(torch.randn(4, D))
    finally:
        guard.forward_exit()
    kept = {n for n, b in block.named_buffers() if id(b) in guard._pre}
    unread = {n for n, b in block.named_buffers() if _storage_key(b) in guard._unread}
    # the counter is read after its increment: its pre-forward value is kept for the replay;
    # BatchNorm's buffers are only updated (rule 2): no copy kept, their replay skips them
    assert kept == {"calls"}
    assert unread == {"bn.num_batches_tracked", "bn.running_mean", "bn.running_var"}
    assert int(guard._pre[id(block.calls)][1]) == 0 and int(block.calls) == 1


def test_functional_batch_norm_writes_are_seen():
    # F.batch_norm writes running statistics the op schema does not declare.
    from memfit.runtime.buffers import BufferGuard

    mod = nn.Module()
    mod.register_buffer("mean", torch.zeros(3))
    mod.register_buffer("var", torch.ones(3))
    guard = BufferGuard((mod,))
    guard.forward_enter()
    try:
        F.batch_norm(torch.randn(5, 3), mod.mean, mod.var, training=True)
        F.batch_norm(torch.randn(5, 3), mod.mean, mod.var, training=False)
    finally:
        guard.forward_exit()
    assert {id(b) for b, _ in guard._pre.values()} == {id(mod.mean), id(mod.var)}


def test_statistics_read_after_their_update_keep_their_copy():
    from memfit.runtime.buffers import BufferGuard

    block = Block("reads_stats")
    guard = BufferGuard((block,))
    guard.forward_enter()
    try:
        block(torch.randn(4, D))
    finally:
        guard.forward_exit()
    copies = {id(buf): copy for buf, copy in guard._pre.values()}
    # running_var is read after its update; batch norm updates both statistics in one op, so
    # its replay must update both: both keep their pre-forward values
    assert torch.equal(copies[id(block.bn.running_mean)], torch.zeros(D))
    assert torch.equal(copies[id(block.bn.running_var)], torch.ones(D))
    assert guard._unread == {_storage_key(block.bn.num_batches_tracked)}


class SharedNormBlock(nn.Module):
    """No buffer of its own: it calls a BatchNorm and a counter registered on its parent."""

    def __init__(self, shared: nn.ModuleDict) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.shared = [shared]  # not a submodule: outside the region's subtree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shared[0]
        return torch.tanh(s.bn(self.lin(x)) * (s.counter() / 4))


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self) -> torch.Tensor:
        self.calls += 1                                              # in place, outside
        return self.calls


class SharedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.ModuleDict({"bn": nn.BatchNorm1d(D), "counter": Counter()})
        self.inp = nn.Linear(8, D)
        self.blocks = nn.ModuleList(SharedNormBlock(self.shared) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return h.sum(-1)


def _watched_ops(monkeypatch) -> list[int]:
    from memfit.runtime import buffers

    return dispatch_counter(monkeypatch, buffers._Watch)


@pytest.mark.slow
def test_regions_that_wrote_no_buffer_when_profiled_run_unwatched(monkeypatch):
    """Rule 6: the GPT block's causal mask is a buffer it only reads, so the planned blocks
    run without the watcher; a block whose BatchNorm writes its statistics is watched."""
    seen = _watched_ops(monkeypatch)
    model = memfit.zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    twin = copy.deepcopy(model)
    x = memfit.zoo.example_inputs(model, batch=2)
    plan = memfit.plan(memfit.profile(model, x, repeats=1), budget=1.0, solver="every_block")
    assert [r.writes_buffers for r in plan.regions] == [False, False]
    apply_plan(model, plan)
    assert_bitwise_twin(model, twin, (x,), steps=2)
    assert seen[0] == 0
    torch.manual_seed(0)
    bn_model = Net("ema").train()
    bn_twin = copy.deepcopy(bn_model)
    bn_plan = memfit.plan(memfit.profile(bn_model, _x(), repeats=1), budget=1.0, solver="every_block")
    assert bn_plan.regions and all(r.writes_buffers for r in bn_plan.regions)
    apply_plan(bn_model, bn_plan)
    assert_bitwise_twin(bn_model, bn_twin, (_x().requires_grad_(),), steps=2)
    assert seen[0] > 0


def test_hand_made_regions_are_watched_when_their_modules_have_buffers(monkeypatch):
    seen = _watched_ops(monkeypatch)
    model = memfit.zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    twin = copy.deepcopy(model)
    apply_plan(model, _plan(tuple(Region((f"blocks.{i}",)) for i in range(2))))  # writes_buffers None
    assert_bitwise_twin(model, twin, (memfit.zoo.example_inputs(model, batch=2),), steps=1)
    assert seen[0] > 0  # the mask buffer: watched, as nothing says it is never written


@pytest.mark.parametrize("how", ["blocks", "segment"])
def test_buffers_of_a_shared_module_are_copied_on_call(how, monkeypatch):
    seen = _watched_ops(monkeypatch)
    torch.manual_seed(0)
    twin = SharedNet().train()
    model = copy.deepcopy(twin)
    model.blocks[1].shared = [model.shared]
    model.blocks[0].shared = [model.shared]
    regions = ((Region(("blocks.0",)), Region(("blocks.1",))) if how == "blocks"
               else (Region(("blocks.0", "blocks.1")),))
    apply_plan(model, _plan(regions))
    assert_bitwise_twin(model, twin, (_x().requires_grad_(),), steps=2)
    assert int(model.shared.counter.calls) == 4 and int(model.shared.bn.num_batches_tracked) == 4
    assert seen[0] == 0
