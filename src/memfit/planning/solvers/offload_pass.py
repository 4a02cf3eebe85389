"""Offload with solvers that cannot model it: the chain DP and greedy, then an offload pass.

NOTE [chain and offload]
    The chain DP (NOTE [chain DP]) needs each block's time to be its own: a block choice's
    seconds are added along the chain. Offload's link time is not a block's own: copies of all
    blocks queue on one link and hide behind the same forward (NOTE [offload time model] in
    ``memfit.planning.offload``), and the host cap is shared by all blocks. So the chain DP
    and greedy plan without offload, and ``offload_pass`` then turns recomputed ops of the
    chosen regions into offloaded ones where the exact time model says it pays: ops in order of
    recompute seconds saved per second of copy, each kept when the plan's time (link time that
    does not hide included) goes down and the host cap holds. Offload changes device memory
    only inside its region's replay (NOTE [offload memory model]), so the plan is then
    simulated; while its peak exceeds the budget at a replay, that region's offloads are undone,
    last first. A heuristic over the solver's regions, not an optimum: the MILP (which models
    offload exactly) is preferred whenever it is small enough.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from memfit.errors import SolverTimeout
from memfit.planning.candidates import Candidate, PlanningContext
from memfit.planning.offload import Copy, link_exposed_s
from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.planning.simulate import simulate
from memfit.planning.solvers import Infeasible, Solution, SolveFn, get_solver

__all__ = ["offload_pass", "offload_solver"]

log = logging.getLogger(__name__)


def _nests(r: Region, regions: tuple[Region, ...]) -> bool:
    """Whether ``r`` holds or sits in another region (nested regions take no op decisions)."""
    if r.is_segment:
        return False
    p = r.modules[0]
    return any(o is not r and any(m.startswith(p + ".") or p.startswith(m + ".") or m == "" or p == ""
                                  for m in o.modules) for o in regions)


def offload_pass(ctx: PlanningContext, sol: Solution, budget_bytes: int) -> Solution:
    """``sol`` with recomputed ops offloaded where it pays (NOTE [chain and offload]).

    ``ctx`` must plan with offload (``ctx.offload``); returns ``sol`` unchanged otherwise.
    """
    spec = ctx.offload
    if spec is None or not sol.regions:
        return sol
    arrs = ctx.arrays
    regions = list(sol.regions)
    options = []  # (ratio, region position, candidate, choice)
    cands: dict[int, Candidate] = {}
    for q, r in enumerate(regions):
        if r.is_segment or _nests(r, sol.regions):
            continue
        cand = ctx.candidate(r.modules)
        if cand is None:
            continue
        cands[q] = cand
        kept = set(r.decisions)
        for ch in cand.choices:
            if ch.policy is OpPolicy.OFFLOAD and ch.copy is not None and cand.keys[ch.op] not in kept:
                t = -ch.effect.time_s
                options.append((t * spec.link_bytes_per_s / ch.copy.nbytes, q, cand, ch))
    options.sort(key=lambda o: (-o[0], o[1], o[3].op))
    copies: list[Copy] = []
    host = 0
    exposed = 0.0
    added: dict[int, list[tuple[str, Copy]]] = {}
    for _, q, cand, ch in options:
        assert ch.copy is not None
        if spec.host_budget_bytes is not None and host + ch.copy.nbytes > spec.host_budget_bytes:
            continue
        new = sum(link_exposed_s(arrs, [*copies, ch.copy], spec.link_bytes_per_s))
        selective = 0.0 if (regions[q].ops or q in added) else cand.selective_s
        if ch.effect.time_s + (new - exposed) + selective >= 0:
            continue
        copies.append(ch.copy)
        host += ch.copy.nbytes
        exposed = new
        added.setdefault(q, []).append((cand.keys[ch.op], ch.copy))
    if not added:
        return sol
    for _ in range(len(added) + 1):
        trial = tuple(
            Region(r.modules, (*r.ops, *((k, OpPolicy.OFFLOAD) for k, _ in added.get(q, ()))))
            for q, r in enumerate(regions))
        sim = simulate(ctx.profile, Plan(trial, 0, 0.0, None, sol.solver, ""), offload=spec, _arrays=arrs)
        if sim.peak_bytes <= budget_bytes:
            n_off = sum(len(v) for v in added.values())
            return replace(sol, regions=trial, predicted_peak_bytes=sim.peak_bytes,
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


def offload_solver(name: str) -> SolveFn:
    """The solve function for ``name`` when planning with offload (NOTE [chain and offload]):
    ``"milp"`` and ``"brute"`` model offload themselves; ``"auto"`` runs the MILP when it is
    small enough (``MILP_MAX_CELLS``), else, as ``"chain"`` and ``"greedy"`` do, plans without
    offload and then runs the offload pass."""
    if name in ("milp", "brute"):
        return get_solver(name)
    base = get_solver(name)
    plain: dict[str, PlanningContext] = {}

    def solve(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
        from memfit.planning.solvers import auto, milp

        why = f"{name} cannot model offload"
        if name == "auto":
            n_vars, n_points = auto.milp_cells(ctx)
            if n_vars * n_points <= auto.MILP_MAX_CELLS:
                try:
                    sol = milp.solve(ctx, budget_bytes, time_limit_s=time_limit_s)
                    return replace(sol, notes=("auto: milp (it models offload exactly)", *sol.notes))
                except SolverTimeout:
                    why = f"milp found no plan within {time_limit_s:g} s"
                except Infeasible:
                    why = "milp has no plan"
            else:
                why = f"MILP of {n_vars} variables x {n_points} points too large"
        if "ctx" not in plain:
            plain["ctx"] = PlanningContext(ctx.profile)
        sol = base(plain["ctx"], budget_bytes, time_limit_s=time_limit_s)
        out = offload_pass(ctx, sol, budget_bytes)
        return replace(out, notes=(f"offload: {why}; planned without it, then the offload pass", *out.notes))

    return solve
