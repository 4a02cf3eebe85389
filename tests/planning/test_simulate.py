"""simulate(): the no-plan timeline, hand-computed plans (exact bytes), and plan validation."""

from __future__ import annotations

import random

import pytest
from profile_builders import (
    TICK,
    StepBuilder,
    chain_profile,
    decoder_profile,
    random_chain,
    random_unet,
    residual_block,
)

from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.planning.rules import is_kept_draw, is_saveable, op_keys
from memfit.planning.simulate import simulate
from memfit.timemodel.calibration import (
    DEFAULT_OP_S,
    DEFAULT_REGION_S,
    DEFAULT_SELECTIVE_OP_S,
    Calibration,
)


def _plan(*regions: Region) -> Plan:
    return Plan(tuple(regions), 0, 0.0, None, "test", "")


@pytest.mark.parametrize("make", [
    lambda: chain_profile([residual_block([64, 128])] * 3),
    lambda: decoder_profile(3),
    lambda: random_unet(random.Random(3), max_levels=3),
    lambda: random_chain(random.Random(5)),
], ids=["chain3", "decoder3", "unet", "random-chain"])
def test_no_plan_reproduces_profile_timeline(make):
    prof = make()
    sim = simulate(prof, _plan())
    assert sim.live_bytes == prof.live_bytes
    assert sim.peak_bytes == prof.peak_bytes
    assert sim.recompute_s == 0.0
    assert sim.positions == tuple(range(len(prof.ops)))


# Three residual blocks (mm 64 B -> gelu 128 B -> add 64 B), activations 64 B.
# Ops: 0 embed, 1-3 layers.0, 4-6 layers.1, 7-9 layers.2, 10 head, 11 loss; 12-23 backward.
# layers.0: h1 (mm output, 64 B, saved by gelu) is dropped after op 3 and recomputed before
# op 21 (gelu backward, its first unpack); gelu's output h2 (128 B) is a transient; the add's
# output x1 escapes into layers.1. Just before op 21, the live storages are x0 (64 B, saved by
# layers.0's mm until op 22) and the gradient made by op 20 (64 B): 128 B.
@pytest.fixture
def chain3():
    return chain_profile([residual_block([64, 128])] * 3)


def test_hand_computed_recompute_all(chain3):
    sim = simulate(chain3, _plan(Region(("layers.0",))))
    plain = list(chain3.live_bytes)
    expect = [v - 64 if 4 <= p <= 20 else v for p, v in enumerate(plain)]
    expect[21:21] = [128 + 64, 128 + 64 + 128, 128 + 64 + 128 + 64]  # replay of ops 1, 2, 3
    assert list(sim.live_bytes) == expect
    assert sim.recompute_points == (21,)
    assert sim.peak_bytes == 512 and chain3.peak_bytes == 576
    # 3 ops rerun, 1 region of 3 forward ops, each checked (NOTE [dispatch overhead])
    assert sim.recompute_s == 3 * TICK + DEFAULT_REGION_S + 3 * DEFAULT_OP_S
    assert sim.region_saved_bytes == (64,)  # the input x0, held for the replay


def test_hand_computed_save_the_matmul(chain3):
    # mm saved: h1 stays (cached until its plain free at op 21), the replay skips op 1
    sim = simulate(chain3, _plan(Region.saving(("layers.0",), ("aten.mm.default#0",))))
    expect = list(chain3.live_bytes)
    expect[21:21] = [192, 192 + 128, 192 + 128 + 64]
    assert list(sim.live_bytes) == expect
    # saving an op runs the selective modes over all 3 forward ops
    assert sim.recompute_s == 2 * TICK + DEFAULT_REGION_S + 3 * (DEFAULT_OP_S + DEFAULT_SELECTIVE_OP_S)
    assert sim.region_saved_bytes == (64 + 64,)


def test_hand_computed_save_the_transient(chain3):
    # gelu saved: its output (128 B, plainly freed after op 3) stays in the cache until the
    # replay before op 21, which takes it out and frees it after op 3's replay step, its last
    # use there (NOTE [cached transients]): not live at op 21 itself
    sim = simulate(chain3, _plan(Region.saving(("layers.0",), ("aten.gelu.default#0",))))
    plain = list(chain3.live_bytes)
    expect = [v + 64 if 4 <= p <= 20 else v for p, v in enumerate(plain)]
    expect[21:21] = [256 + 64, 256 + 64, 256 + 64 + 64]
    assert list(sim.live_bytes) == expect
    assert sim.recompute_s == 2 * TICK + DEFAULT_REGION_S + 3 * (DEFAULT_OP_S + DEFAULT_SELECTIVE_OP_S)


