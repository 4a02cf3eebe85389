"""Compiled costs (NOTE [compiled costs] in memfit.profiling.compiled_costs): which ops fuse,
what the profile keeps, and the plans fit makes with ``Search(compiled=True)``."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

import memfit
from memfit.profiling.compiled_costs import costs_like, for_compiler, is_for_compiler, is_pointwise
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
        if is_pointwise(before.name):
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
