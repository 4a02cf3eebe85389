"""Selective-checkpoint policies: which op outputs of a region are saved, which recomputed.

A policy is a small named object that reads like a sentence::

    wrap(block, save_matmuls())                      # keep matmul outputs, recompute the rest
    wrap(block, save_ops("aten.mm", "aten.gelu"))    # keep every mm and gelu output
    wrap(block, by_key(region.ops))                  # exactly the planned per-op decisions
    wrap(block, save_matmuls() | save_ops("aten.gelu"))

A policy answers with a :class:`memfit.OpPolicy` per op occurrence; ``RegionPolicy`` turns
that into torch's ``CheckpointPolicy`` (SAVE -> MUST_SAVE, RECOMPUTE -> PREFER_RECOMPUTE).
OFFLOAD is MUST_SAVE with the kept outputs moved to host memory (``memfit.runtime.offload``,
NOTE [offload through the selective-checkpoint cache]); ``by_key(..., host=pool)`` names the
host pool, and the outputs of view ops asked to be offloaded are saved instead.

NOTE [forced recompute]
    Whatever a policy says, two kinds of op output are never saved (nor offloaded):
    - outputs of ops that write to an input (``div_``, ``add_``, ``bernoulli_``, ``out=``
      variants: any schema argument marked ``(a!)``). A saved in-place op is skipped during
      recomputation, so the tensor it should have written stays unwritten; dropout on CPU
      (``bernoulli_`` then ``div_``) then silently gives wrong gradients, because the caller
      uses the mutated input, not the op's return value.
    - outputs of random ops (``memfit.ops.is_random``, NOTE [random ops] there:
      ``bernoulli``, ``rand*``, ``native_dropout``, attention with dropout...). A skipped
      random op would not advance the RNG during recomputation, so every later random op in
      the region would draw other numbers. The profiler marks the same ops random, so a plan
      never saves them.
    And a saved output that the forward later writes in place (``h = linear(x); h.mul_(2)``
    with linear saved) is turned back into "recompute" when the write happens: the cache
    holds an alias of it, so recomputation would otherwise read the written value (torch
    raises "Tensor cached during selective activation checkpoint has been mutated").

NOTE [op keys]
    ``save_keys`` names op occurrences ``"<overload>#<k>"`` exactly as
    ``memfit.planning.plan`` documents: k counts, from 0 for each checkpointed call, the calls
    of that overload among the ops the selective-checkpoint policy is consulted for (every op
    of the region's forward in dispatch order, except ``aten.detach.default``, which torch
    ignores because checkpointing itself adds detaches).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from memfit._torch import (
    OpOverload,
    OpOverloadPacket,
    require_sac_storage,
)
from memfit.ops import (
    KEPT_DRAW_OPS,
    MATMUL_PACKETS,
    op_name,
    op_packet_name,
    resolve_op_name,
)
from memfit.planning.plan import OpPolicy

__all__ = ["Policy", "PolicyArg", "recompute_all", "save_matmuls", "save_ops", "save_keys", "by_key",
           "from_callable", "resolve"]

# Ops whose outputs save_matmuls keeps (memfit.ops: the planner's baseline saves the same).
MATMUL_OPS = MATMUL_PACKETS

_KEY_RE = re.compile(r"^(?P<op>[A-Za-z_][\w.]*)#(?P<k>\d+)$")


_SAVE, _RECOMPUTE, _OFFLOAD = OpPolicy.SAVE, OpPolicy.RECOMPUTE, OpPolicy.OFFLOAD


class Policy:
    """Base class: decides, per op occurrence, what happens to its outputs (an ``OpPolicy``).

    Subclasses implement :meth:`decision`. Policies are stateless, picklable values; the
    per-call occurrence counting lives in :class:`RegionPolicy`. ``a | b`` takes ``a``'s
    decision unless it is RECOMPUTE, else ``b``'s.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Policy:
        self = super().__new__(cls)
        # NOTE [policies under torch.compile] in memfit.runtime.checkpoint_compiled: a plain function
        # returning the policy, which dynamo can pass on to AOTAutograd (not the object).
        object.__setattr__(self, "itself", _returning(self))
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("itself", None)  # a closure: __new__ makes a new one on unpickling
        return state

    def decision(self, op: OpOverload, key: str, args: tuple, kwargs: dict) -> OpPolicy:
        raise NotImplementedError

    def decide(self, op: Any, name: str, k: int, args: tuple, kwargs: dict) -> OpPolicy:
        """``decision`` for occurrence ``k`` of ``op`` (named ``name``); subclasses that do
        not read the key override it to skip building the key string."""
        return self.decision(op, f"{name}#{k}", args, kwargs)

    def kept_draws(self) -> frozenset[tuple[str, int]]:
        """The random-op occurrences whose draws this policy keeps, as ``(overload, k)``
        (NOTE [kept draws] in ``memfit.runtime.draws``); only ``by_key`` keeps any."""
        return frozenset()

    def __or__(self, other: Policy) -> Policy:
        if not isinstance(other, Policy):
            return NotImplemented
        return _Either(self, other)


