"""The memory rows of the MILP, compressed (``memfit.planning.solvers.milp``).

NOTE [compressed memory rows]
    The memory rows are dense (an activation kept from forward to backward changes every point
    in between) and nearly equal from one point to the next: on an 8-block GPT, 9,613 rows x
    497 variables with a million nonzeros, on which HiGHS spent 10 s presolving. Every step
    below keeps the optimum (the value; among equally fast plans another may be returned):
    - a row that cannot exceed the budget even with every positive coefficient on
      (``base + Σ max(A, 0) <= budget``) is dropped. For the peak, a row whose largest value is
      at most ``max_t (base + Σ min(A, 0))``, a lower bound of every plan's peak, is dropped
      (no plan's peak can come from it), and ``P`` gets that bound;
    - rows with the same coefficients are merged, keeping the largest base;
    - rows implied by a neighbour are dropped (NOTE [row dominance]);
    - variables that can only make a plan worse are fixed (
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import numpy as np

from memfit.planning.costs import LinearModel

__all__ = ["MemoryRows", "memory_rows"]


def _gcd(values: np.ndarray) -> int:
    nz = np.unique(np.abs(values[values != 0]))
    return int(reduce(math.gcd, (int(v) for v in nz), 0)) or 1


@dataclass(frozen=True)
class MemoryRows:
    """The memory rows left after NOTE [compressed memory rows].

    Row ``k`` stands for timeline point ``points[k]`` (of ``LinearModel``'s points). It bounds
    memory when ``bounded[k]`` (with ``base[k]``, the largest plain memory among the points it
    merges); otherwise it only anchors a difference. ``parent[k]`` is the row its coefficients
    are taken relative to (-1: none).
    """

    points: np.ndarray   # int64 (rows,)
    base: np.ndarray     # int64 (rows,)
    bounded: np.ndarray  # bool (rows,)
    parent: np.ndarray   # int64 (rows,)
    n_points: int        # points of the uncompressed model

    @property
    def n_rows(self) -> int:
        return int(self.points.size)


DOMINANCE_ROUNDS = 12  # rounds of comparing each remaining row with its next two (timeline order)


def _row_keys(R: np.ndarray) -> np.ndarray:
    """One hashable key per row (its bytes), for grouping equal rows."""
    R = np.ascontiguousarray(R)
    return R.view(np.dtype((np.void, R.dtype.itemsize * R.shape[1]))).ravel()


def _merge_equal(A: np.ndarray, pts: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group the rows ``A[pts]`` with equal coefficients. Returns (each group's earliest point,
    in timeline order; the largest base of each group; the group of each of ``pts``, as an index
    into the first array)."""
    rows = A[pts]
    # group by a hash of each row, checked exactly (a collision falls back to the bytes)
    h = rows @ np.random.default_rng(0).integers(1, 2**62, size=A.shape[1], dtype=np.int64)
    _, first, inv = np.unique(h, return_index=True, return_inverse=True)
    inv = np.asarray(inv).ravel()
    if not (rows == rows[first][inv]).all():
        _, inv = np.unique(_row_keys(rows), return_inverse=True)
        inv = np.asarray(inv).ravel()
    n_groups = int(inv.max()) + 1 if inv.size else 0
    rep = np.full(n_groups, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(rep, inv, pts)
    worst = np.full(n_groups, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(worst, inv, base)
    order = np.argsort(rep, kind="stable")
    rank = np.empty(n_groups, dtype=np.int64)
    rank[order] = np.arange(n_groups)
    return rep[order], worst[order], rank[inv]


def _dominated(lm: LinearModel, R: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Rows implied by another row among the next two of them, repeated (NOTE [row dominance])."""
    nc = len(lm.cands)
    owners = np.array(lm.var_owner[nc:], dtype=np.int64)  # s variables come grouped by owner
    starts = np.searchsorted(owners, np.arange(nc))
    ends = np.searchsorted(owners, np.arange(nc), side="right")
    out = np.zeros(R.shape[0], dtype=bool)

    def implies(d: np.ndarray) -> np.ndarray:
        # row "hi" implies row "lo" (their bases already compared) when d = hi - lo is >= 0 for
        # every feasible x: per candidate, y_r = 0 adds 0 and y_r = 1 at least d[y_r] plus the
        # negative d[s_r,j]
        cum = np.zeros((d.shape[0], d.shape[1] - nc + 1), dtype=np.int64)
        np.cumsum(np.minimum(d[:, nc:], 0), axis=1, out=cum[:, 1:])
        worst = d[:, :nc] + cum[:, ends] - cum[:, starts]
        return worst.min(axis=1, initial=0) >= 0  # type: ignore[no-any-return]

    Ry = np.ascontiguousarray(R[:, :nc])
    alive = np.arange(R.shape[0])
    for _ in range(DOMINANCE_ROUNDS):
        gone = np.zeros(alive.size, dtype=bool)
        for w in (1, 2):
            if alive.size <= w:
                break
            a, b = alive[:-w], alive[w:]
            # necessary: no y coefficient smaller in the implying row (then check the saves)
            dy = Ry[b] - Ry[a]
            db = base[b] - base[a]
            up = np.nonzero((db >= 0) & (dy >= 0).all(axis=1))[0]     # b may imply a
            gone[up[implies(R[b[up]] - R[a[up]])]] = True
            down = np.nonzero((db <= 0) & (dy <= 0).all(axis=1))[0]   # a may imply b
            gone[down[implies(R[a[down]] - R[b[down]])] + w] = True
        if not gone.any():
            break
        out[alive[gone]] = True
        alive = alive[~gone]
    return out


def memory_rows(lm: LinearModel, A: np.ndarray, floor: int) -> MemoryRows:
    """Compress the memory rows of ``A`` (points x variables) for a bound of ``floor`` bytes.

    Rows whose largest value is at most ``floor`` are dropped (``floor`` is the budget, or a
    lower bound of the smallest peak). See NOTE [compressed memory rows].
    """
    n_ops = lm.n_ops
    empty = np.zeros(0, dtype=np.int64)
    pos = np.where(A > 0, A, 0).sum(axis=1)
    live = np.nonzero(lm.base + pos > floor)[0]
    if live.size == 0 or A.shape[1] == 0:
        return MemoryRows(empty, empty, np.zeros(0, bool), empty, lm.n_points)
    pts, base, _ = _merge_equal(A, live, lm.base[live])
    keep = ~_dominated(lm, A[pts], base)
    pts, base = pts[keep], base[keep]
    # op rows at the recompute point of a candidate whose replay rows stay: difference anchors
    owner = np.repeat(np.arange(len(lm.cands)), lm.lens)
    anchors = np.setdiff1d(np.unique(lm.rps[owner[pts[pts >= n_ops] - n_ops]]), pts)
    allp = np.concatenate([pts, anchors])
    is_row = np.concatenate([np.ones(pts.size, bool), np.zeros(anchors.size, bool)])
    allb = np.concatenate([base, np.zeros(anchors.size, dtype=np.int64)])
    # an anchor equal to a row is that row; merge with base taken from rows only
    points, _, grp = _merge_equal(A, allp, np.where(is_row, allb, np.iinfo(np.int64).min))
    n_u = points.size
    bounded = np.zeros(n_u, dtype=bool)
    bounded[grp[is_row]] = True
    base_u = np.full(n_u, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(base_u, grp[is_row], allb[is_row])
    base_u[~bounded] = 0
    R = A[points]
    # parent: previous row, the recompute point's op row (replay rows), or none
    big = np.iinfo(np.int64).max
    cost_none = np.count_nonzero(R, axis=1)
    cost_prev = np.full(n_u, big, dtype=np.int64)
    cost_prev[1:] = np.count_nonzero(R[1:] - R[:-1], axis=1)
    cost_anchor = np.full(n_u, big, dtype=np.int64)
    anchor = np.full(n_u, -1, dtype=np.int64)
    rep = points >= n_ops
    if rep.any():
        anc_pts = lm.rps[owner[points[rep] - n_ops]]
        anchor[rep] = grp[_index_in(allp, anc_pts)]
        cost_anchor[rep] = np.count_nonzero(R[rep] - R[anchor[rep]], axis=1)
    best = np.argmin(np.stack([cost_none, cost_prev, cost_anchor]), axis=0)
    parent = np.where(best == 1, np.arange(n_u) - 1, np.where(best == 2, anchor, -1))
    # a parent always precedes its row (anchors are op rows, earlier than any replay row), so
    # the differences form a forest and every u is pinned to its row's value
    if (parent >= np.arange(n_u)).any():
        raise AssertionError("milp: a memory row's parent does not precede it")
    return MemoryRows(points, base_u, bounded, parent.astype(np.int64), lm.n_points)


def _index_in(arr: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Positions of ``values`` in ``arr`` (all present)."""
    order = np.argsort(arr, kind="stable")
    return order[np.searchsorted(arr, values, sorter=order)]
