"""Chain segments: one checkpoint spanning several consecutive sibling module calls.

This is also the only module of memfit that touches private torch APIs (the section just
below); everything else in memfit goes through the names defined there.

NOTE [chain segments]
    Hugging Face models call their blocks from a Python loop (``for layer in self.layers:
    h = layer(h, ...)``), so ``checkpoint_sequential`` cannot checkpoint a run of them as
    one region. A segment does it with module hooks: block k's forward pre-hook enters
    torch's non-reentrant checkpoint (its generator form, which can be entered and left in
    different functions), and block j's forward hook leaves it. Every op between the two
    hooks belongs to the region, and the recomputation must replay exactly those ops. The
    replay function re-calls blocks k..j with the arguments they got in the forward, where an
    argument that was the output of an earlier block of the segment (or an element of it) is
    replaced by that block's recomputed output; any other tensor is held by reference (and
    its version counter checked before the replay).

    That replay is exact only if the parent ran no op between two blocks. memfit counts the
    ops the region dispatches; if the parent ran ops between blocks i-1 and i (``h = h * 2``,
    logging a norm), the segment is cut there for this call (the ops run after block i-1
    end the first checkpoint, which the replay does not redo; what they save for backward is
    saved outside it, NOTE [between blocks]), a warning is logged, and from then on the segment is closed at
    block i-1's forward hook, so that the parent's code runs outside any checkpoint. A block
    called out of order is handled the same way.

    NOTE [between blocks]: the ops the parent runs after block i-1, before block i's pre-hook
    sees that it must cut, run inside the open checkpoint. The tensors they save for backward
    would be packed by the checkpoint, which the replay (blocks only) never recomputes: torch
    would raise "a different number of tensors was saved" in backward. So between two
    blocks the segment puts the saved-tensor hooks of the code outside the checkpoint back on
    top (autograd's default when there were none), and takes them off at the next block's
    pre-hook: what the parent saves between blocks is saved as without the segment, and the
    cut step's backward is correct (only its memory is what the cut segment would have).

    The hooks do nothing while a replay runs. Blocks whose forward raises close the
    checkpoint (``always_call`` forward hooks). Limitations: every block of the segment must
    be called in each forward (a loop stopping early leaves the checkpoint open until the
    next call, and everything the parent runs meanwhile is inside it); forward hooks on the
    last block registered after the segment, and global forward pre-hooks, run outside the
    region in forward but inside the replay (the divergence check reports it if they run
    ops); KV caches must be off (``use_cache=False``), since a replay would update them again.

NOTE [segments and threads]
    Several threads may run the same segmented model at once (each its own forward and
    backward). What a segment tracks for one forward (the open checkpoint, the saved-tensor
    hooks put back between two blocks, whether a replay is running) is therefore per thread
    (``_ThreadState``): torch's saved-tensor hooks and dispatch modes are thread-local too, so
    the thread whose pre-hook opened a checkpoint closes it, and a replay silences the hooks
    of the thread running it only (the one running backward, which sets and reads the flag).
    The handle holds what every call shares: blocks, policy, cuts learnt. Random ops are
    another matter, with or without memfit: threads draw from one global generator in the
    scheduler's order, and torch's checkpoint restores its state around each recomputation
    (``fork_rng``); only without random ops are per-thread results independent of it.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint as _tc
from torch import nn

from memfit.errors import RecomputeMismatch, WrapError

__all__ = ["checkpoint_segment", "SegmentHandle", "segment_of"]

log = logging.getLogger(__name__)

# =======================================================================================
# torch internals: the only place memfit uses private torch APIs. Each is checked here.
# =======================================================================================
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket


def op_writes_inputs(op: Any) -> bool:
    """True if the op's schema marks an argument as written (``Tensor(a!)``)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def written_tensors(op: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments the op's schema marks as written."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def sac_forget(caching_mode: Any, op: Any, index: int) -> bool:
    """Turn a saved entry of torch's selective-checkpoint cache back into "recompute".

    Used when the forward writes in place into a tensor the cache holds (NOTE [forced
    recompute] in memfit.runtime.policies). Returns False if this torch lays the cache out
    differently (the selective checkpoint then raises its own "has been mutated" error).
    """
    storage = getattr(caching_mode, "storage", None)
    marker = getattr(_tc, "_RECOMPUTE", None)
    if storage is None or marker is None or op not in storage or index not in storage[op]:
        return False
    storage[op][index] = marker
    return True


