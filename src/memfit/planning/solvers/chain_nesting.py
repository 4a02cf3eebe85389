"""The chain DP's nested choices (NOTE [chain DP] in ``memfit.planning.solvers.chain``): a
block with one sub-module checkpointed inside it (NOTE [nested regions]) or with its parts
(NOTE [segments nested in a block]), and a segment with each of its blocks checkpointed
inside it (NOTE [nested segments], all in ``memfit.planning.nesting``), evaluated on the
block's local points like the DP's other choices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from memfit.planning.candidates import Candidate, PlanningContext
from memfit.planning.effects import Effect, RegionModel, _cat, dense
from memfit.planning.nesting import NestedModel, Replay, nesting_refused

__all__ = ["nested_effect", "parts_choices"]


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
    changes memory past block ``k - 1``'s recompute point (the DP's zones would not hold it),
    or where the profile refuses nesting in ``outer`` (``memfit.planning.nesting.unnesting``)."""
    if nesting_refused(model.ctx.profile, outer.a, outer.b):
        return None
    nm = NestedModel(model.ctx.arrays, outer, inners)
    lo, hi = model.a[k], model.bwd_hi[k]
    if nm.last_point > hi:
        return None
    M, live, before = _local_peak(model, *nm.effect(), lo, hi, model.local_positions(k, j))
    return M, model.later_constant(live, before, lo, j, cand), nm.time_s


def parts_choices(model: ChainModel, k: int, cand: Candidate
                  ) -> list[tuple[int, int, float, tuple[tuple[str, ...], ...], bool]]:
    """``(M, D, time, parts, nested)`` of block ``k`` with each partition of it into parts
    (NOTE [segments nested in a block] in ``memfit.planning.nesting``) checkpointed inside
    it (``nested``), or checkpointed alone with the block kept."""
    out = []
    for parts in model.ctx.part_partitions(cand.modules[0]):
        names = tuple(p.span.modules for p in parts)
        r = nested_effect(model, cand.model, parts, k, k, cand)
        if r is not None:
            out.append((*r, names, True))
        r = _parts_alone(model, parts, k, cand)
        if r is not None:
            out.append((*r, names, False))
    return out


def _parts_alone(model: ChainModel, parts: list[RegionModel], k: int, cand: Candidate
                 ) -> tuple[int, int, float] | None:
    """``(M, D, time)`` of block ``k`` kept with ``parts`` checkpointed, each a region of its
    own (their effects add: NOTE [linear model]); None where a part changes memory past
    block ``k - 1``'s recompute point."""
    effs = [p.base_effect() for p in parts]
    lo, hi = model.a[k], model.bwd_hi[k]
    if max(max(int(e.pe.max(initial=0)) for e in effs), max(int(p.rp) for p in parts)) > hi:  # type: ignore[arg-type]
        return None
    empty = np.zeros(0, dtype=np.int64)
    eff = Effect(_cat(*(e.ps for e in effs)), _cat(*(e.pe for e in effs)), _cat(*(e.pv for e in effs)),
                 empty, empty, empty, time_s=sum(e.time_s for e in effs))
    replays = [Replay(int(p.rp), p.a, p.stop, e.rs, e.re, e.rv, 0, 0)  # type: ignore[arg-type]
               for p, e in zip(parts, effs, strict=True)]
    M, live, before = _local_peak(model, eff, replays, lo, hi, model.local_positions(k, k))
    return M, model.later_constant(live, before, lo, k, cand), eff.time_s


def _local_peak(model: ChainModel, eff: Effect, replays: Sequence[Replay], lo: int, hi: int,
                pos: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """The local peak over ``pos`` and the replays of a change made of ``eff`` and
    ``replays``, and its live and before vectors over ``lo..hi``. Replays sharing a
    recompute point run one after another, each on top of what the earlier ones left (their
    ``second_bytes``), as ``simulate``'s timeline has them."""
    arrs = model.ctx.arrays
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
