"""The calibrated recompute time model: the fit, the Profile JSON, fake mode, a measured model.

NOTE [calibration] in ``memfit.timemodel``. No test asserts a speed: measured
timings only feed the fit, and the tests check what is derived from them exactly.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from memfit.measuring.calibration import MIN_BLOCKS, STEADY_CHECK
from memfit.measuring.calibration import profile as calibrated_profile
from memfit.planning.planner import plan
from memfit.planning.simulate import simulate, time_terms
from memfit.profiling.profile import Profile
from memfit.profiling.tracer import profile as trace_profile
from memfit.runtime.marks import applied_plan
from memfit.timemodel import (
    DEFAULT_OP_S,
    DEFAULT_REGION_S,
    DEFAULT_SELECTIVE_OP_S,
    FIT_ORDER,
    Calibration,
    CalibrationSource,
    TimedPlan,
    TimeTerms,
    fit_calibration,
)

# Relative tolerance of a fit from exact synthetic timings: NNLS on a square, well-conditioned
# system recovers its solution up to float rounding (observed ~1e-15).
FIT_RTOL = 1e-9

# Independent plans: each row reruns a different mix (the matrix has full rank 5).
SYNTHETIC_TERMS = (
    TimeTerms(matmul_s=0.40, other_s=0.10, regions=8, ops=480, selective_ops=0),
    TimeTerms(matmul_s=0.00, other_s=0.09, regions=8, ops=480, selective_ops=480),
    TimeTerms(matmul_s=0.35, other_s=0.10, regions=3, ops=470, selective_ops=0),
    TimeTerms(matmul_s=0.10, other_s=0.30, regions=5, ops=100, selective_ops=40),
    TimeTerms(matmul_s=0.20, other_s=0.02, regions=1, ops=900, selective_ops=300),
    TimeTerms(matmul_s=0.05, other_s=0.05, regions=12, ops=60, selective_ops=60),
)

TRUE_PARAMS = {
    "slow-recompute": dict(matmul_scale=1.3, other_scale=1.8, region_s=4e-4, op_s=2e-5, selective_op_s=3e-5),
    "cheap-dispatch": dict(matmul_scale=1.05, other_scale=1.2, region_s=1e-5, op_s=1e-6, selective_op_s=5e-6),
    "defaults": dict(matmul_scale=1.0, other_scale=1.0, region_s=DEFAULT_REGION_S, op_s=DEFAULT_OP_S,
                     selective_op_s=DEFAULT_SELECTIVE_OP_S),
}


def _timed(terms: TimeTerms, truth: Calibration, name: str = "p") -> TimedPlan:
    return TimedPlan(name, terms, truth.recompute_s(terms))


@pytest.mark.parametrize("truth", list(TRUE_PARAMS.values()), ids=list(TRUE_PARAMS))
def test_fit_recovers_every_parameter_from_enough_plans(truth: dict[str, float]) -> None:
    cal_true = Calibration(**truth)
    got = fit_calibration([_timed(t, cal_true, f"p{k}") for k, t in enumerate(SYNTHETIC_TERMS)])
    assert got.source is CalibrationSource.FIT
    assert set(got.fitted) == set(FIT_ORDER)
    torch.testing.assert_close(torch.tensor(got.params()), torch.tensor(cal_true.params()),
                               rtol=FIT_RTOL, atol=0.0)


def test_two_baseline_plans_fit_the_two_scales_and_hold_the_charges() -> None:
    """every_block and save_matmuls: two rows determine the two op scales; the fixed charges
    stay at the prior's values (here 0 and known values) and are subtracted exactly."""
    prior = Calibration(region_s=2.0**-12, op_s=2.0**-16, selective_op_s=2.0**-15)
    truth = Calibration(matmul_scale=1.25, other_scale=1.75, region_s=prior.region_s,
                        op_s=prior.op_s, selective_op_s=prior.selective_op_s)
    eb = TimeTerms(matmul_s=0.5, other_s=0.25, regions=8, ops=512, selective_ops=0)
    sm = TimeTerms(matmul_s=0.0, other_s=0.25, regions=8, ops=512, selective_ops=512)
    got = fit_calibration([_timed(eb, truth, "every_block"), _timed(sm, truth, "save_matmuls")], prior=prior)
    assert got.fitted == ("matmul_scale", "other_scale")
    assert (got.region_s, got.op_s, got.selective_op_s) == (prior.region_s, prior.op_s, prior.selective_op_s)
    torch.testing.assert_close(torch.tensor([got.matmul_scale, got.other_scale], dtype=torch.float64),
                               torch.tensor([1.25, 1.75], dtype=torch.float64), rtol=FIT_RTOL, atol=0.0)


