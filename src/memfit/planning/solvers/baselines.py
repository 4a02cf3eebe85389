"""Fixed plans to compare against: none, every block, sqrt(n) segments, save matmuls.

They ignore the budget: the planner notes when a baseline exceeds it, and ``memfit.fit``
refuses to apply one that does (``InfeasibleBudget``). A baseline that finds no blocks
raises ``NoBlocks`` instead of returning an empty plan that would pass for "no checkpointing".

NOTE [baseline blocks]
    The blocks of a baseline are the repeated units a person would checkpoint by hand:
    1. the blocks of every chain (NOTE [chains] in ``memfit.planning.candidates``); merged
       blocks (NOTE [merged blocks] there: VGG's ``[conv, relu_]``) only on the main chain
       (``PlanningContext.chains[0]``), elsewhere the children of a merged block that are
       regions alone: a stem's ``[conv, norm]`` is no repeated unit, its norm is (ResNet's
       stem keeps the blocks it had before merged blocks);
    2. then the children of every other ``nn.ModuleList`` / ``nn.Sequential`` whose children
       are all of one class (repeated units, not a stem's conv, norm and activation), outermost
       container first, that ran once and drop something when checkpointed. The common loop
       ``for b in self.blocks: x = x + b(x)`` is no chain (the residual stream ``x`` is read
       after the next block), and is found here, as is a UNet's encoder loop;
    3. a block overlapping one already found (a ``Sequential`` inside a block) is skipped, so
       no two regions nest;
    4. with none found, the model's own children that drop something.
    Consecutive blocks with the parent's code between them (the residual add) cannot form a
    chain segment (the replay reruns the blocks only), so ``sqrt`` checkpoints such a group of
    blocks one by one, and says so in its notes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from memfit.planning.candidates import CONTAINER_TYPES, Candidate, PlanningContext
from memfit.planning.plan import Region
from memfit.planning.rules import is_matmul
from memfit.planning.solvers import Solution

__all__ = ["solve_none", "solve_every_block", "solve_sqrt", "solve_save_matmuls", "blocks", "block_runs",
           "NoBlocks"]


class NoBlocks(ValueError):
    """A baseline found no block to checkpoint (NOTE [baseline blocks])."""


def block_runs(ctx: PlanningContext) -> list[list[Candidate]]:
    """The blocks of NOTE [baseline blocks], as runs of siblings, each run in op order."""
    recs = {m.path: m for m in ctx.profile.modules}
    runs: list[list[Candidate]] = []
    spans: list[tuple[int, int]] = []  # op ranges of the blocks found (rule 3)

    def overlaps(a: int, b: int) -> bool:
        return any(a <= hi and lo <= b for lo, hi in spans)

    def take(blocks: Iterable[tuple[str, ...]]) -> None:
        run = []
        for blk in blocks:
            got = [recs.get(path) for path in blk]
            if any(r is None or r.calls != 1 or r.first_op is None or r.last_op is None for r in got):
                continue
            if overlaps(got[0].first_op, got[-1].last_op):  # type: ignore[arg-type, union-attr]
                continue
            c = ctx.candidate(blk)
            if c is None or overlaps(c.a, c.b):
                continue
            run.append(c)
            spans.append((c.a, c.b))
        if run:
            runs.append(sorted(run, key=lambda c: c.a))

    for q, ch in enumerate(ctx.chains):  # rule 1
        take(ch.blocks if q == 0 else ((m,) for blk in ch.blocks for m in blk))
    containers = [m for m in recs.values() if m.type in CONTAINER_TYPES and m.children
                  and len({recs[c].type for c in m.children if c in recs}) == 1]
    containers.sort(key=lambda m: (m.path.count(".") if m.path else -1, m.first_op or 0))
    for m in containers:  # rule 2, outermost first
        take((c,) for c in m.children)
    if not runs:  # rule 4
        take((m.path,) for m in recs.values() if m.parent == "")
    return sorted(runs, key=lambda run: run[0].a)


def blocks(ctx: PlanningContext) -> list[Candidate]:
    """Every block of NOTE [baseline blocks], in op order."""
    return sorted((c for run in block_runs(ctx) for c in run), key=lambda c: c.a)


def _blocks_or_raise(ctx: PlanningContext, name: str) -> list[Candidate]:
    found = blocks(ctx)
    if not found:
        raise NoBlocks(
            f"baseline {name!r} found no blocks to checkpoint in {ctx.profile.model or 'the model'}: "
            "no child of an nn.ModuleList / nn.Sequential (nor of the model itself) ran once, "
            "holds activations that checkpointing it would drop, and keeps its inputs unwritten "
            "(an in-place write such as h += block(h) or relu_ on a block's input rules it out). "
            "Use solver 'auto', which checkpoints any module that can be")
    return found


def _sol(regions: list[Region] | tuple[Region, ...], name: str, *notes: str) -> Solution:
    return Solution(tuple(regions), 0, 0.0, name, notes)


def solve_none(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
    return _sol((), "none", "baseline: no checkpointing")


def solve_every_block(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
    found = _blocks_or_raise(ctx, "every_block")
    return _sol([c.region() for c in found], "every_block",
                f"baseline: every block recomputed ({len(found)} blocks)")


def solve_sqrt(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
    """Chen et al. 2016: the main chain cut into about sqrt(n) segments of sqrt(n) blocks
    (without a chain, the blocks of NOTE [baseline blocks], run by run)."""
    if ctx.chains:
        runs = [[c for c in (ctx.candidate(b) for b in ctx.chains[0].blocks) if c is not None]]
    else:
        runs = block_runs(ctx)
    n = sum(len(run) for run in runs)
    if n == 0:
        _blocks_or_raise(ctx, "sqrt")
    s = math.isqrt(n - 1) + 1 if n > 1 else 1  # ceil(sqrt(n))
    regions: list[Region] = []
    alone = 0  # blocks of a group that could not be one segment
    for run in runs:
        for k in range(0, len(run), s):
            group = run[k: k + s]
            seg = (ctx.candidate(tuple(m for c in group for m in c.modules), with_ops=False)
                   if len(group) > 1 else None)
            if seg is not None:
                regions.append(seg.region())
                continue
            # one block, or blocks with the parent's code between them (NOTE [baseline blocks])
            regions.extend(c.region() for c in group)
            alone += len(group) if len(group) > 1 else 0
    notes = [f"baseline: {len(regions)} regions for {n} blocks, segments of up to {s} blocks"]
    if alone:
        notes.append(f"{alone} blocks checkpointed one by one: the parent's code runs between them "
                     "(a residual add), which a segment's replay cannot span")
    return _sol(regions, "sqrt", *notes)


def solve_save_matmuls(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0) -> Solution:
    """Every block checkpointed, keeping the outputs of its matmuls and convolutions."""
    prof = ctx.profile
    regions = []
    found = _blocks_or_raise(ctx, "save_matmuls")
    for c in found:
        ops = [i for i in range(c.a, c.b + 1)
               if i in c.keys and ctx.arrays.op_saveable[i] and is_matmul(prof.ops[i])]
        regions.append(Region.saving(c.modules, (c.keys[i] for i in ops)))
    return _sol(regions, "save_matmuls", f"baseline: every block, matmul outputs saved ({len(regions)} blocks)")
