"""The recompute time model (NOTE [calibration] in ``memfit.timemodel``): the fit, on synthetic
timings, and the defaults. The calibration run that feeds it real timings is tested in
tests/measuring/test_calibration.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memfit.timemodel.calibration import (
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


def test_held_parameters_keep_the_prior_where_the_plans_would_determine_them() -> None:
    prior = Calibration(region_s=1e-4, op_s=1e-5, selective_op_s=4e-5)
    truth = Calibration(matmul_scale=1.1, other_scale=0.9, region_s=1e-4, op_s=1e-5, selective_op_s=6e-5)
    rows = [_timed(t, truth, f"p{k}") for k, t in enumerate(SYNTHETIC_TERMS[:3])]
    free = fit_calibration(rows, prior=prior)
    assert "selective_op_s" in free.fitted
    torch.testing.assert_close(free.selective_op_s, 6e-5, rtol=1e-9, atol=0.0)
    held = fit_calibration(rows, prior=prior, hold=("selective_op_s",))
    assert "selective_op_s" not in held.fitted and held.selective_op_s == 4e-5
