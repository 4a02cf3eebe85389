"""The calibration run (``memfit.measuring.calibration``): baseline plans timed on the model to
fit its time model, fake mode, a measured model. The fit itself: tests/test_timemodel.py.

NOTE [calibration] in ``memfit.timemodel``. No test asserts a speed: measured
timings only feed the fit, and the tests check what is derived from them exactly.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from memfit.measuring.calibration import MIN_BLOCKS, STEADY_CHECK
from memfit.measuring.calibration import profile as calibrated_profile
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate, time_terms
from memfit.profiling.tracer import trace
from memfit.runtime.marks import applied_plan
from memfit.timemodel.calibration import (
    DEFAULT_OP_S,
    DEFAULT_REGION_S,
    Calibration,
    CalibrationSource,
)


def _blocks(n: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
                                 for _ in range(n)))


def test_fake_mode_keeps_the_constants() -> None:
    m = _blocks(4).to("meta")
    prof = calibrated_profile(m, torch.randn(4, 32, device="meta"), mode="fake")
    assert prof.calibration is not None
    assert prof.calibration.source is CalibrationSource.DEFAULT
    assert "fake mode" in prof.calibration.reason
    assert np.array_equal(prof.calibration.params(), Calibration().params())
    eb = plan_for_budget(prof, budget=1.0, solver="every_block")
    terms = time_terms(prof, eb)
    expected = (terms.matmul_s + terms.other_s + DEFAULT_REGION_S * terms.regions
                + DEFAULT_OP_S * terms.ops)
    torch.testing.assert_close(eb.recompute_s, expected, rtol=1e-12, atol=0.0)  # float sum order


def test_measured_profile_is_calibrated_and_leaves_the_model_alone() -> None:
    model = _blocks(4)
    twin = copy.deepcopy(model)
    x = torch.randn(16, 32)
    prof = calibrated_profile(model, x)
    cal = prof.calibration
    assert cal is not None
    names = [m.name for m in cal.measurements]
    assert names == ["every_block", "save_matmuls"]
    eb = plan_for_budget(prof, budget=1.0, solver="every_block")
    assert cal.measurements[0].terms == time_terms(prof, eb)
    assert cal.measurements[0].terms.regions == 4
    # the planners' recompute seconds come from this calibration, whatever it fitted
    torch.testing.assert_close(simulate(prof, eb).recompute_s, cal.recompute_s(time_terms(prof, eb)),
                               rtol=1e-12, atol=0.0)  # float sum order
    assert not any(applied_plan(m) is not None for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert "calibration_wall_s" in prof.extra


def test_too_few_blocks_keep_the_constants() -> None:
    prof = calibrated_profile(_blocks(1), torch.randn(4, 32))
    assert prof.calibration is not None and prof.calibration.source is CalibrationSource.DEFAULT
    assert f"fewer than {MIN_BLOCKS}" in prof.calibration.reason
    assert prof.calibration.measurements == ()


def test_calibration_off_leaves_the_profile_uncalibrated() -> None:
    prof = calibrated_profile(_blocks(4), torch.randn(4, 32), calibrate_time=False)
    assert prof.calibration is None


def test_steady_check_checks_no_call() -> None:
    """The calibration times the default check's unchecked calls (NOTE [calibrated steady state])."""
    assert not any(STEADY_CHECK.checks(call) for call in range(1000))


def test_a_failing_calibration_keeps_the_constants_and_the_profile(monkeypatch) -> None:
    """E.g. a baseline plan the simulator rejects (nested regions on some Hugging Face models)."""
    import memfit.measuring.calibration

    def broken(*args, **kwargs):
        raise ValueError("region 'a.b' is nested two levels deep")

    monkeypatch.setattr(memfit.measuring.calibration, "_time_plans", broken)
    model = _blocks(4)
    prof = calibrated_profile(model, torch.randn(4, 32))
    assert prof.calibration is not None and prof.calibration.source is CalibrationSource.DEFAULT
    assert prof.calibration.reason == "calibration failed: ValueError: region 'a.b' is nested two levels deep"
    assert not any(applied_plan(m) is not None for m in model.modules())


def _scripted_times(monkeypatch, times: dict[str, list[float]]) -> None:
    import memfit.measuring.calibration

    monkeypatch.setattr(memfit.measuring.calibration, "_time_plans", lambda step, plans, rounds: {k: list(v) for k, v in times.items()})


@pytest.mark.parametrize(("spread", "separate"), [(0.0, True), (0.05, False)], ids=["agree", "disagree"])
def test_scales_are_separated_only_from_repeated_steps_that_agree(monkeypatch, spread: float, separate: bool) -> None:
    import memfit.measuring.dispatch_cost
    from memfit.measuring.dispatch_cost import measure_dispatch_charges

    model = _blocks(4)
    x = torch.randn(16, 32)
    traced = trace(model, x, repeats=1)
    t_eb = time_terms(traced, plan_for_budget(traced, budget=1.0, solver="every_block"))
    t_sm = time_terms(traced, plan_for_budget(traced, budget=1.0, solver="save_matmuls"))
    c = measure_dispatch_charges("cpu")
    truth = Calibration(matmul_scale=1.2, other_scale=0.8, region_s=c.region_s, op_s=c.op_s,
                        selective_op_s=c.selective_op_s)
    plain = 0.01
    step_eb, step_sm = plain + truth.recompute_s(t_eb), plain + truth.recompute_s(t_sm)
    # round 0 warms up (9 s, not counted); counted rounds 1 and 2 differ by ``spread``
    import memfit.measuring.calibration

    monkeypatch.setattr(memfit.measuring.calibration, "trace", lambda *a, **k: traced)  # the same op times
    # ... and the same charges: measured again, they differ by timing noise, which the fit of
    # this small step's 1 ms of recompute would read as a scale (4.26 seen)
    monkeypatch.setattr(memfit.measuring.dispatch_cost, "measure_dispatch_charges", lambda *a, **k: c)
    _scripted_times(monkeypatch, {"plain": [plain, plain],
                                  "every_block": [9.0, step_eb, step_eb * (1 + spread)],
                                  "save_matmuls": [9.0, step_sm, step_sm * (1 + spread)]})
    prof = calibrated_profile(model, x, rounds=3)
    cal = prof.calibration
    assert cal is not None and cal.source is CalibrationSource.FIT, cal.reason
    assert prof.step_time_s == plain
    if separate:  # exact steps: the truth, up to float rounding
        torch.testing.assert_close((cal.matmul_scale, cal.other_scale), (1.2, 0.8), rtol=1e-9, atol=0.0)
    else:
        assert cal.matmul_scale == cal.other_scale
