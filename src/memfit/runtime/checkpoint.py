"""``checkpoint``: torch's non-reentrant checkpoint plus policies, buffers written once and a
divergence check.

A checkpointed call runs under two context managers that torch's ``context_fn`` provides:
the forward context (entered while the region runs the first time) and the recompute context
(entered each time backward recomputes it). memfit composes into them, bottom to top:

- forward:   buffer watcher, draw keeper (if the policy keeps draws: NOTE [kept draws] in
             ``memfit.runtime.draws``), selective-checkpoint caching mode (if a policy; its
             policy function also feeds the op recorder), op recorder (if no policy)
- recompute: buffer restore, draw replayer, selective-checkpoint cached mode (if a
             policy), op checker

The checker sits above the cached mode so that it sees every op, also those whose saved
outputs the cached mode returns without running them; torch consults the policy for every
forward op (not just the saved ones), so the recorder sees them all too. The buffer watcher
sits below both, so the buffer copies it makes are not ops of the region (NOTE [buffers
written in forward] in ``memfit.runtime.buffers``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from memfit._torch import traced_source_fn
from memfit.planning.plan import OpPolicy
from memfit.runtime import policies as _policies
from memfit.runtime.buffers import BufferGuard
from memfit.runtime.divergence import CheckSampler, OpChecker, OpRecorder, resolve_check
from memfit.runtime.draws import DrawKeeper
from memfit.runtime.offload import pool_of, selective_contexts

__all__ = ["checkpoint", "RegionContexts", "compiled_contexts"]

log = logging.getLogger(__name__)


class _Composite:
    """Enters several context managers in order, exits them in reverse; re-enterable."""

    def __init__(self, managers: Sequence[Any]) -> None:
        self._managers = managers
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> _Composite:
        stack = contextlib.ExitStack()
        try:
            for m in self._managers:
                stack.enter_context(m)
        except BaseException:
            stack.close()
            raise
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc: Any) -> bool:
        return bool(self._stacks.pop().__exit__(*exc))


class _Hooks:
    """A context manager from two callables."""

    def __init__(self, enter: Callable[[], None], exit_: Callable[[], None]) -> None:
        self._enter, self._exit = enter, exit_

    def __enter__(self) -> None:
        self._enter()

    def __exit__(self, *exc: Any) -> None:
        self._exit()


class _NoAutocastCache:
    """Turn autocast's weight-cast cache off inside the region (forward and recompute).

    NOTE [autocast cache]
        Under autocast, the cast of a parameter is cached for the rest of the autocast
        context. If a region's parameters were cast before the region ran (tied weights) or
        backward runs inside the autocast context, the recomputation finds casts in the
        cache that the forward had to compute, or the other way round: the op sequences
        differ, which shifts the selective-checkpoint cache indices and trips the
        divergence check. With the cache off in the region both passes cast alike, with
        the same (deterministic) values.
    """

    def __init__(self) -> None:
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        for device in ("cpu", "cuda", "xpu", "mps"):
            if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(
                    device, dtype=torch.get_autocast_dtype(device), cache_enabled=False))
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> None:
        self._stacks.pop().close()


class RegionContexts:
    """The ``context_fn`` of one checkpointed call (torch calls it once per call).

    Attributes:
        check: the check this call runs (None: unchecked), from ``check``: a region's
            ``CheckSampler`` (counts the call), else anything ``resolve_check`` takes.
        recorder: the forward's op recorder (counts ops always; records them if checked).
    """

    def __init__(
        self,
        policy: _policies.Policy | None,
        *,
        check: Any,
        name: str,
        modules: Sequence[nn.Module] = (),
        count_ops: bool = False,
        watch_buffers: bool | None = None,
    ) -> None:
        self.policy = policy
        self.check = check.next_call() if isinstance(check, CheckSampler) else resolve_check(check)
        self.name = name
        self.guard = BufferGuard(modules, watch=watch_buffers)
        self.recorder: OpRecorder | None = None
        if self.check is not None or count_ops:
            self.recorder = OpRecorder(record=self.check is not None,
                                       values=self.check is not None and self.check.values)

    def __call__(self) -> tuple[Any, Any]:
        forward: list[Any] = [
            _NoAutocastCache(), _Hooks(self.guard.forward_enter, self.guard.forward_exit)
        ]
        recompute: list[Any] = [
            _NoAutocastCache(), _Hooks(self.guard.recompute_enter, self.guard.recompute_exit)
        ]
        draws = self.policy.kept_draws() if self.policy is not None else frozenset()
        if draws:  # NOTE [kept draws]: below the selective-checkpoint modes
            keeper = DrawKeeper(draws)
            forward.append(keeper.forward_mode())
            recompute.append(keeper.recompute_mode())
        if self.policy is not None:
            # The policy feeds the recorder: one dispatch mode less per forward op.
            region_policy = _policies.RegionPolicy(self.policy, self.recorder)
            pool = pool_of(self.policy)
            if pool is None:
                caching, cached = create_selective_checkpoint_contexts(region_policy)
            else:  # NOTE [offload through the selective-checkpoint cache]
                caching, cached, storage = selective_contexts(region_policy, pool)
                recompute.append(_Hooks(storage.prefetch, storage.release_unread))
            region_policy.caching_mode = caching
            forward.append(caching)
            recompute.append(cached)
        elif self.recorder is not None:
            forward.append(self.recorder)
        if self.recorder is not None and self.check is not None:
            recompute.append(OpChecker(self.recorder, self.name))
        return _Composite(forward), _Composite(recompute)


def describe(fn: Any) -> str:
    """A name for a checkpointed callable, for error messages."""
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    if isinstance(fn, functools.partial):
        return describe(fn.func)
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return f"{type(owner).__name__}.{getattr(fn, '__name__', 'forward')}"
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _modules_of(fn: Any) -> tuple[nn.Module, ...]:
    if isinstance(fn, nn.Module):
        return (fn,)
    if isinstance(fn, functools.partial):
        return _modules_of(fn.func)
    owner = getattr(fn, "__self__", None)
    return (owner,) if isinstance(owner, nn.Module) else ()


def checkpoint(fn: Callable[..., Any], *args: Any, policy: Any = None, check: Any = True,
               **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` with its activations dropped and recomputed in backward.

    A drop-in for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
    **kwargs)`` (``preserve_rng_state``, ``determinism_check``, ``early_stop`` pass through),
    that adds selective policies, buffers written in forward (BatchNorm statistics,
    ``spectral_norm`` vectors, counters) updated once and recomputed from their pre-forward
    values (NOTE [buffers written in forward] in ``memfit.runtime.buffers``) and a
    divergence check (NOTE [divergence check] in ``memfit.runtime.divergence``).

    Args:
        fn: the function or module to run.
        *args: its positional arguments.
        policy: which op outputs to keep instead of recomputing: None (recompute all), a
            ``memfit.runtime.policies`` object, a torch-style function ``(ctx, op, *args,
            **kwargs) -> CheckpointPolicy | bool``, or a collection of op names/overloads
            (``{"aten.mm", "aten.addmm.default", torch.ops.aten.bmm}``). Outputs of in-place
            and random ops are always recomputed.
        check: compare the recomputation with the forward, op by op (overload, shapes,
            dtypes) and value by value (output fingerprints), and raise ``RecomputeMismatch``
            at the first difference: True (default), "always", "ops" (no values: for
            nondeterministic GPU kernels), False, or a ``DivergenceCheck``. This function
            form checks every call its check allows (NOTE [check sampling] in
            ``memfit.runtime.divergence``: ``wrap`` samples calls).
        **kwargs: keyword arguments of ``fn``.

    Returns:
        What ``fn`` returns.

    Raises:
        TypeError: ``fn`` is not callable, or ``policy`` or ``check`` has an unsupported type.
        ValueError: ``policy`` names an unknown op, ``check`` is an unknown string, or
            ``use_reentrant=True`` was passed.

    Example:
        >>> lin = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> y = checkpoint(lin, x, policy={"aten.addmm"})
        >>> y.sum().backward()
    """
    if not callable(fn):
        raise TypeError(
            f"checkpoint expects a function or module to run, got {type(fn).__name__}"
        )
    if kwargs.pop("use_reentrant", False):
        raise ValueError(
            "memfit.checkpoint is built on the non-reentrant checkpoint; use_reentrant=True "
            "is not supported (drop the argument)"
        )
    resolved = _policies.resolve(policy)
    return run_region(fn, args, kwargs, policy=resolved, check=resolve_check(check), name=describe(fn),
                      modules=_modules_of(fn))


