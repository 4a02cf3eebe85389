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

import importlib
from collections.abc import Callable
from typing import Any

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
    "tensor_version", "module_parameters", "module_buffers", "runs_batch_norm_forward", "check_batch_norm_input",
    "forward_pre_hooks",
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
    "checkpoint_side_effects_skipped",
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


def runs_batch_norm_forward(module: nn.Module) -> bool:
    """Whether ``module``'s forward is torch's own batch norm forward (``BatchNorm1d/2d/3d`` and
    subclasses that keep it; not ``SyncBatchNorm`` or a subclass with its own forward)."""
    return type(module).forward is torch.nn.modules.batchnorm._BatchNorm.forward


def check_batch_norm_input(module: nn.Module, x: Any) -> None:
    """What torch's batch norm forward checks of its input first (``_check_input_dim``: the
    number of dimensions of ``BatchNorm1d/2d/3d``), raising as it does."""
    module._check_input_dim(x)  # type: ignore[operator]


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


def checkpoint_side_effects_skipped() -> Any:
    """A context in which dynamo compiles a checkpoint whose forward mutates Python state
    without replaying that in backward (``torch._dynamo.config.
    skip_fwd_side_effects_in_bwd_under_checkpoint``; memfit.compile, NOTE [budgets measured
    under compilation]); None where this torch has no such setting."""
    try:
        import torch._dynamo.config as dynamo_config
    except ImportError:  # pragma: no cover - a torch without dynamo
        return None
    if not hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return None
    return dynamo_config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


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


def cuda_fake_ops() -> dict[str, OpOverload]:
    """The CUDA attention ops fake mode calls itself, by packet name (rule 4)."""
    found = {n: getattr(getattr(torch.ops.aten, n, None), "default", None) for n in _CUDA_FAKE_OPS}
    for name, op in found.items():
        if op is None:
            raise unsupported(f"torch.ops.aten.{name}", feature="GPU-faithful fake mode",
                              advice="profile with target='cpu'")
    return found  # type: ignore[return-value]


# The checkpoint half (imported last: it reads the names above).
from memfit._torch.checkpointing import (  # noqa: E402
    PROFILER_OPS,
    RESPECT_HOOKS,
    SAC_INDEXED,
    SAC_OP_OUTPUT,
    AnyOccurrenceRecomputed,
    QueuedEntries,
    checkpoint_options,
    close_checkpoint,
    feature_problems,
    generator_problem,  # noqa: E402, F401  (rule 2's probe, tested)
    open_checkpoint,
    require_chain_segments,
    require_sac_storage,
    sac_forget,
    sac_ignore_profiler_ops,
    sac_is_entry,
    sac_is_recompute,
    sac_keep_out_of_hooks,
    sac_op_output,
    sac_rearm,
    sac_saved_tensor,
    sac_set_storage,
    selective_checkpoint_contexts,
    traced_source_fn,
)