@dataclass(frozen=True)
class _RecomputeAll(Policy):
    def decision(self, op, key, args, kwargs) -> OpPolicy:
        return _RECOMPUTE

    def __repr__(self) -> str:
        return "recompute_all()"


@dataclass(frozen=True)
class _SaveOps(Policy):
    overloads: frozenset[str]  # "aten.mm.default"
    packets: frozenset[str]    # "aten.mm" (every overload)

    def decision(self, op, key, args, kwargs) -> OpPolicy:
        return self.decide(op, op_name(op), 0, args, kwargs)

    def decide(self, op, name, k, args, kwargs) -> OpPolicy:
        return _SAVE if name in self.overloads or op_packet_name(op) in self.packets else _RECOMPUTE

    def __repr__(self) -> str:
        return f"save_ops({', '.join(repr(n) for n in sorted(self.overloads | self.packets))})"


@dataclass(frozen=True)
class _ByKey(Policy):
    decisions: tuple[tuple[str, OpPolicy], ...]
    # Where OFFLOAD decisions keep their tensors (memfit.runtime.offload.HostPool).
    host: Any = field(default=None, compare=False, repr=False)

    def decision(self, op, key, args, kwargs) -> OpPolicy:
        return dict(self.decisions).get(key, _RECOMPUTE)

    def decide(self, op, name, k, args, kwargs) -> OpPolicy:
        index = self.__dict__.get("_by_name")
        if index is None:
            by_name: dict[str, dict[int, OpPolicy]] = defaultdict(dict)
            for key, policy in self.decisions:
                overload, _, occurrence = key.rpartition("#")
                by_name[overload][int(occurrence)] = policy
            index = dict(by_name)
            object.__setattr__(self, "_by_name", index)
        found = index.get(name)
        return _RECOMPUTE if found is None else found.get(k, _RECOMPUTE)

    def kept_draws(self) -> frozenset[tuple[str, int]]:
        out = set()
        for key, policy in self.decisions:
            overload, _, occurrence = key.rpartition("#")
            if policy is _SAVE and overload in KEPT_DRAW_OPS:
                out.add((overload, int(occurrence)))
        return frozenset(out)

    def __repr__(self) -> str:
        return f"by_key(<{len(self.decisions)} decisions>)"


@dataclass(frozen=True)
class _Either(Policy):
    first: Policy
    second: Policy

    def decision(self, op, key, args, kwargs) -> OpPolicy:
        first = self.first.decision(op, key, args, kwargs)
        return first if first is not _RECOMPUTE else self.second.decision(op, key, args, kwargs)

    def decide(self, op, name, k, args, kwargs) -> OpPolicy:
        first = self.first.decide(op, name, k, args, kwargs)
        return first if first is not _RECOMPUTE else self.second.decide(op, name, k, args, kwargs)

    def kept_draws(self) -> frozenset[tuple[str, int]]:
        return self.first.kept_draws() | self.second.kept_draws()

    def __repr__(self) -> str:
        return f"{self.first!r} | {self.second!r}"


@dataclass(frozen=True)
class _FromCallable(Policy):
    fn: Callable[..., Any]

    def decision(self, op, key, args, kwargs) -> OpPolicy:
        decision = self.fn(_CONTEXT, op, *args, **kwargs)
        if isinstance(decision, bool):
            return _SAVE if decision else _RECOMPUTE
        if isinstance(decision, CheckpointPolicy):
            # torch's eager selective checkpoint treats the CPU-offload values as recompute
            saved = decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
            return _SAVE if saved else _RECOMPUTE
        raise TypeError(
            f"policy function {getattr(self.fn, '__qualname__', self.fn)!r} returned "
            f"{decision!r} for {op}; it must return a bool or a "
            "torch.utils.checkpoint.CheckpointPolicy"
        )

    def __repr__(self) -> str:
        return f"from_callable({getattr(self.fn, '__qualname__', self.fn)!r})"


# The context torch passes to policy functions; the op output is not needed by our rules.
_CONTEXT = torch.utils.checkpoint.SelectiveCheckpointContext(is_recompute=False)


def recompute_all() -> Policy:
    """Recompute every op of the region (plain activation checkpointing).

    Example:
        >>> wrap(block, recompute_all())   # doctest: +SKIP
    """
    return _RecomputeAll()


def save_matmuls() -> Policy:
    """Save the outputs of mm, addmm, bmm, baddbmm, convolution and linear; recompute the rest.

    Example:
        >>> wrap(block, save_matmuls())    # doctest: +SKIP
    """
    return save_ops(*MATMUL_OPS)


