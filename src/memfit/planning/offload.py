"""The model of offloading an op's outputs to host memory (``OpPolicy.OFFLOAD``).

NOTE [offload memory model]
    Inside a checkpointed region an offloaded op is kept for the replay as a saved one is (the
    replay does not rerun it), but its outputs wait in host memory: copied device->host (D2H)
    after the op runs, host->device (H2D) before the replay needs them. Per output storage
    ``s`` of the op (NOTE [region memory model] in ``memfit.planning.effects``):
    - on the device it lives as under recompute: a *dropped* one ``[c, d]`` and again from the
      recompute point ``rp`` to its plain free; any other keeps its plain lifetime;
    - in the replay it is present from the replay's first step (the H2D copy has landed before
      the replay starts: prefetched, or at the latest on demand) to where a recomputed copy
      would end (a dropped one: the replay's end; another: its plain free within the replay);
      the recomputed copy would appear only at its own step, so offload adds ``[a, c - 1]`` to
      the replay and removes op ``c``'s kernel workspace there (the op does not rerun);
    - host memory holds it from ``c`` to ``rp``. Every such interval contains the last forward
      op (``c`` is a forward op, ``rp`` a backward one), so the host peak of a plan is the sum
      of its offloaded bytes: one knapsack row in the MILP.
    The effect is taken relative to recompute-all, as a save's is; it changes no position piece.

NOTE [offload time model]
    Copy seconds = bytes / the host link's rate, each way (``DevicePreset.host_link_bytes_per_s``,
    NOTE [host link] in ``memfit.timemodel.devices``). One link per direction, copies served
    one after another in op order:
    - D2H copies start when their op ends and should finish by the end of the forward; the
      time that does not hide is ``max(0, max_p (Σ_{c_j >= p} copy_j - Wf(p)))``, ``Wf(p)`` the
      forward compute after op ``p`` (a queue's lateness against one deadline);
    - H2D copies run from the start of the backward in order of need; the stall is
      ``max(0, max_q (Σ_{rp_j <= q} copy_j - Wb(q)))``, ``Wb(q)`` the backward compute before
      op ``q`` (the largest lateness of a queue served by earliest deadline);
    plus ``OFFLOAD_TENSOR_S`` per offloaded storage (events, stream bookkeeping, pool lookups,
    both directions). Both maxima are linear in the choice variables over a fixed set of
    thresholds ``p`` and ``q``, which is how the MILP models them exactly. Replays and the
    recompute they add to the backward are not counted as overlap (conservative).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from memfit.planning.effects import Effect, ProfileArrays, RegionModel
from memfit.planning.hosttime import OFFLOAD_TENSOR_S
from memfit.profiling.profile import Profile
from memfit.timemodel.devices import DevicePreset, preset, profile_preset

__all__ = ["OFFLOAD_TENSOR_S", "OffloadSpec", "Copy", "offload_effect", "offload_copies",
           "offload_replay_pieces", "link_exposed_s", "offload_time_s", "link_of"]


@dataclass(frozen=True)
class OffloadSpec:
    """What the planner may offload over.

    Attributes:
        link_bytes_per_s: host-link rate each way, bytes/s (> 0).
        host_budget_bytes: the most host bytes a plan may hold (None: no cap).
        tensor_s: fixed seconds per offloaded storage (``OFFLOAD_TENSOR_S``).
        target: the device preset whose link this is (``"h100"``; ``""``: unnamed), recorded on
            the plan as ``extra["target"]``.
    """

    link_bytes_per_s: float
    host_budget_bytes: int | None = None
    tensor_s: float = OFFLOAD_TENSOR_S
    target: str = ""


@dataclass(frozen=True)
class Copy:
    """The offloaded outputs of one op: created by op ``op``, needed back by ``rp``."""

    op: int
    rp: int
    nbytes: int
    n_storages: int


def link_of(profile: Profile, target: str | DevicePreset | None = None) -> tuple[float, str]:
    """The host-link rate (bytes/s each way) to plan ``profile`` with, and where it comes from.

    ``target`` (a preset name or a DevicePreset) wins; else the profile's own target (a
    fake-mode profile names its preset; one measured on the CPU is the CPU preset, which has
    no link). 0.0 when unknown (a profile measured on a GPU: name its ``target``).

    Example:
        >>> link_of(profile, "h100")              # doctest: +SKIP
        (51200000000.0, 'preset h100')
    """
    dev = preset(target) if target is not None else profile_preset(profile.device, profile.cost_model)
    if dev is None:
        return 0.0, f"profile device {profile.device!r} (no preset)"
    return float(dev.host_link_bytes_per_s), f"preset {dev.name}"


def offload_copies(rm: RegionModel, op: int) -> Copy:
    """The storages op ``op`` of the region would send to the host."""
    m = rm.c == op
    return Copy(int(op), int(rm.rp if rm.rp is not None else 0), int(rm.nb[m].sum()), int(m.sum()))


def offload_replay_pieces(rm: RegionModel, ops: Iterable[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replay pieces that offloading ``ops`` adds to recompute-all (NOTE [offload memory
    model]): each output present from the replay's first step, the op's workspace gone."""
    ops_a = np.fromiter(ops, dtype=np.int64)
    if ops_a.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    m = np.isin(rm.c, ops_a) & rm.replayed & (rm.c > rm.a)
    ws = ops_a[(ops_a >= rm.a) & (ops_a <= rm.stop)]
    ws = ws[rm.workspace[ws] > 0]
    starts = np.concatenate([np.full(int(m.sum()), rm.a, dtype=np.int64), ws])
    ends = np.concatenate([rm.c[m] - 1, ws])
    vals = np.concatenate([rm.nb[m], -rm.workspace[ws]])
    return starts, ends, vals


