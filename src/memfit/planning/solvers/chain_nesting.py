"""The chain DP's nested choices (NOTE [chain DP] in ``memfit.planning.solvers.chain``): a
block with one sub-module checkpointed inside it (NOTE [nested regions]) and a segment with
each of its blocks checkpointed inside it (NOTE [nested segments], both in
``memfit.planning.nesting``), evaluated on the block's local points like the DP's other
choices."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from memfit.planning.candidates import Candidate, PlanningContext
from memfit.planning.effects import RegionModel, dense
from memfit.planning.nesting import NestedModel

__all__ = ["nested_effect"]


class ChainModel(Protocol):
    """What a nested choice is evaluated on (``memfit.planning.solvers.chain.ChainModel``)."""

    ctx: PlanningContext
    a: list[int]
    bwd_hi: list[int]

    def local_positions(self, k: int, j: int) -> np.ndarray: ...

    def later_constant(self, live: np.ndarray, before: np.ndarray, lo: int, j: int, cand: Candidate) -> int: ...


def nested_effect(model: ChainModel, outer: RegionModel, inners: list[RegionModel], k: int, j: int,
                  cand: Candidate) -> tuple[int, int, float] | None:
    """``(M, D, time)`` of ``outer`` over blocks ``k..j`` with ``inners`` nested in it: its
    local peak, its constant on later blocks, its recompute seconds; None where the nesting
    changes memory past block ``k - 1``'s recompute point (the DP's zones would not hold it)."""
    nm = NestedModel(model.ctx.arrays, outer, inners)
    lo, hi = model.a[k], model.bwd_hi[k]
    if nm.last_point > hi:
        return None
    M, live, before = _nested_peak(model, nm, lo, hi, model.local_positions(k, j))
    return M, model.later_constant(live, before, lo, j, cand), nm.time_s


def _nested_peak(model: ChainModel, nm: NestedModel, lo: int, hi: int, pos: np.ndarray
                 ) -> tuple[int, np.ndarray, np.ndarray]:
    """A nesting's local peak over ``pos`` and its replays, and its live and before vectors
    over ``lo..hi``. Replays sharing a recompute point run one after another, each on top of
    what the earlier ones left (their ``second_bytes``), as ``simulate``'s timeline has them."""
    arrs = model.ctx.arrays
    eff, replays = nm.effect()
    live, before = eff.live(lo, hi), eff.before(lo, hi)
    vec = [live[pos - lo]]
    base = [arrs.base_live[pos]]
    left: dict[int, int] = {}
    for r in sorted(replays, key=lambda r: (r.rp, r.depth)):
        extra = left.get(r.rp, 0)
        vec.append(before[r.rp - lo] + extra + dense(r.rs, r.re, r.rv, r.a, r.stop))
        base.append(np.full(r.stop - r.a + 1, arrs.base_before[r.rp], dtype=np.int64))
        left[r.rp] = extra + r.second_bytes
    return int((np.concatenate(base) + np.concatenate(vec)).max()), live, before
