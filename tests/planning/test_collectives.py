"""``memfit.planning.collectives``: what a plan's replays send again, and the planner's choice
between re-running a collective and keeping its output (NOTE [collectives in a region] in
``memfit.planning.rules``), on hand-made tensor-parallel blocks.

Each block is ``h2 = h + all_reduce(attn(0.5 * h))`` then ``out = h2 + all_reduce(mlp(norm(h2)))``,
as a Megatron block under TP: the attention's all-reduce feeds the norm, which saves its
input, so a replay runs it again; the MLP's all-reduce only feeds the last add, after the
replay's stop."""

from __future__ import annotations

import contextlib

import pytest
from profile_builders import TICK, StepBuilder

from memfit.planning.collectives import ReplayedCollectives, moves_data, replayed_collectives
from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate
from memfit.profiling.profile import Profile

ACT = 4096
ALL_REDUCE = "_c10d_functional.all_reduce.default"
KEY = f"{ALL_REDUCE}#0"  # the attention's all-reduce in a block's op keys


def _profile(comm_s: float, n_blocks: int = 2, *, attn_module: bool = True) -> Profile:
    """``attn_module=False``: the attention's ops run in the block's own forward (no
    submodule to checkpoint around the all-reduce)."""
    b = StepBuilder("tp")
    (h,) = b.op("aten.clone.default", [b.input(ACT)], ACT)
    b.container("layers", "ModuleList")
    for k in range(n_blocks):
        with b.module(f"layers.{k}", "Block", parent="layers"):
            w = b.param(512)
            # a scaling that saves nothing: the previous block's output is no saved tensor,
            # so that block's replay stops at its last save (as a real profile's packs say)
            (hs,) = b.op("aten.mul.Tensor", [h], ACT)
            with b.module(f"layers.{k}.attn", "Attention") if attn_module else contextlib.nullcontext():
                (u,) = b.op("aten.mm.default", [hs, w], 4 * ACT, saves=[hs, w], params=[w])
                (y,) = b.op("aten.mm.default", [u, w], ACT, saves=[u, w], params=[w])
                (r,) = b.op(ALL_REDUCE, [y], ACT, time_s=comm_s)
            (h2,) = b.op("aten.add.Tensor", [h, r], ACT)
            with b.module(f"layers.{k}.norm", "Norm"):
                (n,) = b.op("aten.native_layer_norm.default", [h2], ACT, saves=[h2])
            with b.module(f"layers.{k}.mlp", "MLP"):
                (m,) = b.op("aten.mm.default", [n, w], ACT, saves=[n, w], params=[w])
                (r2,) = b.op(ALL_REDUCE, [m], ACT, time_s=comm_s)
            (h,) = b.op("aten.add.Tensor", [h2, r2], ACT)
    b.op("aten.sum.default", [h], 4, keep_until_backward=True)
    return b.build()


def _block0(ops: dict | None = None) -> tuple[Region, ...]:
    return (Region(("layers.0",), ops or {}),)


@pytest.mark.parametrize("ops,count,saved", [
    ({}, 1, 0),                          # the attention's all-reduce replayed, the MLP's not
    ({KEY: OpPolicy.SAVE}, 0, 1),        # its output kept: nothing sent in the replay
], ids=["recompute", "keep-output"])
def test_replayed_collectives_of_one_block(ops, count, saved):
    prof = _profile(comm_s=8 * TICK)
    got = replayed_collectives(prof, _block0(ops))
    assert (got.count, got.saved) == (count, saved)
    assert got.nbytes == count * ACT
    assert got.by_region == ({"layers.0": (1, ACT)} if count else {})
    assert got.seconds == count * 8 * TICK
    assert ReplayedCollectives.from_dict(got.to_dict()) == got


def test_replay_time_counts_the_collective():
    prof = _profile(comm_s=8 * TICK)
    full = simulate(prof, Plan(_block0(), 0, 0.0, None, "hand", ""))
    kept = simulate(prof, Plan(_block0({KEY: OpPolicy.SAVE}), 0, 0.0, None, "hand", ""))
    # against keeping another output of the same size (one TICK of work): both are
    # selective regions with the same fixed charges, so only the skipped op's time differs
    other = simulate(prof, Plan(_block0({"aten.mm.default#1": OpPolicy.SAVE}), 0, 0.0, None, "hand", ""))
    assert other.recompute_s - kept.recompute_s == 7 * TICK
    assert kept.recompute_s < full.recompute_s
    assert kept.peak_bytes > full.peak_bytes  # the kept output is held until backward


