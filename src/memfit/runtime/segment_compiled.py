"""Chain segments under torch.compile: each block its own compiled region, op keys counted over
the whole segment.

NOTE [segments under torch.compile]
    Eagerly a segment is one checkpoint, entered in block k's forward pre-hook and left in
    block j's forward hook through torch's checkpoint generator (NOTE [chain segments] in
    ``memfit.runtime.segment``). Dynamo cannot trace that: with ``fullgraph=True`` it refuses
    the saved-tensor hooks the generator pushes; without it, it breaks the graph there and the
    segment is silently not applied. What dynamo does capture is
    ``torch.utils.checkpoint.checkpoint`` around one function (NOTE [policies under
    torch.compile] in ``memfit.runtime.checkpoint``). So under compilation:

    1. The segment's hooks do nothing (``torch.compiler.is_compiling()``). Each block's
       instance ``forward`` (``SegmentForward``, installed with the hooks) runs the block as
       its own region: torch's checkpoint with a ``functools.partial`` of
       ``segment_contexts``. Eagerly ``SegmentForward`` calls the block's forward directly
       and the hooks make the segment, as before.
    2. Op keys count over the whole segment (NOTE [op keys] in
       ``memfit.runtime.policies``), so block i's ``CompiledRegionPolicy`` starts from the
       counts block i-1's ended with. AOTAutograd calls the regions' context_fns in program
       order in each of its passes over a graph, so when block i's is called, block i-1's
       region of the same pass has been traced; ``SegmentTrace`` keeps, per block, the counts
       of its latest traced call. Block k, and a block where the segment was cut eagerly
       (rule 4 of NOTE [chain segments]), start from zero, as their eager checkpoints do.
    3. Within each block the compiled graph saves what the plan saves. Across blocks it
       also keeps the input of blocks k+1..j (each region's input), which the one eager
       checkpoint recomputes: the peak exceeds the plan's prediction by up to those inputs'
       bytes. memfit logs this once per segment as a WARNING with the bytes (the tensors
       requiring grad passed to blocks k+1..j, read from the traced shapes).

    Consequence: a segment plan compiles (also with ``fullgraph=True``), trains as the
    compiled plain model does, and saves at most the plan's bytes plus the inputs of the
    segment's later blocks. Limitation: the parent's code between two blocks runs outside any
    region under compilation (eagerly it is inside the segment until rule 4 cuts it), and a
    forward calling the blocks out of order gets counts from the last traced call of the block
    before.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from memfit.runtime import checkpoint_compiled as _compiled
from memfit.runtime.replay import map_tensors

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

__all__ = ["SegmentForward", "SegmentTrace", "segment_contexts"]

log = logging.getLogger(__name__)


class SegmentTrace:
    """What the compiled regions of one segment's blocks share while AOTAutograd traces them.

    Attributes:
        name: the segment's name, for the log.
        n_blocks: how many blocks the segment has.
        after: per block position, the eager op counts at the end of its latest traced call.
        extra_bytes: per block position, the bytes of its input the compiled graph keeps and
            the eager segment would not (0 where a region starts; None: unknown shapes).
        warned: whether the memory warning was logged.
        itself: a plain function returning this object (dynamo passes it on as a constant).
    """

    def __init__(self, name: str, n_blocks: int) -> None:
        self.name = name
        self.n_blocks = n_blocks
        self.after: dict[int, dict[str, int]] = {}
        self.extra_bytes: dict[int, int | None] = {}
        self.warned = False
        self.itself = _returning(self)

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "n_blocks": self.n_blocks}  # a copy traces afresh

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["name"], state["n_blocks"])  # type: ignore[misc]

    def say_memory(self) -> None:
        """Log, once, what the compiled segment keeps beyond the plan (rule 3 of NOTE
        [segments under torch.compile])."""
        if self.warned:
            return
        self.warned = True
        sizes = [self.extra_bytes.get(p) for p in range(self.n_blocks)]
        amount = "an unknown number of bytes (symbolic shapes)"
        if all(isinstance(n, int) for n in sizes):
            amount = f"{sum(n for n in sizes if n is not None):,} bytes"
        log.warning(
            "memfit segment %s runs under torch.compile as %d checkpointed regions, one per "
            "block: a compiled graph cannot hold one checkpoint spanning several module calls. "
            "Each block saves what the plan says (op keys continue across the blocks), but the "
            "compiled graph also keeps the input of each block after the first, up to %s more "
            "than the plan predicts; plan at a budget lower by that much if the compiled step "
            "must fit (NOTE [segments under torch.compile]).",
            self.name, self.n_blocks, amount,
        )


def _returning(trace: SegmentTrace) -> Callable[[], SegmentTrace]:
    def itself() -> SegmentTrace:
        return trace
    return itself


def segment_contexts(policy: Callable[[], Any] | None, trace: Callable[[], SegmentTrace],
                     pos: int, first: int, extra_bytes: int | None) -> tuple[Any, Any]:
    """The selective-checkpoint contexts of block ``pos`` of a compiled segment (AOTAutograd
    calls it while it traces the block's region; NOTE [segments under torch.compile]).

    Args:
        policy: the segment policy's ``itself`` (None: recompute everything).
        trace: the segment's ``SegmentTrace.itself``.
        pos: the block's position in the segment.
        first: the position of the block where this block's eager checkpoint starts (0, or
            a cut).
        extra_bytes: the bytes of this block's input the compiled graph keeps and the eager
            segment would not (None: unknown).
    """
    state = trace()
    _compiled.say_unchecked()
    state.extra_bytes[pos] = extra_bytes
    if pos == state.n_blocks - 1:
        state.say_memory()
    if policy is None:
        return create_selective_checkpoint_contexts(_compiled.recompute_everything)
    start = {} if pos == first else state.after.get(pos - 1, {})
    region_policy = _compiled.CompiledRegionPolicy(policy(), start)
    state.after[pos] = region_policy.counts  # filled in as AOTAutograd traces the block
    return create_selective_checkpoint_contexts(region_policy)


def _input_bytes(args: Any, kwargs: Any) -> int | None:
    """Bytes of the tensors requiring grad in a block's arguments (None: symbolic shapes)."""
    sizes: list[Any] = []
    map_tensors((args, kwargs), lambda t: sizes.append(t.numel() * t.element_size())
                if t.requires_grad else None)
    if not all(isinstance(n, int) for n in sizes):
        return None
    return sum(sizes)


