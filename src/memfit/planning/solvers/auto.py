"""Pick a solver for the profile: chain when a chain's regions can drop most of what any
region could drop, else milp (greedy when the MILP would be huge). On a chain profile small
enough, milp also runs (its plan space includes sub-modules of blocks) and the faster plan wins.
When the MILP runs out of time, the chain's or greedy's plan is returned (NOTE [auto never
times out]).
"""

from __future__ import annotations

from memfit.errors import SolverTimeout
from memfit.planning.candidates import PlanningContext
from memfit.planning.solvers import Infeasible, Solution

__all__ = ["solve", "CHAIN_SHARE", "MILP_MAX_CELLS", "BOTH_MAX_CELLS", "milp_cells"]

CHAIN_SHARE = 0.6            # chain if its regions can drop at least this share of droppable bytes
MILP_MAX_CELLS = 30_000_000  # points x variables above which the MILP is skipped
# below this, a chain profile is also solved by milp (sub-modules). An 8-block zoo GPT has 4.8M
# cells and its compressed MILP solves in 0.5-2.7 s here; a 32-block synthetic decoder (46M)
# took 4-5 s. About 74k x blocks^2 cells on a GPT: up to 12 blocks run both.
BOTH_MAX_CELLS = 12_000_000


def milp_cells(ctx: PlanningContext, *, above: int | None = None) -> tuple[int, int]:
    """(variables, points) of the MILP over all region candidates of ``ctx``; with ``above``,
    the count over the first chain's blocks and segments alone where that already exceeds
    ``above`` cells (the modules' candidates are then not built: a deep chain's segments
    decide it)."""
    memo = ctx.memo.setdefault("milp_cells", {})
    if above not in memo:
        memo[above] = _milp_cells(ctx, above)
    return memo[above]  # type: ignore[no-any-return]


def _milp_cells(ctx: PlanningContext, above: int | None) -> tuple[int, int]:
    if above is not None and ctx.chains:
        from memfit.planning.solvers.chain import main_chain

        ch = main_chain(ctx)
        part = [c for c in (ctx.candidate(b) for b in ch.blocks) if c is not None] + ctx.segment_candidates(ch)
        n_vars = len(part) + sum(len(c.choices) for c in part)
        n_points = ctx.arrays.n_ops + sum(c.stop - c.a + 1 for c in part)
        if n_vars * n_points > above:
            return n_vars, n_points
    cands = ctx.region_candidates()
    n_vars = len(cands) + sum(len(c.choices) for c in cands)
    n_points = ctx.arrays.n_ops + sum(c.stop - c.a + 1 for c in cands)
    return n_vars, n_points


def _tag(sol: Solution, solver: str, why: str) -> Solution:
    return Solution(sol.regions, sol.predicted_peak_bytes, sol.recompute_s, solver, (why, *sol.notes))


def _greedy_or(ctx: PlanningContext, budget_bytes: int, time_limit_s: float,
               infeasible: Infeasible | None) -> Solution:
    """Greedy's plan; when it has none, the smaller of its and ``infeasible``'s minimum raised."""
    from memfit.planning.solvers import greedy

    try:
        return greedy.solve(ctx, budget_bytes, time_limit_s=time_limit_s)
    except Infeasible as e:
        if infeasible is not None and infeasible.min_bytes <= e.min_bytes:
            raise infeasible from None
        raise


def solve(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
    """The plan of the solver suited to the profile (see the module docstring).

    NOTE [auto never times out]
        The MILP may run out of its ``time_limit_s`` before it finds any plan
        (``SolverTimeout``). ``auto`` then returns the chain solver's plan when it has one, else
        the greedy solver's, with a note saying so; that error reaches a user only who chose
        ``solver="milp"``. The MILP's smallest peak (on ``Infeasible``) is likewise only as good
        as its time allowed, so greedy's is asked too and the smaller one reported.

    Raises:
        Infeasible: no plan of the solvers tried fits (``min_bytes``: the smallest peak found).
    """
    from memfit.planning.solvers import chain, greedy, milp

    why = "no chain of blocks found"
    share = 0.0
    if ctx.chains:
        ch = chain.main_chain(ctx)
        share = ctx.chain_droppable_share(ch)
        why = (f"chain {ch.parent or '<root>'} ({len(ch.blocks)} blocks) can drop {share:.0%} of the "
               "activation bytes any region can drop")
    n_vars, n_points = milp_cells(ctx, above=MILP_MAX_CELLS)
    cells = n_vars * n_points
    timed_out = f"milp found no plan within its time limit of {time_limit_s:g} s"
    if ctx.chains and share >= CHAIN_SHARE:
        sol: Solution | None = None
        infeasible: Infeasible | None = None
        try:
            sol = chain.solve(ctx, budget_bytes, time_limit_s=time_limit_s, chain=ch)
        except chain.NotAChain as e:
            why = f"{why}, but {e}"
        except Infeasible as e:
            if cells > BOTH_MAX_CELLS:
                raise
            infeasible = e  # the MILP's wider plan space (sub-modules) may still fit
        if sol is not None or infeasible is not None:
            if cells > BOTH_MAX_CELLS:
                assert sol is not None
                return _tag(sol, "chain", f"auto: chain ({why}; MILP of {n_vars} variables x "
                                          f"{n_points} points too large to also try)")
            # small enough to also search sub-module regions: keep the faster plan
            try:
                alt: Solution | None = milp.solve(ctx, budget_bytes, time_limit_s=time_limit_s,
                                                  report_min=sol is None)
            except Infeasible as e:
                if sol is None:  # neither fits: the smaller of their smallest peaks
                    assert infeasible is not None
                    raise e if e.min_bytes < infeasible.min_bytes else infeasible from None
                alt = None
            except SolverTimeout:
                if sol is None:  # NOTE [auto never times out]
                    return _tag(_greedy_or(ctx, budget_bytes, time_limit_s, infeasible), "greedy",
                                f"auto: greedy ({why}; the chain has no plan and {timed_out})")
                return _tag(sol, "chain", f"auto: chain ({why}; {timed_out})")
            if sol is not None and (alt is None or sol.recompute_s <= alt.recompute_s):
                return _tag(sol, "chain", f"auto: chain ({why}; not slower than milp)")
            assert alt is not None
            return _tag(alt, "milp", f"auto: milp ({why}, but milp's plan over sub-modules is faster)")
    if cells > MILP_MAX_CELLS:
        return _tag(greedy.solve(ctx, budget_bytes, time_limit_s=time_limit_s), "greedy",
                    f"auto: greedy ({why}; MILP of {n_vars} variables x {n_points} points too large)")
    try:
        return _tag(milp.solve(ctx, budget_bytes, time_limit_s=time_limit_s), "milp", f"auto: milp ({why})")
    except SolverTimeout:  # NOTE [auto never times out]
        return _tag(_greedy_or(ctx, budget_bytes, time_limit_s, None), "greedy",
                    f"auto: greedy ({why}; {timed_out})")
    except Infeasible as e:
        return _tag(_greedy_or(ctx, budget_bytes, time_limit_s, e), "greedy",
                    f"auto: greedy ({why}; milp has no plan, greedy's heuristic found one)")
