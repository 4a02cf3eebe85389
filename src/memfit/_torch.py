"""Every private torch API memfit uses, in one place, checked against the installed torch.

NOTE [private torch APIs]
    memfit needs a few things torch's public API does not offer: a dispatch mode base class,
    op schemas, storage identities, autograd sequence numbers, a checkpoint that can be
    entered and left in different functions. The rules:

    0. memfit supports the releases its suite has passed on (``SUPPORTED_TORCH``, as
       ``pyproject.toml`` declares; ``memfit.torch_support.releases``): an older torch is refused at this
       module's first import (``UnsupportedTorch`` naming both), a newer one logged.
    1. Only this module imports ``torch._*`` or ``torch.utils._*``, reads a private attribute
       of a torch object (``._schema``, ``._cdata``...) or names an ``aten._*`` op; the rest
       use the names defined here (``tests/test_torch_internals.py`` scans the source and
       exercises every name on the installed torch).
    2. Each API is looked up at this module's first import (by ``memfit.ops`` and every
       profiling and runtime module); ``import memfit`` and loading a ``Profile`` or ``Plan``
       from JSON do not import it.
    3. A missing API that every stage needs raises ``memfit.errors.UnsupportedTorch`` (an
       ``ImportError``) from that import, naming it, the torch version and the range.
    4. A missing API that one feature needs raises ``UnsupportedTorch`` when the feature is
       first used, the rest of memfit working on: chain segments (the non-reentrant
       checkpoint generator, called positionally, yielding once; ``require_chain_segments``),
       the CPU allocator meter (kineto results; ``cpu_memory_events``), offload (the
       selective-checkpoint ``storage`` dict of ``_VersionWrapper``; ``require_sac_storage``),
       GPU-faithful fake mode (the CUDA attention ops; ``cuda_fake_ops``).
    5. Some lookups fall back instead: ``sac_forget`` (False), ``sac_rearm`` (0),
       ``outer_saved_tensors_hooks`` (None: autograd's default), ``sdp_priority_order``
       (torch's default order).

    Consequence: supporting a new torch means changing this file (and its test) only.
"""

from __future__ import annotations

import collections
import importlib
import inspect
from collections.abc import Callable, Generator
from typing import Any, cast

import torch
import torch.fx.traceback
import torch.utils.checkpoint
from torch import nn

from memfit.errors import UnsupportedTorch
from memfit.torch_support.releases import (  # noqa: F401  (re-exported: rule 0)
    _TESTED,
    SUPPORTED_TORCH,
    require_supported_torch,
    torch_release,
)

__all__ = [
    "SUPPORTED_TORCH", "require_supported_torch", "TorchDispatchMode", "FakeTensorMode",
    "FAKE_TENSOR_LOGGER", "OpOverload", "OpOverloadPacket", "tree_flatten", "tree_map",
    "op_schema", "op_packet", "op_namespace", "written_tensors", "is_view_tensor", "storage_key",
    "tensor_version", "module_parameters", "module_buffers", "forward_pre_hooks",
    "forward_pre_hook_takes_kwargs", "remove_forward_pre_hook", "set_display_name",
    "clear_display_name", "current_autograd_node", "node_sequence_nr", "peek_sequence_nr",
    "no_python_dispatch", "without_dispatch_modes", "outer_saved_tensors_hooks", "sac_op_output",
    "sac_forget", "sac_rearm",
    "SAC_OP_OUTPUT", "SAC_INDEXED", "QueuedEntries", "selective_checkpoint_contexts",
    "sac_is_recompute", "checkpoint_options", "RESPECT_HOOKS", "PROFILER_OPS",
    "AnyOccurrenceRecomputed", "sac_ignore_profiler_ops", "sac_keep_out_of_hooks",
    "require_sac_storage", "sac_set_storage", "sac_saved_tensor", "sac_is_entry",
    "traced_source_fn", "require_chain_segments", "open_checkpoint", "close_checkpoint",
    "cpu_memory_events", "profiler_marker", "cpu_marked_spans", "profiler_active",
    "sdp_priority_order", "cuda_fake_ops", "has_cuda_fake_ops", "feature_problems",
]

require_supported_torch()  # rule 0


def unsupported(what: str, *, feature: str | None = None, advice: str = "") -> UnsupportedTorch:
    """The error for a torch that lacks ``what`` (NOTE [private torch APIs], rules 3 and 4)."""
    user = f"memfit's {feature}" if feature else "memfit"
    return UnsupportedTorch(
        f"{user} needs {what}, which torch {torch.__version__} does not provide. memfit "
        f"supports torch {SUPPORTED_TORCH} (tested with {_TESTED}): install a supported "
        f"torch{'; or ' + advice if advice else ''}"
    )


