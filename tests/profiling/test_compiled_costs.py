"""Compiled costs (NOTE [compiled costs] in memfit.profiling.compiled_costs): which ops fuse,
what the profile keeps, and the plans fit makes with ``Search(compiled=True)``."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

import memfit
from memfit.planning.plan import OpPolicy, Region
from memfit.planning.rules import is_kept_draw, op_keys
from memfit.profiling.compiled_costs import (
    FUSED_DRAWS,
    costs_like,
    for_compiler,
    is_for_compiler,
    is_pointwise,
)
from memfit.timemodel.calibration import Calibration
from memfit.zoo import gpt

V, T = 64, 32


@pytest.mark.parametrize("name, pointwise", [
    ("aten.gelu.default", True), ("aten.mul.Tensor", True), ("aten.add.Tensor", True),
    ("aten.relu_.default", True), ("aten.div_.Scalar", True),
    ("aten.mm.default", False), ("aten.addmm.default", False), ("aten.bmm.default", False),
    ("aten._softmax.default", False), ("aten.native_layer_norm.default", False),
    ("aten.convolution.default", False), ("aten.bernoulli_.float", False),
    ("aten.no_such_op.default", False), ("profiler._record_function_enter_new.default", False),
    ("not an op", False),
])
def test_pointwise_ops_are_read_from_torch_tags(name: str, pointwise: bool) -> None:
    assert is_pointwise(name) is pointwise


def _model() -> torch.nn.Module:
    return gpt(n_layer=2, d_model=32, n_head=2, seq_len=T, vocab_size=V, dropout=0.0, seed=0)


def _x(batch: int = 4) -> torch.Tensor:
    return torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def eager() -> memfit.Profile:
    return memfit.profile(_model(), _x())


def test_pointwise_seconds_are_zero_and_memory_unchanged(eager: memfit.Profile) -> None:
    c = for_compiler(eager)
    assert is_for_compiler(c) and not is_for_compiler(eager)
    fused = 0.0
    for before, after in zip(eager.ops, c.ops, strict=True):
        if is_pointwise(before.name) or before.name in FUSED_DRAWS:
            assert after.time_s == 0.0
            fused += before.time_s
        else:
            assert after.time_s == before.time_s
        assert dataclasses.replace(after, time_s=before.time_s) == before  # nothing else changed
    assert fused > 0
    assert c.extra["fused_pointwise_s"] == fused
    assert (c.storages, c.live_bytes, c.peak_bytes, c.modules) == (
        eager.storages, eager.live_bytes, eager.peak_bytes, eager.modules)
    total = sum(op.time_s for op in eager.ops)
    assert c.step_time_s == pytest.approx(eager.step_time_s * (1 - fused / total), rel=1e-12)  # float rounding


def test_no_fixed_charges_and_the_profile_says_why(eager: memfit.Profile) -> None:
    cal = for_compiler(eager).calibration
    assert (cal.region_s, cal.op_s, cal.selective_op_s) == (0.0, 0.0, 0.0)
    assert (cal.matmul_scale, cal.other_scale) == (1.0, 1.0)
    assert cal.reason.startswith("compiled costs")


def test_for_compiler_is_idempotent_and_survives_json(eager: memfit.Profile, tmp_path) -> None:
    c = for_compiler(eager)
    assert for_compiler(c) is c
    path = tmp_path / "p.json"
    c.save(path)
    back = memfit.Profile.load(path)
    assert is_for_compiler(back)
    assert [op.time_s for op in back.ops] == [op.time_s for op in c.ops]


def test_plans_of_compiled_costs_recompute_pointwise_ops_for_free(eager: memfit.Profile) -> None:
    c = for_compiler(eager)
    plan = memfit.plan(c, budget="min")
    assert any(n.startswith("costs as torch.compile runs the step") for n in plan.notes)
    assert not any(n.startswith("costs as torch.compile") for n in memfit.plan(eager, budget="min").notes)
    # the same memory model: the smallest feasible peak is the eager profile's
    assert plan.predicted_peak_bytes == memfit.plan(eager, budget="min").predicted_peak_bytes
    # what a plan reruns is priced without its pointwise ops: against the eager seconds with
    # the same (zero) charges and unit scales, every block rerun costs less by at most the
    # pointwise seconds of its modules
    flat = dataclasses.replace(eager, calibration=dataclasses.replace(
        eager.calibration, region_s=0.0, op_s=0.0, selective_op_s=0.0, matmul_scale=1.0,
        other_scale=1.0))
    compiled_s = memfit.plan(c, budget=1.0, solver="every_block").recompute_s
    every = memfit.plan(flat, budget=1.0, solver="every_block")
    blocks = [m for reg in every.regions for m in reg.modules]
    pointwise_s = sum(op.time_s for op in eager.ops[: eager.n_forward] if is_pointwise(op.name)
                      and any(op.module == b or op.module.startswith(b + ".") for b in blocks))
    assert 0 < every.recompute_s - compiled_s <= pointwise_s * (1 + 1e-9)  # float sums


def test_costs_like_carries_the_first_profiles_costs(eager: memfit.Profile) -> None:
    other = memfit.profile(_model(), _x(2), calibrate_time=False)
    assert not is_for_compiler(costs_like(other, eager))
    assert costs_like(other, eager).calibration == eager.calibration
    assert is_for_compiler(costs_like(other, for_compiler(eager)))


def test_fit_plans_compiled_costs_and_replans_new_shapes_with_them() -> None:
    model = memfit.fit(_model(), _x(), budget="min", search=memfit.Search(compiled=True))
    assert any(n.startswith("costs as torch.compile") for n in model.memfit_plan.notes)
    first = model.memfit_plan
    model(_x(2)).float().mean().backward()  # a new shape: re-planned (on_new_shape="replan")
    assert model.memfit_plan is not first
    assert model.memfit_plan.input_signature != first.input_signature
    assert any(n.startswith("costs as torch.compile") for n in model.memfit_plan.notes)
    again = pickle.loads(pickle.dumps(model))  # NOTE [a fitted model pickles]
    assert again.memfit_plan == model.memfit_plan


@pytest.mark.parametrize("kwargs, error, words", [
    ({"compiled": 1}, TypeError, "compiled must be True or False"),
    ({"compiled": True, "tune": True}, ValueError, "tuning times the candidate plans eagerly"),
    ({"compiled": True, "compress": "lossless"}, ValueError, "compressed saved tensors under torch.compile"),
], ids=["not-bool", "tune", "compress"])
def test_search_refuses_what_compiled_costs_cannot_do(kwargs, error, words) -> None:
    with pytest.raises(error, match=words):
        memfit.Search(**kwargs)


def test_dropout_draws_fuse_and_no_compiled_plan_keeps_one() -> None:
    """NOTE [compiled costs], 5: the compiled backward draws dropout's mask again inside a
    fused kernel, so its ``bernoulli_`` costs 0 s and no plan keeps a draw (a compiled region
    never makes the kept copy the eager planner would charge for)."""
    model = gpt(n_layer=2, d_model=32, n_head=2, seq_len=T, vocab_size=V, dropout=0.1, seed=0)
    eager = memfit.profile(model, _x(), calibrate_time=False)
    eager = dataclasses.replace(eager, calibration=Calibration(region_s=0.0, op_s=0.0, selective_op_s=0.0))
    c = for_compiler(eager)
    draws = [op for op in eager.ops if op.name in FUSED_DRAWS]
    assert draws and all(op.time_s > 0 for op in draws)
    assert [c.ops[op.index].time_s for op in draws] == [0.0] * len(draws)
    fused = sum(op.time_s for op in eager.ops if is_pointwise(op.name) or op.name in FUSED_DRAWS)
    assert c.extra["fused_pointwise_s"] == fused
    kept_eager = [op.index for op in eager.ops if is_kept_draw(eager, op)]
    assert len(kept_eager) == len([op for op in draws if op.index < eager.n_forward])  # one per forward dropout
    assert not any(is_kept_draw(c, op) for op in c.ops)
    # a region keeping a draw: the eager planner prices its copy; compiled costs refuse it
    key = next(k for k in op_keys(eager, *_span(eager, "blocks.0")).values() if "bernoulli_" in k)
    plan = memfit.Plan((Region(("blocks.0",), {key: OpPolicy.SAVE}),), 0, 0.0, None, "hand", eager.signature)
    kept = memfit.simulate(eager, plan)
    drawn = memfit.simulate(eager, dataclasses.replace(plan, regions=(Region(("blocks.0",)),)))
    draw = eager.ops[op_keys_to_index(eager, "blocks.0", key)]
    charge = math.prod(draw.outputs[0].shape) * Calibration().keep_s_per_element
    # rerun: everything but the draw, and its copy written back (float sums: 1e-12 s)
    assert kept.recompute_s - drawn.recompute_s == pytest.approx(charge - draw.time_s, abs=1e-12)
    with pytest.raises(ValueError, match="compiled region draws again in its backward"):
        memfit.simulate(c, plan)
    for budget in ("min", 0.6, 0.9):  # and no compiled-cost plan keeps one
        assert not any("bernoulli_" in k for r in memfit.plan(c, budget=budget).regions for k in r.save)


def op_keys_to_index(profile: memfit.Profile, path: str, key: str) -> int:
    return next(i for i, k in op_keys(profile, *_span(profile, path)).items() if k == key)


def _span(profile: memfit.Profile, path: str) -> tuple[int, int]:
    m = next(m for m in profile.modules if m.path == path)
    return m.first_op, m.last_op