def outer_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The (pack, unpack) saved-tensor hooks in effect now (None: autograd's default)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(True) if top is not None else None


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter (bumped by every in-place write)."""
    return t._version


def no_python_dispatch() -> Any:
    """A context in which ops skip every Python dispatch mode (and tensor subclass): the
    divergence check's fingerprints (NOTE [value check] in memfit.runtime.divergence)."""
    return torch._C._DisableTorchDispatch()


_EXPECTED_PARAMS = (
    "fn", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop",
    "args", "kwargs",
)
_generator = getattr(_tc, "_checkpoint_without_reentrant_generator", None)
_GENERATOR_PROBLEM: str | None = None
if _generator is None:
    _GENERATOR_PROBLEM = (
        f"torch {torch.__version__} has no torch.utils.checkpoint."
        "_checkpoint_without_reentrant_generator"
    )
else:
    _params = tuple(inspect.signature(_generator).parameters)
    if _params != _EXPECTED_PARAMS or not inspect.isgeneratorfunction(_generator):
        _GENERATOR_PROBLEM = (
            f"torch {torch.__version__}'s _checkpoint_without_reentrant_generator has "
            f"parameters {_params}, memfit expects {_EXPECTED_PARAMS}"
        )
# =======================================================================================


@dataclass(frozen=True)
class _Out:
    """Placeholder: the recomputed output of the segment's call ``call`` (element ``index``)."""

    call: int
    index: int | str | None


@dataclass(frozen=True)
class _In:
    """Placeholder: the i-th tensor passed to the checkpoint (saved by torch)."""

    i: int


@dataclass
class _Call:
    module: nn.Module
    args: Any
    kwargs: Any


@dataclass
class _Open:
    """State of a segment checkpoint open in the current forward."""

    gen: Any
    contexts: Any
    start: int
    last: int = -1
    boundary: int = 0
    calls: list[_Call] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)
    input_ids: dict[int, int] = field(default_factory=dict)
    outputs: dict[int, tuple[weakref.ref, int, int | str | None]] = field(default_factory=dict)
    held: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    # The saved-tensor hooks in effect outside the checkpoint, and the context that puts them
    # back in effect between two blocks (NOTE [between blocks]).
    outer_hooks: tuple[Any, Any] | None = None
    between: Any = None


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _map(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map(v, fn) for v in value)
    if isinstance(value, list):
        return [_map(v, fn) for v in value]
    if type(value) is dict:
        return {k: _map(v, fn) for k, v in value.items()}
    return value


def _resolve(value: Any, inputs: Sequence[torch.Tensor], outs: list[Any]) -> Any:
    if isinstance(value, _In):
        return inputs[value.i]
    if isinstance(value, _Out):
        out = outs[value.call]
        return out if value.index is None else out[value.index]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_resolve(v, inputs, outs) for v in value)
    if isinstance(value, list):
        return [_resolve(v, inputs, outs) for v in value]
    if type(value) is dict:
        return {k: _resolve(v, inputs, outs) for k, v in value.items()}
    return value


class _ThreadState(threading.local):
    """Per-thread state of a segment (NOTE [segments and threads])."""

    open: _Open | None = None
    replaying: int = 0


