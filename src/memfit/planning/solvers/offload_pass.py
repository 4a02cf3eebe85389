"""Offload with solvers that cannot model it exactly, and the offload pass.

NOTE [chain and offload]
    Offload's link time is not a region's own: copies of all regions queue on one link and
    hide behind the same forward (NOTE [offload time model] in ``memfit.planning.offload``),
    and the host cap is shared by all regions. Greedy plans without offload; the chain DP
    models it with a link window per block (NOTE [chain DP with offload] in
    ``memfit.planning.solvers.chain_offload``), an upper bound of the exact link time. Both
    plans then go to ``offload_pass``, which turns recomputed ops of the chosen regions into
    offloaded ones where the exact time model says it pays (link time that does not hide,
    the copies the plan already makes included, and, for a region that kept nothing, the
    selective-mode charge), within the host cap: first every op that saves at least ``rho``
    recompute seconds per byte copied, at the best threshold ``rho``, less the regions that
    do not pay; then, region by region (two sweeps in forward order), the prefix of its
    remaining ops by that ratio that lowers the plan's time most. Offload changes device
    memory only inside its region's replay (NOTE [offload memory model]), so the plan is then
    simulated; while its peak exceeds the budget at a replay, that region's added offloads
    are undone, last first. A heuristic over the solver's regions, not an optimum: the MILP
    (which models offload exactly) is preferred whenever it is small enough.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from memfit.planning.candidates import Candidate, OpChoice, PlanningContext
from memfit.planning.offload import Copy, link_exposed_s
from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.planning.simulate import simulate
from memfit.planning.solvers import Solution

__all__ = ["offload_pass"]

log = logging.getLogger(__name__)


def _nests(r: Region, regions: tuple[Region, ...]) -> bool:
    """Whether ``r`` holds or sits in another region (nested regions take no op decisions; a
    segment holds its blocks' own regions: NOTE [nested segments] in ``memfit.planning.nesting``)."""
    def related(p: str, m: str) -> bool:
        return p == m or m == "" or p == "" or m.startswith(p + ".") or p.startswith(m + ".")

    return any(o is not r and any(related(p, m) for p in r.modules for m in o.modules) for o in regions)


def _by_threshold(ctx: PlanningContext, regions: list[Region],
                  groups: dict[int, tuple[Candidate, list[OpChoice]]],
                  before: list[Copy]) -> dict[int, list[tuple[str, Copy]]]:
    """The best start: every op saving at least ``rho`` recompute seconds per byte copied, over
    the thresholds ``rho`` the ops give, within the host cap, less the regions whose offloads
    do not pay for their selective-mode charge (``before``: the plan's own copies)."""
    spec = ctx.offload
    assert spec is not None
    arrs = ctx.arrays

    def ratio(ch: OpChoice) -> float:
        return -ch.effect.time_s / ch.copy.nbytes  # type: ignore[union-attr]

    def total(sel: dict[int, list[OpChoice]]) -> float:
        t = 0.0
        for q, chs in sel.items():
            if chs:
                t += sum(ch.effect.time_s for ch in chs) + (0.0 if regions[q].ops else groups[q][0].selective_s)
        cps = [*before, *(ch.copy for chs in sel.values() for ch in chs)]
        return t + sum(link_exposed_s(arrs, cps, spec.link_bytes_per_s))  # type: ignore[arg-type]

    best: dict[int, list[OpChoice]] = {}
    best_t = total({})
    rhos = sorted({ratio(ch) for _, opts in groups.values() for ch in opts if ratio(ch) > 0}, reverse=True)
    host0 = sum(c.nbytes for c in before)
    for rho in rhos:
        sel = {q: [ch for ch in opts if ratio(ch) >= rho] for q, (_, opts) in groups.items()}
        host = host0 + sum(ch.copy.nbytes for chs in sel.values() for ch in chs if ch.copy is not None)
        if spec.host_budget_bytes is not None and host > spec.host_budget_bytes:
            break
        t = total(sel)
        for q in list(sel):  # drop regions whose offloads do not pay
            if sel[q]:
                without = {**sel, q: []}
                tw = total(without)
                if tw < t:
                    sel, t = without, tw
        if t < best_t:
            best, best_t = sel, t
    return {q: [(groups[q][0].keys[ch.op], ch.copy) for ch in chs]  # type: ignore[misc]
            for q, chs in best.items() if chs}


def offload_pass(ctx: PlanningContext, sol: Solution, budget_bytes: int) -> Solution:
    """``sol`` with recomputed ops offloaded where it pays (NOTE [chain and offload]).

    ``ctx`` must plan with offload (``ctx.offload``); returns ``sol`` unchanged otherwise.
    """
    spec = ctx.offload
    if spec is None or not sol.regions:
        return sol
    arrs = ctx.arrays
    regions = list(sol.regions)
    groups: dict[int, tuple[Candidate, list[OpChoice]]] = {}
    before: list[Copy] = []  # copies the plan already makes (the chain DP with offload)
    for q, r in enumerate(regions):
        if r.is_segment or _nests(r, sol.regions):
            continue
        cand = ctx.candidate(r.modules, tail=r.tail_after is not None)
        if cand is None:
            continue
        offl = set(r.keys_with(OpPolicy.OFFLOAD))
        before += [ch.copy for ch in cand.choices if ch.policy is OpPolicy.OFFLOAD and ch.copy is not None
                   and cand.keys[ch.op] in offl]
        kept = set(r.decisions)
        opts = [ch for ch in cand.choices if ch.policy is OpPolicy.OFFLOAD and ch.copy is not None
                and cand.keys[ch.op] not in kept]
        # recompute seconds saved per byte copied, best first
        opts.sort(key=lambda ch: (ch.effect.time_s / ch.copy.nbytes, ch.op))  # type: ignore[union-attr]
        groups[q] = (cand, opts)
    added = _by_threshold(ctx, regions, groups, before)
    copies = [*before, *(c for v in added.values() for _, c in v)]
    host = sum(c.nbytes for c in copies)
    exposed = sum(link_exposed_s(arrs, copies, spec.link_bytes_per_s))
    for _ in range(2):  # a second sweep uses link time the first left
        for q, (cand, opts) in groups.items():
            done = {k for k, _ in added.get(q, ())}
            todo = [ch for ch in opts if cand.keys[ch.op] not in done]
            charged = bool(regions[q].ops) or q in added
            best, best_k, run_t, run_h = 0.0, 0, 0.0, host
            trial = list(copies)
            for k, ch in enumerate(todo, 1):  # the best prefix of this region's options
                assert ch.copy is not None
                run_h += ch.copy.nbytes
                if spec.host_budget_bytes is not None and run_h > spec.host_budget_bytes:
                    break
                trial.append(ch.copy)
                run_t += ch.effect.time_s
                dt = run_t + sum(link_exposed_s(arrs, trial, spec.link_bytes_per_s)) - exposed \
                    + (0.0 if charged else cand.selective_s)
                if dt < best:
                    best, best_k = dt, k
            for ch in todo[:best_k]:
                assert ch.copy is not None
                copies.append(ch.copy)
                host += ch.copy.nbytes
                added.setdefault(q, []).append((cand.keys[ch.op], ch.copy))
            if best_k:
                exposed = sum(link_exposed_s(arrs, copies, spec.link_bytes_per_s))
    if not added:
        return sol
    for _ in range(len(added) + 1):
        out = tuple(
            Region(r.modules, (*r.ops, *((k, OpPolicy.OFFLOAD) for k, _ in added.get(q, ()))),
                   tail_after=r.tail_after)
            for q, r in enumerate(regions))
        sim = simulate(ctx.profile, Plan(out, 0, 0.0, None, sol.solver, ""), offload=spec, _arrays=arrs)
        if sim.peak_bytes <= budget_bytes:
            n_off = sum(len(v) for v in added.values())
            return replace(sol, regions=out, predicted_peak_bytes=sim.peak_bytes,
                           recompute_s=sim.recompute_s,
                           notes=(*sol.notes, f"offload pass: {n_off} op(s) of {len(added)} region(s) "
                                  f"offloaded, {host} host bytes (NOTE [chain and offload])"))
        over = [q for q in added if sim.recompute_points[q] == sim.peak_at]
        if not over:
            break
        log.info("offload pass: peak %d > budget %d at the replay of %s; undoing its offloads",
                 sim.peak_bytes, budget_bytes, regions[over[0]].name)
        host -= sum(c.nbytes for _, c in added.pop(over[0]))
    return sol
