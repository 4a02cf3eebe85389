"""NOTE [collectives in a region]: a module or segment whose forward runs a collective that must
not re-run (FSDP's all-gather) is no candidate region; the same structure with an ordinary op, or a
functional collective, instead is one.

The profiles mimic a model sharded by ``fully_shard`` per block: before each block, its
parent gathers the block's weight into a fresh buffer (``empty`` + an in-place gather op),
as FSDP2's pre-forward hook does; the profile puts those ops on the parent."""

from __future__ import annotations

import pytest
from profile_builders import StepBuilder

from memfit.planning.candidates import PlanningContext
from memfit.planning.rules import clobbered_inputs, collective_writes, is_collective, must_not_rerun
from memfit.profiling.profile import Profile

ACT = 4096  # bytes of one (tokens, d) activation
GATHER = "c10d._allgather_base_.default"


def _profile(gather: str) -> Profile:
    """``trunk`` holds blocks ``trunk.layers.0..2``; before each, the trunk fills a weight
    buffer with ``gather`` (a collective, or ``aten.fill_.Scalar``)."""
    b = StepBuilder("sharded")
    tokens = b.input(64)
    with b.module("embed", "Embedding"):
        (h,) = b.op("aten.embedding.default", [tokens], ACT, saves=[tokens])
    with b.module("trunk", "Trunk"):
        b.container("trunk.layers", "ModuleList")
        for k in range(3):
            (w,) = b.op("aten.empty.memory_format", [], 1024)
            b.op(gather, [w, b.param(512)], inplace=True)
            with b.module(f"trunk.layers.{k}", "FSDPBlock", parent="trunk.layers"):
                (u,) = b.op("aten.mm.default", [h, w], 4 * ACT, saves=[h, w])
                (g,) = b.op("aten.gelu.default", [u], 4 * ACT, saves=[u])
                (y,) = b.op("aten.mm.default", [g, w], ACT, saves=[g, w])
            (h,) = b.op("aten.add.Tensor", [h, y], ACT)
    b.op("aten.sum.default", [h], 4, keep_until_backward=True)
    return b.build()


# (region, whether it is a candidate with a collective gather, and with an ordinary op)
CASES = {
    "block": (("trunk.layers.1",), True, True),
    "module-holding-blocks": (("trunk",), False, True),
    "segment": (("trunk.layers.0", "trunk.layers.1"), False, False),  # parent ops between
}


@pytest.mark.parametrize("region,with_collective,with_plain_op", CASES.values(), ids=CASES.keys())
def test_candidate_regions(region, with_collective, with_plain_op):
    assert (PlanningContext(_profile(GATHER)).candidate(region) is not None) is with_collective
    assert (PlanningContext(_profile("aten.fill_.Scalar")).candidate(region) is not None) is with_plain_op


def test_collective_writes_names_the_gathered_buffers():
    prof = _profile(GATHER)
    trunk = prof.module("trunk")
    gathers = [op for op in prof.forward_ops if is_collective(op)]
    assert len(gathers) == 3
    written = tuple(op.outputs[0].storage for op in gathers)
    assert collective_writes(prof, trunk.first_op, trunk.last_op) == written
    assert clobbered_inputs(prof, [trunk]) == written
    block = prof.module("trunk.layers.1")
    assert collective_writes(prof, block.first_op, block.last_op) == ()
    assert collective_writes(_profile("aten.fill_.Scalar"), trunk.first_op, trunk.last_op) == ()


@pytest.mark.parametrize("name,collective", [
    (GATHER, True), ("_c10d_functional.all_gather_into_tensor.default", True),
    ("fsdp.split_with_sizes_copy.default", True), ("aten.split_with_sizes_copy.out", False),
], ids=["c10d", "functional", "fsdp", "aten"])
def test_is_collective_by_namespace(name, collective):
    prof = _profile(name)
    assert any(is_collective(op) for op in prof.ops) is collective


def test_functional_collectives_may_rerun():
    """A functional collective (TP's all-reduce, a DTensor redistribution) re-runs in the
    replay: the regions around it are candidates, as with an ordinary op."""
    prof = _profile("_c10d_functional.all_gather_into_tensor.default")
    for region in CASES.values():
        got = PlanningContext(prof).candidate(region[0]) is not None
        assert got is region[2], region
    assert collective_writes(prof, 0, prof.n_forward - 1) == ()


@pytest.mark.parametrize("name,refused", [
    (GATHER, True), ("fsdp.split_with_sizes_copy.default", True),
    ("c10d.allreduce_.default", True), ("_c10d_functional.all_reduce.default", False),
    ("aten.mm.default", False),
], ids=["c10d-gather", "fsdp", "c10d-allreduce", "functional", "aten"])
def test_must_not_rerun(name, refused):
    assert must_not_rerun(name) is refused
