"""Facts about aten ops that profiling, planning and runtime must agree on.

The profiler records them per op occurrence (``OpRecord.random``, ``OpRecord.inplace``), the
planner decides from those records what a plan may save, and the runtime's selective
checkpoint policy decides from the same functions what it must recompute. If two of them
disagreed, a plan could save an output the runtime then recomputes (its memory prediction
off), or worse. So every such fact is defined here, once, and the others import it;
``tests/test_ops.py`` checks every aten overload.

NOTE [random ops]
    1. An op is random when torch tags it ``nondeterministic_seeded``. In torch 2.13 that is
       every op that takes a ``Generator`` argument, the ``*_like`` factories (``rand_like``,
       ``randn_like``, ``randint_like``), the fused attention kernels and the RNN ops (their
       dropout), ``rrelu_with_noise_functional``.
    2. One exception, by argument: a tagged op whose schema has a float ``dropout_p`` or
       ``dropout`` argument draws random numbers only for that dropout. A call passing 0
       there (or ``train=False``) draws none and is not random. memfit needs it because the
       attention kernels (``_scaled_dot_product_flash_attention_for_cpu``,
       ``_scaled_dot_product_efficient_attention``, ...) are the costliest forward ops of a
       transformer, the first a plan wants to save, and ``scaled_dot_product_attention``
       calls them with ``dropout_p=0`` whenever attention dropout is off (the CPU flash
       kernel refuses any other value).
    3. No exception the other way: no untagged aten op takes a ``Generator``
       (``tests/test_ops.py`` checks it), so no name list is needed.
    The answer depends on the call, so the profiler asks with the op's arguments; asked
    without them, :func:`is_random` answers for the worst call (a tagged op is random).

NOTE [torch-free facts]
    The planner reads these facts and imports no torch (a JAX profile plans without it), so
    this module imports torch only where a fact needs it: inside the functions that take
    torch's op objects, and the tables keyed by them (:data:`STATISTICS_UPDATES`,
    :data:`IGNORED_OPS`, :data:`IGNORED_OP_NAMES`), built on first access. The facts by name
    (:data:`MATMUL_PACKETS`, :data:`KEPT_DRAW_OPS`, :func:`is_matmul`) need no torch;
    :func:`ignored_op_names` and :func:`is_update` answer for a torch-free process as for a
    profile without aten ops.

NOTE [ignored ops]
    torch's selective checkpoint never consults a policy about ``SAC_IGNORED_OPS`` (detach and
    the tensor-metadata queries), and checkpointing itself adds a different number of
    detaches during forward and recompute. The plan's op keys skip these ops
    (``memfit.planning.rules``), the runtime's divergence check skips them
    (``memfit.runtime.divergence``), both from :data:`IGNORED_OPS`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

__all__ = [
    "RandomKind",
    "random_kind",
    "is_random",
    "writes_input",
    "is_view",
    "is_cached_cast",
    "MATMUL_PACKETS",
    "XLA_MATMULS",
    "is_matmul",
    "KEPT_DRAW_OPS",
    "IGNORED_OPS",
    "IGNORED_OP_NAMES",
    "STATISTICS_UPDATES",
    "STATISTICS_TRAINING_ARG",
    "updates_statistics",
    "without_statistics",
    "packet_name",
    "aten_overloads",
    "op_name",
    "op_packet_name",
    "resolve_op_name",
    "overload_named",
    "must_recompute",
]


class RandomKind(enum.Enum):
    """How an op overload uses the random-number generator (NOTE [random ops])."""

    NEVER = "never"
    ALWAYS = "always"
    WITH_DROPOUT = "with_dropout"  # only when its dropout argument is non-zero (and train)


_DROPOUT_ARGS = ("dropout_p", "dropout")

# Op packets whose outputs ``save_matmuls`` keeps and the planner's ``save_matmuls`` baseline
# saves: the expensive ops, cheap to store relative to their cost.
MATMUL_PACKETS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.convolution",
                  "aten.linear")
# ... and their JAX primitives (a ``memfit.jax`` profile's op names)
XLA_MATMULS = ("dot_general", "conv_general_dilated")

# Ops that update batch norm's running statistics (these argument positions) when
# ``training`` (argument STATISTICS_TRAINING_ARG) is true, without marking them written
# (``(a!)``) in their schema; their outputs do not depend on the statistics.
STATISTICS_UPDATES: dict[Any, tuple[int, ...]]  # built on first use (NOTE [torch-free facts])
STATISTICS_TRAINING_ARG = 5

# Random ops whose draws a plan may keep instead of drawing again in the replay (NOTE [kept
# draws] in memfit.runtime.draws): in place, their results are 0 or 1 (one byte per element
# kept). CPU dropout draws its mask with the first.
KEPT_DRAW_OPS: frozenset[str] = frozenset({"aten.bernoulli_.float", "aten.bernoulli_.Tensor"})

# NOTE [ignored ops]
IGNORED_OPS: frozenset[Any]  # built on first use (NOTE [torch-free facts])
IGNORED_OP_NAMES: frozenset[str]


def _torch_tables() -> dict[str, Any]:
    """The facts keyed by torch's op objects, built on first use (NOTE [torch-free facts])."""
    import torch

    ignored = frozenset({
        torch.ops.aten.detach.default,
        torch.ops.prim.device.default,
        *getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", ()),
    })
    return {
        "STATISTICS_UPDATES": {
            torch.ops.aten.native_batch_norm.default: (3, 4),
            torch.ops.aten.cudnn_batch_norm.default: (3, 4),
            torch.ops.aten.miopen_batch_norm.default: (3, 4),
        },
        "IGNORED_OPS": ignored,
        "IGNORED_OP_NAMES": frozenset(str(op) for op in ignored),
    }