class SegmentForward:
    """The instance-level ``forward`` a segment installs on each block: the block's own
    forward eagerly, the block as a checkpointed region under compilation (NOTE [segments
    under torch.compile])."""

    def __init__(self, handle: Any, pos: int, instance_forward: Any) -> None:
        # handle: the ``memfit.runtime.segment.SegmentHandle`` (not imported: no cycle)
        self.handle, self.pos = handle, pos
        self.instance_forward = instance_forward  # None: the class's forward

    def inner(self) -> Callable[..., Any]:
        """The block's forward this replaces."""
        if self.instance_forward is not None:
            return self.instance_forward  # type: ignore[no-any-return]
        block: nn.Module = self.handle.blocks[self.pos]
        return functools.partial(type(block).forward, block)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        handle, pos = self.handle, self.pos
        inner = self.inner()
        if not torch.compiler.is_compiling() or not handle.wants_checkpoint(pos, args, kwargs):
            return inner(*args, **kwargs)
        first = 0
        for cut in handle.cuts:
            if first < cut <= pos:
                first = cut
        extra = 0 if pos == first else _input_bytes(args, kwargs)
        policy = None if handle.policy is None else handle.policy.itself
        context_fn = functools.partial(segment_contexts, policy, handle.trace.itself, pos,
                                       first, extra)
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False,
                                                 context_fn=context_fn, **kwargs)
