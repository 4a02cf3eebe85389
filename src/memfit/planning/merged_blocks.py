"""Chain blocks made of several consecutive children.

NOTE [merged blocks]
    A flat ``nn.Sequential`` of layers (VGG's ``features``: conv, in-place ReLU, conv, ...,
    max-pool) has no chain of single children: a conv alone drops nothing (it saves only its
    input and weight), an in-place ReLU alone has its input written in place, and the conv's
    output, written by the ReLU, is read by the next conv, one child too far. So a chain block
    is a run of consecutive children (``Chain.blocks[k]``, its modules in call order), formed
    left to right: a child joins the open block while that block is not yet a useful region,
    or while the chain condition fails between the block before and it (something the block
    before created is read after the open block's end). A block is closed once it is useful
    and the condition holds; each closed block is a segment candidate of its own (the
    runtime applies a multi-module region as a chain segment) and satisfies exactly what
    NOTE [chains] asks of a single-module block, so ``solvers.chain`` stays exact without a
    rule of its own: a block of one child is the old block, and a container whose children
    all qualify alone gets the old chain. Children left over at the end (no useful block
    can be closed) end the chain; a run with parent code between two children is cut there.
    A child whose input is written in place (NOTE [clobbered inputs]) cannot start a block:
    it joins the closed block before it where that block made the input (a ResNet stem's
    ``[conv, bn]`` and its in-place ReLU become ``[conv, bn, relu_]``, whose region holds
    both the write and what it writes); otherwise it ends the chain, which may start again
    after it. (Before the join, a stem began no chain: its conv and norm outputs, 1.18 GB of
    ResNet-50 at batch 184, were held through the whole backward of every plan.)
    ``[conv, relu_]`` becomes one block (the ReLU saves the conv's output, which the region's
    frame then drops and replays); alone it lowers nothing, since the next conv saves that
    output too (its constant on later blocks is the frame's generator state, > 0), but a
    segment of several drops every output but its last. A max-pool stays alone (it drops its
    indices). Only the main chain's merged blocks are baseline blocks (NOTE [baseline
    blocks]); the MILP's plan space gains every merged block and segment whose op range no
    module candidate has.
"""

from __future__ import annotations

from typing import Protocol

from memfit.planning.arrays import ProfileArrays
from memfit.profiling.profile import ModuleRecord

__all__ = ["merged_runs"]


class Blocks(Protocol):
    """What the runs are formed from (``memfit.planning.candidates.PlanningContext``)."""

    arrays: ProfileArrays

    def candidate(self, modules: tuple[str, ...], *, with_ops: bool = True) -> object | None: ...

    def clobbered(self, recs: list[ModuleRecord]) -> bool: ...

    def parent_ops_between(self, prev_last: int, next_first: int) -> bool: ...


def merged_runs(ctx: Blocks, kids: list[ModuleRecord]) -> list[list[list[ModuleRecord]]]:
    """Runs of closed blocks over sibling records in call order (NOTE [merged blocks])."""
    arrs = ctx.arrays
    runs: list[list[list[ModuleRecord]]] = []
    run: list[list[ModuleRecord]] = []  # closed blocks
    open_: list[ModuleRecord] = []

    def closes(blk: list[ModuleRecord]) -> bool:
        if ctx.candidate(tuple(k.path for k in blk)) is None:
            return False
        if not run:
            return True
        prev = run[-1]
        # what the block before (and the parent's code after it) created is read by
        # nothing after this block
        ids = arrs.created_in(int(prev[0].first_op), int(blk[0].first_op) - 1)  # type: ignore[arg-type]
        return not (ids.size and int(arrs.lfu[ids].max()) > int(blk[-1].last_op))  # type: ignore[arg-type]

    def rejoin(merged: list[ModuleRecord]) -> list[ModuleRecord]:
        """The run's last block replaced by ``merged``: closed (the open block is then
        empty) or left open."""
        run.pop()
        if closes(merged):
            run.append(merged)
            return []
        return merged

    for k in kids:
        last = open_[-1] if open_ else (run[-1][-1] if run else None)
        if last is not None and k.first_op <= last.last_op:  # type: ignore[operator]
            runs.append(run)  # not one after another: the chain ends here
            run, open_ = [], []
        elif open_ and ctx.parent_ops_between(int(last.last_op), int(k.first_op)):  # type: ignore[arg-type, union-attr]
            open_ = []  # no block spans the parent's code (a segment's replay cannot)
        open_.append(k)
        if ctx.clobbered(open_) and run:
            # its input is written in place (NOTE [clobbered inputs]) where the block
            # before made it (a stem's in-place relu after its norm): the two as one
            # block, whose region holds both the write and what it writes
            merged = run[-1] + open_
            if not ctx.clobbered(merged) and ctx.candidate(tuple(c.path for c in merged)) is not None:
                open_ = rejoin(merged)
                continue
        if ctx.clobbered(open_):
            # its input is written in place (NOTE [clobbered inputs]): no block starts
            # here, however long; the chain ends before it and may start again after
            runs.append(run)
            run = []
            while open_ and ctx.clobbered(open_):
                open_ = open_[1:]
            if not open_:
                continue
        if closes(open_):
            run.append(open_)
            open_ = []
            continue
        if not run or ctx.candidate(tuple(c.path for c in open_)) is None:
            continue
        # useful, but the block before is read past it: try the two as one block
        merged = run[-1] + open_
        if ctx.candidate(tuple(c.path for c in merged)) is None:
            runs.append(run)  # they cannot be one region (parent code between): a new chain
            run, open_ = [open_], []
            continue
        open_ = rejoin(merged)
    runs.append(run)
    return runs