def _torch_options() -> frozenset[str]:
    """The keyword options of this torch's ``checkpoint`` that memfit passes through (torch
    2.14 added ``respect_saved_tensors_hooks``; ``preserve_rng_state`` is read from
    ``**kwargs`` on 2.13), which ``fn`` must not get when the region runs without autograd."""
    params = inspect.signature(torch.utils.checkpoint.checkpoint).parameters.values()
    keywords = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return frozenset(keywords - {"use_reentrant", "context_fn"} | {"preserve_rng_state"})


_TORCH_OPTIONS = _torch_options()


def run_region(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    *,
    policy: _policies.Policy | None,
    check: Any,
    name: str,
    modules: Sequence[nn.Module] = (),
    watch_buffers: bool | None = None,
) -> Any:
    """Checkpoint one call; the policy is already resolved (used by ``wrap``)."""
    if not torch.is_grad_enabled():
        kwargs = {k: v for k, v in kwargs.items() if k not in _TORCH_OPTIONS}
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        return _compiled_region(fn, args, kwargs, policy)
    contexts = RegionContexts(policy, check=check, name=name, modules=modules,
                              watch_buffers=watch_buffers)
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, context_fn=contexts, **kwargs
    )


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
        name = _policies.op_name(op)
        k = -1
        for eager in _eager_names(op, name, args):
            k = self.counts.get(eager, 0)
            self.counts[eager] = k + 1
            self.keys.append((f"{eager}#{k}", name))
        if _policies.must_recompute(op, args, kwargs):
            return CheckpointPolicy.MUST_RECOMPUTE
        if k < 0 or self.policy.decide(op, name, k, args, kwargs) is not OpPolicy.SAVE:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE


def _compiled_region(fn: Callable[..., Any], args: tuple, kwargs: dict,
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