def lookup(path: str) -> Any:
    """The object at a dotted path (``"torch._C._DisableTorchDispatch"``), importing
    submodules as needed; raises ``UnsupportedTorch`` naming the path if it is missing."""
    parts = path.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(parts[: i + 1]))
            except ImportError:
                raise unsupported(path) from None
    return obj


# ---- rule 2/3: what every stage needs, looked up now ------------------------------------
try:
    from torch._ops import OpOverload, OpOverloadPacket
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map
except ImportError as e:  # pragma: no cover - only on an unsupported torch
    raise unsupported(f"{e.name or 'a private module'} ({e})") from e

for _path in (
    "torch._C._DisableTorchDispatch",
    "torch.utils._python_dispatch._disable_current_modes",
    "torch._C._current_autograd_node",
    "torch._C._autograd._get_sequence_nr",
    "torch._C._functions.AccumulateGrad._sequence_nr",
    "torch.Tensor._version",
    "torch.UntypedStorage._cdata",
    "torch.nn.Module._get_name",
):
    lookup(_path)
for _attr in ("_schema", "_overloadpacket", "_namespace"):  # instance attributes: probe one op
    if not hasattr(torch.ops.aten.add_.Tensor, _attr):
        raise unsupported(f"OpOverload.{_attr}")
if not isinstance(nn.Module().__dict__.get("_buffers"), dict):
    raise unsupported("nn.Module._buffers (a dict of the module's own buffers)")


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
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


# ---- ops -----------------------------------------------------------------------------------
def op_schema(op: Any) -> Any:
    """The op's ``torch.FunctionSchema`` (None for an object without one)."""
    return getattr(op, "_schema", None)


def op_packet(op: OpOverload) -> OpOverloadPacket:
    """The packet of an overload: ``aten.mm`` for ``aten.mm.default``."""
    return op._overloadpacket


def op_namespace(op: OpOverload) -> str:
    """The overload's namespace: ``"aten"``, ``"prim"``..."""
    return op._namespace


