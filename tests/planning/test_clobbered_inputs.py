"""NOTE [clobbered inputs]: a module or segment whose input is written in place once it has
started is no candidate region; the same structure without the write is one."""

from __future__ import annotations

import dataclasses

import pytest
from profile_builders import StepBuilder

from memfit.planning.candidates import PlanningContext
from memfit.planning.rules import clobbered_inputs, in_place_writes
from memfit.profiling.profile import Profile

ACT = 4096  # bytes of one (tokens, d) activation


def _profile(write: str) -> Profile:
    """Embed, then blocks ``layers.0..2`` of ``fc2(gelu(fc1(x * 0.5)))``; ``write`` says which
    in-place write the parent or the blocks do:

    - ``"none"``: ``h = h + block(h)`` (no write);
    - ``"parent_iadd"``: ``h += block(h)`` after every block (writes each block's input);
    - ``"relu_input"``: each block starts with ``relu_`` on its input;
    - ``"after_last"``: ``h = block(h)`` for all blocks, then the parent writes the first
      block's input (a segment's input written after the segment ended).
    """
    b = StepBuilder("inplace")
    tokens = b.input(64)
    with b.module("embed", "Embedding"):
        (h,) = b.op("aten.embedding.default", [tokens], ACT, saves=[tokens])
    first_input = h
    b.container("layers", "ModuleList")
    inputs: dict[str, tuple[int, ...]] = {}
    for k in range(3):
        path = f"layers.{k}"
        inputs[path] = (h,)
        with b.module(path, "Block", parent="layers"):
            x = h
            if write == "relu_input":
                (x,) = b.op("aten.relu_.default", [x], inplace=True, saves=[x])
            (a,) = b.op("aten.mul.Tensor", [x], ACT)
            (u,) = b.op("aten.mm.default", [a], 4 * ACT, saves=[a], params=[b.param(1024)])
            (g,) = b.op("aten.gelu.default", [u], 4 * ACT, saves=[u])
            (y,) = b.op("aten.mm.default", [g], ACT, saves=[g], params=[b.param(1024)])
        if write == "parent_iadd":
            (h,) = b.op("aten.add_.Tensor", [h, y], inplace=True)
        elif write == "none":
            (h,) = b.op("aten.add.Tensor", [h, y], ACT)
        else:
            h = y
    if write == "after_last":
        b.op("aten.mul_.Scalar", [first_input], inplace=True)
    b.op("aten.sum.default", [h], 4, keep_until_backward=True)
    prof = b.build()
    # StepBuilder leaves module inputs empty; the tracer records them.
    mods = tuple(dataclasses.replace(m, inputs=inputs.get(m.path, ())) for m in prof.modules)
    return dataclasses.replace(prof, modules=mods)


# (write, region, whether it is a candidate)
CASES = {
    "no_write-block": ("none", ("layers.0",), True),
    "no_write-segment": ("none", ("layers.1", "layers.2"), False),  # parent's add between them
    "parent_iadd-block0": ("parent_iadd", ("layers.0",), False),
    "parent_iadd-block2": ("parent_iadd", ("layers.2",), False),
    "relu_input-block1": ("relu_input", ("layers.1",), False),
    "relu_input-segment": ("relu_input", ("layers.0", "layers.1"), False),
    "after_last-block0": ("after_last", ("layers.0",), False),
    "after_last-block1": ("after_last", ("layers.1",), True),
    "after_last-segment01": ("after_last", ("layers.0", "layers.1"), False),
    "after_last-segment12": ("after_last", ("layers.1", "layers.2"), True),
}


@pytest.mark.parametrize("write,region,ok", CASES.values(), ids=CASES.keys())
def test_candidate_regions(write, region, ok):
    ctx = PlanningContext(_profile(write))
    assert (ctx.candidate(region) is not None) is ok


def test_clobbered_inputs_names_the_written_storage():
    prof = _profile("parent_iadd")
    writes = in_place_writes(prof)
    block0 = prof.module("layers.0")
    (h,) = block0.inputs
    # three add_ write h: the last one after block 2
    assert writes[h] == prof.module("layers.2").last_op + 1
    assert clobbered_inputs(prof, [block0]) == (h,)
    assert clobbered_inputs(_profile("none"), [_profile("none").module("layers.0")]) == ()
