"""Exhaustive search of the plan space, for tiny instances (the reference the tests use).

Two plan spaces, the same the other solvers search:
- ``"chain"``: partitions of the main chain into kept blocks, checkpointed blocks with any save
  set, and recompute-all segments of up to ``segment_cap(n)`` blocks (``solvers.chain`` with
  ``nested=False``: no nesting, NOTE [nested regions] and [nested segments]);
- ``"regions"``: any set of disjoint candidates (modules and chain segments) with any save sets
  (``solvers.milp``).
Plans are scored with the linear model (NOTE [linear model]) on all its points.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from memfit.planning.candidates import Candidate, PlanningContext, indexed, segment_cap
from memfit.planning.costs import LinearModel
from memfit.planning.solvers import Infeasible, Solution

__all__ = ["solve", "enumerate_plans"]

Choices = list[tuple[int, tuple[int, ...]]]


def _subsets(ops: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    for m in range(2 ** len(ops)):
        yield tuple(o for q, o in enumerate(ops) if (m >> q) & 1)


def _choice_sets(c: Candidate) -> Iterator[tuple[int, ...]]:
    """Sets of ``c``'s choices with at most one per op (save or offload)."""
    for sub in _subsets(tuple(range(len(c.choices)))):
        ops = [c.choices[j].op for j in sub]
        if len(set(ops)) == len(ops):
            yield sub


def _chain_space(ctx: PlanningContext) -> tuple[list[Candidate], Iterator[Choices]]:
    chain = ctx.chains[0]
    n = len(chain.blocks)
    cap = segment_cap(n)
    raw: list[Candidate] = []
    at: dict[tuple[int, int], int] = {}
    for k in range(n):
        for j in range(k, min(n, k + cap)):
            c = ctx.candidate(chain.modules(k, j), with_ops=(k == j))
            if c is not None:
                at[(k, j)] = len(raw)
                raw.append(c)
    cands = indexed(raw)

    def rec(k: int) -> Iterator[Choices]:
        if k == n:
            yield []
            return
        for rest in rec(k + 1):  # keep block k
            yield rest
        for j in range(k, min(n, k + cap)):
            r = at.get((k, j))
            if r is None:
                continue
            for ops in _choice_sets(cands[r]):
                for rest in rec(j + 1):
                    yield [(r, ops), *rest]

    return cands, rec(0)


def _region_space(ctx: PlanningContext) -> tuple[list[Candidate], Iterator[Choices]]:
    cands = ctx.region_candidates()
    order = sorted(cands, key=lambda c: (c.a, -c.b))

    def rec(q: int, free_from: int) -> Iterator[Choices]:
        if q == len(order):
            yield []
            return
        c = order[q]
        yield from rec(q + 1, free_from)
        if c.a >= free_from:
            for ops in _choice_sets(c):
                for rest in rec(q + 1, c.b + 1):
                    yield [(c.index, ops), *rest]

    # candidates sorted by start: a later-starting candidate never overlaps an earlier chosen one
    # that ends before it, and free_from forbids any that starts inside one
    return cands, rec(0, 0)


def enumerate_plans(ctx: PlanningContext, mode: str) -> tuple[LinearModel, list[tuple[Choices, int, float]]]:
    """Every plan of the space with its linear-model peak and time (cached on ``ctx``)."""
    cache = ctx.__dict__.setdefault("_brute_cache", {})
    if mode in cache:
        return cache[mode]  # type: ignore[no-any-return]
    cands, plans = _chain_space(ctx) if mode == "chain" else _region_space(ctx)
    lm = LinearModel(ctx, cands)
    A = lm.matrix()
    out = []
    for q, choices in enumerate(plans):
        if q > 2_000_000:
            raise ValueError("brute force: more than 2,000,000 plans; use it on tiny profiles only")
        cap = ctx.offload.host_budget_bytes if ctx.offload is not None else None
        if cap is not None and lm.host_bytes(choices) > cap:
            continue
        vs = lm.vars_of(choices)
        total = lm.base + A[:, vs].sum(axis=1) if vs else lm.base
        out.append((choices, int(total.max()), lm.time_s(choices)))
    cache[mode] = (lm, out)
    return lm, out


def solve(ctx: PlanningContext, budget_bytes: int, *, time_limit_s: float = 10.0,
          mode: str | None = None) -> Solution:
    """The least-time plan of the space (``mode`` "chain" or "regions"; default: "chain" when
    the profile has a chain) whose linear-model peak fits ``budget_bytes``."""
    mode = mode or ("chain" if ctx.chains else "regions")
    lm, plans = enumerate_plans(ctx, mode)
    feasible = [(t, pk, ch) for ch, pk, t in plans if pk <= budget_bytes]
    if not feasible:
        raise Infeasible(min(pk for _, pk, _ in plans))
    t, pk, ch = min(feasible, key=lambda x: (x[0], x[1]))
    regions = tuple(lm.cands[r].region(ops) for r, ops in sorted(ch, key=lambda x: lm.cands[x[0]].a))
    return Solution(regions, pk, t, "brute", (f"brute force ({mode}): {len(plans)} plans",))


def min_peak(ctx: PlanningContext, mode: str) -> int:
    return int(np.min([pk for _, pk, _ in enumerate_plans(ctx, mode)[1]]))
