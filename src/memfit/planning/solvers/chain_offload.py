"""Offload inside the chain DP: each block's ops saved, offloaded or recomputed.

NOTE [chain DP with offload]
    The chain DP (NOTE [chain DP] in ``memfit.planning.solvers.chain``) adds each choice's
    seconds along the chain, so an offloading block choice must carry a link charge of its
    own. The exact model (NOTE [offload time model] in ``memfit.planning.offload``) queues
    the copies of all blocks on one link each way; the DP charges instead, per block ``k``,
    what its own copies leave exposed in a window of the link that belongs to block ``k``
    alone, and the windows of the blocks tile the link's time:

    1. D2H. The forward's compute from block 0 to the end of the forward is cut into windows
       ``[T0_k, T1_k]``: ``T0_k`` is where a share ``shift`` of block ``k``'s forward compute
       has run, ``T1_k = T0_{k+1}``, the last window ends with the forward. A copy of block
       ``k`` is released when its op ends or at ``T0_k``, whichever is later (a later release
       never shortens the queue). The charge ``e_k = max(0, max_i (Σ_{rel_j >= rel_i} x_j -
       (T1_k - rel_i)))`` over block ``k``'s copies (``x``: copy seconds) is the lateness of
       its copies served alone in its window. For any threshold of the exact formula in
       window ``m``, the exact lateness is at most ``e_m + Σ_{k > m} (X_k - w_k)`` (``X_k``:
       block ``k``'s copy seconds, ``w_k``: its window), and ``X_k - w_k <= e_k``: so the
       exact D2H lateness is at most ``Σ_k e_k``.
    2. H2D. Block ``k``'s copies are needed at its recompute point ``rp_k``; the backward
       compute before it is ``Σ_{k' >= k} v_{k'}`` with ``v_k`` the backward of block ``k + 1``
       (for the last block: the backward before its recompute point). The exact stall is
       ``max_m Σ_{k >= m} (X_k - v_k)``, at most ``Σ_k f_k`` with ``f_k = max(0, X_k - v_k)``.
    3. A block choice's seconds are then its recompute, its per-storage charges
       (``OFFLOAD_TENSOR_S``), ``e_k + f_k`` and, under a host cap, ``price`` per host byte
       (a Lagrangian multiplier: the DP is rerun with a higher price while its plan holds more
       host bytes than the cap, bisecting; the plan then fits the cap, but may not be the
       best that does). The DP stays exact for this model; its time is an upper bound of
       the exact model's, which the solver reports (``simulate``), never the bound.
    4. Choices per block: every assignment of save / offload / recompute when the block has
       at most ``OFFLOAD_ENUM_LIMIT`` ops to choose for; else, for a few offload sets (the
       ops whose recompute seconds per copy second are largest: ``OFFLOAD_LEVELS`` prefixes of
       that order evenly, and those whose copy seconds cross shares of the block's windows), the
       (kept bytes, time) knapsack frontiers of save sets with the other ops of the set
       offloaded (NOTE [chain DP]'s two frontiers), plus each op saved or offloaded alone.
       Every choice's local peak, constant and time are then exact; only which choices are
       offered is a heuristic, as without offload.
    The windows' ``shift`` is a parameter of the model, not of the plan: a copy made late in
    its block's forward hides behind the next block's compute only if the window reaches
    there. The solver tries a few shifts and keeps the plan the exact model finds fastest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memfit.planning.candidates import Candidate, Chain, PlanningContext
from memfit.planning.plan import OpPolicy, Plan
from memfit.planning.simulate import simulate
from memfit.planning.solvers import Solution
from memfit.planning.solvers.chain import (
    ChainModel,
    _Choice,
    _knapsack_masks,
    _pareto3,
    regions_of,
    run_dp,
)

__all__ = ["OFFLOAD_ENUM_LIMIT", "OFFLOAD_LEVELS", "SHIFTS", "PRICE_STEPS", "LinkWindows", "link_windows",
           "d2h_excess", "assignments", "block_choices", "solve_offload"]

OFFLOAD_ENUM_LIMIT = 6  # enumerate all 3**n assignments of a block with at most this many ops
OFFLOAD_LEVELS = 8      # else this many offload sets evenly, plus those crossing window shares
SHIFTS = (0.0, 0.5)     # D2H window starts tried: share of each block's forward compute
_CROSS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)  # offload sets crossing these shares of a window


@dataclass(frozen=True)
class LinkWindows:
    """Per block: the D2H window ``[t0, t1]`` (seconds from the step's start) and the H2D
    window (seconds), NOTE [chain DP with offload]."""

    t0: np.ndarray
    t1: np.ndarray
    h2d: np.ndarray


def link_windows(cum: np.ndarray, n_forward: int, a: list[int], fwd_hi: list[int], rp: list[int],
                 shift: float) -> LinkWindows:
    """The link windows of a chain with blocks starting at ``a``, forward zones ending at
    ``fwd_hi`` and recompute points ``rp`` (``cum``: cumulative op seconds, ``cum[p]`` = start
    of op ``p``)."""
    n = len(a)
    t0 = np.empty(n)
    for k in range(n):
        lo, hi = cum[a[k]], cum[fwd_hi[k] + 1]
        t0[k] = lo + shift * (hi - lo)
    t1 = np.append(t0[1:], cum[n_forward])
    h2d = np.array([cum[rp[k]] - cum[rp[k + 1]] for k in range(n - 1)] + [cum[rp[-1]] - cum[n_forward]])
    return LinkWindows(t0, t1, h2d)


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
    ``cand.choices`` in op order), NOTE [chain DP with offload] 4. ``tj``, ``dj``, ``wj``: per
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


def block_choices(model: ChainModel, k: int, cand: Candidate, v0: np.ndarray, base: np.ndarray, d0: int,
                  vj: np.ndarray, dj: np.ndarray, tj: np.ndarray) -> list[_Choice]:
    """Block ``k``'s checkpointed choices with offload (NOTE [chain DP with offload]): exact
    local peak ``M`` and constant ``D``; time with the block's link charge and host price."""
    spec = model.ctx.offload
    assert spec is not None and model.windows is not None
    win = model.windows
    ops = sorted({c.op for c in cand.choices})
    col = {op: i for i, op in enumerate(ops)}
    x = np.zeros(len(ops))
    nbytes = np.zeros(len(ops), dtype=np.int64)
    for c in cand.choices:
        if c.policy is OpPolicy.OFFLOAD and c.copy is not None:
            nbytes[col[c.op]] = c.copy.nbytes
            x[col[c.op]] = c.copy.nbytes / spec.link_bytes_per_s
    t0, t1, h2d = float(win.t0[k]), float(win.t1[k]), float(win.h2d[k])
    wj = np.maximum(dj, vj.max(axis=1))
    A = assignments(cand, tj, dj, wj, dict(zip(ops, x.tolist(), strict=True)), (t1 - t0, h2d), _knapsack_masks)
    masks = np.zeros((A.shape[0], len(cand.choices)))
    for j, c in enumerate(cand.choices):
        masks[:, j] = A[:, col[c.op]] == (1 if c.policy is OpPolicy.SAVE else 2)
    # float products are exact: byte sums stay far below 2**53
    M = ((base + v0)[None, :] + np.rint(masks @ vj.astype(np.float64)).astype(np.int64)).max(axis=1)
    D = d0 + np.rint(masks @ dj.astype(np.float64)).astype(np.int64)
    off = (A == 2).astype(np.float64)
    cum = model.ctx.arrays.op_cumtime
    release = np.maximum(cum[np.array(ops) + 1], t0)
    link = d2h_excess(off, x, release, t1) + np.maximum(off @ x - h2d, 0.0)
    H = np.rint(off @ nbytes.astype(np.float64)).astype(np.int64)
    T = cand.time_s + masks @ tj + masks.any(axis=1) * cand.selective_s + link + model.host_price * H
    return [_Choice(k, k, cand, tuple(int(i) for i in np.nonzero(masks[q])[0]), int(M[q]), int(D[q]),
                    float(T[q]), H=int(H[q]))
            for q in _pareto3(M, D, T)]


def solve_offload(ctx: PlanningContext, budget_bytes: int, chain: Chain, *, nested: bool = True) -> Solution:
    """The chain DP with offload (NOTE [chain DP with offload]): the fastest plan by the exact
    model over the window shifts ``SHIFTS``, within the host cap; ``recompute_s`` is the exact
    model's (``simulate``), not the DP's bound."""
    best: Solution | None = None
    for shift in SHIFTS:
        sol = _within_cap(ctx, budget_bytes, chain, shift, nested)
        if best is None or sol.recompute_s < best.recompute_s:
            best = sol
    assert best is not None
    return best


def _solve_at(ctx: PlanningContext, budget_bytes: int, chain: Chain, shift: float, price: float,
              nested: bool) -> tuple[Solution, int]:
    model = ChainModel(ctx, chain, nested=nested, shift=shift, host_price=price)
    chosen, peak, _ = run_dp(model, budget_bytes)
    regions = regions_of(chosen)
    sim = simulate(ctx.profile, Plan(regions, 0, 0.0, None, "chain", ""), offload=ctx.offload, _arrays=ctx.arrays)
    notes = [f"chain {chain.parent or '<root>'}: {model.n} blocks, segments up to {model.cap}, with offload "
             f"(link windows shifted by {shift:g} of a block's forward{f', host price {price:.3g} s/B' if price else ''}; "
             "NOTE [chain DP with offload])", *model.notes]
    return Solution(regions, peak, sim.recompute_s, "chain", tuple(notes)), int(sim.host_peak_bytes)


def _within_cap(ctx: PlanningContext, budget_bytes: int, chain: Chain, shift: float, nested: bool) -> Solution:
    """The DP at host price 0, or, when its plan exceeds the host cap, at the lowest price
    found by bisection whose plan fits the cap (NOTE [chain DP with offload] 3)."""
    spec = ctx.offload
    assert spec is not None
    sol, host = _solve_at(ctx, budget_bytes, chain, shift, 0.0, nested)
    cap = spec.host_budget_bytes
    if cap is None or host <= cap:
        return sol
    # a price at which no offload pays: above every op's recompute seconds per byte copied
    ratios = [1e-30]
    for b in chain.blocks:
        cand = ctx.candidate((b,))
        ratios += [-c.effect.time_s / c.copy.nbytes for c in (cand.choices if cand is not None else ())
                   if c.policy is OpPolicy.OFFLOAD and c.copy is not None and c.copy.nbytes > 0]
    lo, hi = 0.0, 2.0 * max(ratios)
    fit, _ = _solve_at(ctx, budget_bytes, chain, shift, hi, nested)
    for _ in range(PRICE_STEPS):
        mid = 0.5 * (lo + hi)
        s, h = _solve_at(ctx, budget_bytes, chain, shift, mid, nested)
        if h <= cap:
            hi, fit = mid, s
        else:
            lo = mid
    return fit


PRICE_STEPS = 12  # bisection steps on the host price

