"""Rule 4 of NOTE [host overhead on an async device] (in ``memfit.planning.hosttime``): one
plan's own host work against its own device work."""

from __future__ import annotations

from dataclasses import replace

from memfit.planning.hosttime import HOST_OP_S
from memfit.planning.plan import Plan
from memfit.planning.simulate import simulate
from memfit.profiling.profile import Profile
from memfit.timemodel import Calibration, CalibrationSource

__all__ = ["device_only", "plan_hides"]


def device_only(profile: Profile) -> Profile:
    """``profile`` with its calibration's fixed charges at 0 s: each plan costs its device
    seconds (NOTE [host overhead on an async device], rule 4)."""
    cal = profile.calibration if profile.calibration is not None else Calibration()
    return replace(profile, calibration=replace(cal, region_s=0.0, op_s=0.0, selective_op_s=0.0))


def plan_hides(profile: Profile, plan: Plan, device_s: float) -> tuple[bool, float, float]:
    """NOTE [host overhead on an async device], rule 4, for a plan without offload whose
    recompute is ``device_s`` device seconds: (whether its host work hides behind its device
    work, the host seconds, the device seconds)."""
    cal = profile.calibration if profile.calibration is not None else Calibration()
    # a fitted source: taken as given, whatever rules 1-3 find (device + launches + charges)
    launches = replace(profile, calibration=replace(cal, op_s=cal.op_s + HOST_OP_S,
                                                    source=CalibrationSource.FIT))
    charged = simulate(launches, plan).recompute_s
    host = HOST_OP_S * len(profile.ops) + (charged - device_s)
    device = sum(op.time_s for op in profile.ops) + device_s
    return host <= device, host, device
