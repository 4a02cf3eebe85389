"""Exact dynamic programming over a chain of blocks (NOTE [chains]).

NOTE [chain DP]
    Zones of the timeline, for blocks ``0..n-1`` with forward ranges ``[a_k, b_k]`` and
    single-block recompute points ``rp_0 > rp_1 > ... > rp_{n-1} > b_{n-1}``: block ``k``'s
    forward zone is ``[a_k, a_{k+1} - 1]`` (the last one ends at ``b_{n-1}``), its backward zone
    ``[rp_k, rp_{k-1} - 1]`` (block 0's runs to the end of the step). Before ``a_0`` is the
    prefix, untouched by any plan; between ``b_{n-1}`` and ``rp_{n-1}`` the tail (head and
    loss, forward and backward), where every block's constant applies.
    A *choice* covers blocks ``k..j``: keep block ``k``; checkpoint it with a save set, or with
    one sub-module or its parts checkpointed inside it (NOTE [nested regions], [segments
    nested in a block]); or checkpoint the segment ``k..j`` (recompute-all), alone or with
    each of its blocks checkpointed inside it (NOTE [nested segments] in
    ``memfit.planning.nesting``). Its effect (NOTE [linear model]) is
    - local: on the forward zones ``k..j``, the backward zones ``j..k`` and its own replays;
    - a constant ``D`` (kept bytes, usually negative) on the zones of every later block and on
      the tail;
    - zero elsewhere (after a region's recompute point its storages live as in the plain step;
      a nesting's changes end before block ``k - 1``'s recompute point or it is not offered).
    So with ``P`` the sum of ``D`` over the choices before, a choice fits the budget iff
    ``P + M <= budget`` with ``M`` the maximum of plain memory plus its local effect over its
    local points. The DP runs over block boundaries with states ``(P, time)``, exact integers,
    Pareto-pruned. Each block's save sets are enumerated (all subsets when it has at most
    ``ENUM_LIMIT`` saveable ops, else a (kept bytes, time) knapsack frontier) and pruned to the
    Pareto set of ``(M, D, time)``. The frontier ignores the local peak ``M``, so recompute-all,
    single ops and a second frontier weighted by each op's largest local increase are added;
    only this case is not exact. Whether an effect really is constant on later zones is
    checked; where it is not, its maximum there is used (conservative) and a note says so.
    With offload, a block's choices also offload ops and pay a link charge of their own
    (NOTE [chain DP with offload] in ``memfit.planning.solvers.chain_offload``).

NOTE [state cap]
    The ``(P, time)`` frontier at a boundary grows about linearly with the blocks before it
    (some 250 states per Llama layer), so the DP's work grows with the square of the depth. Past
    ``STATE_CAP`` states at one boundary the frontier is cut to the fastest state of each of
    ``STATE_CAP`` equal bands of ``P``, plus the smallest ``P``. Every kept state is exact, and
    feasibility is monotone in ``P`` (NOTE [suffix peaks]), so a budget some plan fits is never
    lost and every plan returned fits; only the time may exceed the optimum, by what a band's
    slack of kept bytes is worth. Chains of up to some 60 blocks never reach the cap; the plan
    notes when it was cut.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit.planning.candidates import Candidate, Chain, PlanningContext, segment_cap
from memfit.planning.chain_joins import joined_chain
from memfit.planning.effects import Effect
from memfit.planning.plan import Region
from memfit.planning.solvers import Infeasible, Solution, refuse_offload
from memfit.planning.solvers.chain_nesting import nested_effect, parts_choices
from memfit.profiling.profile import is_for_compiler

__all__ = ["solve", "ChainModel", "chain_model", "suffix_peaks", "ENUM_LIMIT"]

log = logging.getLogger(__name__)

ENUM_LIMIT = 10      # enumerate all save sets of a block with at most this many saveable ops
KNAPSACK_CAP = 48    # else keep at most this many points of the knapsack frontier
STATE_CAP = 4_096    # DP states kept per block boundary (NOTE [state cap])


CAPPED_NOTE = (f"chain: more than {STATE_CAP} DP states at a block boundary; the fastest of each "
               "of that many bands of kept bytes was kept (NOTE [state cap]): the plan fits, its "
               "recompute may be slightly above the optimum")


class NotAChain(ValueError):
    """The profile's chain does not have the structure the DP needs."""


