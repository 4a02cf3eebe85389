"""The linear cost model: a plan's memory timeline as the plain one plus a sum of effects.

NOTE [linear model]
    Points of the timeline: every op position ``0..N-1`` and, for every candidate region ``r``,
    one point per op of its replay (``a_r..stop_r``), sitting just before its recompute point.
    For candidate ``r`` recompute-all has a column ``Δ_r`` over all points (its own replay
    included on its own replay points; on another candidate's replay points it counts what it
    changes "just before" that candidate's recompute point); saving op ``j`` of ``r`` adds a
    column ``B_{r,j}`` (its outputs kept until ``rp_r`` instead of dropped or replayed). A plan
    (disjoint regions ``r`` with save sets ``S_r``) is predicted to peak at
    ``max_t base(t) + Σ_r (Δ_r(t) + Σ_{j ∈ S_r} B_{r,j}(t))`` and to cost
    ``Σ_r (T_r - Σ_{j ∈ S_r} t_j + [S_r ≠ ∅] c_r)`` seconds, ``c_r`` the selective-mode charge of
    NOTE [dispatch overhead].

    Exactness: equal to ``simulate`` whenever no storage is an input of two chosen regions and
    no two chosen regions share a recompute point (see NOTE [region memory model]). A shared
    input is counted once per region (an over-estimate). Replay points of regions not chosen are
    harmless: the memory just before op ``p`` never exceeds the memory at op ``p - 1``.

    Offload (NOTE [offload memory model], NOTE [offload time model] in
    ``memfit.planning.offload``): an OFFLOAD choice is a column like a save's; its time is the
    linear part of ``effect.time_s`` plus, for the whole plan, the link time no compute hides
    (``time_s`` adds it; the MILP models it with two continuous variables).

    Kernel workspaces (NOTE [region memory model]) sit in the op points of ``base`` (never in
    the "just before" values) and in each candidate's replay: ``Δ_r`` adds the workspace of
    every op it reruns, ``B_{r,j}`` removes op ``j``'s, since a saved op is not rerun.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memfit.planning.candidates import Candidate, PlanningContext
from memfit.planning.effects import Effect
from memfit.planning.offload import Copy, link_exposed_s

__all__ = ["LinearModel"]


class LinearModel:
    """Dense columns of the linear model over a fixed set of candidates (NOTE [linear model])."""

    def __init__(self, ctx: PlanningContext, cands: Sequence[Candidate]) -> None:
        self.ctx = ctx
        self.cands = list(cands)
        arrs = ctx.arrays
        n = arrs.n_ops
        self.n_ops = n
        self.rps = np.array([c.rp for c in self.cands], dtype=np.int64)
        self.lens = np.array([c.stop - c.a + 1 for c in self.cands], dtype=np.int64)
        self.offsets = n + np.concatenate([[0], np.cumsum(self.lens)[:-1]]).astype(np.int64) if self.cands \
            else np.zeros(0, dtype=np.int64)
        self.n_points = int(n + self.lens.sum())
        self.base = np.concatenate([arrs.base_live, np.repeat(arrs.base_before[self.rps], self.lens)]) \
            if self.cands else arrs.base_live.copy()
        # variables: y_r for each candidate, then s_{r,j} for each op choice j of each candidate
        self.var_owner: list[int] = list(range(len(self.cands)))
        self.var_choice: list[int] = [-1] * len(self.cands)
        for c in self.cands:
            for j in range(len(c.choices)):
                self.var_owner.append(c.index)
                self.var_choice.append(j)
        self.n_vars = len(self.var_owner)
        self.var_time = np.array([c.time_s for c in self.cands]
                                 + [ch.effect.time_s for c in self.cands for ch in c.choices],
                                 dtype=np.float64)
        # the fixed charge of a region that saves any op (NOTE [dispatch overhead])
        self.selective_time = np.array([c.selective_s for c in self.cands], dtype=np.float64)
        self._col_cache: dict[int, np.ndarray] = {}
        self._choice_var = {(c.index, j): len(self.cands) + k for k, (c, j) in
                            enumerate((c, j) for c in self.cands for j in range(len(c.choices)))}

    def column(self, var: int) -> np.ndarray:
        """The dense column of variable ``var`` over all points (int64)."""
        hit = self._col_cache.get(var)
        if hit is not None:
            return hit
        owner = self.cands[self.var_owner[var]]
        eff = owner.base if var < len(self.cands) else owner.choices[self.var_choice[var]].effect
        col = self.effect_column(eff, owner)
        self._col_cache[var] = col
        return col

    def effect_column(self, eff: Effect, owner: Candidate) -> np.ndarray:
        n = self.n_ops
        col = np.zeros(self.n_points, dtype=np.int64)
        col[:n] = eff.live(0, n - 1)
        before = eff.before(0, n - 1)
        if self.cands:
            col[n:] = np.repeat(before[self.rps], self.lens)
        off = int(self.offsets[owner.index])
        col[off: off + owner.stop - owner.a + 1] += eff.replay(owner.a, owner.stop)
        return col

    def choice_var(self, cand: int, choice: int) -> int:
        return self._choice_var[(cand, choice)]

    def matrix(self) -> np.ndarray:
        """All columns, shape (points, variables)."""
        if self.n_vars == 0:
            return np.zeros((self.n_points, 0), dtype=np.int64)
        return np.stack([self.column(v) for v in range(self.n_vars)], axis=1)

    def vars_of(self, choices: Sequence[tuple[int, Sequence[int]]]) -> list[int]:
        out = []
        for r, ops in choices:
            out.append(r)
            out.extend(self.choice_var(r, j) for j in ops)
        return out

    def timeline(self, choices: Sequence[tuple[int, Sequence[int]]]) -> np.ndarray:
        """Predicted memory at every point for a plan given as ``[(candidate, saved ops)]``."""
        total = self.base.copy()
        for v in self.vars_of(choices):
            total += self.column(v)
        return total

    def peak(self, choices: Sequence[tuple[int, Sequence[int]]]) -> int:
        return int(self.timeline(choices).max()) if self.n_points else 0

    def time_s(self, choices: Sequence[tuple[int, Sequence[int]]]) -> float:
        """Predicted recompute seconds: the variables' times plus, for each region that saves
        an op, its selective-mode charge (NOTE [dispatch overhead])."""
        extra = sum(self.selective_time[r] for r, ops in choices if len(ops))
        t = float(sum(self.var_time[v] for v in self.vars_of(choices)) + extra)
        copies = self.copies(choices)
        spec = self.ctx.offload
        if copies and spec is not None:
            t += sum(link_exposed_s(self.ctx.arrays, copies, spec.link_bytes_per_s))
        return t

    def copies(self, choices: Sequence[tuple[int, Sequence[int]]]) -> list[Copy]:
        """The host copies of a plan's OFFLOAD choices."""
        out = []
        for r, ops in choices:
            for j in ops:
                cp = self.cands[r].choices[j].copy
                if cp is not None:
                    out.append(cp)
        return out

    def host_bytes(self, choices: Sequence[tuple[int, Sequence[int]]]) -> int:
        """Peak host bytes of a plan: all its offloaded bytes (NOTE [offload memory model])."""
        return sum(c.nbytes for c in self.copies(choices))
