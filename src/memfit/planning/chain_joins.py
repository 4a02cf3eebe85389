"""Chains of chains: a staged network's stages opened into one chain of blocks.

NOTE [joined chains]
    A staged network (a ResNet's four ``nn.Sequential`` stages of bottlenecks, a 3D CNN's
    levels) has a chain over its stages and one chain inside each stage (NOTE [chains] in
    ``memfit.planning.candidates``). The chain solver plans one chain: given the chain of
    stages it cuts only between stages, given one stage it leaves the others' activations to
    whole-module candidates. The joined chain is the chain of stages with each block that is
    one module holding a chain over its whole op range replaced by that chain's blocks,
    recursively. Inside each original chain the chain condition holds (block ``k``'s
    creations are read by nothing after block ``k + 1``); it is checked again at every pair
    of consecutive blocks, with no op between two blocks of different parents. No segment
    crosses from one parent to another (``PlanningContext.candidate`` has none for modules of
    different parents: the runtime's segments are runs of siblings), so the DP stays exact:
    segments end where a stage does, and the blocks on either side are chosen freely.
"""

from __future__ import annotations

from itertools import pairwise

from memfit.planning.candidates import Chain, PlanningContext

__all__ = ["joined_chain"]


def joined_chain(ctx: PlanningContext) -> Chain | None:
    """The chain of NOTE [joined chains] that covers the first chain's ops with the most
    blocks, if it has more blocks than the first chain, else None."""
    memo = ctx.memo.setdefault("joined", {})
    if "chain" not in memo:
        memo["chain"] = _joined(ctx)
    return memo["chain"]  # type: ignore[no-any-return]


def _joined(ctx: PlanningContext) -> Chain | None:
    if len(ctx.chains) < 2:
        return None
    first = ctx.chains[0]
    by_parent = {c.parent: c for c in ctx.chains}
    best: Chain | None = None
    for ch in ctx.chains:
        if ch.first_ops[0] > first.first_ops[0] or ch.last_ops[-1] < first.last_ops[-1]:
            continue  # it does not cover the first chain
        opened = _opened(ctx, ch, by_parent)
        if opened is not None and len(opened.blocks) > len((best or first).blocks):
            best = opened
    return best


def _opened(ctx: PlanningContext, ch: Chain, by_parent: dict[str, Chain]) -> Chain | None:
    """``ch`` with its stage blocks opened (recursively), or None if none opens or the chain
    condition fails at a new pair of blocks."""
    prof = ctx.profile
    index = {m.path: m for m in prof.modules}
    parts: list[tuple[tuple[str, ...], int, int]] = []

    def add(c: Chain) -> None:
        for blk, a, b in zip(c.blocks, c.first_ops, c.last_ops, strict=True):
            inner = by_parent.get(blk[0]) if len(blk) == 1 else None
            if inner is not None and (inner.first_ops[0], inner.last_ops[-1]) == (a, b):
                add(inner)
            else:
                parts.append((blk, a, b))

    add(ch)
    if len(parts) == len(ch.blocks):
        return None
    arrs = ctx.arrays
    for (blk0, a0, b0), (blk1, a1, b1) in pairwise(parts):
        if index[blk0[0]].parent != index[blk1[0]].parent and ctx.parent_ops_between(b0, a1):
            return None
        ids = arrs.created_in(a0, a1 - 1)
        if ids.size and int(arrs.lfu[ids].max()) > b1:
            return None
    return Chain(f"{ch.parent or '<root>'} (stages opened)", tuple(p[0] for p in parts),
                 tuple(p[1] for p in parts), tuple(p[2] for p in parts))
