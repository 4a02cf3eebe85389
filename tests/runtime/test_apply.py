"""memfit.runtime.apply: a Plan applied in place, refused when it does not fit the model."""

from __future__ import annotations

import copy

import pytest
import torch
from runtime_helpers import CallCounter, TinyGPT, assert_bitwise_twin, conv_net, pair

from memfit.errors import PlanMismatch, WrapError
from memfit.planning.plan import Plan, Region
from memfit.runtime.apply import apply_plan, unapply
from memfit.runtime.segment import segment_of
from memfit.runtime.wrap import is_wrapped, wrap


def _plan(*regions: Region, types: dict | None = None) -> Plan:
    return Plan(regions=regions, predicted_peak_bytes=0, recompute_s=0.0, budget_bytes=None,
                solver="test", profile_signature="", extra={"module_types": types or {}})


def test_apply_wraps_and_segments_bitwise():
    model, twin = pair(TinyGPT)
    plan = _plan(
        Region.saving(("blocks.0",), ("aten.addmm.default#0",)),
        Region.saving(("blocks.1", "blocks.2"), ("aten.bmm.default#1",)),
        types={"blocks.0": "GPTBlock", "blocks": "torch.nn.modules.container.ModuleList"},
    )
    assert apply_plan(model, plan) is model and model.memfit_plan is plan
    assert is_wrapped(model.blocks[0]) and segment_of(model.blocks[2]) is not None
    counter = CallCounter(*(b.attn.qkv for b in model.blocks))
    assert_bitwise_twin(model, twin, (torch.randint(0, 64, (2, 8)),), steps=2)
    assert counter.count == 2 * 3 * 2
    unapply(model)
    assert not hasattr(model, "memfit_plan") and not is_wrapped(model.blocks[0])
    assert segment_of(model.blocks[1]) is None


def test_second_plan_replaces_first():
    model = TinyGPT()
    apply_plan(model, _plan(Region(("blocks.0",))))
    second = _plan(Region(("blocks.1",)))
    apply_plan(model, second)
    assert not is_wrapped(model.blocks[0]) and is_wrapped(model.blocks[1])
    assert model.memfit_plan is second


BAD = {
    "missing_path": (_plan(Region(("blocks.7",))), "blocks.7"),
    "not_consecutive": (_plan(Region(("blocks.0", "blocks.2"))), "not consecutive"),
    "different_parents": (_plan(Region(("blocks.0", "ln"))), "different parents"),
    "type_mismatch": (_plan(Region(("blocks.0",)), types={"blocks.0": "LlamaDecoderLayer"}),
                      "LlamaDecoderLayer"),
    "twice": (_plan(Region(("blocks.0",)), Region(("blocks.0",))), "two regions"),
    "two segments": (_plan(Region(("blocks.0", "blocks.1")), Region(("blocks.1", "blocks.2"))), "two regions"),
    # NOTE [segments nested in a block]: simulate models it, memfit.jax runs it, torch does not
    "segment_in_block": (_plan(Region(("blocks.1",)), Region(("blocks.1.ln1", "blocks.1.attn"))),
                         r"segment blocks\.1\.ln1\.\.blocks\.1\.attn is nested in region blocks\.1"),
    # NOTE [regions nested deeper]: a segment in a segment, which memfit.jax runs
    "segment_in_segment": (_plan(Region(("blocks.0", "blocks.1", "blocks.2")), Region(("blocks.0", "blocks.1"))),
                           "module 'blocks.0' appears in two regions"),
}


@pytest.mark.parametrize("plan,message", BAD.values(), ids=BAD.keys())
def test_mismatching_plans_are_refused_and_change_nothing(plan, message):
    model = TinyGPT()
    with pytest.raises(PlanMismatch, match=message):
        apply_plan(model, plan)
    assert not any(is_wrapped(m) or segment_of(m) for m in model.modules())
    assert not hasattr(model, "memfit_plan")


