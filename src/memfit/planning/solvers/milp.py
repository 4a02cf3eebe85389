"""Mixed-integer program (SciPy ``milp``, HiGHS) on the linear model, for any graph.

Variables: ``y_r`` (checkpoint candidate ``r``, recompute-all), ``s_{r,j} <= y_r`` (also save
op ``j`` of ``r``) and ``z_r >= s_{r,j}`` (``r`` saves some op), all binary. Minimise
``Σ T_r y_r - Σ t_j s_{r,j} + Σ c_r z_r`` (``c_r``: NOTE [dispatch overhead]) subject to, at every
point of the timeline that can bind, ``base(t) + Σ Δ_r(t) y_r + Σ B_{r,j}(t) s_{r,j} <= budget``
(NOTE [linear model]); candidates sharing a forward op are mutually exclusive (nesting). The
smallest peak is one MILP too: minimise ``P`` subject to ``base(t) + (row t) x <= P``.

NOTE [compressed memory rows] and NOTE [row dominance]: ``memfit.planning.solvers.milp_rows``.

NOTE [fixed variables]);
    - each remaining row ``t`` gets a continuous ``u_t = A_t x`` defined by difference from a
      *parent* row: ``u_t = u_parent + (A_t - A_parent) x`` (the parent is the previous row in
      timeline order, or for a replay point the op row of its recompute point, or none,
      whichever differs in fewest coefficients; it always comes earlier, so every ``u`` is
      pinned). Memory pieces start and end at few points, so the differences are sparse. The
      bound moves onto the variable: ``u_t <= budget - base(t)``;
    - memory is divided by the gcd of all coefficients and the budget rounded down to it
      (``A x`` is a multiple of the gcd), then scaled (NOTE [memory units]).
    On that GPT: about 290 rows, 5,000 nonzeros, 0.5-2.7 s per solve. ``compress=False`` builds
    the dense rows (all points, no merging, nothing fixed): the reference the tests compare to.

NOTE [memory units]
    The memory rows count bytes in units of ``g * k``: ``g`` the gcd of the coefficients, ``k``
    the least power of two (at most 2**16) that brings the largest coefficient to 2**20 units
    or less. Divided by a power of two the coefficients and bounds stay exact floats, and the
    ``u`` columns are continuous. In gcd units alone HiGHS (presolve off) called a MONeT
    ResNet-50's compressed model infeasible in 0.1 s where the dense model had a plan
    (coefficients to 1.96e9; the v100 preset's compiled costs at 8.01 GB); in units of 2**11
    gcds it proved the same optimum in 1 s.

NOTE [row dominance]
    Row ``hi`` implies row ``lo`` when ``base_hi >= base_lo`` and ``A_hi x >= A_lo x`` for every
    ``x`` with ``s_{r,j} <= y_r``. With ``d = A_hi - A_lo`` that is, per candidate ``r``,
    ``d[y_r] + Σ_j min(0, d[s_{r,j}]) >= 0`` (``y_r = 0`` adds nothing; ``y_r = 1`` adds at least
    that). After equal rows are merged no two rows imply each other, so dropping every implied
    row leaves, for each, a chain of implications ending at a kept row. Each row is compared
    with the next two remaining ones in timeline order, in rounds, as neighbours differ least.

NOTE [fixed variables]
    From the rows that bound memory: a candidate that lowers no row even with its best saves
    (``Δ_r + Σ_j min(0, B_{r,j}) >= 0`` everywhere) is fixed off: removing it from a plan lowers
    no row and its recompute time is ``>= 0``. A save that raises no row (``B_{r,j} <= 0``
    everywhere) is tied to its candidate (``s_{r,j} = y_r``): adding it lowers no row and saves
    the op's time (saveable ops take time ``> 0``), provided the free saves of that candidate
    together save at least its selective charge (NOTE [dispatch overhead]); ``z_r`` is never
    fixed on.
"""


from __future__ import annotations

import logging

import numpy as np

from memfit._native_output import silenced_fd
from memfit.errors import SolverTimeout
from memfit.planning.candidates import OpChoice, PlanningContext, overlap_groups
from memfit.planning.costs import LinearModel
from memfit.planning.plan import OpPolicy
from memfit.planning.solvers import Infeasible, Solution
from memfit.planning.solvers.milp_rows import MemoryRows, _gcd, memory_rows
from memfit.units import format_bytes