@dataclass(frozen=True)
class _Choice:
    k: int
    j: int
    cand: Candidate | None  # None: keep block k
    ops: tuple[int, ...]    # positions in cand.choices taken instead of recompute
    M: int
    D: int
    T: float
    inner: tuple[tuple[str, ...], ...] = ()  # regions inside the block, or the kept block's parts
    H: int = 0  # host bytes offloaded (NOTE [chain DP with offload])


class ChainModel:
    """Per-choice local peaks, constants and times of one chain (NOTE [chain DP])."""

    def __init__(self, ctx: PlanningContext, chain: Chain, *, cap: int | None = None,
                 nested: bool = True, windows: Any = None, host_price: float = 0.0,
                 offload_choices: Callable[..., list[_Choice]] | None = None) -> None:
        if ctx.offload is not None and (windows is None or offload_choices is None):
            raise ValueError("a chain planned with offload needs the host link's windows and the "
                             "offload choices: memfit.planning.solvers.chain_offload.solve plans it")
        self.offload_choices = offload_choices  # NOTE [chain DP with offload]
        self.ctx = ctx
        self.host_price = host_price  # seconds per host byte (NOTE [chain DP with offload])
        self.chain = chain
        arrs = ctx.arrays
        n = len(chain.blocks)
        self.n = n
        self.notes: list[str] = []
        self.exact = True
        cands = [ctx.candidate(blk) for blk in chain.blocks]
        if any(c is None for c in cands):
            raise NotAChain(f"chain {chain.parent!r} has a block that drops nothing")
        self.blocks: list[Candidate] = cands  # type: ignore[assignment]
        self.a = [c.a for c in self.blocks]
        self.rp = [c.rp for c in self.blocks]
        b_last = self.blocks[-1].b
        if not all(self.rp[k] > self.rp[k + 1] for k in range(n - 1)) or self.rp[-1] <= b_last:
            raise NotAChain(f"chain {chain.parent!r}: recompute points {self.rp} are not in reverse "
                            "block order, so its backward is not a reversed chain")
        nops = arrs.n_ops
        self.fwd_hi = [self.a[k + 1] - 1 for k in range(n - 1)] + [b_last]
        self.bwd_hi = [nops - 1] + [self.rp[k - 1] - 1 for k in range(1, n)]
        prefix = arrs.base_live[: self.a[0]]
        self.outside_peak = int(prefix.max()) if prefix.size else 0
        tail = arrs.base_live[b_last + 1: self.rp[-1]]
        self.tail_peak = int(tail.max()) if tail.size else 0
        self.cap = segment_cap(n) if cap is None else cap
        self.windows = windows  # NOTE [chain DP with offload]
        self.choices_by_end: list[list[_Choice]] = [[] for _ in range(n)]
        compiled = is_for_compiler(ctx.profile)  # then no nested segments: NOTE [segments under torch.compile]
        self._masks: dict[tuple[bytes, ...], np.ndarray] = {}  # knapsack save sets, by block
        for k in range(n):
            self.choices_by_end[k].extend(self._block_choices(k))
            if nested:
                self.choices_by_end[k].extend(self._nested_choices(k))
        for k in range(n):
            for j in range(k + 1, min(n, k + self.cap)):
                seg = ctx.candidate(chain.modules(k, j), with_ops=False)
                if seg is None:
                    continue
                vec, base, D = self._eval(seg.base, seg, k, j)
                M = int((base + vec).max())
                self.choices_by_end[j].append(_Choice(k, j, seg, (), M, D, seg.time_s))
                if nested and not compiled:
                    self.choices_by_end[j].extend(self._blocks_nested_choice(k, j, seg))
        self.choices: list[_Choice] = [c for chs in self.choices_by_end for c in chs]
        self.starting_at: list[list[int]] = [[] for _ in range(n)]
        for q, c in enumerate(self.choices):
            self.starting_at[c.k].append(q)
        self.memo: dict[str, Any] = {}  # NOTE [suffix peaks]
        self.last_capped = False  # whether the last run_dp capped its states (NOTE [state cap])

    # -- local evaluation ----------------------------------------------------------------------
    def local_positions(self, k: int, j: int) -> np.ndarray:
        return np.concatenate([np.arange(self.a[k], self.fwd_hi[j] + 1),
                               np.arange(self.rp[j], self.bwd_hi[k] + 1)])

    def _eval(self, eff: Effect, cand: Candidate, k: int, j: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(local effect vector, plain memory at those points, constant on later zones)."""
        arrs = self.ctx.arrays
        lo, hi = self.a[k], self.bwd_hi[k]
        live = eff.live(lo, hi)
        before = eff.before(lo, hi)
        pos = self.local_positions(k, j)
        nb = cand.stop - cand.a + 1
        vec = np.concatenate([live[pos - lo], before[cand.rp - lo] + eff.replay(cand.a, cand.stop)])
        base = np.concatenate([arrs.base_live[pos], np.full(nb, arrs.base_before[cand.rp], dtype=np.int64)])
        return vec, base, self.later_constant(live, before, lo, j, cand)

    def _block_choices(self, k: int) -> list[_Choice]:
        arrs = self.ctx.arrays
        cand = self.blocks[k]
        pos = self.local_positions(k, k)
        out = [_Choice(k, k, None, (), int(arrs.base_live[pos].max()), 0, 0.0)]
        v0, base, d0 = self._eval(cand.base, cand, k, k)
        J = len(cand.choices)
        if J == 0:
            out.append(_Choice(k, k, cand, (), int((base + v0).max()), d0, cand.time_s))
            return out
        vj = np.empty((J, v0.size), dtype=np.int64)
        dj = np.empty(J, dtype=np.int64)
        tj = np.array([c.effect.time_s for c in cand.choices], dtype=np.float64)
        for q, choice in enumerate(cand.choices):
            vj[q], _, dj[q] = self._eval(choice.effect, cand, k, k)
        if self.offload_choices is not None:  # NOTE [chain DP with offload]
            return out + self.offload_choices(self, k, cand, v0, base, d0, vj, dj, tj)
        if J <= ENUM_LIMIT:
            masks = ((np.arange(2 ** J)[:, None] >> np.arange(J)[None, :]) & 1).astype(np.int64)
        else:
            # two (kept bytes, time) frontiers: weights = bytes kept on later blocks, and the
            # largest local increase (peak-aware); plus recompute-all and each op alone
            wj = np.maximum(dj, vj.max(axis=1))
            key = (dj.tobytes(), wj.tobytes(), tj.tobytes())  # a model's identical blocks share it
            if key not in self._masks:
                self._masks[key] = np.unique(np.concatenate([
                    _knapsack_masks(dj, tj), _knapsack_masks(wj, tj),
                    np.zeros((1, J), dtype=np.int64), np.eye(J, dtype=np.int64)]), axis=0)
            masks = self._masks[key]
            if not self._noted_knapsack:
                self.notes.append(f"chain: blocks with more than {ENUM_LIMIT} saveable ops choose "
                                  "save sets on a (kept bytes, time) frontier")
                self._noted_knapsack = True
        M = (base[None, :] + v0[None, :] + masks @ vj).max(axis=1)
        D = d0 + masks @ dj
        T = cand.time_s + masks.astype(np.float64) @ tj + masks.any(axis=1) * cand.selective_s
        for q in _pareto3(M, D, T):
            ops = tuple(int(i) for i in np.nonzero(masks[q])[0])
            out.append(_Choice(k, k, cand, ops, int(M[q]), int(D[q]), float(T[q])))
        return out

    _noted_knapsack = False

    def _nested_choices(self, k: int) -> list[_Choice]:
        """Block ``k`` checkpointed with one of its sub-modules checkpointed inside it (NOTE
        [nested regions]); none in a merged block (NOTE [merged blocks])."""
        cand = self.ctx.candidate(self.chain.blocks[k], tail=False)  # NOTE [region tails]: none nested
        if cand is None or len(cand.modules) > 1:
            return []
        out = []
        for inner in self.ctx.inner_candidates(cand.modules[0]):
            r = nested_effect(self, cand.model, [inner], k, k, cand)
            if r is not None:
                out.append(_Choice(k, k, cand, (), *r, inner=(inner.span.modules,)))
        out.extend(_Choice(k, k, cand if n else None, (), M, D, T, inner=p) for M, D, T, p, n in parts_choices(self, k, cand))
        return out

    def _blocks_nested_choice(self, k: int, j: int, seg: Candidate) -> list[_Choice]:
        """Blocks ``k..j`` as one segment with each block checkpointed inside it (NOTE [nested
        segments] in ``memfit.planning.nesting``); none where a block is a merged one."""
        blocks = [self.ctx.candidate(blk, tail=False) for blk in self.chain.blocks[k: j + 1]]
        if any(b is None or len(b.modules) > 1 for b in blocks) or seg.model.rp is None:
            return []
        r = nested_effect(self, seg.model, [b.model for b in blocks if b], k, j, seg)
        return [] if r is None else [_Choice(k, j, seg, (), *r, inner=tuple(b.modules for b in blocks if b))]

    def later_constant(self, live: np.ndarray, before: np.ndarray, lo: int, j: int, cand: Candidate) -> int:
        """The effect on the zones of blocks after ``j`` and the tail (constant on a chain, else
        its maximum there)."""
        if j < self.n - 1:
            l2, h2 = self.a[j + 1], self.rp[j + 1]
        else:
            l2, h2 = self.fwd_hi[-1] + 1, self.rp[-1] - 1
            if h2 < l2:
                return 0
        later_live = live[l2 - lo: h2 - lo + 1]
        later_before = before[l2 + 1 - lo: h2 - lo + 1]
        D = int(later_live[0])
        if not ((later_live == D).all() and (later_before == D).all()):
            D = int(max(later_live.max(), later_before.max() if later_before.size else D))
            if self.exact:
                self.notes.append(f"chain: the effect of {cand.model.span.name} is not constant "
                                  "over later blocks; its maximum is used (conservative)")
            self.exact = False
        return D


def _pareto3(M: np.ndarray, D: np.ndarray, T: np.ndarray) -> list[int]:
    """Indices of points not dominated in (M, D, T), all minimised."""
    order = np.lexsort((D, M, T))
    kept: list[int] = []
    km = np.empty(0, dtype=np.int64)
    kd = np.empty(0, dtype=np.int64)
    for q in order:
        if km.size and ((km <= M[q]) & (kd <= D[q])).any():
            continue
        kept.append(int(q))
        km = np.append(km, M[q])
        kd = np.append(kd, D[q])
    return kept


def _knapsack_masks(d: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Save sets on the Pareto frontier of (kept bytes, recompute time) (t are negative)."""
    J = d.size
    front = [(0, 0.0, 0)]
    for q in range(J):
        cand = front + [(D + int(d[q]), T + float(t[q]), m | (1 << q)) for D, T, m in front]
        cand.sort(key=lambda x: (x[0], x[1]))
        front = []
        best = float("inf")
        for D, T, m in cand:
            if best > T:
                front.append((D, T, m))
                best = T
        if len(front) > KNAPSACK_CAP:
            idx = np.unique(np.linspace(0, len(front) - 1, KNAPSACK_CAP).round().astype(int))
            front = [front[i] for i in idx]
    return np.array([[(m >> q) & 1 for q in range(J)] for _, _, m in front], dtype=np.int64)


def _prune(P: np.ndarray, V: np.ndarray, *rest: np.ndarray, cap: int | None = None) -> tuple[np.ndarray, ...]:
    """Keep rows not dominated in (P, V), both minimised (ties: the first); past ``cap`` rows,
    the fastest row of each of ``cap`` equal bands of ``P`` and the smallest ``P`` (NOTE
    [state cap])."""
    # the rows come in runs sorted by P (a state set plus one choice's constant): a stable sort
    # merges them fast; rows of equal P keep their order, so an exact tie keeps the first row
    order = np.argsort(P, kind="stable")
    P, V = P[order], V[order]
    best = np.minimum.accumulate(V)
    keep = np.ones(P.size, dtype=bool)
    keep[1:] = V[1:] < best[:-1]
    keep[:-1] &= ~(keep[1:] & (P[1:] == P[:-1]))  # equal P: only the fastest
    idx = order[keep]
    P, V = P[keep], V[keep]
    if cap is not None and P.size > cap:
        # on the frontier V falls as P grows: a band's fastest row is its last
        band = ((P - P[0]).astype(np.float64) * (cap / (float(P[-1] - P[0]) + 1.0))).astype(np.int64)
        last = np.ones(P.size, dtype=bool)
        last[:-1] = band[1:] != band[:-1]
        last[0] = True  # the smallest P: feasibility is monotone in P (NOTE [suffix peaks])
        idx, P, V = idx[last], P[last], V[last]
    return (P, V, *(r[idx] for r in rest))


def suffix_peaks(model: ChainModel) -> tuple[list[int], list[int]]:
    """NOTE [suffix peaks] ``R[j]``: the least peak of blocks ``j..n-1`` and the tail, counted
    from a kept-bytes total of 0 at boundary ``j``, over every choice sequence; and the choice
    (an index into ``model.choices``) that starts a sequence reaching it.

    ``R[n]`` is the tail's peak and ``R[j] = min over choices c from j of max(M_c, D_c +
    R[end_c + 1])``: one pass over the choices, no states. A DP state ``(P, time)`` at boundary
    ``j`` can be completed within budget ``B`` iff ``P + R[j] <= B`` (the peak of a completion
    is ``P`` plus its peak from 0), so states failing that are dropped (exact), and the chain's
    least peak is ``max(outside peak, R[0])``, found without the ``(P, peak)`` state DP.
    """
    memo = model.memo.get("suffix")
    if memo is not None:
        return memo
    n = model.n
    R = [0] * (n + 1)
    arg = [-1] * (n + 1)
    R[n] = model.tail_peak
    for j in range(n - 1, -1, -1):
        best, best_t, pick = None, 0.0, -1
        for q in model.starting_at[j]:
            c = model.choices[q]
            r = max(c.M, c.D + R[c.j + 1])
            if best is None or r < best or (r == best and best_t > c.T):
                best, best_t, pick = r, c.T, q
        if best is None:
            raise AssertionError(f"chain block {j} has no choice")
        R[j], arg[j] = best, pick
    model.memo["suffix"] = (R, arg)
    return R, arg


def min_peak_choices(model: ChainModel) -> tuple[list[_Choice], int, float]:
    """The least-peak choice sequence (NOTE [suffix peaks]): (choices, peak, seconds)."""
    R, arg = suffix_peaks(model)
    chosen: list[_Choice] = []
    b = 0
    while b < model.n:
        c = model.choices[arg[b]]
        chosen.append(c)
        b = c.j + 1
    return chosen, max(model.outside_peak, R[0]), float(sum(c.T for c in chosen))


def run_dp(model: ChainModel, budget_bytes: int | None) -> tuple[list[_Choice], int, float]:
    """Least-time choices under the budget, or (``budget_bytes=None``) the least peak.

    Returns (choices, predicted peak, recompute seconds).
    Raises:
        Infeasible: no choice sequence fits the budget.
    """
    if budget_bytes is None:
        return min_peak_choices(model)
    n = model.n
    B = int(budget_bytes)
    capped = False
    R, _ = suffix_peaks(model)
    least = max(model.outside_peak, R[0])
    if least > B:
        raise Infeasible(least)
    # states per boundary: P (kept bytes so far), V (time, or peak so far), back pointers
    states: list[tuple[np.ndarray, ...]] = [(np.zeros(1, np.int64), np.zeros(1, np.float64),
                                             np.full(1, -1), np.full(1, -1), np.full(1, -1))]
    table: list[_Choice] = []
    for j in range(n):
        parts_P, parts_V, parts_b, parts_i, parts_c = [], [], [], [], []
        by_k: dict[int, list[_Choice]] = {}
        for ch in model.choices_by_end[j]:
            by_k.setdefault(ch.k, []).append(ch)
        for k, chs in by_k.items():
            P, V = states[k][0], states[k][1]
            if P.size == 0:
                continue
            M = np.array([c.M for c in chs], dtype=np.int64)
            D = np.array([c.D for c in chs], dtype=np.int64)
            T = np.array([c.T for c in chs], dtype=np.float64)
            gid = np.arange(len(table), len(table) + len(chs))
            table.extend(chs)
            # fits here, and can still be completed within the budget (NOTE [suffix peaks])
            Rnext = np.array([R[c.j + 1] for c in chs], dtype=np.int64)
            here = P[:, None] + np.maximum(M, D + Rnext)[None, :]
            si, oi = np.nonzero(here <= B)
            if si.size == 0:
                continue
            parts_P.append(P[si] + D[oi])
            parts_V.append(V[si] + T[oi])
            parts_b.append(np.full(si.size, k))
            parts_i.append(si)
            parts_c.append(gid[oi])
        if not parts_P:  # every feasible sequence passes over this boundary (a segment)
            empty = np.zeros(0, np.int64)
            states.append((empty, np.zeros(0, np.float64), empty, empty, empty))
            continue
        pruned = _prune(np.concatenate(parts_P), np.concatenate(parts_V), np.concatenate(parts_b),
                        np.concatenate(parts_i), np.concatenate(parts_c))
        if pruned[0].size > STATE_CAP:  # NOTE [state cap]
            capped = True
            pruned = _prune(*pruned, cap=STATE_CAP)
        states.append(pruned)
    P, V, sb, si, sc = states[n]
    tail = P + model.tail_peak  # head and loss: every block's constant applies
    ok = np.nonzero(tail <= B)[0]
    if ok.size == 0:
        raise AssertionError("chain DP: no final state fits a feasible budget")
    q = int(ok[np.argmin(V[ok])])
    chosen: list[_Choice] = []
    b = n
    peak = model.outside_peak
    while b > 0:
        ch = table[int(states[b][4][q])]
        chosen.append(ch)
        q, b = int(states[b][3][q]), int(states[b][2][q])
    chosen.reverse()
    Pacc = 0
    total_t = 0.0
    for ch in chosen:
        peak = max(peak, Pacc + ch.M)
        Pacc += ch.D
        total_t += ch.T
    peak = max(peak, Pacc + model.tail_peak)
    model.last_capped = capped
    return chosen, int(peak), float(total_t)


def regions_of(chosen: list[_Choice]) -> tuple:
    out: list[Region] = []
    for ch in chosen:
        if ch.cand is not None:
            out.append(ch.cand.region(ch.ops))
        out.extend(Region(m) for m in ch.inner)  # nested, or parts of a kept block
    return tuple(out)


def main_chain(ctx: PlanningContext, chain: Chain | None = None) -> Chain:
    """``chain``, or the joined chain (NOTE [joined chains]) where the DP takes it, else the
    profile's first (longest-saving) chain. Raises:
        NotAChain: ``chain`` is None and the profile has no chain.
    """
    if chain is not None:
        return chain
    if not ctx.chains:
        raise NotAChain("no chain of blocks (children of an nn.ModuleList/Sequential called "
                        "one after another) found in the profile; use solver='milp'")
    joined = joined_chain(ctx)
    try:
        return joined if joined is not None and chain_model(ctx, joined) else ctx.chains[0]
    except NotAChain:
        return ctx.chains[0]


def solve(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0,
          chain: Chain | None = None, nested: bool = True) -> Solution:
    """The least-recompute plan over the main chain whose predicted peak fits ``budget_bytes``.

    A context with offload is refused (ValueError): ``memfit.planning.solvers.chain_offload
    .solve`` plans a chain with offload (NOTE [chain DP with offload] there).

    Raises:
        NotAChain: the profile has no chain the DP can use (use ``milp``).
        Infeasible: no plan of the chain's plan space fits.
    """
    chain = main_chain(ctx, chain)
    refuse_offload(ctx, "chain")  # memfit.planning.solvers.chain_offload.solve plans with it
    model = chain_model(ctx, chain, nested=nested)
    chosen, peak, t = run_dp(model, budget_bytes)
    notes = [f"chain {chain.parent or '<root>'}: {model.n} blocks, segments up to {model.cap}"]
    notes.extend(model.notes)
    if model.last_capped:
        notes.append(CAPPED_NOTE)
    return Solution(regions_of(chosen), peak, t, "chain", tuple(notes))


def min_peak(ctx: PlanningContext, chain: Chain | None = None, *, nested: bool = True) -> int:
    """The smallest predicted peak any plan of the chain's plan space reaches (``nested``:
    with NOTE [nested regions] in it)."""
    return run_dp(chain_model(ctx, main_chain(ctx, chain), nested=nested), None)[1]


def chain_model(ctx: PlanningContext, chain: Chain, *, nested: bool = True) -> ChainModel:
    """The chain's model, built once per planning context: it does not depend on the budget,
    so the re-solves of one ``plan`` call (tightening, ``"min"``) share it."""
    memo = ctx.memo.setdefault("chain", {})
    key = (chain, nested)
    if key not in memo:
        memo[key] = ChainModel(ctx, chain, nested=nested)
    return memo[key]
