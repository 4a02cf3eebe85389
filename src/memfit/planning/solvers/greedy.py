"""A fast heuristic for graphs too large for the MILP.

Checkpoint candidate modules in order of bytes dropped per second of recompute (skipping
overlaps and any that would raise the peak) until the predicted peak fits; then save ops of
the chosen regions, most seconds saved per byte first, while the plan still fits; then drop
regions that are no longer needed, costliest first. Memory is tracked exactly on the linear
model's op positions and the chosen regions' replays.
"""

from __future__ import annotations

import numpy as np

from memfit.planning.candidates import Candidate, PlanningContext
from memfit.planning.effects import Effect
from memfit.planning.solvers import Infeasible, Solution, refuse_offload

__all__ = ["solve"]


class _State:
    def __init__(self, ctx: PlanningContext) -> None:
        arrs = ctx.arrays
        self.n = arrs.n_ops
        self.live = arrs.base_live.copy()
        self.before = arrs.base_before.copy()
        self.replay: dict[int, np.ndarray] = {}   # candidate id -> its replay vector
        self.cands: dict[int, Candidate] = {}

    def apply(self, eff: Effect, cand: Candidate, sign: int) -> None:
        lo, hi = cand.a, min(self.n - 1, max(cand.rp, cand.b))
        self.live[lo: hi + 1] += sign * eff.live(lo, hi)
        self.before[lo: hi + 1] += sign * eff.before(lo, hi)
        key = id(cand)
        rep = self.replay.setdefault(key, np.zeros(cand.stop - cand.a + 1, dtype=np.int64))
        rep += sign * eff.replay(cand.a, cand.stop)
        self.cands[key] = cand

    def peak(self, chosen: dict[int, list[int]]) -> int:
        pk = int(self.live.max())
        for key in chosen:
            c = self.cands[key]
            pk = max(pk, int(self.before[c.rp]) + int(self.replay[key].max()))
        return pk


def solve(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
    """A good (not optimal) plan whose linear-model peak fits the budget (no offload: NOTE
    [chain and offload] in ``memfit.planning.solvers.offload_pass``)."""
    refuse_offload(ctx, "greedy")
    cands = list(ctx.module_candidates)
    for ch in ctx.chains:
        cands.extend(ctx.segment_candidates(ch, cap=2))
    st = _State(ctx)
    chosen: dict[int, list[int]] = {}
    byid: dict[int, Candidate] = {id(c): c for c in cands}

    def dropped(c: Candidate) -> int:
        return int(-c.base.live(c.b + 1, c.b + 1)[0]) if c.b + 1 < ctx.arrays.n_ops else 0

    order = sorted(cands, key=lambda c: dropped(c) / (c.time_s + 1e-12), reverse=True)
    peak = st.peak(chosen)
    for c in order:
        if peak <= budget_bytes:
            break
        if any(not (c.b < o.a or c.a > o.b) for o in (byid[k] for k in chosen)):
            continue
        st.apply(c.base, c, +1)
        chosen[id(c)] = []
        new = st.peak(chosen)
        if new >= peak:
            st.apply(c.base, c, -1)
            del chosen[id(c)]
            continue
        peak = new
    if peak > budget_bytes:
        raise Infeasible(peak, "(greedy: heuristic)")
    # save ops while the plan fits
    for key in list(chosen):
        c = byid[key]
        effs = sorted(((j, ch.effect) for j, ch in enumerate(c.choices)),
                      key=lambda x: -x[1].time_s / (1 + max(0, int(x[1].live(c.rp, c.rp)[0]))))
        for j, eff in effs:
            st.apply(eff, c, +1)
            chosen[key].append(j)
            if st.peak(chosen) > budget_bytes:
                st.apply(eff, c, -1)
                chosen[key].pop()
        _drop_unpaid_saves(st, c, chosen, key, budget_bytes)
    # drop regions no longer needed
    for key in sorted(chosen, key=lambda k: -byid[k].time_s):
        c = byid[key]
        parts = [c.base, *(c.choices[j].effect for j in chosen[key])]
        for e in parts:
            st.apply(e, c, -1)
        ops = chosen.pop(key)
        if st.peak(chosen) > budget_bytes:
            for e in parts:
                st.apply(e, c, +1)
            chosen[key] = ops
    regions = tuple(byid[k].region(ops) for k, ops in sorted(chosen.items(), key=lambda kv: byid[kv[0]].a))
    t = sum(byid[k].time_s + sum(byid[k].choices[j].effect.time_s for j in ops)
            + (byid[k].selective_s if ops else 0.0)
            for k, ops in chosen.items())
    return Solution(regions, st.peak(chosen), float(t), "greedy",
                    (f"greedy: {len(cands)} candidates, {len(chosen)} chosen (heuristic, not optimal)",))


def _drop_unpaid_saves(st: _State, c: Candidate, chosen: dict[int, list[int]], key: int,
                       budget_bytes: int) -> None:
    """Unsave every op of ``c`` when together they save less rerun time than the region's
    selective charge (NOTE [dispatch overhead]) and the plan fits without them: a region whose
    only saves are free to rerun (a batch norm's empty reserve) would otherwise run torch's
    selective modes for nothing."""
    ops = chosen[key]
    if not ops or -sum(c.choices[j].effect.time_s for j in ops) >= c.selective_s:
        return
    for j in ops:
        st.apply(c.choices[j].effect, c, -1)
    chosen[key] = []
    if st.peak(chosen) > budget_bytes:
        for j in ops:
            st.apply(c.choices[j].effect, c, +1)
        chosen[key] = ops
