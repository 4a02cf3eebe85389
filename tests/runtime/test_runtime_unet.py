"""Regression: a plan over the zoo 3D UNet whose segment spans decoder blocks.

The decoder calls ``up[i]`` from a loop with ``upconv[i]`` and ``torch.cat`` in between, so a
chain segment over ``up.0..up.1`` is cut at its first step (NOTE [chain segments]). The
transposed convolution between the blocks saves its input and weight for backward; those
used to be packed by the still-open checkpoint, which the replay never recomputes, and
backward raised torch's CheckpointError ("a different number of tensors was saved during
the original forward and recomputation"). NOTE [chain segments] in memfit.runtime.segment, rule 5.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from runtime_helpers import assert_bitwise_twin

from memfit.errors import InfeasibleBudget
from memfit.runtime import policies as P
from memfit.runtime.apply import apply_plan
from memfit.runtime.segment import checkpoint_segment
from memfit.zoo import example_inputs, unet3d


def _unet_pair(base: int, depth: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = unet3d(base=base, depth=depth, seed=0).train()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("policy", [None, P.save_ops("aten.relu")], ids=["recompute_all", "save_relu"])
def test_segment_over_decoder_blocks_is_exact_from_the_first_step(policy, caplog):
    model, twin = _unet_pair(base=2, depth=2)
    handle = checkpoint_segment(model.up, [0, 1], policy)
    x = example_inputs(model, batch=1, size=8, seed=0).requires_grad_()
    with caplog.at_level(logging.WARNING, logger="memfit.runtime.segment"):
        assert_bitwise_twin(model, twin, (x,), steps=2)
    assert handle.cuts == {1}
    assert sum("the parent ran tensor ops" in r.message for r in caplog.records) == 1


@pytest.mark.slow
def test_min_budget_plan_of_unet3d_trains_bitwise_equal():
    from memfit.planning.planner import plan_for_budget
    from memfit.profiling.tracer import trace

    model, twin = _unet_pair(base=4, depth=3)
    x = example_inputs(model, batch=1, size=16, seed=0)
    prof = trace(model, x)
    with pytest.raises(InfeasibleBudget) as info:
        plan_for_budget(prof, budget=1)
    p = plan_for_budget(prof, budget=info.value.min_feasible_bytes)
    # This once planned a segment over decoder blocks the parent runs ops between (the case
    # the test above covers); the planner now ends chains there, so no plan spans them.
    assert p.regions and not any(r.modules == ("up.0", "up.1") for r in p.regions), p.regions
    apply_plan(model, p)
    assert_bitwise_twin(model, twin, (x,), steps=2)
