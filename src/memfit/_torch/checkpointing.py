"""torch's checkpoint machinery as memfit uses it: the selective-checkpoint cache's layouts
across releases (NOTE [selective-checkpoint layouts]), its storage, the non-reentrant generator
that chain segments drive, and the features they gate (NOTE [private torch APIs] in
``memfit._torch``, whose part this is: ``memfit._torch`` re-exports every public name)."""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable, Generator
from typing import Any, cast

import torch
import torch.fx.traceback
import torch.utils.checkpoint

from memfit._torch import unsupported  # the core half, defined before this module is imported
from memfit.errors import UnsupportedTorch


def _has_op_output() -> bool:
    probe = torch.zeros(1)
    try:
        ctx = torch.utils.checkpoint.SelectiveCheckpointContext(is_recompute=False,
                                                                op_output=probe)
    except TypeError:
        return False
    return getattr(ctx, "op_output", None) is probe


# NOTE [selective-checkpoint layouts] (memfit.runtime.policies reads these two flags)
#     torch's selective checkpoint keeps saved op outputs in a dict ``storage`` that its
#     caching (forward) and cached (recompute) dispatch modes share, laid out in one of two ways:
#
#     - indexed (torch 2.13 on, ``SAC_INDEXED``): ``storage[op][k]`` per occurrence k, holding
#       the entry, ``_RECOMPUTE`` or ``_CONSUMED``; the policy is asked in the forward only.
#     - queued (torch 2.9-2.12): ``storage[op]`` a list of the saved entries in forward order,
#       which the recomputation pops from the front; the policy is asked again during the
#       recomputation (``ctx.is_recompute``), and an entry consumed by one recomputation is
#       gone for the next (another backward, or a recomputation resumed after an early stop:
#       the next pop takes the wrong entry, and torch's own selective checkpoint then gives
#       wrong gradients silently).
#
#     memfit gives both the indexed semantics: on the queued layout the region policy answers
#     the recomputation from the forward's decisions, by occurrence (never deciding again), and
#     the lists are ``QueuedEntries``, whose pop takes the entry of the occurrence the policy
#     named and leaves a hole; an occurrence whose entry was consumed (or forgotten: NOTE
#     [forced recompute]) is recomputed, as ``_RECOMPUTE`` on the indexed layout.
#     ``SAC_OP_OUTPUT`` (torch 2.12 on): the policy's context carries the op's output; before
#     2.12 the policy is asked before the op runs, and memfit's ``OutputTap`` hands it the
#     output afterwards (memfit.runtime.policies).
SAC_OP_OUTPUT = _has_op_output()
SAC_INDEXED = all(getattr(torch.utils.checkpoint, name, None) is not None
                  for name in ("_RECOMPUTE", "_CONSUMED"))


class QueuedEntries(list):
    """One op's saved entries on the queued layout (NOTE [selective-checkpoint layouts]):
    ``pop`` takes the entry at ``cursor`` (set by the region policy just before torch pops)
    and leaves a hole (None), so positions stay those of the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.cursor: int | None = None

    def pop(self, index: Any = -1) -> Any:  # torch calls pop(0)
        pos = self.cursor
        self.cursor = None
        if pos is None:  # not one of memfit's eager regions' pops: the first entry left
            pos = next(i for i, e in enumerate(self) if e is not None)
        entry = self[pos]
        self[pos] = None
        return entry

    def __len__(self) -> int:  # torch reads an empty list as "backward an extra time"
        return sum(e is not None for e in self)

    def __bool__(self) -> bool:
        return len(self) > 0


# NOTE [profiler ops in a replay]
#     ``torch.profiler.record_function`` (FSDP2's hooks, ``nn.DataParallel``, users' own ranges)
#     dispatches ``profiler._record_function_enter_new`` / ``_record_function_exit`` ops, and a
#     replay runs them a different number of times than the forward when a range encloses
#     the region's end. They compute nothing the gradients read: the divergence check skips
#     them (memfit.runtime.divergence), and on the indexed layout every occurrence of them is
#     "recompute" (``AnyOccurrenceRecomputed``), where torch's cached mode would raise "invocation
#     index ... not found in storage" for an occurrence the forward did not have. On the
#     queued layout the policy is asked and answers recompute.
PROFILER_OPS: tuple[Any, ...] = tuple(
    op for name in ("_record_function_enter", "_record_function_enter_new",
                    "_record_function_exit")
    for packet in [getattr(torch.ops.profiler, name, None)] if packet is not None
    for op in (getattr(packet, o) for o in packet.overloads()))


class AnyOccurrenceRecomputed(dict):
    """A profiler op's entries on the indexed layout: every occurrence is "recompute"."""

    def get(self, key: Any, default: Any = None) -> Any:
        return torch.utils.checkpoint._RECOMPUTE