@pytest.mark.parametrize("terms", [
    (TimeTerms(other_s=0.25, regions=4, ops=40),),                                  # one plan
    (TimeTerms(other_s=0.25, regions=4, ops=40), TimeTerms(other_s=0.25, regions=4, ops=40)),  # no matmul saved
], ids=["one-plan", "same-plan-twice"])
def test_scales_fitted_as_one_when_not_separable(terms: tuple[TimeTerms, ...]) -> None:
    prior = Calibration(region_s=0.0, op_s=0.0, selective_op_s=0.0)
    rows = [TimedPlan(f"p{k}", t, 0.5) for k, t in enumerate(terms)]  # 0.25 s of ops took 0.5 s
    got = fit_calibration(rows, prior=prior)
    assert got.fitted == ("matmul_scale", "other_scale")
    assert got.matmul_scale == got.other_scale
    torch.testing.assert_close(got.other_scale, 2.0, rtol=FIT_RTOL, atol=0.0)


def test_implausible_scales_fall_back_to_one_common_scale() -> None:
    """Noise: save_matmuls measured nearly free, so other ops would rerun at 0.2x their forward
    time (below SCALE_BOUNDS); one scale fitted by least squares over both plans instead."""
    prior = Calibration(region_s=0.0, op_s=0.0, selective_op_s=0.0)
    eb = TimedPlan("every_block", TimeTerms(matmul_s=0.5, other_s=0.25, regions=2, ops=8), 0.9)
    sm = TimedPlan("save_matmuls", TimeTerms(other_s=0.25, regions=2, ops=8, selective_ops=8), 0.05)
    got = fit_calibration([eb, sm], prior=prior)
    assert got.source is CalibrationSource.FIT and got.fitted == ("matmul_scale", "other_scale")
    # argmin_k (0.75 k - 0.9)^2 + (0.25 k - 0.05)^2 = (0.675 + 0.0125) / 0.625
    torch.testing.assert_close(torch.tensor([got.matmul_scale, got.other_scale], dtype=torch.float64),
                               torch.tensor([1.1, 1.1], dtype=torch.float64), rtol=FIT_RTOL, atol=0.0)


@pytest.mark.parametrize("rows,why", [
    ((), "no timed plans"),
    ((TimedPlan("p", TimeTerms(), 0.1),), "rerun nothing"),
    ((TimedPlan("p", TimeTerms(matmul_s=0.2, other_s=0.1), -0.05),), "fit rejected"),
    ((TimedPlan("p", TimeTerms(matmul_s=0.2, other_s=0.1), 30.0),), "fit rejected"),
], ids=["nothing-timed", "nothing-rerun", "negative-extra", "absurd-extra"])
def test_fit_falls_back_to_the_defaults_and_says_why(rows: tuple[TimedPlan, ...], why: str) -> None:
    got = fit_calibration(rows)
    assert got.source is CalibrationSource.DEFAULT and got.fitted == ()
    assert np.array_equal(got.params(), Calibration().params())
    assert why in got.reason


def test_default_calibration_is_the_constants() -> None:
    c = Calibration()
    assert (c.matmul_scale, c.other_scale) == (1.0, 1.0)
    assert (c.region_s, c.op_s, c.selective_op_s) == (DEFAULT_REGION_S, DEFAULT_OP_S, DEFAULT_SELECTIVE_OP_S)


# ---- profiles ----------------------------------------------------------------------------
def _blocks(n: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
                                 for _ in range(n)))


FITTED = Calibration(matmul_scale=1.5, other_scale=2.25, region_s=2.0**-11, op_s=2.0**-17,
                     selective_op_s=2.0**-15, source=CalibrationSource.FIT,
                     fitted=("matmul_scale", "other_scale"),
                     measurements=(TimedPlan("every_block", TimeTerms(0.5, 0.25, 2, 8, 0), 0.75, 1.5),))


@pytest.mark.parametrize("cal", [None, Calibration.default("fake mode"), FITTED], ids=["none", "default", "fitted"])
def test_profile_json_round_trip_keeps_the_calibration(tmp_path, cal: Calibration | None) -> None:
    import dataclasses

    prof = dataclasses.replace(trace_profile(_blocks(2), torch.randn(4, 32), repeats=1), calibration=cal)
    path = tmp_path / "p.json"
    prof.save(path)
    back = Profile.load(path)
    assert back == prof
    assert back.calibration == cal
    if cal is not None:
        assert back.calibration.measurements == cal.measurements  # not part of ==