def __getattr__(name: str) -> Any:
    if name in ("STATISTICS_UPDATES", "IGNORED_OPS", "IGNORED_OP_NAMES"):
        found = globals().get(name)
        if found is None:  # built once: the runtime asks per op
            globals().update(_torch_tables())
            found = globals()[name]
        return found
    raise AttributeError(f"module 'memfit.ops' has no attribute {name!r}")


def ignored_op_names() -> frozenset[str]:
    """:data:`IGNORED_OP_NAMES` for a torch-free caller (the planner): empty where torch is not
    installed, since a profile made without torch (another framework's) has no aten op."""
    try:
        names: frozenset[str] = __getattr__("IGNORED_OP_NAMES")
    except ImportError:
        return frozenset()
    return names

_random_kinds: dict[Any, RandomKind] = {}
_writes: dict[Any, bool] = {}
_written_returns: dict[Any, tuple[int, ...] | None] = {}
_updates: dict[str, bool] = {}
_views: dict[Any, bool] = {}


def random_kind(op: Any) -> RandomKind:
    """How ``op`` (an ``OpOverload``) uses the RNG, from its tags and schema.

    Example:
        >>> random_kind(torch.ops.aten.bernoulli.p)
        <RandomKind.ALWAYS: 'always'>
        >>> random_kind(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
        <RandomKind.WITH_DROPOUT: 'with_dropout'>
    """
    import torch

    from memfit._torch import op_schema

    kind = _random_kinds.get(op)
    if kind is None:
        schema = op_schema(op)
        if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
            kind = RandomKind.NEVER
        elif schema is not None and any(
                a.name in _DROPOUT_ARGS and str(a.type) == "float" for a in schema.arguments):
            kind = RandomKind.WITH_DROPOUT
        else:
            kind = RandomKind.ALWAYS
        _random_kinds[op] = kind
    return kind


def is_random(op: Any, args: Any = None, kwargs: dict[str, Any] | None = None) -> bool:
    """Whether this call of ``op`` consumes the random-number generator (NOTE [random ops]).

    Args:
        op: an ``OpOverload``.
        args: the call's positional arguments; None (default) answers for any call.
        kwargs: the call's keyword arguments (default none).

    Example:
        >>> sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        >>> q = torch.randn(1, 1, 4, 2)
        >>> is_random(sdpa, (q, q, q, 0.0)), is_random(sdpa, (q, q, q, 0.1)), is_random(sdpa)
        (False, True, True)
    """
    from memfit._torch import op_schema

    kind = random_kind(op)
    if kind is not RandomKind.WITH_DROPOUT:
        return kind is RandomKind.ALWAYS
    if args is None:
        return True
    kwargs = kwargs or {}
    dropout = False
    for i, a in enumerate(op_schema(op).arguments):
        if a.name not in _DROPOUT_ARGS and a.name != "train":
            continue
        if i < len(args) and not a.kwarg_only:
            value = args[i]
        elif a.name in kwargs:
            value = kwargs[a.name]
        elif a.has_default_value():
            value = a.default_value
        else:
            return True  # cannot tell: assume the worst
        if a.name == "train":
            if value is False:
                return False
        elif not isinstance(value, (int, float)) or value != 0:
            dropout = True
    return dropout