def test_no_collectives_nothing_replayed():
    b = StepBuilder()
    with b.module("lin", "Linear"):
        (y,) = b.op("aten.mm.default", [b.input(64), b.param(64)], 64, saves=[0])
    b.op("aten.sum.default", [y], 4, keep_until_backward=True)
    assert replayed_collectives(b.build(), (Region(("lin",)),)) == ReplayedCollectives()


def test_planner_sends_nothing_again_when_it_can_and_replays_at_the_least_memory():
    """With a slow link and room for one activation per block, the fastest plan re-sends
    nothing (it keeps the all-reduce's output, or checkpoints around it); at the least
    memory it must replay a collective."""
    prof = _profile(comm_s=1000 * TICK)
    both = tuple(Region((f"layers.{k}",), {KEY: OpPolicy.SAVE}) for k in range(2))
    budget = simulate(prof, Plan(both, 0, 0.0, None, "hand", "")).peak_bytes
    roomy = plan_for_budget(prof, budget=budget, solver="milp")
    sent = replayed_collectives(prof, roomy.regions)
    assert sent.count == 0, roomy
    assert roomy.extra.get("collectives", ReplayedCollectives().to_dict()) == sent.to_dict()
    tight = plan_for_budget(prof, budget="min", solver="milp")
    assert tight.predicted_peak_bytes < roomy.predicted_peak_bytes
    assert replayed_collectives(prof, tight.regions).count >= 1


@pytest.mark.parametrize("comm_ticks,keeps", [(1000, True), (0, False)], ids=["slow-link", "free-link"])
def test_planner_keeps_the_all_reduce_output_when_replaying_it_costs_more(comm_ticks, keeps):
    """Blocks without an attention submodule (nothing to checkpoint around the all-reduce),
    at the peak of whole blocks that keep their attention's all-reduce output: over a slow
    link the plan keeps it (Megatron's selective recompute, nothing sent again); over a free
    one it re-runs the all-reduce and keeps other outputs instead."""
    prof = _profile(comm_s=comm_ticks * TICK, attn_module=False)
    kept = tuple(Region((f"layers.{k}",), {KEY: OpPolicy.SAVE}) for k in range(2))
    budget = simulate(prof, Plan(kept, 0, 0.0, None, "hand", "")).peak_bytes
    plan = plan_for_budget(prof, budget=budget, solver="milp")
    sent = replayed_collectives(prof, plan.regions)
    assert plan.predicted_peak_bytes <= budget < prof.peak_bytes
    blocks = [r for r in plan.regions if r.modules[0].count(".") == 1]
    assert blocks, plan  # a whole block: the budget needs one
    if keeps:
        assert all(KEY in r.save for r in blocks), plan
        assert (sent.count, sent.saved) == (0, len(blocks))
    else:
        assert not any(KEY in r.save for r in plan.regions), plan
        assert (sent.count, sent.saved) == (len(blocks), 0)
    # by the time model, the same regions with the other choice are slower (a free link:
    # no faster, and keeping the output costs its bytes until backward)
    flipped = tuple(Region(r.modules, {**{k: p for k, p in r.ops if k != KEY}, **({} if keeps else {KEY: OpPolicy.SAVE})})
                    for r in plan.regions)
    other = simulate(prof, Plan(flipped, 0, 0.0, None, "hand", ""))
    assert plan.recompute_s < other.recompute_s if keeps else plan.recompute_s <= other.recompute_s


@pytest.mark.parametrize("name,moves", [
    (ALL_REDUCE, True), ("_c10d_functional.all_gather_into_tensor.default", True),
    ("_c10d_functional.wait_tensor.default", False),
    ("_c10d_functional._wrap_tensor_autograd.default", False), ("aten.mm.default", False),
], ids=["all_reduce", "all_gather", "wait", "wrap", "aten"])
def test_moves_data(name, moves):
    assert moves_data(name) is moves
