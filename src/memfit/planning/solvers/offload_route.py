"""Which solver plans with offload, and how (NOTE [chain and offload] in
``memfit.planning.solvers.offload_pass``): the planner's entry point for ``offload=True``."""

from __future__ import annotations

from dataclasses import replace

from memfit.errors import SolverTimeout
from memfit.planning.candidates import PlanningContext
from memfit.planning.solvers import (
    Infeasible,
    Solution,
    SolveFn,
    auto,
    chain_offload,
    get_solver,
    milp,
)
from memfit.planning.solvers.offload_pass import offload_pass

__all__ = ["offload_solver"]


def offload_solver(name: str) -> SolveFn:
    """The solve function for ``name`` when planning with offload (NOTE [chain and offload]):
    ``"milp"`` and ``"brute"`` model offload themselves; ``"auto"`` runs the MILP when it is
    small enough (``MILP_MAX_CELLS``), else, as ``"chain"`` and ``"greedy"`` do, plans without
    offload and then runs the offload pass; where that plan is the chain DP's, the chain DP
    with offload (NOTE [chain DP with offload]) then the offload pass also runs, and the
    faster plan by the exact model wins."""
    if name in ("milp", "brute"):
        return get_solver(name)
    base = get_solver(name)
    plain: dict[str, PlanningContext] = {}

    def solve(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
        why = f"{name} cannot model offload"
        exact: Solution | None = None
        if name == "auto":
            n_vars, n_points = auto.milp_cells(ctx)
            if n_vars * n_points <= auto.MILP_MAX_CELLS:
                try:
                    exact = milp.solve(ctx, budget_bytes, time_limit_s=time_limit_s)
                    exact = replace(exact, notes=("auto: milp (it models offload exactly)", *exact.notes))
                    if not any("time limit" in n for n in exact.notes):
                        return exact
                    # not proven optimal: the plan without offload, then offloaded, may be faster
                    why = f"milp hit its time limit of {time_limit_s:g} s"
                except SolverTimeout:
                    why = f"milp found no plan within {time_limit_s:g} s"
                except Infeasible:
                    why = "milp has no plan"
            else:
                why = f"MILP of {n_vars} variables x {n_points} points too large"
        if "ctx" not in plain:
            plain["ctx"] = PlanningContext(ctx.profile)
        try:
            sol = base(plain["ctx"], budget_bytes, time_limit_s=time_limit_s)
        except (Infeasible, SolverTimeout):
            if exact is not None:
                return exact
            raise
        out = offload_pass(ctx, sol, budget_bytes)
        out = replace(out, notes=(f"offload: {why}; planned without it, then the offload pass", *out.notes))
        if sol.solver == "chain":  # NOTE [chain DP with offload], then the pass on its plan
            try:
                dp = chain_offload.solve(ctx, budget_bytes, time_limit_s=time_limit_s)
            except Infeasible:
                dp = None
            if dp is not None and dp.recompute_s < out.recompute_s:  # already through the offload pass
                out = replace(dp, notes=(f"offload: {why}; the chain DP with offload, then the offload "
                                         f"pass (faster than planning without it: {out.recompute_s:.6g} s)",
                                         *dp.notes))
        return exact if exact is not None and exact.recompute_s <= out.recompute_s else out

    return solve
