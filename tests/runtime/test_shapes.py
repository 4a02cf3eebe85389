"""The input guard (NOTE [inputs other than the profiled ones]): ranges, switches, warn once per
new signature, raise; and what a call's check costs."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import memfit
from memfit.planning.plan import Plan, Region
from memfit.runtime.apply import apply_plan, input_guard, unapply
from memfit.runtime.shapes import OnNewShape, ShapeRange, signature_of


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))


def _plan(rows: int, regions: tuple[str, ...] = ("1",)) -> Plan:
    return Plan(regions=tuple(Region((r,)) for r in regions), predicted_peak_bytes=0,
                recompute_s=0.0, budget_bytes=None, solver="test", profile_signature="",
                extra={"module_types": {}},
                input_signature=(("0", (rows, 8), "float32"), ("<parameters>", (), "float32")))


def test_a_range_covers_each_dimension_between_its_ends_with_the_same_dtypes():
    lo = signature_of((("0", (2, 32), "int64"),))
    hi = signature_of((("0", (2, 128), "int64"),))
    r = ShapeRange(lo, hi, plan=_plan(4))
    assert r.covers(signature_of((("0", (2, 96), "int64"),)))
    assert r.covers(lo) and r.covers(hi)
    assert not r.covers(signature_of((("0", (2, 129), "int64"),)))
    assert not r.covers(signature_of((("0", (3, 64), "int64"),)))
    assert not r.covers(signature_of((("0", (2, 64), "int32"),)))
    assert not r.covers(signature_of((("0", (2, 64, 1), "int64"),)))
    assert not r.covers(signature_of((("x", (2, 64), "int64"),)))


def test_a_call_in_a_planned_range_switches_plans_without_replanning():
    model = _model()
    small, large = _plan(4, ("1",)), _plan(16, ("0", "2"))
    apply_plan(model, small, on_new_shape="raise",
          ranges=(ShapeRange(signature_of(small.input_signature),
                             signature_of(large.input_signature), large),))
    guard = input_guard(model)
    assert guard is not None
    model(torch.randn(4, 8)).sum().backward()
    assert model.memfit_plan is small and guard.switches == 0
    model(torch.randn(12, 8)).sum().backward()
    assert model.memfit_plan is large and guard.switches == 1
    wrapped = {n for n, m in model.named_modules() if "_memfit_wrap" in m.__dict__}
    assert wrapped == {"0", "2"}
    model(torch.randn(4, 8)).sum().backward()  # its own plan again
    assert model.memfit_plan is small and guard.switches == 2
    with pytest.raises(memfit.NewInputShape, match=r"20x8:float32"):
        model(torch.randn(20, 8))
    unapply(model)
    assert not any("_memfit_wrap" in m.__dict__ for m in model.modules())


def test_warn_is_once_per_new_signature_and_keeps_the_plan():
    model = _model()
    plan = _plan(4)
    apply_plan(model, plan)  # apply's default: warn
    guard = input_guard(model)
    assert guard is not None and guard.on_new is OnNewShape.WARN
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (4, 5, 5, 6, 5, 4):
            model(torch.randn(rows, 8)).sum().backward()
    assert [str(w.message).split("now called with ")[1][:5] for w in caught] == ["(0=5x", "(0=6x"]
    assert model.memfit_plan is plan and guard.warned == {
        signature_of((("0", (r, 8), "float32"), ("<parameters>", (), "float32"))) for r in (5, 6)}


def test_replan_needs_a_replan_function():
    with pytest.raises(ValueError, match="replan function"):
        apply_plan(_model(), _plan(4), on_new_shape="replan")


def test_the_check_of_a_call_on_the_planned_shape_costs_microseconds():
    """Not a timing assertion (benchmarks time): prints the guard's cost per call next to a
    small step's, for NOTE [inputs other than the profiled ones]."""
    model = _model()
    x = torch.randn(4, 8)
    apply_plan(model, _plan(4, ()))
    guard = input_guard(model)
    assert guard is not None
    n = 2000

    def per_call(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    same = per_call(lambda: guard(model, (x,), {}))
    other = torch.randn(5, 8)
    guard.warned.add(signature_of((("0", (5, 8), "float32"), ("<parameters>", (), "float32"))))
    built = per_call(lambda: guard(model, (other,), {}))
    step = per_call(lambda: model(x).sum().backward())
    print(f"guard: {same * 1e6:.1f} us on the planned shape, {built * 1e6:.1f} us on another; "
          f"a step of a 2-layer 8-wide MLP: {step * 1e6:.1f} us")
    assert same > 0 and built > 0
