"""``memfit.integrations.deepspeed_peak``: the step's peak with the gradients moved into
DeepSpeed's buffers (NOTE [DeepSpeed's gradients in the timeline]); no DeepSpeed needed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from memfit.integrations.deepspeed_peak import partition_elements, step_peak
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate
from memfit.profiling.profile import StorageKind
from memfit.profiling.tracer import trace


@pytest.mark.parametrize(("numels", "world", "rank", "expected"), [
    ([6, 4, 2], 2, 0, 6),     # flat 12, slices [0, 6) and [6, 12): the 6
    ([6, 4, 2], 2, 1, 6),     # the 4 and the 2
    ([5, 4, 3], 2, 0, 9),     # [0, 6): the 5 and the 4 that starts at 5, whole
    ([5, 4, 3], 2, 1, 7),     # [6, 12): the 4 (from 5 to 9) and the 3
    ([7], 2, 1, 7),           # padded to 8: [4, 8) holds the 7's tail
    ([1, 1, 1], 4, 3, 0),     # padded to 8, slices of 2: [6, 8) is padding only
], ids=["even-0", "even-1", "straddle-0", "straddle-1", "one-param", "padding"])
def test_the_partition_holds_every_parameter_it_overlaps(numels: list[int], world: int, rank: int,
                                                         expected: int) -> None:
    assert partition_elements(numels, world, rank) == expected


@pytest.fixture(scope="module")
def step() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 8))
    profile = trace(model, torch.randn(32, 64), repeats=1)
    plan = plan_for_budget(profile, budget=1.0)  # nothing checkpointed: the plain step
    sim = simulate(profile, plan)
    grads = sorted((s.created_by, s.nbytes) for s in profile.storages
                   if s.kind == StorageKind.GRADIENT and s.freed_after is None)
    return profile, plan, sim, grads


def test_the_plain_timeline_with_nothing_moved_is_the_plans_peak(step: tuple) -> None:
    profile, plan, sim, grads = step
    # every weight and bias (float32): 64*256+256 + 256*256+256 + 256*8+8 elements
    assert sum(n for _, n in grads) == 4 * (16640 + 65792 + 2056)
    # ZeRO-1 with no buffers: the gradients stay where autograd made them
    assert step_peak(profile, plan, stage=1, bucket_bytes=0, partition_bytes=0) == sim.peak_bytes


def test_zero2_and_3_free_each_gradient_after_its_hook(step: tuple) -> None:
    profile, plan, sim, grads = step
    live = list(zip(sim.positions, sim.live_bytes, strict=True))
    # by hand: at each op, the live bytes less the gradients made at earlier ops
    expected = max(b - sum(n for at, n in grads if at < i) for i, b in live)
    expected = max(expected, sim.live_bytes[-1] - sum(n for _, n in grads))
    assert step_peak(profile, plan, stage=3, bucket_bytes=0, partition_bytes=0) == expected
    assert expected < sim.peak_bytes  # the peak is in backward, after the first gradient
    assert step_peak(profile, plan, stage=2, bucket_bytes=0, partition_bytes=0) == expected
    # ZeRO-3's gathered parameters: a constant on top
    assert step_peak(profile, plan, stage=3, bucket_bytes=0, partition_bytes=0,
                     gathered_bytes=1000) == expected + 1000


def test_the_bucket_counts_from_the_first_gradient_and_the_partition_from_the_first_reduction(
        step: tuple) -> None:
    profile, plan, sim, grads = step
    first = grads[0][0]
    before = max(b for i, b in zip(sim.positions, sim.live_bytes, strict=True) if i < first)
    bucket = 10**9  # larger than any gradient total: no reduction until backward ends
    # ZeRO-1: live + bucket from the first gradient on; the end (all gradients, the bucket,
    # the partition less the gradients copied) is lower here
    after = max(b for i, b in zip(sim.positions, sim.live_bytes, strict=True) if i >= first)
    assert step_peak(profile, plan, stage=1, bucket_bytes=bucket, partition_bytes=8) == max(
        before, after + bucket, sim.live_bytes[-1] + 8)
    # ZeRO-2, a bucket of 1 byte: the first gradient already reduces, so bucket and
    # partition count from the first gradient on, with the gradients made before freed
    moved = max(b - sum(n for at, n in grads if at < i)
                for i, b in zip(sim.positions, sim.live_bytes, strict=True) if i >= first)
    end = sim.live_bytes[-1] - sum(n for _, n in grads)
    assert step_peak(profile, plan, stage=2, bucket_bytes=1, partition_bytes=500_000) == max(
        before, moved + 1 + 500_000, end + 1 + 500_000)


def test_a_plan_the_profile_does_not_reproduce_gives_none(step: tuple) -> None:
    profile, plan, _, _ = step
    other = dataclasses.replace(plan, predicted_peak_bytes=plan.predicted_peak_bytes + 1)
    assert step_peak(profile, other, stage=2, bucket_bytes=4, partition_bytes=4) is None
