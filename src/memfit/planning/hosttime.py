"""Host-side charges on an asynchronous device: when they hide behind the device's work.

NOTE [host overhead on an async device]
    The fixed charges of the time model (NOTE [region overhead], NOTE [dispatch overhead] in
    ``memfit.timemodel``; ``region_s``, ``op_s`` and ``selective_op_s`` of NOTE
    [calibration]) are seconds of *host* work: Python frames, saved-tensor hooks, dispatch
    modes, the divergence check. On a CPU the host is the device, so they add to the step.
    On an asynchronous accelerator (CUDA) the host only enqueues kernels; the device runs
    them later, in order. Host work delays the step only where the host falls behind the
    device, which cannot happen while the host has less to do than the device:

    1. *Any plan's host work* is at most ``H`` = ``HOST_OP_S`` per op of the plain step
       (forward and backward), plus ``HOST_OP_S`` per forward op twice more (a replay of an
       outer and of a nested region: NOTE [nested regions] allows one level), plus the fixed
       charges of the deepest plan: ``op_s + selective_op_s`` per forward op for the outer
       level and ``op_s`` for the nested one (a nested region saves nothing), ``region_s``
       per region, at most twice the largest number of pairwise-disjoint module op ranges
       (each level's regions are disjoint; a segment spans whole modules), plus
       ``OFFLOAD_TENSOR_S`` per forward-created storage.
    2. *Any plan's device work* is at least ``D``, the plain step's device seconds (a plan
       only adds work: replays, copies).
    3. If ``H <= D`` the step is device-bound whatever the plan: the host enqueues the whole
       step in less time than the device needs to run it, so the fixed charges hide behind
       kernels and are 0 seconds of step time; the calibration's fixed charges are zeroed.
       Otherwise they stay charged in full (no partial credit: what hides then depends on
       where in the step the host falls behind, which the linear model cannot see).

    The rule applies only to a profile for an asynchronous device whose calibration is the
    default one: a fake-mode profile for a GPU preset (op times from the roofline model), or
    a profile measured on CUDA. A *fitted* calibration measured what its fixed charges cost
    on the device they were timed on (hidden or not), so it is kept as fitted. ``H <= D``
    is a balance over the whole step, not per op: a host that falls behind in a stretch of
    cheap ops catches up only if it was ahead before. ``HOST_OP_S`` covers that with margin
    (about 5x the host cost per op measured here, below); the plan notes say the rule applied.

    4. *One plan's own host work*: where the bound of 1 fails (``H > D``), a plan ``P`` may
       still hide its charges. Its host work is at most ``HOST_OP_S`` per op of the plain
       step, plus ``HOST_OP_S`` and the fixed charges per forward op of its regions (an
       inner region's counted twice, as it replays twice), plus ``region_s`` per region;
       its device work is at least ``D`` plus the device seconds of its reruns. When the
       first is at most the second, ``P`` costs its device seconds alone. The planner
       therefore first solves with the fixed charges at 0 s (each plan's device seconds, a
       lower bound on its cost) and keeps that plan if it hides by this rule: no plan costs
       less than its own lower bound, so that plan is also the fastest under the charged
       model. Otherwise it solves again with the charges counted in full (rule 3). Not with
       offload (the per-storage charges of the copies are host work the check would have to
       place). ``plan_hides`` (in ``memfit.planning.hidden_host``) checks a plan; the
       plan's ``recompute_s`` is then its device seconds. ``memfit.simulate``
       (``hidden_host.simulate_plan``) applies the rule too, so it gives the same seconds;
       ``memfit.planning.simulate.simulate``, the solvers' own, applies rules 1-3 only.

    ``HOST_OP_S`` = 2**-16 s (15.3 us) per op: a forward + backward of 50 tiny Linear + Tanh
    blocks on this project's CPU (torch 2.13, 1 thread, 2026-12-01) costs 3.0 us of host
    time per aten op (801 ops, the device work negligible); a CUDA launch adds ~3-5 us. A
    power of two, so that sums of dyadic test times stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from memfit.profiling.profile import Profile
from memfit.timemodel.calibration import Calibration, CalibrationSource
from memfit.timemodel.devices import profile_preset

__all__ = ["HOST_OP_S", "OFFLOAD_TENSOR_S", "HostOverhead", "host_overhead", "max_disjoint"]

HOST_OP_S = 2.0**-16

# 2**-17 s (7.6 us) per offloaded storage, both directions: torchtune's OffloadActivations
# and torch's offload pass record an event and a stream wait per copy each way (a few us each
# on a GPU). A power of two, so that sums of dyadic test times stay exact. (NOTE [offload time
# model] in memfit.planning.offload; defined here because the host bound counts it.)
OFFLOAD_TENSOR_S = 2.0**-17


@dataclass(frozen=True)
class HostOverhead:
    """The outcome of NOTE [host overhead on an async device] for one profile.

    Attributes:
        calibration: the calibration the planners use (fixed charges zeroed when hidden).
        hidden: whether the fixed charges hide behind the device's work.
        host_bound_s: ``H``, the most host seconds any plan needs (0.0 when not checked).
        device_s: ``D``, the plain step's device seconds (0.0 when not checked).
        note: what was decided and why, for the plan's notes ("" when not checked).
    """

    calibration: Calibration
    hidden: bool = False
    host_bound_s: float = 0.0
    device_s: float = 0.0
    note: str = ""


def is_async_device(profile: Profile) -> bool:
    """Whether the profile's step runs on an asynchronous accelerator (a GPU preset in fake
    mode, or measured on CUDA)."""
    if str(profile.device).lower().startswith("cuda"):
        return True
    dev = profile_preset(profile.device, profile.cost_model)
    return dev is not None and dev.asynchronous


def max_disjoint(starts: np.ndarray, ends: np.ndarray) -> int:
    """The largest number of pairwise-disjoint closed intervals ``[start, end]`` (earliest
    end first, which is optimal)."""
    count, last = 0, -1
    for k in np.lexsort((starts, ends)):
        if starts[k] > last:
            count += 1
            last = ends[k]
    return count


def host_overhead(profile: Profile, calibration: Calibration, op_time: np.ndarray) -> HostOverhead:
    """Apply NOTE [host overhead on an async device] to ``profile`` (``op_time``: its per-op
    device seconds)."""
    if calibration.source is not CalibrationSource.DEFAULT or not is_async_device(profile):
        return HostOverhead(calibration)
    nf = profile.n_forward
    n = len(profile.ops)
    spans = [(m.first_op, m.last_op) for m in profile.modules
             if m.path and m.first_op is not None and m.last_op is not None]
    regions = 2 * max_disjoint(np.array([s for s, _ in spans], dtype=np.int64),
                               np.array([e for _, e in spans], dtype=np.int64)) if spans else 0
    fwd_storages = sum(1 for s in profile.storages if s.created_by is not None and s.created_by < nf)
    cal = calibration
    host = (HOST_OP_S * (n + 2 * nf) + nf * (2 * cal.op_s + cal.selective_op_s)
            + regions * cal.region_s + fwd_storages * OFFLOAD_TENSOR_S)
    device = float(op_time.sum())
    hidden = host <= device
    if hidden:
        cal = replace(cal, region_s=0.0, op_s=0.0, selective_op_s=0.0)
    verdict = ("hidden: region and per-op charges count 0 s" if hidden
               else "not hidden: region and per-op charges stay")
    note = (f"host overhead on an async device {verdict} (any plan's host work <= {host * 1e3:.1f} ms "
            f"{'<=' if hidden else '>'} the plain step's device work {device * 1e3:.1f} ms; NOTE "
            "[host overhead on an async device])")
    return HostOverhead(cal, hidden, host, device, note)