def test_str_of_a_simulation_is_a_table_like_the_plan_s(chain3):
    """print(memfit.simulate(...)) printed the dataclass repr (issue #39)."""
    from memfit.units import format_seconds

    sim = simulate(chain3, _plan(Region(("layers.0",)), Region(("layers.1", "layers.2"))))
    first, second = (format_seconds(s) for s in sim.region_recompute_s)
    assert str(sim).splitlines() == [
        f"memfit simulation: peak 576 B at op 15, recompute +{format_seconds(sim.recompute_s)}",
        f"  region              saved  {'recompute':>{len(first)}}  FLOPs  replayed at",
        f"  layers.0             64 B  {first:>9}      -        op 21",
        f"  layers.1..layers.2   64 B  {second:>9}      -        op 15",
    ]
    assert str(simulate(chain3, _plan())).splitlines()[1] == "  no checkpointing: every activation is kept"


def test_segment_replays_all_blocks(chain3):
    sim = simulate(chain3, _plan(Region(("layers.0", "layers.1", "layers.2"))))
    assert sim.recompute_s == 9 * TICK + DEFAULT_REGION_S + 9 * DEFAULT_OP_S  # one segment: one region
    assert sim.recompute_points == (15,)  # layers.2's gelu backward
    assert len(sim.live_bytes) == len(chain3.ops) + 9


def test_nested_or_overlapping_regions_rejected(chain3):
    with pytest.raises(ValueError, match="overlap or nest"):
        simulate(chain3, _plan(Region(("layers.0", "layers.1")), Region(("layers.1", "layers.2"))))
    with pytest.raises(ValueError, match="overlap or nest"):  # a segment inside a segment
        simulate(chain3, _plan(Region(("layers.0", "layers.1", "layers.2")), Region(("layers.0", "layers.1"))))


def test_a_block_nested_in_its_segment_replays_twice(chain3):
    """NOTE [nested segments]: the segment's replay reruns its first two blocks (the third's
    call refills its frame: torch ends the replay there), then each block's own replay reruns
    it again."""
    seg = Region(("layers.0", "layers.1", "layers.2"))
    alone = simulate(chain3, _plan(seg))
    sim = simulate(chain3, _plan(seg, *(Region((f"layers.{i}",)) for i in range(3))))
    assert sim.region_recompute_s[0] == alone.recompute_s - 3 * TICK
    assert sim.region_recompute_s[1:] == (3 * TICK + DEFAULT_REGION_S + 3 * DEFAULT_OP_S,) * 3
    assert sim.recompute_points[0] == alone.recompute_points[0] == sim.recompute_points[3]


def test_unknown_key_and_module_rejected(chain3):
    with pytest.raises(ValueError, match="no such occurrence"):
        simulate(chain3, _plan(Region.saving(("layers.0",), ("aten.mm.default#1",))))
    with pytest.raises(ValueError, match="does not have"):
        simulate(chain3, _plan(Region(("layers.9",))))


def _dropout_profile():
    b = StepBuilder()
    x = b.input(64)
    with b.module("blk", "Block"):
        (h,) = b.op("aten.mm.default", [x], 64, saves=[x])
        (m,) = b.op("aten.relu_.default", [h], inplace=True)
        (d,) = b.op("aten.native_dropout.default", [h], 64, random=True, saves=[])
        (v,) = b.op("aten.view.default", [d], view=True)
        (y,) = b.op("aten.detach.default", [v], 64)
        (z,) = b.op("aten.relu.default", [v], 64)
        b._ops[-1].saves.append(z)
    b.op("aten.sum.default", [z], 4, keep_until_backward=True)
    return b.build()


@pytest.mark.parametrize("key,why", [
    ("aten.relu_.default#0", "writes to an input"),
    ("aten.native_dropout.default#0", "consumes the RNG"),
    ("aten.view.default#0", "view or alias"),
], ids=["inplace", "random", "view"])
def test_unsaveable_ops_rejected(key, why):
    prof = _dropout_profile()
    with pytest.raises(ValueError, match=why):
        simulate(prof, _plan(Region.saving(("blk",), (key,))))


def _draw_profile():
    """A block whose ``drop`` draws into a tensor it made (``empty_like``) and into the mm's
    output, made before ``drop`` started."""
    b = StepBuilder()
    x = b.input(64)
    with b.module("blk", "Block"):
        (h,) = b.op("aten.mm.default", [x], 64, saves=[x])
        with b.module("blk.drop", "Dropout", parent="blk"):
            (m,) = b.op("aten.empty_like.default", [h], 64)
            b.op("aten.bernoulli_.float", [m], inplace=True, random=True, time_s=8 * TICK)
            b.op("aten.bernoulli_.float", [h], inplace=True, random=True, time_s=8 * TICK)
            (z,) = b.op("aten.mul.Tensor", [m, h], 64, saves=[m, h])
            (y,) = b.op("aten.relu.default", [z], 64, saves=[z])  # the replay runs to the mul
    b.op("aten.sum.default", [y], 4, keep_until_backward=True)
    return b.build()