def sac_ignore_profiler_ops(storage: Any) -> None:
    """NOTE [profiler ops in a replay], on a selective-checkpoint storage dict."""
    if SAC_INDEXED:
        for op in PROFILER_OPS:
            storage[op] = AnyOccurrenceRecomputed()


def selective_checkpoint_contexts(policy_fn: Callable[..., Any]) -> tuple[Any, Any]:
    """torch's ``create_selective_checkpoint_contexts(policy_fn)``, with ``QueuedEntries``
    lists on the queued layout (NOTE [selective-checkpoint layouts]) and profiler ops
    recomputed (NOTE [profiler ops in a replay])."""
    caching, cached = torch.utils.checkpoint.create_selective_checkpoint_contexts(policy_fn)
    if not SAC_INDEXED:
        storage: Any = collections.defaultdict(QueuedEntries)
        caching.storage = storage
        cached.storage = storage
    sac_ignore_profiler_ops(caching.storage)
    sac_keep_out_of_hooks(caching)
    return caching, cached


def sac_keep_out_of_hooks(caching_mode: Any) -> None:
    """NOTE [saved-tensor hooks around selective regions] on the caching mode itself: torch
    sets it from checkpoint's argument only on a caching mode that is the whole forward
    context, and memfit's forward context composes several."""
    if hasattr(caching_mode, RESPECT_HOOKS):
        setattr(caching_mode, RESPECT_HOOKS, False)


def sac_is_recompute(ctx: Any) -> bool:
    """Whether torch asks the policy during a recomputation (queued layout only)."""
    return bool(getattr(ctx, "is_recompute", False))


# Logger of the fake-tensor machinery (the CLI quiets its tracebacks of failing ops).


# ---- torch.utils.checkpoint ----------------------------------------------------------------
def sac_op_output(ctx: Any) -> Any:
    """The output of the op a selective-checkpoint policy is asked about: what the caching
    mode stores if the policy says save (``ctx`` as torch passes it to the policy; None
    before torch 2.12: NOTE [selective-checkpoint layouts])."""
    return getattr(ctx, "op_output", None)


def sac_forget(caching_mode: Any, op: Any, index: int, position: int | None = None) -> bool:
    """Turn a saved entry of torch's selective-checkpoint cache back into "recompute" (the
    forward writes in place into a tensor the cache holds: NOTE [forced recompute] in
    ``memfit.runtime.policies``): occurrence ``index`` on the indexed layout, the entry at
    ``position`` of ``QueuedEntries`` on the queued one (NOTE [selective-checkpoint
    layouts]). False if this torch lays the cache out otherwise (rule 5)."""
    storage = getattr(caching_mode, "storage", None)
    if not SAC_INDEXED:
        entries = storage.get(op) if isinstance(storage, dict) else None
        if not isinstance(entries, QueuedEntries) or position is None or \
                position >= list.__len__(entries):
            return False
        entries[position] = None
        return True
    marker = getattr(torch.utils.checkpoint, "_RECOMPUTE", None)
    if storage is None or marker is None or op not in storage or index not in storage[op]:
        return False
    storage[op][index] = marker
    return True


def sac_rearm(cached_mode: Any) -> int:
    """Turn the cache entries a replay consumed back into "recompute": another backward
    (``retain_graph``, double backward) recomputes them instead of torch's "Trying to backward
    an extra time". Returns how many; 0 on a torch with another cache layout (rule 5)."""
    storage = getattr(cached_mode, "storage", None)
    consumed = getattr(torch.utils.checkpoint, "_CONSUMED", None)
    marker = getattr(torch.utils.checkpoint, "_RECOMPUTE", None)
    if not isinstance(storage, dict) or consumed is None or marker is None:
        return 0
    turned = 0
    for entries in storage.values():
        for index, entry in entries.items():
            if entry is consumed:
                entries[index] = marker
                turned += 1
    return turned


