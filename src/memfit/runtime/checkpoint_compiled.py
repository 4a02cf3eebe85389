"""Checkpointed regions under ``torch.compile``: the ``context_fn`` dynamo can pass on, and op
keys counted as in eager mode (NOTE [policies under torch.compile], NOTE [op keys under
torch.compile])."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from memfit._torch import sac_is_recompute, traced_source_fn
from memfit.ops import must_recompute, op_name
from memfit.planning.plan import OpPolicy
from memfit.runtime import policies as _policies

__all__ = ["CompiledRegionPolicy", "compiled_contexts", "compiled_region", "say_unchecked",
           "recompute_everything"]

log = logging.getLogger(__name__)


# ---- under torch.compile ------------------------------------------------------------------
# NOTE [policies under torch.compile]
#     Dynamo captures ``torch.utils.checkpoint.checkpoint`` as a higher-order op and hands its
#     ``context_fn`` on to AOTAutograd, which calls it while it traces the region and tags
#     every traced node with what the selective-checkpoint policy said; the partitioner then
#     saves the MUST_SAVE nodes and recomputes the others in the compiled backward. Dynamo
#     passes on only a plain function or a ``functools.partial`` of constants (a policy object
#     raises "checkpoint not implemented for UserDefinedObjectVariable context_fn"), so:
#
#     1. Under compilation (``torch.compiler.is_compiling()``) ``run_region`` calls torch's
#        checkpoint with ``functools.partial(compiled_contexts, policy.itself)``: ``itself``
#        is a plain function returning the policy, made with every ``Policy``.
#     2. ``compiled_contexts`` builds a ``CompiledRegionPolicy`` per traced call, so op keys
#        count from 0 in each call, as in eager mode (NOTE [op keys under torch.compile]).
#     3. No memfit context manager runs: the divergence check, the buffer guard and the
#        autocast-cache switch are Python-side dispatch modes around eager recomputation,
#        which a compiled backward does not have (it recomputes inside its graph). That is
#        said once per process, as a warning. Functionalization already applies buffer
#        writes once per step under compilation.
#
# NOTE [op keys under torch.compile]
#     AOTAutograd traces the region's ops through torch's Python decompositions, so the op
#     stream the policy sees is not always the eager one whose keys the plan names (measured
#     on torch 2.13, zoo GPT): dropout (train, 0 < p < 1) traces as one
#     ``aten.native_dropout`` where eager CPU runs ``empty_like, bernoulli_, div_, mul``;
#     dropout with p = 0 (or in eval mode) traces as ``aten.clone`` where eager runs nothing
#     (torch 2.13; from 2.14 on it traces as nothing too);
#     matmul's result reshape traces as ``aten.view`` where eager runs ``aten._unsafe_view``.
#     Counting the traced ops as they come would shift later keys (a plan saving the
#     attention's ``aten.mul.Tensor#4`` would save another mul). ``CompiledRegionPolicy``
#     therefore counts each traced op as the eager ops it stands for: ``native_dropout`` as
#     those four on devices where eager dropout does not fuse (CPU), nothing for a dropout's
#     clone (read from the traced node's source, ``memfit._torch.traced_source_fn``). Views
#     are left as they trace: a plan never saves a view (NOTE [saveable ops] in
#     ``memfit.planning.rules``), and their counts name no other op. Random and in-place ops
#     stay recomputed (NOTE [forced recompute]).

_FUSED_DROPOUT_DEVICES = ("cuda", "xpu", "lazy", "privateuseone")
_CPU_DROPOUT = ("aten.empty_like.default", "aten.bernoulli_.float", "aten.div_.Scalar",
                "aten.mul.Tensor")


def _eager_names(op: Any, name: str, args: tuple) -> tuple[str, ...]:
    """The eager op names the traced ``op`` stands for (NOTE [op keys under torch.compile])."""
    if name == "aten.native_dropout.default":
        x, p = args[0], args[1]
        train = args[2] if len(args) > 2 else None
        if train is not False and 0 < p < 1 and x.device.type not in _FUSED_DROPOUT_DEVICES:
            return _CPU_DROPOUT
        return (name,)
    if name == "aten.clone.default" and _is_dropout(traced_source_fn()):
        return ()
    return (name,)


def _is_dropout(source: Any) -> bool:
    if source is torch.nn.functional.dropout:
        return True
    return isinstance(source, type) and issubclass(source, nn.Dropout)


class CompiledRegionPolicy:
    """The selective-checkpoint policy of one compiled region call (NOTE [op keys under
    torch.compile]): counts the traced ops in eager op keys, then asks the memfit policy.

    Args:
        policy: the region's memfit policy.
        counts: per eager op name, the occurrences before this call (default none; a block of
            a segment continues its predecessors' counts: NOTE [segments under
            torch.compile] in ``memfit.runtime.segment_compiled``).
    """

    def __init__(self, policy: _policies.Policy, counts: dict[str, int] | None = None) -> None:
        self.policy = policy
        self.counts: dict[str, int] = dict(counts or {})
        self.keys: list[tuple[str, str]] = []  # (eager key, traced op), for tests and logs

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if sac_is_recompute(ctx):  # torch before 2.13 asks again; the traced forward decided
            return CheckpointPolicy.PREFER_RECOMPUTE
        name = op_name(op)
        k = -1
        for eager in _eager_names(op, name, args):
            k = self.counts.get(eager, 0)
            self.counts[eager] = k + 1
            self.keys.append((f"{eager}#{k}", name))
        if must_recompute(op, args, kwargs):
            return CheckpointPolicy.MUST_RECOMPUTE
        if k < 0 or self.policy.decide(op, name, k, args, kwargs) is not OpPolicy.SAVE:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE


def compiled_region(fn: Callable[..., Any], args: tuple, kwargs: dict,
                     policy: _policies.Policy | None) -> Any:
    """The region as dynamo traces it: torch's checkpoint with a context_fn it can pass on."""
    itself = None if policy is None else policy.itself  # type: ignore[attr-defined]
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False,
        context_fn=functools.partial(compiled_contexts, itself), **kwargs
    )


_said_unchecked: list[bool] = []  # the warning is logged once per process


def compiled_contexts(policy: Callable[[], _policies.Policy] | None) -> tuple[Any, Any]:
    """The selective-checkpoint contexts of one compiled region call (AOTAutograd calls it
    while it traces the region).

    Args:
        policy: the region policy's ``itself`` (None: recompute everything).
    """
    say_unchecked()
    region_policy: Any = (recompute_everything if policy is None
                          else CompiledRegionPolicy(policy()))
    return create_selective_checkpoint_contexts(region_policy)


def say_unchecked() -> None:
    """Log, once per process, that compiled regions run without the divergence check."""
    if not _said_unchecked:
        _said_unchecked.append(True)
        log.warning(
            "memfit regions compiled by torch.compile run without memfit's divergence check: "
            "the compiled backward recomputes them inside its graph, where memfit's "
            "Python-side recorder cannot follow (the plan's per-op policy still decides what "
            "the graph saves). Verify the plan eagerly (memfit.verify) before compiling."
        )


def recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective-checkpoint policy of a compiled region without a memfit policy."""
    return CheckpointPolicy.PREFER_RECOMPUTE