def save_ops(*names: str | OpOverload | OpOverloadPacket) -> Policy:
    """Save the outputs of the named ops, every occurrence; recompute the rest.

    Args:
        *names: ``"aten.mm"`` (every overload), ``"aten.addmm.default"`` (one overload), or
            the objects ``torch.ops.aten.bmm`` / ``torch.ops.aten.bmm.default``.

    Raises:
        ValueError: a name that is not an aten (or other registered) op.

    Example:
        >>> policy = save_ops("aten.mm", torch.ops.aten.bmm.default)
    """
    overloads: set[str] = set()
    packets: set[str] = set()
    for name in names:
        kind, resolved = resolve_op_name(name)
        (overloads if kind == "overload" else packets).add(resolved)
    return _SaveOps(frozenset(overloads), frozenset(packets))


def save_keys(keys: Iterable[str]) -> Policy:
    """Save exactly the named op occurrences (NOTE [op keys]); recompute the rest.

    Args:
        keys: region-local op keys such as ``"aten.mm.default#2"``.

    Raises:
        ValueError: a key that is not ``"<overload>#<k>"`` or names an unknown overload.

    Example:
        >>> policy = save_keys(["aten.mm.default#0", "aten.mm.default#2"])
    """
    if isinstance(keys, str):
        raise TypeError(f"save_keys expects a collection of keys, got the string {keys!r}; "
                        f"write save_keys([{keys!r}])")
    return by_key({key: _SAVE for key in keys})


def by_key(decisions: Mapping[str, OpPolicy] | Iterable[tuple[str, OpPolicy]], *,
           host: Any = None) -> Policy:
    """Exactly the given per-op decisions (NOTE [op keys]); ops not named are recomputed.

    Args:
        decisions: op key -> ``OpPolicy``, as a ``memfit.Region`` holds them in ``Region.ops``.
        host: the ``memfit.runtime.offload.HostPool`` that OFFLOAD decisions keep their
            tensors in (default None: a pool of this policy's own, without a cap).

    Raises:
        ValueError: a key that is not ``"<overload>#<k>"`` or names an unknown overload.
        UnsupportedTorch: OFFLOAD decisions on a torch before 2.13 (``memfit.capabilities()``).

    Example:
        >>> policy = by_key({"aten.mm.default#0": OpPolicy.SAVE,
        ...                  "aten.gelu.default#0": OpPolicy.OFFLOAD})
    """
    pairs = list(decisions.items() if isinstance(decisions, Mapping) else decisions)
    checked = []
    for key, policy in pairs:
        if not isinstance(policy, OpPolicy):
            raise TypeError(f"decision for {key!r} is {policy!r}, not a memfit.OpPolicy")
        match = _KEY_RE.match(key) if isinstance(key, str) else None
        if match is None:
            raise ValueError(
                f"op key {key!r} is not of the form '<overload>#<k>' (e.g. 'aten.mm.default#2')"
            )
        try:
            kind, _ = resolve_op_name(match["op"])
        except ValueError as e:
            raise ValueError(f"op key {key!r}: {e}") from None
        if kind != "overload":
            raise ValueError(
                f"op key {key!r} names the op packet {match['op']!r}; keys name one overload, "
                f"e.g. '{match['op']}.default#{match['k']}'"
            )
        if policy is not _RECOMPUTE:
            checked.append((key, policy))
    if any(p is _OFFLOAD for _, p in checked):
        require_sac_storage()  # offload needs torch 2.13's indexed cache (rule 4)
        if host is None:
            from memfit.runtime.offload import HostPool

            host = HostPool()
    else:
        host = None
    return _ByKey(tuple(checked), host)



def from_callable(fn: Callable[..., Any]) -> Policy:
    """Use a torch-style policy function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy|bool``.

    Example:
        >>> policy = from_callable(lambda ctx, op, *a, **k: op == torch.ops.aten.mm.default)
    """
    if not callable(fn):
        raise TypeError(f"from_callable expects a function, got {type(fn).__name__}")
    return _FromCallable(fn)


#: What ``policy=`` takes: None (recompute all), a Policy, a torch-style function, op names.
PolicyArg = Policy | Callable[..., Any] | Collection[Any] | None


def resolve(policy: PolicyArg) -> Policy | None:
    """Turn what users pass as ``policy=`` into a :class:`Policy` (or None: recompute all).

    Accepts None, a Policy, a torch-style callable, or a collection of op names/overloads.
    """
    if policy is None or isinstance(policy, Policy):
        return policy
    if isinstance(policy, (str, OpOverload, OpOverloadPacket)):
        raise TypeError(
            f"policy={policy!r} is a single op; pass a collection such as {{{str(policy)!r}}} "
            "or save_ops(...)"
        )
    if callable(policy):
        return _FromCallable(policy)
    if isinstance(policy, Iterable):
        return save_ops(*policy)
    raise TypeError(
        f"policy must be None, a memfit.runtime.policies object, a function "
        f"(ctx, op, *args, **kwargs) -> CheckpointPolicy|bool, or a collection of op names; "
        f"got {type(policy).__name__}"
    )


def _returning(policy: Policy) -> Callable[[], Policy]:
    def itself() -> Policy:
        return policy
    return itself