def _sac_storage_problem() -> str | None:
    """What offload needs from torch's selective checkpoint and this torch lacks (None: all)."""
    wrapper = getattr(torch.utils.checkpoint, "_VersionWrapper", None)
    if wrapper is None or getattr(torch.utils.checkpoint, "_CONSUMED", None) is None:
        return ("the indexed selective-checkpoint cache of torch 2.13 and newer "
                "(torch.utils.checkpoint._VersionWrapper and _CONSUMED)")
    caching, cached = torch.utils.checkpoint.create_selective_checkpoint_contexts(lambda *a: False)
    if getattr(caching, "storage", None) is None or getattr(cached, "storage", None) is not \
            caching.storage:
        return "a selective-checkpoint storage dict shared by the caching and cached modes"
    probe = wrapper(torch.zeros(1))
    if not isinstance(getattr(probe, "val", None), torch.Tensor) or probe.version != 0:
        return "torch.utils.checkpoint._VersionWrapper with .val and .version"
    return None


_SAC_STORAGE_PROBLEM = _sac_storage_problem()


def require_sac_storage() -> None:
    """Raise ``UnsupportedTorch`` if this torch's selective checkpoint cannot host offload (rule 4)."""
    if _SAC_STORAGE_PROBLEM is not None:
        raise unsupported(_SAC_STORAGE_PROBLEM, feature="offload",
                          advice="plan without offload (offload=False)")


def sac_set_storage(caching_mode: Any, cached_mode: Any, storage: Any) -> None:
    """Make the two modes of one ``create_selective_checkpoint_contexts`` call share
    ``storage`` (a dict ``op -> {index: entry}``) instead of the dict torch made for them."""
    require_sac_storage()
    sac_ignore_profiler_ops(storage)
    sac_keep_out_of_hooks(caching_mode)
    caching_mode.storage = storage
    cached_mode.storage = storage


def sac_is_entry(value: Any) -> bool:
    """True for one leaf of a saved selective-checkpoint entry (torch's ``_VersionWrapper``),
    False for torch's markers (recompute, consumed)."""
    return isinstance(value, torch.utils.checkpoint._VersionWrapper)


def sac_saved_tensor(leaf: Any) -> tuple[torch.Tensor, int] | None:
    """The tensor a ``_VersionWrapper`` leaf holds and its version when cached (None: not a
    tensor, or a user's pack hook's result: torch 2.14's ``respect_saved_tensors_hooks``)."""
    if getattr(leaf, "unpack_hook", None) is not None:
        return None
    val = leaf.val
    return (val, leaf.version) if isinstance(val, torch.Tensor) else None


_current_meta = getattr(torch.fx.traceback, "get_current_meta", None)


def traced_source_fn() -> Any:
    """While AOTAutograd traces a dynamo graph: the innermost source (module class or torch
    function) of the node traced (NOTE [op keys under torch.compile]), else None (rule 5)."""
    meta = _current_meta() if _current_meta is not None else None
    stack = meta.get("source_fn_stack") if isinstance(meta, dict) else None
    if not stack or not isinstance(stack[-1], tuple) or len(stack[-1]) != 2:
        return None
    return stack[-1][1]


# What memfit passes to the generator, positionally; the inputs follow as ``*args``. torch 2.14
# wraps the generator (same order, a keyword-only parameter added): the check is on these.
_GENERATOR_POSITIONAL = (
    "fn", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop",
)
_GENERATOR_NAME = "torch.utils.checkpoint._checkpoint_without_reentrant_generator"
_GENERATOR_WANTED = (f"{_GENERATOR_NAME}({', '.join(_GENERATOR_POSITIONAL)}, *args, ...) "
                     "(further parameters keyword-only with defaults)")


def generator_problem(generator: Any) -> str | None:
    """What is wrong with a candidate checkpoint generator (None: memfit can call it with
    ``_GENERATOR_POSITIONAL`` and ``*inputs``; what it returns: ``open_checkpoint``)."""
    if generator is None:
        return _GENERATOR_NAME
    try:
        params = list(inspect.signature(generator).parameters.values())
    except (TypeError, ValueError):
        return f"{_GENERATOR_WANTED} (this torch's has no signature)"
    n = len(_GENERATOR_POSITIONAL)
    head, rest = params[:n], params[n:]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ok = (tuple(p.name for p in head) == _GENERATOR_POSITIONAL
          and all(p.kind in positional for p in head)
          and bool(rest) and rest[0].kind is inspect.Parameter.VAR_POSITIONAL
          and all(p.kind is inspect.Parameter.VAR_KEYWORD
                  or (p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not p.empty)
                  for p in rest[1:]))
    if not ok:
        names = tuple(p.name for p in params)
        return f"{_GENERATOR_WANTED} (this torch's has {names})"
    return None