def written_tensors(op: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments of this call that the op's schema marks written (``Tensor(a!)``)."""
    schema = op_schema(op)
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


# ---- tensors, storages, modules ------------------------------------------------------------
def storage_key(st: torch.UntypedStorage) -> int:
    """The identity of a live storage: its ``StorageImpl*`` (NOTE [storage identity and frees]
    in ``memfit.profiling.storages``)."""
    return int(st._cdata)


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter (bumped by every in-place write)."""
    return t._version


def is_view_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor (shares its base's storage)."""
    return bool(t._is_view())


def module_parameters(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own parameter slots by name, the live dict (``functional_call``'s too)."""
    return module._parameters  # type: ignore[return-value]


def module_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own buffer slots by name (the live dict: replace a buffer, persistence kept)."""
    return module._buffers


def forward_pre_hooks(module: nn.Module) -> dict[int, Callable[..., Any]]:
    """The module's forward pre-hooks by handle id, in call order (the live dict: read it)."""
    return module._forward_pre_hooks


def forward_pre_hook_takes_kwargs(module: nn.Module, key: int) -> bool:
    """Whether the pre-hook with handle id ``key`` was registered ``with_kwargs=True``."""
    return key in module._forward_pre_hooks_with_kwargs


def remove_forward_pre_hook(module: nn.Module, key: int) -> None:
    """Remove the forward pre-hook with handle id ``key`` (as its handle's ``remove()``)."""
    del module._forward_pre_hooks[key]
    module._forward_pre_hooks_with_kwargs.pop(key, None)


def set_display_name(module: nn.Module, name: Callable[[], str]) -> None:
    """Make ``repr(module)`` show ``name()`` as its class name (over ``nn.Module._get_name``)."""
    module._get_name = name  # type: ignore[method-assign]


def clear_display_name(module: nn.Module) -> None:
    """Undo ``set_display_name``."""
    module.__dict__.pop("_get_name", None)


# ---- autograd ------------------------------------------------------------------------------
def current_autograd_node() -> Any:
    """The autograd node whose backward runs now on this thread (None outside backward)."""
    return torch._C._current_autograd_node()


def node_sequence_nr(node: Any) -> int:
    """An autograd node's sequence number (order of creation in its thread)."""
    return int(node._sequence_nr())


def peek_sequence_nr() -> int:
    """The sequence number the next autograd node created on this thread will get."""
    return int(torch._C._autograd._get_sequence_nr())


def no_python_dispatch() -> Any:
    """A context in which ops skip every Python dispatch mode and tensor subclass (the
    divergence check's fingerprints, NOTE [value check] in ``memfit.runtime.divergence``)."""
    return torch._C._DisableTorchDispatch()


def without_dispatch_modes() -> Any:
    """A context in which the Python dispatch-mode stack is empty (the modes are put back on
    exit); tensor subclasses still dispatch (NOTE [engine work in a region] in
    ``memfit.runtime.engine_work``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def outer_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The (pack, unpack) saved-tensor hooks in effect now (None: autograd's default, or a
    torch that cannot tell: rule 5)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(True) if top is not None else None


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


# ---- torch.profiler ------------------------------------------------------------------------
def cpu_memory_events(prof: Any) -> list[tuple[int, int]]:
    """``(time_ns, bytes)`` of the CPU allocator's alloc (+) and free (-) events a finished
    ``torch.profiler.profile(profile_memory=True)`` recorded, in time order (ties: record
    order). ``UnsupportedTorch`` if the profiler keeps no kineto results (rule 4)."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        raise unsupported("torch.profiler.profile().profiler.kineto_results",
                          feature="allocator meter", advice="measure with meter='dispatch'")
    cpu = torch.autograd.DeviceType.CPU
    events = [(e.start_ns(), e.nbytes()) for e in results.events()
              if e.name() == "[memory]" and e.device_type() == cpu]
    events.sort(key=lambda e: e[0])
    return events


_FAST_MARKER = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)


def profiler_marker(name: str) -> Any:
    """A context manager that records a span named ``name`` in an active torch profiler
    (``torch._C._profiler._RecordFunctionFast``: about 1 us, against 35 us for the public
    ``torch.profiler.record_function``, which it falls back to)."""
    if _FAST_MARKER is not None:
        return _FAST_MARKER(name)
    return torch.profiler.record_function(name)  # pragma: no cover - older torch


def cpu_marked_spans(prof: Any, name: str) -> list[tuple[int, int]]:
    """``(start_ns, end_ns)`` of the spans named ``name`` (:func:`profiler_marker`) a finished
    ``torch.profiler.profile`` recorded, on :func:`cpu_memory_events`'s clock, in time
    order. ``UnsupportedTorch`` if the profiler keeps no kineto results (rule 4)."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        raise unsupported("torch.profiler.profile().profiler.kineto_results",
                          feature="workspace meter", advice="profile with mode='fake'")
    spans = [(e.start_ns(), e.end_ns()) for e in results.events() if e.name() == name]
    spans.sort()
    return spans


def profiler_active() -> bool:
    """Whether a torch profiler is recording now (``torch._C._autograd._profiler_enabled``):
    starting another would end its session (torch 2.13 warns, and the outer profile comes
    back empty). False where torch cannot tell."""
    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(enabled()) if enabled is not None else False


# ---- CUDA kernels fake mode dispatches (NOTE [CUDA kernels in fake mode], profiling.cuda_kernels)
_CUDA_FAKE_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_safe_softmax")


def sdp_priority_order() -> tuple[int, ...]:
    """SDPA backends (``SDPBackend`` values) in the order CUDA tries them (rule 5)."""
    get = getattr(torch._C, "_get_sdp_priority_order", None)
    return tuple(int(b) for b in get()) if get is not None else (1, 2, 0, 3)


def has_cuda_fake_ops() -> bool:
    """Whether this torch has every CUDA attention op fake mode calls (``cuda_fake_ops``)."""
    return all(getattr(getattr(torch.ops.aten, n, None), "default", None) is not None
               for n in _CUDA_FAKE_OPS)


def feature_problems() -> dict[str, str | None]:
    """What this torch lacks for each feature that rule 4 gates (None: nothing), and whether
    it takes ``respect_saved_tensors_hooks``, for ``memfit.capabilities``."""
    return {"offload": _SAC_STORAGE_PROBLEM, "chain segments": _CHAIN_SEGMENTS_PROBLEM,
            RESPECT_HOOKS: None if _CHECKPOINT_TAKES_RESPECT else "not taken"}


def cuda_fake_ops() -> dict[str, OpOverload]:
    """The CUDA attention ops fake mode calls itself, by packet name (rule 4)."""
    found = {n: getattr(getattr(torch.ops.aten, n, None), "default", None) for n in _CUDA_FAKE_OPS}
    for name, op in found.items():
        if op is None:
            raise unsupported(f"torch.ops.aten.{name}", feature="GPU-faithful fake mode",
                              advice="profile with target='cpu'")
    return found  # type: ignore[return-value]
