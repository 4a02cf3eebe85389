"""Fixed plans to compare against: none, every block, sqrt(n) segments, save matmuls.

They ignore the budget (the planner notes when a baseline exceeds it).
"""

from __future__ import annotations

import math

from memfit.planning.candidates import Candidate, PlanningContext
from memfit.planning.plan import Region
from memfit.planning.rules import is_matmul
from memfit.planning.solvers import Solution

__all__ = ["solve_none", "solve_every_block", "solve_sqrt", "solve_save_matmuls"]


def _blocks(ctx: PlanningContext) -> list[Candidate]:
    """Blocks of every chain; with no chain, the root's children that can be checkpointed."""
    out: list[Candidate] = []
    for ch in ctx.chains:
        out.extend(c for c in (ctx.candidate((b,)) for b in ch.blocks) if c is not None)
    if not out:
        out = [c for c in ctx.module_candidates
               if ctx.profile.module(c.modules[0]).parent == ""]
    return sorted(out, key=lambda c: c.a)


def _sol(regions: list[Region] | tuple[Region, ...], name: str, note: str) -> Solution:
    return Solution(tuple(regions), 0, 0.0, name, (note,))


def solve_none(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
    return _sol((), "none", "baseline: no checkpointing")


def solve_every_block(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
    blocks = _blocks(ctx)
    return _sol([c.region() for c in blocks], "every_block",
                f"baseline: every block recomputed ({len(blocks)} blocks)")


def solve_sqrt(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
    """Chen et al. 2016: the main chain cut into about sqrt(n) segments of sqrt(n) blocks."""
    if not ctx.chains:
        return solve_every_block(ctx, budget_bytes)
    blocks = ctx.chains[0].blocks
    n = len(blocks)
    s = max(1, math.isqrt(n - 1) + 1 if n > 1 else 1)
    regions = []
    for k in range(0, n, s):
        c = ctx.candidate(blocks[k: k + s], with_ops=False)
        if c is not None:
            regions.append(c.region())
    return _sol(regions, "sqrt", f"baseline: {len(regions)} segments of up to {s} blocks")


def solve_save_matmuls(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
    """Every block checkpointed, keeping the outputs of its matmuls and convolutions."""
    prof = ctx.profile
    regions = []
    for c in _blocks(ctx):
        ops = [i for i in range(c.a, c.b + 1)
               if i in c.keys and ctx.arrays.op_saveable[i] and is_matmul(prof.ops[i])]
        regions.append(Region.saving(c.modules, (c.keys[i] for i in ops)))
    return _sol(regions, "save_matmuls", f"baseline: every block, matmul outputs saved ({len(regions)} blocks)")
