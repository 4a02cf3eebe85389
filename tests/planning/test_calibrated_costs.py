"""The planners price recompute with the profile's calibration (NOTE [calibration] in
``memfit.timemodel``), not the constants, when the profile has one."""

from __future__ import annotations

import dataclasses

import pytest
from profile_builders import TICK, OpSpec, chain_profile

from memfit.planning.plan import Plan, Region
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate, time_terms
from memfit.profiling.profile import Profile
from memfit.timemodel.calibration import Calibration, CalibrationSource

SOLVERS = ("auto", "chain", "milp", "greedy", "brute")


def _two_blocks() -> Profile:
    """Block 0: 3 ops, 9 ticks, 6 of them one matmul; block 1: 8 cheap non-matmul ops, 6
    ticks. Either alone fits the budget (``_budget``); under the constants block 1 is the cheaper
    recompute."""
    slow_few = [OpSpec("aten.mm.default", 1536, 6 * TICK, save="in"),
                OpSpec("aten.gelu.default", 64, 2 * TICK, save="in"),
                OpSpec("aten.add.Tensor", 64, TICK, inputs=(0, -1))]
    cheap_many = [OpSpec("aten.gelu.default", 256, 0.75 * TICK, save="in") for _ in range(7)]
    cheap_many.append(OpSpec("aten.add.Tensor", 64, 0.75 * TICK, inputs=(0, -1)))
    return chain_profile([slow_few, cheap_many], head_bytes=2048)


def _budget(prof: Profile) -> int:
    def peak(block: str) -> int:
        return simulate(prof, Plan((Region((block,)),), 0, 0.0, None, "x", "")).peak_bytes

    budget = max(peak("layers.0"), peak("layers.1"))
    assert budget < prof.peak_bytes  # something must be checkpointed
    return budget


CALIBRATIONS = {
    # a per-op charge of one tick: block 1's 8 ops cost more than block 0's 3
    "per-op-charge": (Calibration(op_s=TICK, source=CalibrationSource.FIT), "layers.0"),
    # matmuls rerun at a quarter of their forward time: block 0 gets cheap
    "cheap-matmuls": (Calibration(matmul_scale=0.25, source=CalibrationSource.FIT), "layers.0"),
    # the constants (an uncalibrated profile) pick block 1
    "uncalibrated": (None, "layers.1"),
}


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("name", list(CALIBRATIONS))
def test_calibration_changes_the_chosen_plan(name: str, solver: str) -> None:
    cal, expected = CALIBRATIONS[name]
    prof = dataclasses.replace(_two_blocks(), calibration=cal)
    got = plan_for_budget(prof, budget=_budget(prof), solver=solver)
    assert [r.modules for r in got.regions] == [(expected,)]
    assert [r.save for r in got.regions] == [()]
    model = cal if cal is not None else Calibration()
    # dyadic times: the solvers' sums and the model's agree exactly
    assert got.recompute_s == model.recompute_s(time_terms(prof, got))
    assert got.predicted_step_s == prof.step_time_s + got.recompute_s


def test_calibrated_selective_region_pays_the_calibrated_charges() -> None:
    cal = Calibration(matmul_scale=0.5, other_scale=2.0, region_s=2 * TICK, op_s=TICK / 4,
                      selective_op_s=TICK / 2, source=CalibrationSource.FIT)
    prof = dataclasses.replace(_two_blocks(), calibration=cal)
    region = Region.saving(("layers.0",), ("aten.mm.default#0",))
    sim = simulate(prof, Plan((region,), 0, 0.0, None, "x", ""))
    # block 0 reruns gelu (2) and add (1) at 2x; 3 ops at 1/4 + 1/2; one region at 2 ticks
    assert sim.recompute_s == (2 + 1) * 2.0 * TICK + 3 * (TICK / 4 + TICK / 2) + 2 * TICK
    assert sim.recompute_s == cal.recompute_s(time_terms(prof, Plan((region,), 0, 0.0, None, "x", "")))