def test_a_kept_draw_holds_its_copy_and_skips_its_rerun():
    """NOTE [kept draws]: keeping the first draw (16 float elements) holds 16 B from the
    draw to its replay step and saves its rerun, less what keeping costs per element."""
    prof = _draw_profile()
    assert [is_kept_draw(prof, op) for op in prof.ops[:5]] == [False, False, True, True, False]
    plain = simulate(prof, _plan(Region(("blk",))))
    kept = simulate(prof, _plan(Region.saving(("blk",), ("aten.bernoulli_.float#0",))))
    keep_s = 16 * Calibration().keep_s_per_element
    assert kept.recompute_s == plain.recompute_s - 8 * TICK + keep_s + DEFAULT_SELECTIVE_OP_S * 6
    assert [v - w for v, w in zip(kept.live_bytes[:prof.n_forward], plain.live_bytes, strict=False)
            ] == [0, 0, 16, 16, 16, 16, 16]  # from the draw to the end of forward
    assert kept.peak_bytes >= plain.peak_bytes


def test_a_draw_into_a_tensor_made_before_its_region_is_not_kept():
    prof = _draw_profile()
    simulate(prof, _plan(Region.saving(("blk",), ("aten.bernoulli_.float#1",))))  # made in blk
    with pytest.raises(ValueError, match="made before the region"):
        simulate(prof, _plan(Region.saving(("blk.drop",), ("aten.bernoulli_.float#1",))))


def test_rules_and_keys():
    prof = _dropout_profile()
    keys = op_keys(prof, 0, 5)
    assert keys == {0: "aten.mm.default#0", 1: "aten.relu_.default#0",
                    2: "aten.native_dropout.default#0", 3: "aten.view.default#0",
                    5: "aten.relu.default#0"}  # detach gets no key (torch never asks about it)
    assert [is_saveable(prof, op) for op in prof.ops[:6]] == [True, False, False, False, False, True]
    assert not any(is_saveable(prof, op) for op in prof.backward_ops)


# chain3 again, with a 32 B kernel workspace on each block's mm (ops 1, 4, 7) and on its
# backward op (22, 19, 16): counted at those positions only, never "just before" a position,
# and again in a replay that reruns the mm.
@pytest.fixture
def chain3_ws():
    return chain_profile([residual_block([64, 128], workspaces=[32, 0])] * 3)


def test_workspace_counts_at_its_ops_only(chain3, chain3_ws):
    ws_at = {1, 4, 7, 16, 19, 22}
    assert [op.index for op in chain3_ws.ops if op.workspace_bytes] == sorted(ws_at)
    assert list(chain3_ws.live_bytes) == [v + 32 * (p in ws_at) for p, v in enumerate(chain3.live_bytes)]
    sim = simulate(chain3_ws, _plan())
    assert sim.live_bytes == chain3_ws.live_bytes
    # the peak stays at op 9 (576 B), no workspace there; op 7 rises from 384 to 416
    assert sim.peak_bytes == chain3_ws.peak_bytes == 576 and chain3_ws.live_bytes[7] == 384 + 32


def test_hand_computed_recompute_all_with_workspace(chain3, chain3_ws):
    sim = simulate(chain3_ws, _plan(Region(("layers.0",))))
    ws_at = {1, 4, 7, 16, 19, 22}
    expect = [v - 64 * (4 <= p <= 20) + 32 * (p in ws_at) for p, v in enumerate(chain3.live_bytes)]
    # replay of ops 1 (mm reruns: its workspace again), 2, 3; just before op 21: 128 B
    expect[21:21] = [128 + 64 + 32, 128 + 64 + 128, 128 + 64 + 128 + 64]
    assert list(sim.live_bytes) == expect
    assert sim.peak_bytes == 512  # at op 9; the replayed mm reaches 128 + 64 + 32 only


def test_hand_computed_saved_op_skips_its_workspace(chain3, chain3_ws):
    # mm saved: the replay returns its cached output without running the kernel
    sim = simulate(chain3_ws, _plan(Region.saving(("layers.0",), ("aten.mm.default#0",))))
    ws_at = {1, 4, 7, 16, 19, 22}
    expect = [v + 32 * (p in ws_at) for p, v in enumerate(chain3.live_bytes)]
    expect[21:21] = [192, 192 + 128, 192 + 128 + 64]
    assert list(sim.live_bytes) == expect


def test_offload_needs_a_host_link(chain3):
    """OFFLOAD is simulated (tests/planning/test_offload.py); on a CPU profile, with no link
    given, simulate refuses to time its copies."""
    region = Region(("layers.0",), {"aten.mm.default#0": OpPolicy.OFFLOAD})
    with pytest.raises(ValueError, match="has no host link"):
        simulate(chain3, _plan(region))