def test_profile_json_without_calibration_still_loads(tmp_path) -> None:
    """A profile written before calibration existed has no ``calibration`` key."""
    import dataclasses

    prof = dataclasses.replace(trace_profile(_blocks(2), torch.randn(4, 32), repeats=1), calibration=FITTED)
    data = prof.to_dict()
    del data["calibration"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    back = Profile.load(tmp_path / "old.json")
    assert back.calibration is None
    assert back == dataclasses.replace(prof, calibration=None)


def test_fake_mode_keeps_the_constants() -> None:
    m = _blocks(4).to("meta")
    prof = calibrated_profile(m, torch.randn(4, 32, device="meta"), mode="fake")
    assert prof.calibration is not None
    assert prof.calibration.source is CalibrationSource.DEFAULT
    assert "fake mode" in prof.calibration.reason
    assert np.array_equal(prof.calibration.params(), Calibration().params())
    eb = plan(prof, budget=1.0, solver="every_block")
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
    eb = plan(prof, budget=1.0, solver="every_block")
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


def test_one_common_scale_when_asked() -> None:
    """The two baselines determine both scales; ``separate_scales=False`` fits one, by least
    squares over both plans (NOTE [calibration])."""
    prior = Calibration(region_s=0.0, op_s=0.0, selective_op_s=0.0)
    eb = TimedPlan("every_block", TimeTerms(matmul_s=0.2, other_s=0.1), extra_s=0.5)
    sm = TimedPlan("save_matmuls", TimeTerms(other_s=0.1), extra_s=0.2)
    two = fit_calibration([eb, sm], prior=prior)
    assert (round(two.matmul_scale, 9), round(two.other_scale, 9)) == (1.5, 2.0)
    one = fit_calibration([eb, sm], prior=prior, separate_scales=False)
    # least squares of [0.3, 0.1] x = [0.5, 0.2]: x = (0.15 + 0.02) / (0.09 + 0.01) = 1.7
    assert one.matmul_scale == one.other_scale
    torch.testing.assert_close(one.matmul_scale, 1.7, rtol=1e-12, atol=0.0)


def _scripted_times(monkeypatch, times: dict[str, list[float]]) -> None:
    import memfit.measuring.calibration

    monkeypatch.setattr(memfit.measuring.calibration, "_time_plans", lambda step, plans, rounds: {k: list(v) for k, v in times.items()})


@pytest.mark.parametrize(("spread", "separate"), [(0.0, True), (0.05, False)], ids=["agree", "disagree"])
def test_scales_are_separated_only_from_repeated_steps_that_agree(monkeypatch, spread: float, separate: bool) -> None:
    import memfit.measuring.dispatch_cost
    from memfit.measuring.dispatch_cost import measure_dispatch_charges

    model = _blocks(4)
    x = torch.randn(16, 32)
    trace = trace_profile(model, x, repeats=1)
    t_eb = time_terms(trace, plan(trace, budget=1.0, solver="every_block"))
    t_sm = time_terms(trace, plan(trace, budget=1.0, solver="save_matmuls"))
    c = measure_dispatch_charges("cpu")
    truth = Calibration(matmul_scale=1.2, other_scale=0.8, region_s=c.region_s, op_s=c.op_s,
                        selective_op_s=c.selective_op_s)
    plain = 0.01
    step_eb, step_sm = plain + truth.recompute_s(t_eb), plain + truth.recompute_s(t_sm)
    # round 0 warms up (9 s, not counted); counted rounds 1 and 2 differ by ``spread``
    import memfit.measuring.calibration

    monkeypatch.setattr(memfit.measuring.calibration, "trace_profile", lambda *a, **k: trace)  # the same op times
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


def test_held_parameters_keep_the_prior_where_the_plans_would_determine_them() -> None:
    prior = Calibration(region_s=1e-4, op_s=1e-5, selective_op_s=4e-5)
    truth = Calibration(matmul_scale=1.1, other_scale=0.9, region_s=1e-4, op_s=1e-5, selective_op_s=6e-5)
    rows = [_timed(t, truth, f"p{k}") for k, t in enumerate(SYNTHETIC_TERMS[:3])]
    free = fit_calibration(rows, prior=prior)
    assert "selective_op_s" in free.fitted
    torch.testing.assert_close(free.selective_op_s, 6e-5, rtol=1e-9, atol=0.0)
    held = fit_calibration(rows, prior=prior, hold=("selective_op_s",))
    assert "selective_op_s" not in held.fitted and held.selective_op_s == 4e-5