__all__ = ["solve", "min_peak", "MemoryRows", "memory_rows"]  # rows re-exported

log = logging.getLogger(__name__)

# HiGHS presolve off: on the compressed model of an 8-block GPT it spent 0.5-1.5 s before the
# root and its restarts did not repay it (median solve 1.4 s off vs 2.4 s on, measured here)
PRESOLVE = False

# with OFFLOAD columns the dense rows are used up to this many cells (NOTE [offload in the milp])
DENSE_OFFLOAD_CELLS = 20_000_000


def _choices(lm: LinearModel, x: np.ndarray) -> list[tuple[int, tuple[int, ...]]]:
    on = np.round(x[: lm.n_vars]).astype(int) == 1
    out = []
    for r in range(len(lm.cands)):
        if on[r]:
            ops = tuple(lm.var_choice[v] for v in range(len(lm.cands), lm.n_vars)
                        if on[v] and lm.var_owner[v] == r)
            out.append((r, ops))
    return out


def _fixings(lm: LinearModel, R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Variables fixed without losing the optimum (NOTE [fixed variables]), from the bounding
    rows ``R``. Returns (candidates that never lower a bounding row, save variables that never
    raise one)."""
    nc = len(lm.cands)
    owners = np.array(lm.var_owner[nc:], dtype=np.int64)
    best = R[:, :nc].copy()
    if owners.size:
        np.add.at(best.T, owners, np.minimum(R[:, nc:], 0).T)
    useless = np.asarray((best >= 0).all(axis=0))
    free_save = np.asarray((R[:, nc:] <= 0).all(axis=0)) & ~_has_alternative(lm)
    return useless, free_save


def _choice_of(lm: LinearModel, v: int) -> OpChoice:
    return lm.cands[lm.var_owner[v]].choices[lm.var_choice[v]]


def _has_alternative(lm: LinearModel) -> np.ndarray:
    """Per choice variable: whether it is an OFFLOAD or a SAVE whose op may also be offloaded
    (NOTE [offload in the milp]: such saves are never tied to their candidate)."""
    nc = len(lm.cands)
    out = np.zeros(lm.n_vars - nc, dtype=bool)
    if getattr(getattr(lm, "ctx", None), "offload", None) is None:  # no OFFLOAD choices
        return out
    for v in range(nc, lm.n_vars):
        c = lm.cands[lm.var_owner[v]]
        ch = c.choices[lm.var_choice[v]]
        out[v - nc] = ch.policy is OpPolicy.OFFLOAD or any(
            o.op == ch.op and o.policy is OpPolicy.OFFLOAD for o in c.choices)
    return out


def _offload_rows(lm: LinearModel, rows: _Rows, first_e: int, peak_mode: bool, unit_s: float) -> int:
    """NOTE [offload in the milp] Rows for OFFLOAD choices; returns the continuous columns
    added (``e_D``, ``e_H`` at ``first_e``, ``first_e + 1``, then the running sums; none in
    peak mode).
    - one decision per op: ``s_save + s_offload <= y_r``;
    - the host cap: ``Σ bytes_v s_v <= host budget`` (the host peak is the sum of offloaded
      bytes, NOTE [offload memory model] in ``memfit.planning.offload``);
    - the link time no compute hides (NOTE [offload time model]): ``e_D >= Σ_{op_v >= p}
      copy_v s_v - Wf(p)`` for each offloaded op ``p``, ``e_H >= Σ_{rp_v <= q} copy_v s_v -
      Wb(q)`` for each recompute point ``q``; ``e_D, e_H >= 0`` in the objective at cost 1.
      The sums are running sums in queue order (continuous columns ``S``), one nonzero per copy.
    Seconds are counted in objective units (``unit_s``), and HiGHS presolves these models: with
    presolve off (``PRESOLVE``) it reported as optimal plans 2.5x (seconds as coefficients) and
    then 4% (objective units) slower than the optimum it accepted when that plan was fixed
    (a 2-layer fake Llama 7B at 8.2 GiB, 2026-12-01); with presolve on it found the optimum.
    At another budget (9.0 GiB) the compressed rows still gave a plan 30% slower than the dense
    rows' optimum (which the compressed model accepts when fixed): until that is understood, a
    model with OFFLOAD columns uses the dense rows up to ``DENSE_OFFLOAD_CELLS``.
    Then the MILP's time of a plan is exactly ``LinearModel.time_s``."""
    spec = lm.ctx.offload
    nc = len(lm.cands)
    off = [v for v in range(nc, lm.n_vars) if _choice_of(lm, v).copy is not None]
    if spec is None or not off:
        return 0
    by_op: dict[tuple[int, int], list[int]] = {}
    for v in range(nc, lm.n_vars):
        by_op.setdefault((lm.var_owner[v], _choice_of(lm, v).op), []).append(v)
    for (r, _), vs in by_op.items():
        if len(vs) > 1:
            rows.add(1, np.zeros(len(vs) + 1, dtype=np.int64), np.array([*vs, r], dtype=np.int64),
                     np.array([1.0] * len(vs) + [-1.0]), -np.inf, 0.0)
    cps = [_choice_of(lm, v).copy for v in off]
    nbytes = np.array([c.nbytes for c in cps], dtype=np.int64)  # type: ignore[union-attr]
    if spec.host_budget_bytes is not None:
        g = _gcd(nbytes)
        rows.add(1, np.zeros(len(off), dtype=np.int64), np.array(off, dtype=np.int64), nbytes / g,
                 -np.inf, float(spec.host_budget_bytes // g))
    if peak_mode:
        return 0
    arrs = lm.ctx.arrays
    cum, nf = arrs.op_cumtime, arrs.n_forward
    copy_s = nbytes / spec.link_bytes_per_s / unit_s
    ops = np.array([c.op for c in cps], dtype=np.int64)  # type: ignore[union-attr]
    rps = np.array([c.rp for c in cps], dtype=np.int64)  # type: ignore[union-attr]
    offv = np.array(off, dtype=np.int64)
    # running sums S_k = S_{k-1} + (copies at threshold k) x, in queue order, then e >= S_k - W_k:
    # one nonzero per copy instead of one per copy and threshold
    n_s = 0
    for col, key, window in ((first_e, -ops, lambda p: cum[nf] - cum[p + 1]),
                             (first_e + 1, rps, lambda q: cum[q] - cum[nf])):
        levels, group = np.unique(key, return_inverse=True)
        for k, lvl in enumerate(levels):
            s_col = first_e + 2 + n_s + k
            m = group == k
            prev = [s_col - 1] if k else []
            rows.add(1, np.zeros(int(m.sum()) + 1 + len(prev), dtype=np.int64),
                     np.array([s_col, *prev, *offv[m]], dtype=np.int64),
                     np.array([1.0, *[-1.0] * len(prev), *(-copy_s[m])]), 0.0, 0.0)
            t = int(-lvl) if col == first_e else int(lvl)
            rows.add(1, np.zeros(2, dtype=np.int64), np.array([s_col, col], dtype=np.int64),
                     np.array([1.0, -1.0]), -np.inf, float(window(t)) / unit_s)
        n_s += len(levels)
    return 2 + n_s



def _paying_free_saves(lm: LinearModel, free_save: np.ndarray) -> np.ndarray:
    """Keep a candidate's free saves tied to it only where, together, they save at least its
    selective charge (NOTE [dispatch overhead]): then any plan checkpointing it does no worse
    with all of them saved; otherwise saving none may be faster."""
    nc = len(lm.cands)
    owners = np.array(lm.var_owner[nc:], dtype=np.int64)
    if not owners.size:
        return free_save
    gain = np.zeros(nc)
    np.add.at(gain, owners[free_save], -lm.var_time[nc:][free_save])
    return free_save & (gain[owners] >= lm.selective_time[owners])


def _run(lm: LinearModel, A: np.ndarray, budget: int | None, time_limit_s: float,
         n_forward: int, *, compress: bool = True) -> tuple[object, int]:
    """Solve for least time under ``budget`` or (``None``) least peak.

    Returns (scipy result, memory rows in the model).
    """
    from scipy.optimize import Bounds, milp

    peak_mode = budget is None
    nv = lm.n_vars
    nc = len(lm.cands)
    pos = np.where(A > 0, A, 0).sum(axis=1)
    neg = np.where(A < 0, A, 0).sum(axis=1)
    lower = int((lm.base + neg).max()) if A.shape[0] else 0  # no plan peaks below this
    rows = _Rows()
    if compress:
        mr = memory_rows(lm, A, lower if peak_mode else int(budget))  # type: ignore[arg-type]
        n_mem = mr.n_rows
        R = A[mr.points]
        par = mr.parent
        D = R - np.where(par[:, None] >= 0, R[np.maximum(par, 0)], 0)
        g, per = _units(D)
        q = g * per  # bytes per unit of the u columns and their rows (NOTE [memory units])
        n = nv + n_mem + (1 if peak_mode else 0)
        lb, ub = np.zeros(n), np.ones(n)
        # u_k - u_parent - D_k x = 0
        ii, jj = np.nonzero(D)
        k = np.arange(n_mem)
        hp = par >= 0
        rows.add(n_mem, np.concatenate([ii, k, k[hp]]), np.concatenate([jj, nv + k, nv + par[hp]]),
                 np.concatenate([-D[ii, jj] / q, np.ones(n_mem), -np.ones(int(hp.sum()))]), 0.0, 0.0)
        lb[nv: nv + n_mem] = neg[mr.points] / q
        ub[nv: nv + n_mem] = pos[mr.points] / q
        bd = np.nonzero(mr.bounded)[0]
        if peak_mode:  # u_k - P <= -base_k
            rows.add(bd.size, np.concatenate([np.arange(bd.size)] * 2),
                     np.concatenate([nv + bd, np.full(bd.size, n - 1)]),
                     np.concatenate([np.ones(bd.size), -np.ones(bd.size)]), -np.inf, -mr.base[bd] / q)
        else:
            ub[nv + bd] = np.minimum(ub[nv + bd], ((int(budget) - mr.base[bd]) // g) / per)  # type: ignore[arg-type]
        useless, free_save = _fixings(lm, R[mr.bounded])
        free_save = _paying_free_saves(lm, free_save)
    else:
        n_mem = A.shape[0]
        g, per = _units(A)
        q = g * per
        n = nv + (1 if peak_mode else 0)
        lb, ub = np.zeros(n), np.ones(n)
        ii, jj = np.nonzero(A)
        vals = A[ii, jj] / q
        if peak_mode:  # A x - P <= -base
            rows.add(n_mem, np.concatenate([ii, np.arange(n_mem)]), np.concatenate([jj, np.full(n_mem, n - 1)]),
                     np.concatenate([vals, -np.ones(n_mem)]), -np.inf, -lm.base / q)
        else:
            rows.add(n_mem, ii, jj, vals, -np.inf, ((int(budget) - lm.base) // g) / per)  # type: ignore[arg-type]
        useless, free_save = np.zeros(nc, bool), np.zeros(nv - nc, bool)
    # s_{r,j} <= y_r (= y_r when saving never costs memory); one candidate of each nested group
    owner_s = np.array(lm.var_owner[nc:], dtype=np.int64)
    ks = np.arange(nv - nc)
    rows.add(ks.size, np.concatenate([ks, ks]), np.concatenate([nc + ks, owner_s]),
             np.concatenate([np.ones(ks.size), -np.ones(ks.size)]), np.where(free_save, 0.0, -np.inf), 0.0)
    for grp in overlap_groups(lm.cands, n_forward):
        rows.add(1, np.zeros(len(grp), dtype=np.int64), np.array(grp, dtype=np.int64), np.ones(len(grp)), -np.inf, 1.0)
    ub[:nc][useless] = 0.0
    ub[nc:nv][useless[owner_s]] = 0.0
    # z_r >= s_{r,j}: region r saves some op and pays its selective charge (NOTE [dispatch
    # overhead]); one binary per candidate that has saveable ops, after every other column
    charged = np.unique(owner_s[lm.selective_time[owner_s] > 0]) if owner_s.size and not peak_mode else owner_s[:0]
    z_of = {int(r): n + q for q, r in enumerate(charged)}
    if charged.size:
        zcol = np.array([z_of[int(r)] for r in owner_s if int(r) in z_of], dtype=np.int64)
        sk = ks[np.isin(owner_s, charged)]
        rows.add(sk.size, np.concatenate([np.arange(sk.size)] * 2), np.concatenate([nc + sk, zcol]),
                 np.concatenate([np.ones(sk.size), -np.ones(sk.size)]), -np.inf, 0.0)
    nz = charged.size
    # objective units: 1e3 per the largest time (HiGHS prefers coefficients near 1)
    scale = float(max(np.abs(lm.var_time).max(), lm.selective_time.max(initial=0.0))) or 1.0
    ne = _offload_rows(lm, rows, n + nz, peak_mode, scale / 1e3)
    lb, ub = np.concatenate([lb, np.zeros(nz + ne)]), np.concatenate([ub, np.ones(nz), np.full(ne, np.inf)])
    ub[n: n + nz][useless[charged]] = 0.0
    integrality = np.zeros(n + nz + ne)
    integrality[:nv] = 1
    integrality[n: n + nz] = 1
    c = np.zeros(n + nz + ne)
    if peak_mode:
        c[n - 1] = 1.0
        lb[n - 1] = lower / q if compress else -np.inf
        ub[n - 1] = np.inf
    else:
        c[:nv] = lm.var_time / scale * 1e3
        c[n: n + nz] = lm.selective_time[charged] / scale * 1e3
        c[n + nz: n + nz + min(ne, 2)] = 1.0  # e_D, e_H are in objective units already
    n += nz + ne
    cons = [rows.constraint(n)] if rows.n else []
    with silenced_fd(1):  # HiGHS may print progress lines to stdout from C++
        res = milp(c, constraints=cons, integrality=integrality, bounds=Bounds(lb, ub),
                   options={"time_limit": float(time_limit_s), "mip_rel_gap": 0.0,
                            "presolve": PRESOLVE or ne > 0})  # NOTE [offload in the milp]
    return res, n_mem


# NOTE [memory units]: the largest memory coefficient HiGHS is given, in units
MAX_COEFFICIENT = 2.0**20
# and the most units one gcd step of memory may shrink to: a plan over its budget by one step
# stays 1.5e-5 units over, far above HiGHS's feasibility tolerance (1e-7)
MAX_STEPS_PER_UNIT = 2**16


def _units(M: np.ndarray) -> tuple[int, int]:
    """``(g, k)``: memory rows in units of ``g * k`` bytes (NOTE [memory units])."""
    g = _gcd(M.ravel()) if M.size else 1
    top = float(np.abs(M).max(initial=0)) / g
    k = 1
    while top / k > MAX_COEFFICIENT and k < MAX_STEPS_PER_UNIT:
        k *= 2
    return g, k


class _Rows:
    """Constraint rows gathered as COO blocks."""

    def __init__(self) -> None:
        self.i: list[np.ndarray] = []
        self.j: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.lo: list[np.ndarray] = []
        self.hi: list[np.ndarray] = []
        self.n = 0

    def add(self, m: int, i: np.ndarray, j: np.ndarray, v: np.ndarray, lo: float | np.ndarray,
            hi: float | np.ndarray) -> None:
        """Rows ``self.n .. self.n + m - 1``: entries ``(i, j, v)`` with ``i`` counted from 0."""
        self.i.append(i + self.n)
        self.j.append(j)
        self.v.append(v)
        self.lo.append(np.broadcast_to(np.asarray(lo, dtype=np.float64), (m,)))
        self.hi.append(np.broadcast_to(np.asarray(hi, dtype=np.float64), (m,)))
        self.n += m

    def constraint(self, n_cols: int) -> object:
        from scipy.optimize import LinearConstraint
        from scipy.sparse import coo_matrix

        M = coo_matrix((np.concatenate(self.v), (np.concatenate(self.i), np.concatenate(self.j))),
                       shape=(self.n, n_cols)).tocsr()
        return LinearConstraint(M, np.concatenate(self.lo), np.concatenate(self.hi))


def min_peak(ctx: PlanningContext, *, time_limit_s: float = 10.0, compress: bool = True) -> tuple[int, bool]:
    """The smallest linear-model peak over the candidates (and whether it is proven optimal).

    One MILP: minimise ``P`` subject to ``base(t) + (row t) x <= P`` at every point that can bind.
    ``compress=False`` uses the dense rows (NOTE [compressed memory rows]); tests only.
    """
    cands = ctx.region_candidates()
    lm = LinearModel(ctx, cands)
    if not cands:
        return int(lm.base.max()), True
    res, _ = _run(lm, lm.matrix(), None, time_limit_s, ctx.arrays.n_forward, compress=compress)
    if getattr(res, "x", None) is None:
        return int(lm.base.max()), False
    return lm.peak(_choices(lm, res.x)), res.status == 0  # type: ignore[attr-defined]


def solve(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0,
          compress: bool = True, report_min: bool = True) -> Solution:
    """The least-recompute plan over all candidates whose linear-model peak fits the budget.

    Args:
        ctx: the planning context of the profile.
        budget_bytes: the largest predicted peak allowed (bytes).
        time_limit_s: seconds HiGHS may search (default 10.0); past it the best plan found is
            returned with a note, or ``SolverTimeout`` raised when none was found.
        compress: compress the memory rows (default ``True``; NOTE [compressed memory rows]);
            ``False`` builds the dense model, for tests.
        report_min: on infeasibility, solve for the smallest peak to report (default
            ``True``); ``False`` raises at once with ``min_bytes`` 0 (a caller that has a plan
            from another solver only needs to know this one has none).

    Raises:
        Infeasible: no plan fits (``min_bytes``: the smallest peak found).
        SolverTimeout: the time limit passed before HiGHS found any plan.

    Example:
        >>> sol = solve(PlanningContext(profile), 6 * 2**30)   # doctest: +SKIP
        >>> sol.predicted_peak_bytes <= 6 * 2**30               # doctest: +SKIP
        True
    """
    cands = ctx.region_candidates()
    lm = LinearModel(ctx, cands)
    nf = ctx.arrays.n_forward
    if compress and ctx.offload is not None and lm.n_vars * lm.n_points <= DENSE_OFFLOAD_CELLS:
        compress = False  # NOTE [offload in the milp]
    if not cands:
        pk = int(lm.base.max())
        if pk > budget_bytes:
            raise Infeasible(pk, "(no module can be checkpointed)")
        return Solution((), pk, 0.0, "milp", ("milp: no candidate regions",))
    A = lm.matrix()
    neg = np.where(A < 0, A, 0).sum(axis=1)
    if (lm.base + neg > budget_bytes).any():
        raise Infeasible(min_peak(ctx, time_limit_s=time_limit_s, compress=compress)[0] if report_min else 0)
    res, n_rows = _run(lm, A, budget_bytes, time_limit_s, nf, compress=compress)
    notes = [f"milp: {len(cands)} candidate regions, {lm.n_vars} variables, "
             f"{n_rows} of {lm.n_points} memory rows"]
    status = res.status  # type: ignore[attr-defined]
    x = getattr(res, "x", None)
    if x is None:
        if status == 2 and compress:
            # NOTE [compression fallback] The compressed rows have been seen to call a budget
            # at (and 0.1% above) the smallest peak infeasible where the dense model finds a
            # plan (a 3-block zoo GPT, 2026-11-30); until that is found, infeasibility is only
            # believed from the dense model.
            log.info("compressed milp infeasible at %d bytes; checking with the dense model", budget_bytes)
            return solve(ctx, budget_bytes, time_limit_s=time_limit_s, compress=False, report_min=report_min)
        if status == 2:
            raise Infeasible(min_peak(ctx, time_limit_s=time_limit_s, compress=compress)[0] if report_min else 0)
        raise SolverTimeout(
            f"solver 'milp' found no plan for a budget of {format_bytes(budget_bytes)} within its "
            f"time limit of {time_limit_s:g} s ({lm.n_vars} variables, {n_rows} memory rows). "
            "Give it more time (memfit.plan(..., time_limit_s=...)), or use solver='auto', which "
            "falls back to the chain or greedy solver when the MILP runs out of time.",
            solver="milp", time_limit_s=float(time_limit_s))
    if status != 0:
        notes.append(f"milp: time limit {time_limit_s:g} s hit; returning the best plan found "
                     f"(not proven optimal: {res.message})")  # type: ignore[attr-defined]
    choices = _choices(lm, x)
    pk = lm.peak(choices)
    regions = tuple(lm.cands[r].region(ops) for r, ops in sorted(choices, key=lambda c: lm.cands[c[0]].a))
    return Solution(regions, pk, lm.time_s(choices), "milp", tuple(notes))