def test_conflict_with_manual_wrap_rolls_back():
    model = TinyGPT()
    wrap(model.blocks[2])
    with pytest.raises(WrapError):
        apply_plan(model, _plan(Region(("blocks.0",)), Region(("blocks.2",))))
    assert not is_wrapped(model.blocks[0]) and is_wrapped(model.blocks[2])
    with pytest.raises(PlanMismatch, match="no memfit plan"):
        unapply(model)


def test_apply_without_the_divergence_check_is_still_bitwise():
    from memfit import zoo

    model = zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=40)
    twin = copy.deepcopy(model)
    plan = Plan((Region.saving(("blocks.0",), ("aten.addmm.default#0",)), Region(("blocks.1",))),
                0, 0.0, None, "hand", "")
    apply_plan(model, plan, check=False)
    x = zoo.example_inputs(model, batch=2)
    torch.manual_seed(3)
    model(x).sum().backward()
    torch.manual_seed(3)
    twin(x).sum().backward()
    for (n, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), n


def test_nested_regions_bitwise_and_inner_recomputed_twice():
    # NOTE [nested regions]: blocks.0 with its attention's dropout inside it, a segment with a
    # sub-module of its first block inside it; dropout on, two steps
    model, twin = pair(TinyGPT)
    plan = _plan(Region(("blocks.0",)), Region(("blocks.0.attn.drop",)),
                 Region(("blocks.1", "blocks.2")), Region(("blocks.1.attn",)))
    apply_plan(model, plan)
    inner = CallCounter(model.blocks[1].attn.qkv)
    outer = CallCounter(model.blocks[2].attn.qkv)
    assert_bitwise_twin(model, twin, (torch.randint(0, 64, (2, 8)),), steps=2)
    # per step: forward, the segment's replay, the inner replay; a plain segment member twice
    assert inner.count == 2 * 3 and outer.count == 2 * 2


def test_blocks_nested_in_their_segment_bitwise_and_rerun_twice():
    # NOTE [nested segments]: a segment of three blocks with each block checkpointed inside it,
    # listed before or after the segment; dropout on, two steps
    for order in (1, -1):
        model, twin = pair(TinyGPT)
        regions = (Region(("blocks.0", "blocks.1", "blocks.2")),
                   *(Region((f"blocks.{i}",)) for i in range(3)))
        apply_plan(model, _plan(*regions[::order]))
        counters = [CallCounter(model.blocks[i].attn.qkv) for i in range(3)]
        assert_bitwise_twin(model, twin, (torch.randint(0, 64, (2, 8)),), steps=2)
        # per step: forward, the segment's replay, the block's own replay; the last block's
        # call refills the segment's frame (its inputs), so torch ends that replay before it
        assert [c.count for c in counters] == [2 * 3, 2 * 3, 2 * 2]


def test_nested_regions_update_batchnorm_once():
    model, twin = pair(conv_net)
    plan = _plan(Region(("0",)), Region(("0.bn",)), Region(("1", "2")), Region(("2.conv",)))
    apply_plan(model, plan)
    assert_bitwise_twin(model, twin, (torch.randn(4, 3, 12, 12),), steps=2)
    assert int(model[0].bn.num_batches_tracked) == 2


def test_a_plan_for_another_width_is_refused():
    import memfit

    torch.manual_seed(0)
    narrow = memfit.zoo.gpt(n_layer=2, d_model=64, n_head=4, seq_len=64, vocab_size=256)
    memfit.fit(narrow, torch.randint(0, 256, (4, 64)), budget=0.6)
    planned = Plan.from_dict(narrow.memfit_plan.to_dict())  # as loaded from its file
    assert planned.extra["parameter_shapes"]["blocks.0.attn.qkv.weight"] == [192, 64]
    wide = memfit.zoo.gpt(n_layer=2, d_model=96, n_head=4, seq_len=64, vocab_size=256)
    with pytest.raises(PlanMismatch, match=r"parameter 'blocks\.0\.attn\.qkv\.weight' has shape "
                                           r"\(192, 64\), but this GPT's has \(288, 96\)"):
        memfit.apply(wide, planned)
    assert memfit.runtime.marks.applied_plan(wide) is None  # nothing applied
    memfit.apply(copy.deepcopy(narrow), planned)  # the same width takes it