def offload_effect(rm: RegionModel, op: int, spec: OffloadSpec) -> Effect:
    """The change from recompute-all when op ``op`` is offloaded; ``time_s`` is its linear
    part (the op not rerun, the per-storage charge), without the link's exposed time."""
    rs, re_, rv = offload_replay_pieces(rm, (op,))
    z = np.zeros(0, dtype=np.int64)
    t = float(rm.op_time[op]) if op <= rm.stop else 0.0
    n = offload_copies(rm, op).n_storages
    return Effect(z, z, z, rs, re_, rv, time_s=n * spec.tensor_s - t)


def link_exposed_s(arrs: ProfileArrays, copies: Iterable[Copy], link_bytes_per_s: float) -> tuple[float, float]:
    """Seconds of D2H and H2D copying that no compute hides (NOTE [offload time model])."""
    cs = [c for c in copies if c.nbytes > 0]
    if not cs or link_bytes_per_s <= 0:
        return 0.0, 0.0
    nf = arrs.n_forward
    cum = arrs.op_cumtime
    d2h = 0.0
    run = 0.0
    by_op = sorted(cs, key=lambda c: -c.op)
    for k, c in enumerate(by_op):
        run += c.nbytes / link_bytes_per_s
        if k + 1 < len(by_op) and by_op[k + 1].op == c.op:
            continue
        window = float(cum[nf] - cum[c.op + 1])  # forward compute after op c
        d2h = max(d2h, run - window)
    h2d = 0.0
    run = 0.0
    by_rp = sorted(cs, key=lambda c: c.rp)
    for k, c in enumerate(by_rp):
        run += c.nbytes / link_bytes_per_s
        if k + 1 < len(by_rp) and by_rp[k + 1].rp == c.rp:
            continue
        window = float(cum[c.rp] - cum[nf])  # backward compute before op rp
        h2d = max(h2d, run - window)
    return d2h, h2d


def offload_time_s(arrs: ProfileArrays, copies: Iterable[Copy], spec: OffloadSpec) -> float:
    """The link's exposed seconds plus the per-storage charge of ``copies``."""
    cs = list(copies)
    d2h, h2d = link_exposed_s(arrs, cs, spec.link_bytes_per_s)
    return d2h + h2d + sum(c.n_storages for c in cs) * spec.tensor_s
