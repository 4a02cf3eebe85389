"""Mixed-integer program (SciPy ``milp``, HiGHS) on the linear model, for any graph.

Variables: ``y_r`` (checkpoint candidate ``r``, recompute-all) and ``s_{r,j} <= y_r`` (also save
op ``j`` of ``r``), all binary. Minimise ``Σ T_r y_r - Σ t_j s_{r,j}`` subject to, at every
point of the timeline that can bind, ``base(t) + Σ Δ_r(t) y_r + Σ B_{r,j}(t) s_{r,j} <= budget``
(NOTE [linear model]); candidates sharing a forward op are mutually exclusive (nesting).
Rows that can never bind are dropped and identical rows merged; memory is divided by the gcd
of all coefficients so HiGHS works on small exact integers.
"""

from __future__ import annotations

import logging
import math
from functools import reduce

import numpy as np

from memfit.planning.candidates import PlanningContext, overlap_groups
from memfit.planning.costs import LinearModel
from memfit.planning.solvers import Infeasible, Solution

__all__ = ["solve", "min_peak"]

log = logging.getLogger(__name__)


def _gcd(values: np.ndarray) -> int:
    nz = np.unique(np.abs(values[values != 0]))
    return int(reduce(math.gcd, (int(v) for v in nz), 0)) or 1


def _structure(lm: LinearModel, n_forward: int) -> tuple[list[np.ndarray], list[float]]:
    """Link rows (s <= y) and overlap rows (one of each nested group), as dense rows + ub."""
    rows, ub = [], []
    for v in range(len(lm.cands), lm.n_vars):
        r = np.zeros(lm.n_vars)
        r[v], r[lm.var_owner[v]] = 1.0, -1.0
        rows.append(r)
        ub.append(0.0)
    for g in overlap_groups(lm.cands, n_forward):
        r = np.zeros(lm.n_vars)
        r[g] = 1.0
        rows.append(r)
        ub.append(1.0)
    return rows, ub


def _choices(lm: LinearModel, x: np.ndarray) -> list[tuple[int, tuple[int, ...]]]:
    on = np.round(x[: lm.n_vars]).astype(int) == 1
    out = []
    for r in range(len(lm.cands)):
        if on[r]:
            ops = tuple(lm.var_op[v] for v in range(len(lm.cands), lm.n_vars)
                        if on[v] and lm.var_owner[v] == r)
            out.append((r, ops))
    return out


def _run(lm: LinearModel, A: np.ndarray, budget: int | None, time_limit_s: float,
         n_forward: int) -> tuple[object, bool]:
    """Solve for least time under ``budget`` or (``None``) least peak. Returns (result, peak_mode)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    peak_mode = budget is None
    base = lm.base
    if peak_mode:
        keep = np.ones(A.shape[0], dtype=bool)
    else:
        keep = base + np.where(A > 0, A, 0).sum(axis=1) > budget
    A_b, base_b = A[keep], base[keep]
    g = _gcd(A_b.ravel()) if A_b.size else 1
    n = lm.n_vars + (1 if peak_mode else 0)
    cons = []
    if A_b.size:
        uniq, inv = np.unique(A_b, axis=0, return_inverse=True)
        inv = np.asarray(inv).ravel()
        worst = np.full(uniq.shape[0], np.iinfo(np.int64).min, dtype=np.int64)
        np.maximum.at(worst, inv, base_b)
        if peak_mode:  # A x - z <= -base  (z in units of g, rounded up below)
            M = np.hstack([uniq / g, -np.ones((uniq.shape[0], 1))])
            cons.append(LinearConstraint(M, -np.inf, -worst / g))
        else:
            cons.append(LinearConstraint(uniq / g, -np.inf, (int(budget) - worst) // g))  # type: ignore[arg-type]
    rows, ub = _structure(lm, n_forward)
    if rows:
        R = np.array(rows)
        if peak_mode:
            R = np.hstack([R, np.zeros((R.shape[0], 1))])
        cons.append(LinearConstraint(R, -np.inf, np.array(ub)))
    if peak_mode:
        c = np.zeros(n)
        c[-1] = 1.0
        integrality = np.ones(n)
        integrality[-1] = 0
        bounds = Bounds(np.zeros(n), np.concatenate([np.ones(n - 1), [np.inf]]))
    else:
        scale = float(np.abs(lm.var_time).max()) or 1.0
        c = lm.var_time / scale * 1e3
        integrality = np.ones(n)
        bounds = Bounds(np.zeros(n), np.ones(n))
    res = milp(c, constraints=cons, integrality=integrality, bounds=bounds,
               options={"time_limit": float(time_limit_s), "mip_rel_gap": 0.0})
    return res, peak_mode


def min_peak(ctx: PlanningContext, *, time_limit_s: float = 10.0) -> tuple[int, bool]:
    """The smallest linear-model peak over the candidates (and whether it is proven optimal)."""
    cands = ctx.region_candidates()
    lm = LinearModel(ctx, cands)
    if not cands:
        return int(lm.base.max()), True
    res, _ = _run(lm, lm.matrix(), None, time_limit_s, ctx.arrays.n_forward)
    if getattr(res, "x", None) is None:
        return int(lm.base.max()), False
    return lm.peak(_choices(lm, res.x)), res.status == 0  # type: ignore[attr-defined]


def solve(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
    """The least-recompute plan over all candidates whose linear-model peak fits the budget.

    Raises:
        Infeasible: no plan fits (``min_bytes``: the smallest peak found).
    """
    cands = ctx.region_candidates()
    lm = LinearModel(ctx, cands)
    nf = ctx.arrays.n_forward
    if not cands:
        pk = int(lm.base.max())
        if pk > budget_bytes:
            raise Infeasible(pk, "(no module can be checkpointed)")
        return Solution((), pk, 0.0, "milp", ("milp: no candidate regions",))
    A = lm.matrix()
    neg = np.where(A < 0, A, 0).sum(axis=1)
    notes = [f"milp: {len(cands)} candidate regions, {lm.n_vars} variables"]
    if (lm.base + neg > budget_bytes).any():
        raise Infeasible(min_peak(ctx, time_limit_s=time_limit_s)[0])
    res, _ = _run(lm, A, budget_bytes, time_limit_s, nf)
    status = res.status  # type: ignore[attr-defined]
    x = getattr(res, "x", None)
    if x is None:
        if status == 2:
            raise Infeasible(min_peak(ctx, time_limit_s=time_limit_s)[0])
        raise TimeoutError(f"milp found no plan within its time limit of {time_limit_s:g} s")
    if status != 0:
        notes.append(f"milp: time limit {time_limit_s:g} s hit; returning the best plan found "
                     f"(not proven optimal: {res.message})")  # type: ignore[attr-defined]
    choices = _choices(lm, x)
    pk = lm.peak(choices)
    regions = tuple(lm.cands[r].region(ops) for r, ops in sorted(choices, key=lambda c: lm.cands[c[0]].a))
    return Solution(regions, pk, lm.time_s(choices), "milp", tuple(notes))
