"""Region tails: a module region's last ops whose saves outlive it run outside its replay
(NOTE [region tails] in memfit.planning.tails)."""

from __future__ import annotations

import copy

import pytest
import torch
from runtime_helpers import Bottleneck
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memfit
from memfit.errors import MemfitError
from memfit.planning.effects import ProfileArrays, resolve_span
from memfit.planning.plan import Plan, Region
from memfit.planning.simulate import simulate
from memfit.planning.tails import with_tail
from memfit.profiling.profile import without_tails
from memfit.runtime.apply import apply_plan


def _net() -> tuple[nn.Module, torch.Tensor, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                          Bottleneck(16, 8), Bottleneck(16, 8), Bottleneck(16, 8, downsample=True),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    x = torch.randn(4, 3, 16, 16)
    y = torch.randint(0, 10, (4,))
    return model, x, (lambda out: nn.functional.cross_entropy(out, y))


@pytest.fixture(scope="module")
def net_profile() -> tuple[nn.Module, torch.Tensor, object, memfit.Profile]:
    model, x, loss_fn = _net()
    return model, x, loss_fn, memfit.profile(copy.deepcopy(model), x, loss_fn=loss_fn)


def _every_block(prof: memfit.Profile, tails: bool) -> Plan:
    arrs = ProfileArrays(prof)
    regions = []
    for path in ("3", "4", "5"):
        span = resolve_span(prof, (path,))
        regions.append(Region((path,), tail_after=with_tail(arrs, span).tail_after if tails else None))
    sim = simulate(prof, Plan(tuple(regions), 0, 0.0, None, "test", prof.signature))
    return Plan(tuple(regions), sim.peak_bytes, sim.recompute_s, None, "test", prof.signature)


def test_each_block_ends_its_range_at_bn3_and_its_replay_before_the_add(net_profile) -> None:
    _, _, _, prof = net_profile
    arrs = ProfileArrays(prof)
    index = {m.path: m for m in prof.modules}
    for path in ("3", "4", "5"):
        span = resolve_span(prof, (path,))
        tailed = with_tail(arrs, span)
        assert tailed.tail_after == f"{path}.downsample" if path == "5" else f"{path}.bn3"
        assert tailed.last_op == index[tailed.tail_after].last_op
        # the tail: the in-place add and the relu (and nothing the frame must pack)
        tail = [prof.ops[i].name for i in range(tailed.last_op + 1, span.last_op + 1)]
        assert tail == ["aten.add_.Tensor", "aten.relu_.default"]
        assert resolve_span(prof, (path,), tail_after=tailed.tail_after) == tailed
    # the stem's relu is out of place and its region (a Sequential's child) has no sub-module
    assert with_tail(arrs, resolve_span(prof, ("2",))).tail_after is None
    # off for a profile marked so (memfit.Search(tails=False))
    assert with_tail(ProfileArrays(without_tails(prof)), resolve_span(prof, ("3",))).tail_after is None


def test_tails_rerun_less_at_no_more_memory(net_profile) -> None:
    _, _, _, prof = net_profile
    plain, tailed = _every_block(prof, False), _every_block(prof, True)
    assert tailed.recompute_s < plain.recompute_s
    assert tailed.predicted_peak_bytes <= plain.predicted_peak_bytes


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("tails", [False, True], ids=["whole", "tails"])
def test_planned_step_is_bitwise_and_peaks_as_predicted(net_profile, tails: bool) -> None:
    model, x, loss_fn, prof = net_profile
    plan = _every_block(prof, tails)
    planned = copy.deepcopy(model)
    apply_plan(planned, plan)
    rep = memfit.verify(planned, x, loss_fn=loss_fn)
    assert rep.bitwise and rep.bn_stats_equal
    assert rep.peak_bytes == rep.predicted_peak_bytes == plan.predicted_peak_bytes


def test_the_replays_skip_each_tails_add_and_relu(net_profile) -> None:
    model, x, loss_fn, prof = net_profile
    counts = {}
    for tails in (False, True):
        planned = copy.deepcopy(model)
        apply_plan(planned, _every_block(prof, tails))
        out = loss_fn(planned(x))
        ops = _Ops()
        with ops:
            out.backward()
        counts[tails] = (ops.names.count("aten.add_.Tensor"), ops.names.count("aten.relu_.default"))
    # each of the 3 replays ran the block's add_ and its last relu_ before; now neither
    # (add_ also counts the batch norms' num_batches_tracked updates, the same in both)
    assert counts[False][0] - counts[True][0] == 3
    assert counts[False][1] - counts[True][1] == 3


def test_plans_of_fit_take_tails_unless_told_not_to(net_profile) -> None:
    model, x, loss_fn, _ = net_profile
    with_tails = memfit.fit(copy.deepcopy(model), x, loss_fn=loss_fn, budget=0.9,
                            search=memfit.Search(solver="every_block")).memfit_plan
    assert any(r.tail_after for r in with_tails.regions)
    assert Plan.from_dict(with_tails.to_dict()) == with_tails
    without = memfit.fit(copy.deepcopy(model), x, loss_fn=loss_fn, budget=0.9,
                         search=memfit.Search(solver="every_block", tails=False)).memfit_plan
    assert all(r.tail_after is None for r in without.regions)


def test_a_backward_that_builds_a_graph_through_a_tail_raises(net_profile) -> None:
    model, x, loss_fn, prof = net_profile
    planned = copy.deepcopy(model)
    apply_plan(planned, _every_block(prof, True))
    out = loss_fn(planned(x))
    with pytest.raises(MemfitError, match="create_graph=True"):
        torch.autograd.grad(out, list(planned.parameters()), create_graph=True)


def test_region_refuses_a_tail_on_a_segment_or_outside_its_module() -> None:
    with pytest.raises(ValueError, match="segment has no tail"):
        Region(("3", "4"), tail_after="3.bn3")
    with pytest.raises(ValueError, match="not one of its sub-modules"):
        Region(("3",), tail_after="4.bn3")
