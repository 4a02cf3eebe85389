"""A scaled-down ResNet-50 (torchvision's layout: a stem with an in-place ReLU, stages of
bottlenecks) planned at its smallest peak: the stem is a block of the chain (its in-place ReLU
merged with the norm before it), segments hold their blocks checkpointed inside them (NOTE
[nested segments] in memfit.planning.nesting), and the planned step is the plain one bit for
bit at the peak predicted."""

from __future__ import annotations

import copy

import pytest
import torch
from benchmarks.published import Bottleneck
from test_predicted_peaks import (
    ALLOC_REL_TOL,
    REL_TOL,
    _measured_peaks,
    _seen_by_dispatch,
    _without_workspaces,
)
from torch import nn

from memfit import InfeasibleBudget
from memfit.planning.candidates import PlanningContext
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate
from memfit.planning.solvers import chain
from memfit.profiling.tracer import trace
from memfit.runtime.apply import apply_plan, unapply


def small_resnet(stages: tuple[int, ...] = (3, 4, 6), width: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    c = width
    for i, n in enumerate(stages):
        blocks = []
        for k in range(n):
            blocks.append(Bottleneck(c, width << i, 2 if k == 0 and i > 0 else 1))
            c = (width << i) * 4
        layers.append(nn.Sequential(*blocks))
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


@pytest.fixture(scope="module")
def planned():
    model = small_resnet()
    x = torch.randn(2, 3, 64, 64)
    p = trace(model, x, repeats=1)
    with pytest.raises(InfeasibleBudget) as err:  # the chain DP has no time limit
        plan_for_budget(p, budget=1, solver="chain")
    return model, x, p, plan_for_budget(p, budget=err.value.min_feasible_bytes, solver="chain")


def test_the_stem_with_its_inplace_relu_is_a_block(planned):
    _, _, p, plan = planned
    blocks = chain.main_chain(PlanningContext(p)).blocks
    assert blocks[0] == ("0", "1", "2")  # conv, norm, the in-place relu that writes the norm's output
    assert blocks[1:4] == (("3",), ("4.0",), ("4.1",))
    assert any(r.modules[0] == "0" for r in plan.regions)  # the smallest peak reruns the stem


def test_smallest_peak_nests_blocks_in_segments_bitwise_at_the_predicted_peak(planned):
    model, x, p, plan = planned
    segs = [r for r in plan.regions if r.is_segment]
    nested = [s for s in segs if all(any(r.modules == (m,) for r in plan.regions) for m in s.modules)]
    assert nested, [r.name for r in plan.regions]
    metered, twin = copy.deepcopy(model), copy.deepcopy(model)
    predicted = simulate(p, plan).peak_bytes
    predicted_tensors = simulate(_without_workspaces(p), _seen_by_dispatch(plan)).peak_bytes
    apply_plan(metered, plan)
    tracked, allocated = _measured_peaks(metered, x)
    assert abs(tracked - predicted_tensors) <= REL_TOL * predicted_tensors, (tracked, predicted_tensors)
    # the full prediction (kernel workspaces included) against the CPU allocator: at or above
    # it (measured here 2.1% above: 399,960 B allocated, 408,640 B predicted), within 1.5x the
    # tolerance of test_predicted_peaks
    assert predicted - 1.5 * ALLOC_REL_TOL * predicted <= allocated <= predicted, (allocated, predicted)
    apply_plan(model, plan)
    try:
        model(x).sum().backward()
    finally:
        unapply(model)
    twin(x).sum().backward()
    for (n, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), n
    for (n, a), (_, b) in zip(model.named_buffers(), twin.named_buffers(), strict=True):
        assert torch.equal(a, b), n


def test_fit_at_the_smallest_peak_verifies_bitwise():
    """``fit(budget="min")`` to ``verify``: the plan with nested segments (the chain DP's, the
    one ``"min"`` returns here) is the plain step bit for bit, within its budget."""
    import memfit

    model = small_resnet()
    x = torch.randn(2, 3, 64, 64)
    memfit.fit(model, x, budget="min")
    plan = model.memfit_plan
    assert any(r.is_segment and any(q.modules == (r.modules[0],) for q in plan.regions)
               for r in plan.regions), [r.name for r in plan.regions]
    report = memfit.verify(model, x)
    assert report.ok and report.bitwise, str(report)
    assert report.peak_bytes <= report.budget_bytes


def test_steps_after_the_checked_calls_stay_bitwise_at_the_same_peak(planned):
    """Calls after the divergence check's first ones run the blocks' batch norms without the
    buffer watcher (NOTE [batch norms without the watcher]); nested in segments, over five
    steps, the gradients and every statistic stay the plain step's, and the memory of a step
    after them is the first step's."""
    model, x, _, plan = planned
    planned_model, twin, metered = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    apply_plan(planned_model, plan)
    for step in range(5):
        for m in (planned_model, twin):
            for p in m.parameters():
                p.grad = None
            m(x).sum().backward()
        for (n, a), (_, b) in zip(planned_model.named_parameters(), twin.named_parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), (step, n)
        for (n, a), (_, b) in zip(planned_model.named_buffers(), twin.named_buffers(), strict=True):
            assert torch.equal(a, b), (step, n)
    apply_plan(metered, plan)
    first = _measured_peaks(metered, x)
    for _ in range(3):
        metered(x).sum().backward()
    assert _measured_peaks(metered, x) == first
