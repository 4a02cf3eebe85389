"""Chain segments: one checkpoint spanning several consecutive sibling module calls.

NOTE [chain segments]
    Hugging Face models call their blocks from a Python loop (``for layer in self.layers:
    h = layer(h, ...)``), so ``checkpoint_sequential`` cannot checkpoint a run of them as one
    region. A segment does it with module hooks on blocks k..j, under these rules.

    Rule 1. The region is every op that runs from block k's forward pre-hook to block j's
            forward hook: the pre-hook enters torch's non-reentrant checkpoint (its
            generator form, which can be entered and left in different functions:
            ``memfit._torch.open_checkpoint``) and the forward hook leaves it.

    Rule 2. The recomputation replays exactly the region's ops, by re-calling blocks k..j
            with the arguments they got in the forward. An argument that was the output of
            an earlier block of the segment (or an element of it) is replaced by that
            block's recomputed output, a tensor passed into the checkpoint by the copy torch
            saved, and any other tensor is held by reference, its version counter checked
            before the replay.

    Rule 3. The segment's hooks do nothing while a replay runs.

    Rule 4. The parent runs no op inside the region. memfit counts the ops the region
            dispatches; if the parent ran ops between blocks i-1 and i (``h = h * 2``,
            logging a norm), or calls block i after another block than i-1, the segment is
            cut there: this call's checkpoint ends (covering blocks up to i-1, a new one
            starting at block i), a warning is logged, and from then on the segment closes
            its checkpoint at block i-1's forward hook, so the parent's code runs outside
            any checkpoint.

    Rule 5. What the parent saves for backward between two blocks is saved as without the
            segment: from a block's forward hook to the next block's pre-hook, the
            saved-tensor hooks of the code outside the checkpoint are put back on top
            (autograd's default when there were none).

    Rule 6. A block whose forward raises abandons the checkpoint (``always_call`` forward
            hooks).

    Consequence: the step's gradients are bitwise those of the plain step. In the usual case
    every forward calls every block in order with nothing in between, and the replay redoes
    the region op for op (rules 1-3). The first call in which the parent runs ops between
    blocks i-1 and i runs them inside the open checkpoint (rule 4 sees them only at block
    i's pre-hook): the replay does not redo them (the divergence check expects only the ops
    up to block i-1's end), and by rule 5 what they save is saved outside the checkpoint, so
    torch finds the saved tensors it expects (it would raise "a different number of tensors
    was saved") and that step's backward is correct too; only its memory is what the cut
    segment would have. Later calls close the checkpoint before that code.

    Limitations: every block of the segment must be called in each forward (a loop stopping
    early leaves the checkpoint open until the next call, and everything the parent runs
    meanwhile is inside it); forward hooks on the last block registered after the segment,
    and global forward pre-hooks, run outside the region in forward but inside the replay
    (the divergence check reports it if they run ops); KV caches must be off
    (``use_cache=False``), since a replay would update them again.
    Under ``torch.compile`` the hooks do nothing and each block runs as its own region, op
    keys still counted over the segment (NOTE [segments under torch.compile] in
    ``memfit.runtime.segment_compiled``).

    Implementation: ``SegmentHandle`` puts a ``_PreHook`` (prepended) and a ``_PostHook``
    (``always_call``) on each block. Block i's pre-hook, with a checkpoint open: takes the
    rule-5 hooks off, then cuts (rule 4: block 0 again means the last forward stopped early;
    another block than the next; an op count above the one at the last block's end, the
    ``boundary``) or records the call (rule 2). With none open (or just cut) and autograd
    recording (NOTE [when a region checkpoints] in ``memfit.runtime.wrap``), it opens one
    whose ``context_fn`` is a ``RegionContexts`` counting ops. Block i's forward hook records
    its outputs and the boundary, then closes the checkpoint at the last block or before a
    learnt cut, and puts the rule-5 hooks on otherwise. The records and the ``Replay`` that
    torch calls to recompute live in ``memfit.runtime.replay``.

NOTE [segments and threads]
    Several threads may run the same segmented model at once (each its own forward and
    backward). What a segment tracks for one forward (the open checkpoint, the saved-tensor
    hooks put back between two blocks, whether a replay is running) is therefore per thread
    (``ThreadState``): torch's saved-tensor hooks and dispatch modes are thread-local too, so
    the thread whose pre-hook opened a checkpoint closes it, and a replay silences the hooks
    of the thread running it only (the one running backward, which sets and reads the flag).
    The handle holds what every call shares: blocks, policy, cuts learnt. Random ops are
    another matter, with or without memfit: threads draw from one global generator in the
    scheduler's order, and torch's checkpoint restores its state around each recomputation
    (``fork_rng``); only without random ops are per-thread results independent of it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from memfit._torch import (
    close_checkpoint,
    open_checkpoint,
    outer_saved_tensors_hooks,
    require_chain_segments,
)
from memfit.errors import WrapError
from memfit.runtime import checkpoint as _checkpoint
from memfit.runtime import policies as _policies
from memfit.runtime.bindings import watch_inputs
from memfit.runtime.divergence import CheckArg, CheckSampler
from memfit.runtime.marks import SEGMENT_ATTR, is_wrapped, segment_mark, suspended
from memfit.runtime.policies import PolicyArg
from memfit.runtime.replay import OpenCheckpoint, Replay, ThreadState, map_tensors
from memfit.runtime.segment_compiled import SegmentForward, SegmentTrace

__all__ = ["checkpoint_segment", "SegmentHandle", "segment_of"]

log = logging.getLogger(__name__)


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


class SegmentHandle:
    """A chain segment installed on consecutive sibling modules; ``remove()`` uninstalls it.

    Attributes:
        blocks: the modules of the segment, in call order.
        name: how errors and logs name the segment.
    """

    def __init__(self, blocks: Sequence[nn.Module], policy: Any, *, check: Any,
                 name: str, watch_buffers: bool | None = None) -> None:
        self.blocks = tuple(blocks)
        self.watch_buffers = watch_buffers
        self.policy = policy
        self.check = CheckSampler(check)  # one call counter per segment
        self.name = name
        self.cuts: set[int] = set()
        self.trace = SegmentTrace(name, len(self.blocks))  # NOTE [segments under torch.compile]
        self._tls = ThreadState()
        self._hooks: list[Any] = []
        self._forwards: list[SegmentForward] = []
        for pos, block in enumerate(self.blocks):
            forward = SegmentForward(self, pos, block.__dict__.get("forward"))
            self._forwards.append(forward)
            block.forward = forward  # type: ignore[method-assign]
            self._hooks.append(block.register_forward_pre_hook(
                _PreHook(self, pos), with_kwargs=True, prepend=True))
            self._hooks.append(block.register_forward_hook(
                _PostHook(self, pos), with_kwargs=True, always_call=True))
            setattr(block, SEGMENT_ATTR, self)

    def __repr__(self) -> str:
        return f"SegmentHandle({self.name}, {len(self.blocks)} blocks, policy={self.policy!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_tls"]  # a copy starts with no forward open, in any thread
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tls = ThreadState()

    def remove(self) -> None:
        """Uninstall the segment: the blocks run plainly again."""
        if self._tls.open is not None:
            self._abort()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for block, forward in zip(self.blocks, self._forwards, strict=True):
            if segment_mark(block) is self:
                delattr(block, SEGMENT_ATTR)
            if block.__dict__.get("forward") is forward:
                if forward.instance_forward is None:
                    del block.__dict__["forward"]
                else:
                    block.__dict__["forward"] = forward.instance_forward
        self._forwards = []

    # ---- forward-time logic (NOTE [chain segments], Implementation) ---------------------
    def wants_checkpoint(self, pos: int, args: Any, kwargs: Any) -> bool:
        """Whether autograd records block ``pos``'s call (NOTE [when a region checkpoints])."""
        if not torch.is_grad_enabled():  # also in eval(): NOTE [when a region checkpoints], wrap.py
            return False
        if suspended():  # NOTE [suspended plans] in memfit.runtime.marks
            return False
        found = []
        map_tensors((args, kwargs), lambda t: found.append(t.requires_grad))
        if any(found):
            return True
        return any(p.requires_grad for b in self.blocks[pos:] for p in b.parameters())

    def _start(self, pos: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        # Looked up at call time: tests count the contexts made by replacing the class.
        contexts = _checkpoint.RegionContexts(self.policy, check=self.check, name=self.name,
                                              modules=self.blocks[pos:], count_ops=True,
                                              watch_buffers=self.watch_buffers)
        op = OpenCheckpoint(gen=None, contexts=contexts, start=pos,
                            outer_hooks=outer_saved_tensors_hooks())
        map_tensors((args, kwargs), op.add_input)
        try:
            op.gen = open_checkpoint(Replay(self.name, self._tls, op.calls, op.held), contexts,
                                     op.inputs)
        except ValueError as e:
            if "incompatible with non-default context_fn" not in str(e):
                raise
            raise _checkpoint.debug_mode_error(self.name) from None
        self._tls.open = op
        op.add_call(pos, module, args, kwargs)

    @staticmethod
    def _enter_between(op: OpenCheckpoint) -> None:  # rule 5
        pack, unpack = op.outer_hooks if op.outer_hooks is not None else (_keep, _keep)
        op.between = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        op.between.__enter__()

    @staticmethod
    def _leave_between(op: OpenCheckpoint) -> None:
        if op.between is not None:
            between, op.between = op.between, None
            between.__exit__(None, None, None)

    def _close(self, *, replayed_prefix: int | None = None) -> None:
        op = self._tls.open
        assert op is not None
        self._tls.open = None
        if replayed_prefix is not None and op.contexts.recorder is not None:
            op.contexts.recorder.replayed_prefix = replayed_prefix
        close_checkpoint(op.gen)
        # NOTE [the forward's tensors] in memfit.runtime.bindings, rule 5
        watch_inputs(self.name, op.inputs, [ref() for ref, _, _ in op.outputs.values()])

    def _abort(self) -> None:
        op = self._tls.open
        self._tls.open = None
        if op is not None:
            self._leave_between(op)
            op.gen.close()

    def _cut(self, pos: int, why: str) -> None:  # rule 4
        op = self._tls.open
        assert op is not None
        self._close(replayed_prefix=op.boundary)
        if pos not in self.cuts:
            self.cuts.add(pos)
            log.warning(
                "memfit segment %s: %s before block %d; the segment is cut there (one "
                "checkpoint ends after block %d, another starts at block %d); later steps "
                "close the checkpoint before that code.",
                self.name, why, pos, pos - 1, pos,
            )

    def pre_hook(self, pos: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():  # NOTE [segments under torch.compile]
            return
        if self._tls.replaying:  # rule 3
            return
        op = self._tls.open
        if op is not None:
            self._leave_between(op)
            if pos == 0:
                log.warning("memfit segment %s: the previous forward did not reach the last "
                            "block; closing its checkpoint", self.name)
                self._abort()
            elif pos != op.last + 1:
                self._cut(pos, f"block {pos} was called after block {op.last}")
            elif op.contexts.recorder.count != op.boundary:
                self._cut(pos, "the parent ran tensor ops")
            else:
                op.add_call(pos, module, args, kwargs)
                return
        if self.wants_checkpoint(pos, args, kwargs):
            self._start(pos, module, args, kwargs)

    def post_hook(self, pos: int, module: nn.Module, output: Any) -> None:
        if torch.compiler.is_compiling():  # NOTE [segments under torch.compile]
            return
        if self._tls.replaying:  # rule 3
            return
        op = self._tls.open
        if op is None or op.last != pos or op.calls[-1].module is not module:
            return
        if output is None and sys.exc_info()[1] is not None:  # rule 6: the forward raised
            self._abort()
            return
        op.add_output(output)
        op.boundary = op.contexts.recorder.count
        if pos == len(self.blocks) - 1 or (pos + 1) in self.cuts:
            self._close()
        else:
            self._enter_between(op)


class _PreHook:
    """Picklable forward pre-hook bound to one block position."""

    def __init__(self, handle: SegmentHandle, pos: int) -> None:
        self.handle, self.pos = handle, pos

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.handle.pre_hook(self.pos, module, args, kwargs)


class _PostHook:
    def __init__(self, handle: SegmentHandle, pos: int) -> None:
        self.handle, self.pos = handle, pos

    def __call__(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self.handle.post_hook(self.pos, module, output)


def segment_of(module: nn.Module) -> SegmentHandle | None:
    """The segment a module belongs to, if any."""
    return cast("SegmentHandle | None", segment_mark(module))


def checkpoint_segment(
    parent: nn.Module,
    names_or_indices: Sequence[str | int],
    policy: PolicyArg = None,
    *,
    check: CheckArg = True,
    name: str | None = None,
    watch_buffers: bool | None = None,
) -> SegmentHandle:
    """Checkpoint a run of consecutive sibling modules as one region (NOTE [chain segments]).

    Args:
        parent: the module holding the blocks, e.g. ``model.model.layers`` (a ModuleList) or
            the module whose attributes they are.
        names_or_indices: the blocks, as child names or positions among ``parent``'s
            children, consecutive and in order (``[2, 3, 4]`` or ``["2", "3", "4"]``).
        policy: as for ``memfit.runtime.checkpoint.checkpoint``; op keys count over the
            whole segment.
        check: compare the replay with the forward op by op and value by value: True
            (default: the first calls, then one in 100), "always", "ops", False, or a
            ``DivergenceCheck`` (NOTE [check sampling] in ``memfit.runtime.divergence``).
        name: how errors name the segment (default: parent class and block names).
        watch_buffers: as for ``memfit.runtime.wrap.wrap``.

    Returns:
        A handle; ``handle.remove()`` undoes it.

    Raises:
        WrapError: unknown or non-consecutive blocks, or a block already wrapped or in a
            segment.
        UnsupportedTorch: this torch's private checkpoint generator is missing or has
            another signature (NOTE [private torch APIs] in ``memfit._torch``).

    Example:
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
        >>> handle = checkpoint_segment(layers, [1, 2])
        >>> handle.remove()
    """
    require_chain_segments()
    if not isinstance(parent, nn.Module):
        raise TypeError(f"checkpoint_segment expects the parent module, got {type(parent).__name__}")
    if isinstance(names_or_indices, (str, int)) or not names_or_indices:
        raise WrapError(f"checkpoint_segment needs a non-empty list of block names or "
                        f"indices, got {names_or_indices!r}")
    children = [n for n, _ in parent.named_children()]
    positions = []
    for item in names_or_indices:
        if isinstance(item, int) and not isinstance(item, bool):
            if not -len(children) <= item < len(children):
                raise WrapError(f"block index {item} is out of range: {type(parent).__name__} "
                                f"has {len(children)} children")
            positions.append(item % len(children))
        elif isinstance(item, str) and item in children:
            positions.append(children.index(item))
        else:
            raise WrapError(f"{type(parent).__name__} has no child {item!r} (children: "
                            f"{children[:8]}{'...' if len(children) > 8 else ''})")
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise WrapError(f"segment blocks must be consecutive siblings in call order; got "
                        f"{[children[p] for p in positions]} at positions {positions}")
    blocks = [parent.get_submodule(children[p]) for p in positions]
    for b, p in zip(blocks, positions, strict=True):
        if is_wrapped(b) or segment_of(b) is not None:
            raise WrapError(f"block {children[p]!r} ({type(b).__name__}) is already "
                            "checkpointed (wrapped or in a segment); undo that first (to checkpoint "
                            "a block inside a segment, make the segment first, then wrap the block)")
    label = name or f"{type(parent).__name__}[{children[positions[0]]}..{children[positions[-1]]}]"
    return SegmentHandle(blocks, _policies.resolve(policy), check=check, name=label,
                         watch_buffers=watch_buffers)