def writes_input(op: Any) -> bool:
    """Whether ``op``'s schema marks an argument as written (``Tensor(a!)``): in-place ops,
    ``out=`` variants and other mutating ops.

    Example:
        >>> writes_input(torch.ops.aten.add_.Tensor), writes_input(torch.ops.aten.add.Tensor)
        (True, False)
    """
    from memfit._torch import op_schema

    hit = _writes.get(op)
    if hit is None:
        schema = op_schema(op)
        hit = schema is not None and any(
            a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        _writes[op] = hit
    return hit


def written_returns(op: Any) -> tuple[int, ...] | None:
    """For an op whose every result is one of its written arguments (``add_`` returns its
    ``self``; ``out=`` variants their ``out``), the argument position of each result; None for
    any other op (one that writes nothing, or returns a tensor it computed).

    Example:
        >>> written_returns(torch.ops.aten.add_.Tensor), written_returns(torch.ops.aten.add.Tensor)
        ((0,), None)
    """
    from memfit._torch import op_schema

    if op in _written_returns:
        return _written_returns[op]
    schema = op_schema(op)
    found: tuple[int, ...] | None = None
    if schema is not None and writes_input(op):
        written = {frozenset(a.alias_info.before_set): i for i, a in enumerate(schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write}
        picks = [written.get(frozenset(r.alias_info.before_set)) if r.alias_info is not None
                 and r.alias_info.is_write else None for r in schema.returns]
        if all(i is not None for i in picks):
            found = tuple(i for i in picks if i is not None)
    _written_returns[op] = found
    return found


def update_results(op: Any) -> tuple[int, ...] | None:
    """For an op that only updates the tensors it writes (an aten op whose every result is a
    written argument, drawing no random numbers: ``add_``, ``copy_``, ``mul.out``), the
    argument position of each result; None for any other op. NOTE [buffers written in
    forward], rule 2, in ``memfit.runtime.buffers``.

    Example:
        >>> update_results(torch.ops.aten.add_.Tensor), update_results(torch.ops.aten.bernoulli_.float)
        ((0,), None)
    """
    picks = written_returns(op)
    if picks is None or not op_name(op).startswith("aten.") or is_random(op):
        return None
    return picks


def is_update(name: str) -> bool:
    """:func:`update_results` by overload name (``"aten.add_.Tensor"``), for profiles; False
    for a name torch does not know."""
    hit = _updates.get(name)
    if hit is None:
        op = overload_named(name)
        hit = _updates[name] = op is not None and update_results(op) is not None
    return hit


def overload_named(name: str) -> Any | None:
    """The overload named ``name`` (``"aten.add_.Tensor"``); None where torch has none."""
    import torch

    parts = name.split(".")
    if len(parts) != 3 or not all(parts):
        return None
    try:
        return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return None


def is_view(op: Any) -> bool:
    """Whether ``op`` returns an alias of an input without writing to it (``Tensor(a)``):
    ``view``, ``transpose``, ``split``, ``expand``, ``alias``...

    Example:
        >>> is_view(torch.ops.aten.transpose.int), is_view(torch.ops.aten.add_.Tensor)
        (True, False)
    """
    from memfit._torch import op_schema

    hit = _views.get(op)
    if hit is None:
        schema = op_schema(op)
        hit = schema is not None and not writes_input(op) and any(
            r.alias_info is not None for r in schema.returns)
        _views[op] = hit
    return hit


def is_cached_cast(op: Any, args: Any, out: Any, autocast_devices: frozenset[str]) -> bool:
    """Whether autocast keeps this call's output in its weight-cast cache: a ``_to_copy`` of a
    float32 leaf that requires grad (a parameter, not a view) to the autocast dtype of its
    device, with autocast on there (``autocast_devices``: where the step runs it; inside
    autocast's kernel the dispatcher reports it off) and its cache enabled. torch's own rule
    for caching a cast (NOTE [autocast's cast cache] in ``memfit.planning.effects``).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> out = w.detach().to(torch.bfloat16)
        >>> is_cached_cast("aten._to_copy.default", (w,), out, frozenset({"cpu"}))  # or the overload
        True
    """
    import torch

    from memfit._torch import is_view_tensor

    if not args or not isinstance(out, torch.Tensor) or op_name(op) != "aten._to_copy.default":
        return False
    src = args[0]
    if not isinstance(src, torch.Tensor) or src.device.type not in autocast_devices:
        return False
    return (torch.is_autocast_cache_enabled() and src.dtype == torch.float32
            and src.requires_grad and src.is_leaf and not is_view_tensor(src)
            and out.dtype == torch.get_autocast_dtype(src.device.type))


def packet_name(name: str) -> str:
    """``"aten.mm.default"`` -> ``"aten.mm"``."""
    return name.rsplit(".", 1)[0]


def is_matmul(name: str) -> bool:
    """Whether the overload named ``name`` (``"aten.addmm.default"``) is a matmul or
    convolution, one of :data:`MATMUL_PACKETS` (or a JAX primitive of :data:`XLA_MATMULS`).

    Example:
        >>> is_matmul("aten.addmm.default"), is_matmul("aten.gelu.default"), is_matmul("dot_general")
        (True, False, True)
    """
    return name in XLA_MATMULS or packet_name(name) in MATMUL_PACKETS


def updates_statistics(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call updates batch norm's running statistics (:data:`STATISTICS_UPDATES`
    in training mode, with statistics given)."""
    positions = __getattr__("STATISTICS_UPDATES").get(op)
    if positions is None:
        return False
    i = STATISTICS_TRAINING_ARG
    training = args[i] if len(args) > i else kwargs.get("training")
    return bool(training) and any(i < len(args) and args[i] is not None for i in positions)


def without_statistics(op: Any, args: tuple, kwargs: dict) -> tuple:
    """``args`` with the running statistics left out (None) where this call would update them:
    the same outputs, bitwise, and no write."""
    if not updates_statistics(op, args, kwargs):
        return args
    positions = __getattr__("STATISTICS_UPDATES")[op]
    return tuple(None if i in positions else a for i, a in enumerate(args))


def aten_overloads() -> Iterator[Any]:
    """Every overload of every ``torch.ops.aten`` op packet (about 2,100 in torch 2.13)."""
    import torch

    from memfit._torch import OpOverloadPacket

    for packet_attr in dir(torch.ops.aten):
        try:
            packet = getattr(torch.ops.aten, packet_attr)
        except (AttributeError, RuntimeError):
            continue
        if not isinstance(packet, OpOverloadPacket):
            continue
        for overload in packet.overloads():
            yield getattr(packet, overload)


def resolve_op_name(name: Any) -> tuple[str, str]:
    """Return ("overload"|"packet", canonical name) or raise ValueError naming the bad name."""
    import torch

    from memfit._torch import OpOverload, OpOverloadPacket

    if isinstance(name, OpOverload):
        return "overload", str(name)
    if isinstance(name, OpOverloadPacket):
        return "packet", str(name)
    if not isinstance(name, str):
        raise ValueError(
            f"op name {name!r} ({type(name).__name__}) is neither a string like 'aten.mm' nor "
            "a torch.ops object"
        )
    parts = name.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(
            f"unknown op name {name!r}: expected 'namespace.op' or 'namespace.op.overload', "
            "e.g. 'aten.mm' or 'aten.addmm.default'"
        )
    try:
        packet = getattr(getattr(torch.ops, parts[0]), parts[1])
        if len(parts) == 2:
            if not isinstance(packet, OpOverloadPacket):
                raise AttributeError(parts[1])
            return "packet", str(packet)
        overload = getattr(packet, parts[2])
    except (AttributeError, RuntimeError):
        raise ValueError(
            f"unknown op name {name!r}: torch.ops has no such op; check the spelling "
            "(names look like 'aten.mm' or 'aten.addmm.default')"
        ) from None
    return "overload", str(overload)


_NAMES: dict[Any, str] = {}
_PACKETS: dict[Any, str] = {}


def op_name(op: Any) -> str:
    """``str(op)`` ("aten.mm.default"), cached per op."""
    name = _NAMES.get(op)
    if name is None:
        name = _NAMES[op] = str(op)
    return name


def op_packet_name(op: Any) -> str:
    """``"aten.mm"`` for the overload ``aten.mm.default``, cached per op."""
    packet = _PACKETS.get(op)
    if packet is None:
        packet = _PACKETS[op] = op_name(op).rsplit(".", 1)[0]
    return packet


def must_recompute(op: Any, args: Any = None, kwargs: dict[str, Any] | None = None) -> bool:
    """True if NOTE [forced recompute] forbids saving this call's outputs (without ``args``:
    any call's)."""
    return writes_input(op) or is_random(op, args, kwargs)
