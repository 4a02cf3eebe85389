"""Rule 4 of NOTE [host overhead on an async device] (in ``memfit.planning.hosttime``): one
plan's own host work against its own device work."""

from __future__ import annotations

from dataclasses import replace

from memfit.planning.arrays import ProfileArrays
from memfit.planning.hosttime import HOST_OP_S
from memfit.planning.offload import OffloadSpec
from memfit.planning.plan import OpPolicy, Plan
from memfit.planning.simulate import Simulation, simulate
from memfit.profiling.profile import Profile
from memfit.timemodel.calibration import Calibration, CalibrationSource

__all__ = ["device_only", "plan_hides", "rule_4_applies", "simulate_plan"]


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


def rule_4_applies(profile: Profile, arrays: ProfileArrays | None = None) -> bool:
    """Whether the bound of rule 1 fails on ``profile`` and its calibration has fixed charges
    that a plan hiding its own host work would not pay (rule 4)."""
    host = (arrays if arrays is not None else ProfileArrays(profile)).host
    cal = profile.calibration
    return (host.host_bound_s > 0 and not host.hidden and cal is not None
            and bool(cal.region_s or cal.op_s or cal.selective_op_s))


def simulate_plan(profile: Profile, plan: Plan, *, offload: OffloadSpec | None = None) -> Simulation:
    """``memfit.simulate``: ``memfit.planning.simulate.simulate`` with rule 4 applied, so that
    a plan the planner costed by its device seconds simulates to the same seconds.

    A plan without offload whose own host work hides behind its device work gets the
    simulation of ``device_only(profile)`` (the same timeline and peak: only the charges
    differ); any other plan the charged one (rules 1-3).
    """
    arrays = ProfileArrays(profile)
    sim = simulate(profile, plan, offload=offload, _arrays=arrays)
    offloads = any(pol is OpPolicy.OFFLOAD for r in plan.regions for _, pol in r.ops)
    if offload is not None or offloads or not rule_4_applies(profile, arrays):
        return sim
    device = simulate(device_only(profile), plan)
    return device if plan_hides(profile, plan, device.recompute_s)[0] else sim