def _takes_keyword(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# NOTE [saved-tensor hooks around selective regions]
#     torch 2.14 added ``respect_saved_tensors_hooks`` to the non-reentrant checkpoint: whether
#     the outputs a selective region saves pass through the user's ``saved_tensors_hooks``
#     around it (memfit's compression and offload hooks are such hooks). Unset, torch keeps
#     them out of the hooks and warns (FutureWarning) that a later release will route them
#     through. memfit's plans count a region's saved outputs on the device, uncompressed
#     (compression applies outside regions), so memfit passes False wherever torch takes it,
#     unless the caller passed the argument.
RESPECT_HOOKS = "respect_saved_tensors_hooks"
_CHECKPOINT_TAKES_RESPECT = _takes_keyword(torch.utils.checkpoint.checkpoint, RESPECT_HOOKS)


def checkpoint_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for ``torch.utils.checkpoint.checkpoint`` with ``respect_saved_tensors_hooks``
    set to False where this torch takes it and the caller did not set it (NOTE [saved-tensor
    hooks around selective regions])."""
    if _CHECKPOINT_TAKES_RESPECT and RESPECT_HOOKS not in kwargs:
        return {**kwargs, RESPECT_HOOKS: False}
    return kwargs


_generator = getattr(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator", None)
_GENERATOR_TAKES_RESPECT = _generator is not None and _takes_keyword(_generator, RESPECT_HOOKS)
_CHAIN_SEGMENTS_PROBLEM = generator_problem(_generator)


def require_chain_segments() -> None:
    """Raise ``UnsupportedTorch`` if this torch cannot run chain segments (rule 4)."""
    if _CHAIN_SEGMENTS_PROBLEM is not None:
        raise _chain_segments_unsupported(_CHAIN_SEGMENTS_PROBLEM)


def _chain_segments_unsupported(what: str) -> UnsupportedTorch:
    return unsupported(what, feature="chain segments",
                       advice="wrap the blocks one by one with memfit.wrap")


def open_checkpoint(fn: Callable[..., Any], context_fn: Callable[[], tuple[Any, Any]],
                    inputs: list[torch.Tensor]) -> Generator[None, None, None]:
    """Enter torch's non-reentrant checkpoint (RNG preserved, default determinism check, early
    stop): the ops until ``close_checkpoint`` are its region, ``fn(*inputs)`` its replay (NOTE
    [chain segments]). ``UnsupportedTorch`` if the generator differs (rule 4)."""
    require_chain_segments()
    assert _generator is not None
    options = {RESPECT_HOOKS: False} if _GENERATOR_TAKES_RESPECT else {}
    gen: Any = _generator(fn, True, context_fn, "default", False, True, *inputs, **options)
    if not inspect.isgenerator(gen):
        raise _chain_segments_unsupported(
            f"{_GENERATOR_NAME} to return a generator (this torch's returned "
            f"{type(gen).__name__})")
    try:
        next(gen)
    except StopIteration:
        raise _chain_segments_unsupported(
            f"{_GENERATOR_NAME} to yield once, where the region runs (this torch's "
            "generator yielded nothing)") from None
    return cast("Generator[None, None, None]", gen)


def close_checkpoint(gen: Generator[None, None, None]) -> None:
    """Leave a checkpoint ``open_checkpoint`` entered: what ran since is its region."""
    try:
        next(gen)
    except StopIteration:
        return
    raise AssertionError("torch's checkpoint generator yielded more than once")


def feature_problems() -> dict[str, str | None]:
    """What this torch lacks for each feature that rule 4 gates (None: nothing), and whether
    it takes ``respect_saved_tensors_hooks``, for ``memfit.capabilities``."""
    return {"offload": _SAC_STORAGE_PROBLEM, "chain segments": _CHAIN_SEGMENTS_PROBLEM,
            RESPECT_HOOKS: None if _CHECKPOINT_TAKES_RESPECT else "not taken"}