class SegmentHandle:
    """A chain segment installed on consecutive sibling modules; ``remove()`` uninstalls it.

    Attributes:
        blocks: the modules of the segment, in call order.
        name: how errors and logs name the segment.
    """

    def __init__(self, blocks: Sequence[nn.Module], policy: Any, *, check: Any,
                 name: str) -> None:
        self.blocks = tuple(blocks)
        self.policy = policy
        from memfit.runtime.divergence import CheckSampler

        self.check = CheckSampler(check)  # one call counter per segment
        self.name = name
        self.cuts: set[int] = set()
        self._tls = _ThreadState()
        self._hooks: list[Any] = []
        for pos, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(
                _PreHook(self, pos), with_kwargs=True, prepend=True))
            self._hooks.append(block.register_forward_hook(
                _PostHook(self, pos), with_kwargs=True, always_call=True))
            block._memfit_segment = self  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SegmentHandle({self.name}, {len(self.blocks)} blocks, policy={self.policy!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_tls"]  # a copy starts with no forward open, in any thread
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tls = _ThreadState()

    def remove(self) -> None:
        """Uninstall the segment: the blocks run plainly again."""
        if self._tls.open is not None:
            self._abort()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for block in self.blocks:
            if block.__dict__.get("_memfit_segment") is self:
                del block._memfit_segment

    # ---- forward-time logic ------------------------------------------------------------
    def _wants_checkpoint(self, pos: int, args: Any, kwargs: Any) -> bool:
        if not torch.is_grad_enabled():  # also in eval(): NOTE [when a region checkpoints], wrap.py
            return False
        found = []
        _map((args, kwargs), lambda t: found.append(t.requires_grad))
        if any(found):
            return True
        return any(p.requires_grad for b in self.blocks[pos:] for p in b.parameters())

    def _encode(self, op: _Open, value: Any) -> Any:
        def one(t: torch.Tensor) -> Any:
            entry = op.outputs.get(id(t))
            if entry is not None and entry[0]() is t:
                return _Out(entry[1], entry[2])
            i = op.input_ids.get(id(t))
            if i is not None and op.inputs[i] is t:
                return _In(i)
            op.held.append((t, tensor_version(t)))
            return t

        return _map(value, one)

    def _start(self, pos: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        from memfit.runtime.checkpoint import RegionContexts

        assert _generator is not None
        contexts = RegionContexts(self.policy, check=self.check, name=self.name,
                                  modules=self.blocks[pos:], count_ops=True)
        op = _Open(gen=None, contexts=contexts, start=pos, outer_hooks=outer_saved_tensors_hooks())

        def collect(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in op.input_ids:
                op.input_ids[id(t)] = len(op.inputs)
                op.inputs.append(t)
            return t

        _map((args, kwargs), collect)
        op.gen = _generator(_Replay(self, op.calls, op.held), True, contexts, "default", False,
                            True, *op.inputs)
        next(op.gen)
        self._tls.open = op
        self._add_call(op, pos, module, args, kwargs)

    @staticmethod
    def _enter_between(op: _Open) -> None:
        pack, unpack = op.outer_hooks if op.outer_hooks is not None else (_keep, _keep)
        op.between = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        op.between.__enter__()

    @staticmethod
    def _leave_between(op: _Open) -> None:
        if op.between is not None:
            between, op.between = op.between, None
            between.__exit__(None, None, None)

    def _add_call(self, op: _Open, pos: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        op.calls.append(_Call(module, self._encode(op, args), self._encode(op, kwargs)))
        op.last = pos

    def _close(self, *, replayed_prefix: int | None = None) -> None:
        op = self._tls.open
        assert op is not None
        self._tls.open = None
        if replayed_prefix is not None and op.contexts.recorder is not None:
            op.contexts.recorder.replayed_prefix = replayed_prefix
        try:
            next(op.gen)
        except StopIteration:
            return
        raise AssertionError("torch's checkpoint generator yielded more than twice")

    def _abort(self) -> None:
        op = self._tls.open
        self._tls.open = None
        if op is not None:
            self._leave_between(op)
            op.gen.close()

    def _cut(self, pos: int, why: str) -> None:
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
        if self._tls.replaying:
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
                self._add_call(op, pos, module, args, kwargs)
                return
        if self._wants_checkpoint(pos, args, kwargs):
            self._start(pos, module, args, kwargs)

    def post_hook(self, pos: int, module: nn.Module, output: Any) -> None:
        if self._tls.replaying:
            return
        op = self._tls.open
        if op is None or op.last != pos or op.calls[-1].module is not module:
            return
        if output is None and sys.exc_info()[1] is not None:  # the block's forward raised
            self._abort()
            return
        index = len(op.calls) - 1

        def register(t: torch.Tensor, key: int | str | None) -> None:
            op.outputs[id(t)] = (weakref.ref(t), index, key)

        if isinstance(output, torch.Tensor):
            register(output, None)
        elif isinstance(output, (tuple, list)):
            for i, v in enumerate(output):
                if isinstance(v, torch.Tensor):
                    register(v, i)
        elif isinstance(output, dict):
            for k, v in output.items():
                if isinstance(v, torch.Tensor):
                    register(v, k)
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


class _Replay:
    """The recompute function of one segment checkpoint: re-calls its blocks in order."""

    def __init__(self, handle: SegmentHandle, calls: list[_Call],
                 held: list[tuple[torch.Tensor, int]]) -> None:
        self.handle, self.calls, self.held = handle, calls, held

    def __call__(self, *inputs: torch.Tensor) -> None:
        for t, version in self.held:
            if tensor_version(t) != version:
                raise RecomputeMismatch(
                    f"segment {self.handle.name}: a tensor passed to one of its blocks "
                    f"(shape {list(t.shape)}) was modified in place after the forward "
                    f"(version {version} -> {tensor_version(t)}), so the recomputation "
                    "cannot replay it; avoid in-place updates of tensors fed to the blocks"
                )
        outs: list[Any] = []
        self.handle._tls.replaying += 1
        try:
            for call in self.calls:
                args = _resolve(call.args, inputs, outs)
                kwargs = _resolve(call.kwargs, inputs, outs)
                outs.append(call.module(*args, **kwargs))
        finally:
            self.handle._tls.replaying -= 1


def segment_of(module: nn.Module) -> SegmentHandle | None:
    """The segment a module belongs to, if any."""
    return module.__dict__.get("_memfit_segment")


def checkpoint_segment(
    parent: nn.Module,
    names_or_indices: Sequence[str | int],
    policy: Any = None,
    *,
    check: bool | str | Any = True,
    name: str | None = None,
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

    Returns:
        A handle; ``handle.remove()`` undoes it.

    Raises:
        WrapError: unknown or non-consecutive blocks, a block already wrapped or in a
            segment, or a torch whose private checkpoint generator memfit does not know.

    Example:
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
        >>> handle = checkpoint_segment(layers, [1, 2])
        >>> handle.remove()
    """
    from memfit.runtime import policies as _policies
    from memfit.runtime.wrap import is_wrapped

    if _GENERATOR_PROBLEM is not None:
        raise WrapError(f"chain segments are unavailable: {_GENERATOR_PROBLEM}; wrap the "
                        "blocks one by one with memfit.wrap instead")
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
                            "checkpointed (wrapped or in a segment); undo that first")
    label = name or f"{type(parent).__name__}[{children[positions[0]]}..{children[positions[-1]]}]"
    return SegmentHandle(blocks, _policies.resolve(policy), check=check, name=label)
