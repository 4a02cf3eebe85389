"""Pick a solver for the profile: chain when a chain's regions can drop most of what any
region could drop, else milp (greedy when the MILP would be huge). On a chain profile small
enough, milp also runs (its plan space includes sub-modules of blocks) and the faster plan wins.
"""

from __future__ import annotations

from memfit.planning.candidates import PlanningContext
from memfit.planning.solvers import Infeasible, Solution

__all__ = ["solve", "CHAIN_SHARE", "MILP_MAX_CELLS", "BOTH_MAX_CELLS"]

CHAIN_SHARE = 0.6           # chain if its regions can drop at least this share of droppable bytes
MILP_MAX_CELLS = 30_000_000  # points x variables above which the MILP is skipped
BOTH_MAX_CELLS = 3_000_000   # below this, a chain profile is also solved by milp (sub-modules)


def solve(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
    from memfit.planning.solvers import chain, greedy, milp

    why = "no chain of blocks found"
    share = 0.0
    if ctx.chains:
        ch = ctx.chains[0]
        share = ctx.chain_droppable_share(ch)
        why = (f"chain {ch.parent or '<root>'} ({len(ch.blocks)} blocks) can drop {share:.0%} of the "
               "activation bytes any region can drop")
    cands = ctx.region_candidates()
    n_vars = len(cands) + sum(len(c.saveable) for c in cands)
    n_points = ctx.arrays.n_ops + sum(c.stop - c.a + 1 for c in cands)
    if ctx.chains and share >= CHAIN_SHARE:
        sol: Solution | None = None
        usable = True
        try:
            sol = chain.solve(ctx, budget_bytes, time_limit_s=time_limit_s, chain=ch)
        except chain.NotAChain as e:
            why = f"{why}, but {e}"
            usable = False
        except Infeasible:
            if n_vars * n_points > BOTH_MAX_CELLS:
                raise
            sol = None  # the MILP's wider plan space (sub-modules) may still fit
        else:
            if n_vars * n_points > BOTH_MAX_CELLS:
                assert sol is not None
                return Solution(sol.regions, sol.predicted_peak_bytes, sol.recompute_s, "chain",
                                (f"auto: chain ({why})", *sol.notes))
        if usable and n_vars * n_points <= BOTH_MAX_CELLS:
            # small enough to also search sub-module regions: keep the faster plan
            try:
                alt = milp.solve(ctx, budget_bytes, time_limit_s=time_limit_s)
            except Infeasible:
                if sol is None:
                    raise
                alt = None
            if sol is not None and (alt is None or sol.recompute_s <= alt.recompute_s):
                return Solution(sol.regions, sol.predicted_peak_bytes, sol.recompute_s, "chain",
                                (f"auto: chain ({why}; not slower than milp)", *sol.notes))
            assert alt is not None
            return Solution(alt.regions, alt.predicted_peak_bytes, alt.recompute_s, "milp",
                            (f"auto: milp ({why}, but milp's plan over sub-modules is faster)", *alt.notes))
    if n_vars * n_points > MILP_MAX_CELLS:
        sol = greedy.solve(ctx, budget_bytes, time_limit_s=time_limit_s)
        return Solution(sol.regions, sol.predicted_peak_bytes, sol.recompute_s, "greedy",
                        (f"auto: greedy ({why}; MILP of {n_vars} variables x {n_points} points too large)",
                         *sol.notes))
    sol = milp.solve(ctx, budget_bytes, time_limit_s=time_limit_s)
    return Solution(sol.regions, sol.predicted_peak_bytes, sol.recompute_s, "milp",
                    (f"auto: milp ({why})", *sol.notes))
