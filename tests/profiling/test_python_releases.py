"""NOTE [Python releases] in memfit.profiling.profile: where the step's code lets go of what the
forward made, traced once without saved tensors, and the region model that uses it."""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

import memfit
from memfit.planning.effects import ProfileArrays, RegionModel, resolve_span
from memfit.planning.plan import Plan, Region
from memfit.planning.simulate import simulate
from memfit.profiling.profile import PYTHON_RELEASES, Profile
from memfit.runtime.apply import apply_plan

BATCH, WIDTH = 4096, 32
ACT = BATCH * WIDTH * 4  # one float32 activation of the block


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.l3 = nn.Linear(WIDTH, 4 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the first ReLU's output is let go when l2 returns, not when the block does
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # live through the block's forward only (no graph): the step peaks there
        wide = x.repeat(1, 16)
        return self.block(x).sum() + wide.mean()


def _setup() -> tuple[nn.Module, torch.Tensor, Profile]:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(BATCH, WIDTH)
    return model, x, memfit.profile(copy.deepcopy(model), x, loss_fn=torch.sum)


def _op(prof: Profile, module: str, name: str) -> int:
    found = [op.index for op in prof.ops[: prof.n_forward] if op.module == module and op.name == name]
    assert len(found) == 1, (module, name, found)
    return found[0]


def _untraced(prof: Profile) -> Profile:
    """The profile as written before Python releases were traced."""
    extra = {k: v for k, v in prof.extra.items() if k != PYTHON_RELEASES}
    return dataclasses.replace(prof, extra=extra,
                               storages=tuple(dataclasses.replace(s, released_after=None) for s in prof.storages))


def test_each_activation_is_released_where_the_code_lets_it_go() -> None:
    _, _, prof = _setup()
    assert prof.extra[PYTHON_RELEASES] is True
    relu1 = [op.index for op in prof.ops[: prof.n_forward] if op.name == "aten.relu.default"][0]
    l2 = _op(prof, "block.l2", "aten.addmm.default")
    l3 = _op(prof, "block.l3", "aten.addmm.default")
    (sid,) = (s.storage for s in prof.ops[relu1].outputs)
    rec = prof.storages[sid]
    # autograd holds it into backward (relu and l2 saved it); Python let go after l2's matmul
    assert rec.saved and rec.freed_after is not None and rec.freed_after >= prof.n_forward
    assert rec.released_after == l2
    # the block's output goes once its sum is taken, ``wide`` when the forward returns
    (out,) = (s.storage for s in prof.ops[l3].outputs)
    assert prof.ops[l3 + 1].name == "aten.sum.default"
    assert prof.storages[out].released_after == l3 + 1
    (wide,) = (s.storage for s in prof.ops[_op(prof, "", "aten.repeat.default")].outputs)
    assert prof.storages[wide].released_after == _op(prof, "", "aten.add.Tensor")


def test_a_region_drops_the_storage_where_python_releases_it() -> None:
    _, _, prof = _setup()
    span = resolve_span(prof, ("block",))
    traced, old = RegionModel(ProfileArrays(prof), span), RegionModel(ProfileArrays(_untraced(prof)), span)
    l2 = _op(prof, "block.l2", "aten.addmm.default")
    relu1 = [op.index for op in prof.ops[: prof.n_forward] if op.name == "aten.relu.default"][0]
    k = int((traced.c == relu1).nonzero()[0][0])
    assert traced.dropped[k] and old.dropped[k]
    assert traced.d[k] == l2
    assert old.d[k] == span.last_op  # the older rule: until the block returns


def test_the_planned_step_peaks_where_predicted_and_the_older_rule_over_counts() -> None:
    model, x, prof = _setup()
    plan0 = Plan((Region(("block",)),), 0, 0.0, None, "test", prof.signature)
    sim = simulate(prof, plan0)
    plan = dataclasses.replace(plan0, predicted_peak_bytes=sim.peak_bytes, recompute_s=sim.recompute_s)
    planned = copy.deepcopy(model)
    apply_plan(planned, plan)
    rep = memfit.verify(planned, x, loss_fn=torch.sum)
    assert rep.bitwise
    assert rep.peak_bytes == rep.predicted_peak_bytes == sim.peak_bytes
    # the step peaks at the block's last matmul in forward (``wide`` live): without the trace
    # the first ReLU's output is counted there too
    assert simulate(_untraced(prof), plan0).peak_bytes == sim.peak_bytes + ACT


def test_a_forward_that_runs_other_ops_the_second_time_records_no_release() -> None:
    class Changing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            y = self.lin(x)
            return y.sin() if self.calls == 1 else y.cos()

    prof = memfit.profile(Changing(), torch.randn(8, WIDTH), loss_fn=torch.sum, repeats=1)
    assert PYTHON_RELEASES not in prof.extra
    assert all(s.released_after is None for s in prof.storages)
    arrs = ProfileArrays(prof)
    assert (arrs.released == -1).all()
