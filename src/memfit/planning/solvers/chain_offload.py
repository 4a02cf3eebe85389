"""Offload inside the chain DP: each block's ops saved, offloaded or recomputed.

NOTE [chain DP with offload]
    The chain DP (NOTE [chain DP] in ``memfit.planning.solvers.chain``) adds each choice's
    seconds along the chain, so an offloading block choice carries a link charge of its own.
    The exact model (NOTE [offload time model] in ``memfit.planning.offload``) queues the
    copies of all blocks on one link each way; the DP charges, per block ``k``, what its own
    copies leave exposed in a *window* of the link that belongs to block ``k`` alone. The
    windows of the blocks never overlap, so the charges add up to at least the exact time:

    1. D2H. The forward is cut at points ``S_0 <= S_1 <= ... <= S_n`` (``S_n``: the forward's
       end; ``S_k`` no earlier than block ``k``'s first op, so that block ``k - 1``'s copies
       are all made before ``S_k``); block ``k``'s window is ``[S_k, S_{k+1}]``. A copy of block
       ``k`` is released when its op ends or at ``S_k``, whichever is later (a later release
       never shortens a queue). The charge ``e_k = max(0, max_i (Σ_{rel_j >= rel_i} x_j -
       (S_{k+1} - rel_i)))`` over block ``k``'s copies (``x``: link seconds) is their lateness
       served alone in the window. For a threshold ``ρ`` of the exact formula in window ``m``
       the exact lateness is at most ``e_m + Σ_{k > m} (X_k - w_k)`` (``X_k``: block ``k``'s
       copy seconds, ``w_k``: its window's compute), and ``X_k - w_k <= e_k``: the exact D2H
       lateness is at most ``Σ_k e_k``.
    2. H2D. Block ``k``'s copies are needed at its recompute point ``rp_k``. The backward
       compute is cut at ``U_n = 0 <= U_{n-1} <= ... <= U_0`` with ``U_k`` no later than the
       backward compute before ``rp_k``; block ``k``'s window holds ``u_k = U_k - U_{k+1}``.
       The exact stall is ``max_m Σ_{k >= m} (X_k - Wb(rp_m))`` with ``Wb(rp_m) >= Σ_{k >= m}
       u_k``, so it is at most ``Σ_k f_k``, ``f_k = max(0, X_k - u_k)``.
    3. A block choice's seconds are its recompute, its per-storage charges
       (``OFFLOAD_TENSOR_S``), the selective charge, ``e_k + f_k`` and, under a host cap,
       ``price`` per host byte (a Lagrangian multiplier: while the plan holds more host bytes
       than the cap, the DP is rerun at a price found by bisection; that plan fits the cap,
       but may not be the best that does). The DP is exact for this model, whose time is an
       upper bound of the exact model's; the solver reports the exact one (``simulate``).
    4. Which windows: a parameter of the model, not of the plan. First every block gets its
       own: ``S_k`` a share ``shift`` into block ``k``'s forward (``SHIFTS``: a copy made
       late in its block hides behind the next block's compute only if its window reaches
       there), ``U_k`` the backward compute before ``rp_k``. Then, from the blocks that
       offload in that plan (``C``), windows are re-cut: blocks outside ``C`` get none, and
       blocks of ``C`` share the link time so freed (their own windows plus an equal extra,
       passed on block to block: the windows of blocks kept whole at the end of the chain
       serve every offloading block before them). The DP runs again (``ROUNDS`` times at
       most, until ``C`` repeats); the plan the exact model finds fastest wins.
    5. Choices per block: every assignment of save / offload / recompute when the block has
       at most ``OFFLOAD_ENUM_LIMIT`` ops to choose for; else, for a few offload sets (the
       ops whose recompute seconds per copy second are largest: ``OFFLOAD_LEVELS`` prefixes of
       that order evenly, and those whose copy seconds cross multiples of the block's own
       windows), the (kept bytes, time) knapsack frontiers of save sets with the other ops
       of the set offloaded (NOTE [chain DP]'s two frontiers), plus each op saved or
       offloaded alone. Each choice's local peak, constant, time and copies are exact; only
       which choices are offered is a heuristic on large blocks, as without offload.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memfit.planning.candidates import Candidate, Chain, PlanningContext
from memfit.planning.effects import ProfileArrays
from memfit.planning.plan import OpPolicy, Plan
from memfit.planning.simulate import simulate
from memfit.planning.solvers import Solution
from memfit.planning.solvers.chain import (
    ChainModel,
    _Choice,
    _knapsack_masks,
    _pareto3,
    main_chain,
    regions_of,
    run_dp,
)
from memfit.planning.solvers.offload_pass import offload_pass

__all__ = ["solve", "OFFLOAD_ENUM_LIMIT", "OFFLOAD_LEVELS", "SHIFTS", "ROUNDS", "PRICE_STEPS", "LinkWindows",
           "link_windows", "d2h_excess", "assignments", "block_choices", "solve_offload"]

OFFLOAD_ENUM_LIMIT = 6  # enumerate all 3**n assignments of a block with at most this many ops
OFFLOAD_LEVELS = 8      # else this many offload sets evenly, plus those crossing window multiples
SHIFTS = (0.0, 0.5)     # D2H windows start this share into each block's forward
ROUNDS = 3              # re-cuts of the windows after the first plan (NOTE [chain DP with offload] 4)
PRICE_STEPS = 12        # bisection steps on the host price
_CROSS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)  # offload sets crossing these multiples of a window


@dataclass(frozen=True)
class LinkWindows:
    """Per block: its D2H window ``[t0, t1]`` (seconds from the step's start) and its H2D
    window ``h2d`` (seconds), NOTE [chain DP with offload]."""

    t0: np.ndarray
    t1: np.ndarray
    h2d: np.ndarray

    @property
    def d2h(self) -> np.ndarray:
        return self.t1 - self.t0


def link_windows(arrs: ProfileArrays, a: list[int], fwd_hi: list[int], rp: list[int], *, shift: float = 0.0,
                 using: frozenset[int] | None = None) -> LinkWindows:
    """The link windows of a chain whose blocks start at ops ``a``, with forward zones ending
    at ``fwd_hi`` and recompute points ``rp``: each block its own (``using=None``), or shared
    by the blocks ``using`` (NOTE [chain DP with offload] 4)."""
    cum, nf = arrs.op_cumtime, arrs.n_forward
    n = len(a)
    end = float(cum[nf])
    lo = np.array([cum[a[k]] for k in range(n)])
    hi = np.array([cum[fwd_hi[k] + 1] for k in range(n)])
    base = np.append(lo + shift * (hi - lo), end)  # own windows [base_k, base_{k+1}]
    G = np.append([cum[rp[k]] - cum[nf] for k in range(n)], 0.0)  # backward compute before rp_k
    if using is None:
        return LinkWindows(base[:-1], base[1:], G[:-1] - G[1:])
    C = [k in using for k in range(n)]

    def cut_d2h(extra: float) -> np.ndarray:
        S = base.copy()
        for k in range(n):
            S[k + 1] = max(base[k + 1], S[k] + (base[k + 1] - base[k] + extra if C[k] else 0.0))
        return S

    def ok(extra: float) -> bool:
        S = cut_d2h(extra)
        return bool(S[n] <= end and (not C[n - 1] or S[n - 1] <= base[n - 1]))

    S = cut_d2h(_bisect(ok, end, largest=True))
    S[n] = end

    def cut_h2d(extra: float) -> np.ndarray:
        U = np.zeros(n + 1)
        for k in range(n - 1, -1, -1):
            U[k] = min(G[k], U[k + 1] + G[k] - G[k + 1] + extra) if C[k] else U[k + 1]
        return U

    first = min(using) if using else 0
    U = cut_h2d(_bisect(lambda e: bool(cut_h2d(e)[first] >= G[first]), float(G[0]), largest=False))
    return LinkWindows(S[:-1], S[1:], U[:-1] - U[1:])


def _bisect(ok: object, hi: float, *, largest: bool, steps: int = 50) -> float:
    """The largest ``x`` in ``[0, hi]`` with ``ok(x)`` (``ok`` true at 0, monotone), or the
    smallest one (``ok`` true at ``hi``)."""
    lo = 0.0
    if largest:
        if ok(hi):  # type: ignore[operator]
            return hi
    elif ok(0.0):  # type: ignore[operator]
        return 0.0
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        if ok(mid) == largest:  # type: ignore[operator]
            lo = mid
        else:
            hi = mid
    return lo if largest else hi


def d2h_excess(offloaded: np.ndarray, x: np.ndarray, release: np.ndarray, t1: float) -> np.ndarray:
    """Per row of ``offloaded`` (assignments x ops, 0/1, ops in release order): the lateness
    of those copies (seconds ``x``, released at ``release``) served alone before ``t1``."""
    if x.size == 0:
        return np.zeros(offloaded.shape[0])
    sx = offloaded * x[None, :]
    suffix = np.cumsum(sx[:, ::-1], axis=1)[:, ::-1]  # Σ_{j >= i} x_j
    late = suffix - (t1 - release)[None, :]
    return np.maximum(late.max(axis=1), 0.0)


def assignments(cand: Candidate, tj: np.ndarray, dj: np.ndarray, wj: np.ndarray, x_of: dict[int, float],
                windows: tuple[float, float], knapsack: object) -> np.ndarray:
    """Per-op assignments to offer (rows; 0 recompute, 1 save, 2 offload; columns: the ops of
    ``cand.choices`` in op order), NOTE [chain DP with offload] 5. ``tj``, ``dj``, ``wj``: per
    choice seconds, kept bytes and peak-aware weight; ``x_of``: copy seconds per offloadable op;
    ``knapsack``: ``chain._knapsack_masks``."""
    ops = sorted({c.op for c in cand.choices})
    n = len(ops)
    col = {op: i for i, op in enumerate(ops)}
    off_ok = np.zeros(n, dtype=bool)
    t_save = np.zeros(n)
    t_off = np.zeros(n)
    d_save = np.zeros(n, dtype=np.int64)
    w_save = np.zeros(n, dtype=np.int64)
    x = np.zeros(n)
    for j, c in enumerate(cand.choices):
        i = col[c.op]
        if c.policy is OpPolicy.SAVE:
            t_save[i], d_save[i], w_save[i] = tj[j], dj[j], wj[j]
        else:
            off_ok[i], t_off[i], x[i] = True, tj[j], x_of[c.op]
    if n <= OFFLOAD_ENUM_LIMIT:
        grid = np.array(np.meshgrid(*[[0, 1, 2] if off_ok[i] else [0, 1] for i in range(n)],
                                    indexing="ij")).reshape(n, -1).T
        return grid.astype(np.int8)
    rows = [np.zeros((1, n), dtype=np.int8)]
    eye = np.eye(n, dtype=np.int8)
    rows.append(eye)
    rows.append((2 * eye[off_ok]).astype(np.int8))
    good = np.nonzero(off_ok & (t_off < 0))[0]
    order = good[np.argsort(-(-t_off[good] / np.maximum(x[good], 1e-300)), kind="stable")]
    cum = np.cumsum(x[order])
    lengths = {0, len(order)}
    lengths.update(int(v) for v in np.linspace(0, len(order), OFFLOAD_LEVELS).round())
    for w in windows:
        for s in _CROSS:
            lengths.add(int(np.searchsorted(cum, s * w, side="right")))
    for m in sorted(lengths):
        in_o = np.zeros(n, dtype=bool)
        in_o[order[:m]] = True
        dt = t_save - np.where(in_o, t_off, 0.0)  # saving instead of the set's default
        for weight in (d_save, w_save):
            save = knapsack(weight, dt).astype(bool)  # type: ignore[operator]
            rows.append(np.where(save, 1, np.where(in_o[None, :], 2, 0)).astype(np.int8))
    return np.unique(np.concatenate(rows), axis=0)


@dataclass(frozen=True)
class _Table:
    """A block's offered assignments with what does not depend on the windows."""

    masks: np.ndarray   # assignments x choices, 0/1
    M: np.ndarray
    D: np.ndarray
    T: np.ndarray       # seconds without link charge and host price
    off: np.ndarray     # assignments x ops (op order), 0/1 offloaded
    x: np.ndarray       # per op: link seconds
    H: np.ndarray       # host bytes per assignment
    ends: np.ndarray    # per op: when it ends (seconds from the step's start)


def _table(model: ChainModel, k: int, cand: Candidate, v0: np.ndarray, base: np.ndarray, d0: int,
           vj: np.ndarray, dj: np.ndarray, tj: np.ndarray) -> _Table:
    spec = model.ctx.offload
    assert spec is not None
    ops = sorted({c.op for c in cand.choices})
    col = {op: i for i, op in enumerate(ops)}
    x = np.zeros(len(ops))
    nbytes = np.zeros(len(ops), dtype=np.int64)
    for c in cand.choices:
        if c.policy is OpPolicy.OFFLOAD and c.copy is not None:
            nbytes[col[c.op]] = c.copy.nbytes
            x[col[c.op]] = c.copy.nbytes / spec.link_bytes_per_s
    own = link_windows(model.ctx.arrays, model.a, model.fwd_hi, model.rp)
    wj = np.maximum(dj, vj.max(axis=1))
    A = assignments(cand, tj, dj, wj, dict(zip(ops, x.tolist(), strict=True)),
                    (float(own.d2h[k]), float(own.h2d[k])), _knapsack_masks)
    masks = np.zeros((A.shape[0], len(cand.choices)))
    for j, c in enumerate(cand.choices):
        masks[:, j] = A[:, col[c.op]] == (1 if c.policy is OpPolicy.SAVE else 2)
    # float products are exact: byte sums stay far below 2**53
    M = ((base + v0)[None, :] + np.rint(masks @ vj.astype(np.float64)).astype(np.int64)).max(axis=1)
    D = d0 + np.rint(masks @ dj.astype(np.float64)).astype(np.int64)
    off = (A == 2).astype(np.float64)
    T = cand.time_s + masks @ tj + masks.any(axis=1) * cand.selective_s
    H = np.rint(off @ nbytes.astype(np.float64)).astype(np.int64)
    ends = model.ctx.arrays.op_cumtime[np.array(ops, dtype=np.int64) + 1]
    return _Table(masks, M, D, T, off, x, H, ends)


def block_choices(model: ChainModel, k: int, cand: Candidate, v0: np.ndarray, base: np.ndarray, d0: int,
                  vj: np.ndarray, dj: np.ndarray, tj: np.ndarray) -> list[_Choice]:
    """Block ``k``'s checkpointed choices with offload (NOTE [chain DP with offload]): exact
    local peak ``M`` and constant ``D``; seconds with the block's link charge and host price.
    What does not depend on the windows is computed once per context."""
    assert model.windows is not None
    memo = model.ctx.memo.setdefault("chain_offload", {})
    tab = memo.get(cand.modules)
    if tab is None:
        tab = memo[cand.modules] = _table(model, k, cand, v0, base, d0, vj, dj, tj)
    win = model.windows
    t0, t1 = float(win.t0[k]), float(win.t1[k])
    link = (d2h_excess(tab.off, tab.x, np.maximum(tab.ends, t0), t1)
            + np.maximum(tab.off @ tab.x - float(win.h2d[k]), 0.0))
    T = tab.T + link + model.host_price * tab.H
    return [_Choice(k, k, cand, tuple(int(i) for i in np.nonzero(tab.masks[q])[0]), int(tab.M[q]),
                    int(tab.D[q]), float(T[q]), H=int(tab.H[q]))
            for q in _pareto3(tab.M, tab.D, T)]


def solve(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0, chain: Chain | None = None,
          nested: bool = True) -> Solution:
    """The chain solver with offload: ``solve_offload`` on ``chain`` (default: the profile's
    first chain).

    Raises:
        NotAChain: the profile has no chain the DP can use.
        Infeasible: no plan of the chain's plan space fits.
    """
    return solve_offload(ctx, budget_bytes, main_chain(ctx, chain), nested=nested)


def solve_offload(ctx: PlanningContext, budget_bytes: int, chain: Chain, *, nested: bool = True) -> Solution:
    """The chain DP with offload (NOTE [chain DP with offload]), each plan then given to the
    offload pass (NOTE [chain and offload]): the fastest by the exact model over the window
    cuts tried, within the host cap; ``recompute_s`` is the exact model's (``simulate``), not
    the DP's bound."""
    best: Solution | None = None
    for shift in SHIFTS:
        using: frozenset[int] | None = None
        seen: set[frozenset[int] | None] = set()
        for _ in range(ROUNDS + 1):
            seen.add(using)
            sol, offloading = _within_cap(ctx, budget_bytes, chain, shift, using, nested)
            sol = offload_pass(ctx, sol, budget_bytes)  # link time the windows left unused
            if best is None or sol.recompute_s < best.recompute_s:
                best = sol
            if not offloading or offloading in seen:
                break
            using = offloading
    assert best is not None
    return best


def _solve_at(ctx: PlanningContext, budget_bytes: int, chain: Chain, shift: float, using: frozenset[int] | None,
              price: float, nested: bool) -> tuple[Solution, int, frozenset[int]]:
    blocks = [ctx.candidate(blk) for blk in chain.blocks]
    a = [c.a for c in blocks]  # type: ignore[union-attr]
    fwd_hi = [a[k + 1] - 1 for k in range(len(a) - 1)] + [blocks[-1].b]  # type: ignore[union-attr]
    rp = [c.rp for c in blocks]  # type: ignore[union-attr]
    win = link_windows(ctx.arrays, a, fwd_hi, rp, shift=shift, using=using)
    model = ChainModel(ctx, chain, nested=nested, windows=win, host_price=price, offload_choices=block_choices)
    chosen, peak, _ = run_dp(model, budget_bytes)
    regions = regions_of(chosen)
    sim = simulate(ctx.profile, Plan(regions, 0, 0.0, None, "chain", ""), offload=ctx.offload, _arrays=ctx.arrays)
    offloading = frozenset(ch.k for ch in chosen if ch.H > 0)
    how = "own windows" if using is None else f"windows shared by the {len(using)} offloading blocks"
    priced = f", host price {price:.3g} s/B to fit the host cap" if price else ""
    notes = [f"chain {chain.parent or '<root>'}: {model.n} blocks, segments up to {model.cap}, with offload "
             f"({how}, D2H windows from {shift:g} into each block{priced}; NOTE [chain DP with offload])",
             *model.notes]
    return Solution(regions, peak, sim.recompute_s, "chain", tuple(notes)), int(sim.host_peak_bytes), offloading


def _within_cap(ctx: PlanningContext, budget_bytes: int, chain: Chain, shift: float, using: frozenset[int] | None,
                nested: bool) -> tuple[Solution, frozenset[int]]:
    """The DP at host price 0, or, when its plan exceeds the host cap, at the lowest price
    found by bisection whose plan fits the cap (NOTE [chain DP with offload] 3)."""
    spec = ctx.offload
    assert spec is not None
    sol, host, offloading = _solve_at(ctx, budget_bytes, chain, shift, using, 0.0, nested)
    cap = spec.host_budget_bytes
    if cap is None or host <= cap:
        return sol, offloading
    # a price at which no offload pays: above every op's recompute seconds per byte copied
    ratios = [1e-30]
    for blk in chain.blocks:
        cand = ctx.candidate(blk)
        ratios += [-c.effect.time_s / c.copy.nbytes for c in (cand.choices if cand is not None else ())
                   if c.policy is OpPolicy.OFFLOAD and c.copy is not None and c.copy.nbytes > 0]
    lo, hi = 0.0, 2.0 * max(ratios)
    fit, _, fit_off = _solve_at(ctx, budget_bytes, chain, shift, using, hi, nested)
    for _ in range(PRICE_STEPS):
        mid = 0.5 * (lo + hi)
        s, h, o = _solve_at(ctx, budget_bytes, chain, shift, using, mid, nested)
        if h <= cap:
            hi, fit, fit_off = mid, s, o
        else:
            lo = mid
    return fit, fit_off
