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

from memfit._torch import (
    RESPECT_HOOKS,
    SAC_OP_OUTPUT,
    checkpoint_options,
    sac_rearm,
    selective_checkpoint_contexts,
)
from memfit.errors import MemfitError
from memfit.runtime import policies as _policies
from memfit.runtime.bindings import ForwardTensors, watch_inputs
from memfit.runtime.buffers import BufferGuard
from memfit.runtime.checkpoint_compiled import compiled_region
from memfit.runtime.divergence import CheckArg, CheckSampler, OpChecker, OpRecorder, resolve_check
from memfit.runtime.draws import DrawKeeper
from memfit.runtime.generators import GeneratorReplay
from memfit.runtime.norm_statistics import StatisticsFinding
from memfit.runtime.offload import pool_of, selective_contexts
from memfit.runtime.policies import PolicyArg
from memfit.runtime.region_policy import OutputTap, RegionPolicy

__all__ = ["checkpoint", "RegionContexts", "run_region", "debug_mode_error"]

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

    def __init__(self, enter: Callable[[], object], exit_: Callable[[], object]) -> None:
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
        user_contexts: Callable[[], tuple[Any, Any]] | None = None,
        statistics: StatisticsFinding | None = None,
    ) -> None:
        self.policy = policy
        self.user_contexts = user_contexts  # the caller's own context_fn (torch's argument)
        sampler = check if isinstance(check, CheckSampler) else None
        self.check = sampler.next_call() if sampler is not None else resolve_check(check)
        self.name = name
        # NOTE [explicit generators] in memfit.runtime.generators, rule 2: which calls watch.
        self.watch_generators = sampler is None or sampler.watches_generators(self.check)
        self.generators = GeneratorReplay(
            name, on_seen=None if sampler is None else sampler.saw_generator)
        self.guard = BufferGuard(modules, watch=watch_buffers, finding=statistics,
                                 watched=self.check is not None)
        self.tensors = ForwardTensors(modules) if modules else None
        self.recorder: OpRecorder | None = None
        if self.check is not None or count_ops:
            self.recorder = OpRecorder(record=self.check is not None,
                                       values=self.check is not None and self.check.values)

    def __call__(self) -> tuple[Any, Any]:
        forward: list[Any] = [
            _NoAutocastCache(), _Hooks(self.guard.forward_enter, self.guard.forward_exit)
        ]
        recompute: list[Any] = [
            _Hooks(self.generators.replay_enter, self.generators.replay_exit),
            _NoAutocastCache(), _Hooks(self.guard.recompute_enter, self.guard.recompute_exit)
        ]
        if self.recorder is not None:  # a replay inside the forward is not the forward's
            recompute.insert(0, _Hooks(self.recorder.pause, self.recorder.resume))
        if self.tensors is not None:  # NOTE [the forward's tensors]: outside the guard
            forward.insert(0, _Hooks(self.tensors.forward_enter, self.tensors.forward_exit))
            recompute.insert(0, _Hooks(self.tensors.replay_enter, self.tensors.replay_exit))
        if self.watch_generators:  # NOTE [explicit generators]: below the selective modes
            forward.append(self.generators.forward_mode())
            recompute.append(self.generators.recompute_mode())
        draws = self.policy.kept_draws() if self.policy is not None else frozenset()
        if draws:  # NOTE [kept draws]: below the selective-checkpoint modes
            keeper = DrawKeeper(draws)
            forward.append(keeper.forward_mode())
            recompute.append(keeper.recompute_mode())
        if self.policy is not None:
            # The policy feeds the recorder: one dispatch mode less per forward op.
            region_policy = RegionPolicy(
                self.policy, self.recorder,
                generators=None if self.watch_generators else self.generators)
            pool = pool_of(self.policy)
            if pool is None:
                caching, cached = selective_checkpoint_contexts(region_policy)
            else:  # NOTE [offload through the selective-checkpoint cache]
                caching, cached, storage = selective_contexts(region_policy, pool)
                recompute.append(_Hooks(storage.prefetch, storage.release_unread))
            region_policy.caching_mode = caching
            forward.append(caching)
            if not SAC_OP_OUTPUT:  # NOTE [selective-checkpoint layouts]
                forward.append(OutputTap(region_policy))
            recompute.append(_Hooks(region_policy.replay_enter, _nothing))
            # Entered before the cached mode, left after it: another backward through the
            # region recomputes what this replay took from the cache (sac_rearm).
            recompute.append(_Hooks(_nothing, functools.partial(sac_rearm, cached)))
            recompute.append(cached)
        if self.user_contexts is not None:  # below the recorder and checker: they see all ops
            user_forward, user_recompute = self.user_contexts()
            forward.append(user_forward)
            recompute.append(user_recompute)
        if self.policy is None and self.recorder is not None:
            forward.append(self.recorder)
        if self.recorder is not None and self.check is not None:
            recompute.append(OpChecker(self.recorder, self.name, skipped=self.guard.replay_skips))
        return _Composite(forward), _Composite(recompute)


def _nothing() -> None:
    pass


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


def checkpoint(fn: Callable[..., Any], *args: Any, policy: PolicyArg = None, check: CheckArg = True,
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
    if kwargs.get("debug"):
        raise ValueError(
            "memfit.checkpoint does not take debug=True: torch's checkpoint debug mode "
            "cannot run with the context_fn memfit's regions need. memfit's divergence check "
            "names the first op that differs (check=\"always\"); for torch's debug traces "
            "call torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False, debug=True)"
        )
    if kwargs.get(RESPECT_HOOKS):
        raise ValueError(
            "memfit.checkpoint does not take respect_saved_tensors_hooks=True: memfit counts "
            "the outputs a selective region saves on its device, outside outer saved-tensor "
            "hooks (NOTE [saved-tensor hooks around selective regions]). Drop the argument, or "
            "call torch.utils.checkpoint.checkpoint for that region")
    user_contexts = kwargs.pop("context_fn", None)
    resolved = _policies.resolve(policy)
    if user_contexts is not None:
        if not callable(user_contexts):
            raise TypeError(f"context_fn must be a function returning two context managers, "
                            f"got {type(user_contexts).__name__}")
        if resolved is not None:
            raise ValueError(
                "memfit.checkpoint takes a policy= or a context_fn=, not both: a "
                "selective-checkpoint context_fn and memfit's policy would both decide what "
                "the region saves. Pass the policy alone (memfit.policies.from_callable "
                "takes a torch-style policy function)"
            )
    return run_region(fn, args, kwargs, policy=resolved, check=resolve_check(check), name=describe(fn),
                      modules=_modules_of(fn), user_contexts=user_contexts)


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
    user_contexts: Callable[[], tuple[Any, Any]] | None = None,
    statistics: StatisticsFinding | None = None,
) -> Any:
    """Checkpoint one call; the policy is already resolved (used by ``wrap``, which passes its
    region's ``statistics``: NOTE [buffers written in forward], rule 7)."""
    if not torch.is_grad_enabled():
        kwargs = {k: v for k, v in kwargs.items() if k not in _TORCH_OPTIONS}
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        if user_contexts is not None:
            raise ValueError("memfit.checkpoint does not take context_fn= under torch.compile; "
                             "pass a policy= instead")
        return compiled_region(fn, args, kwargs, policy)
    contexts = RegionContexts(policy, check=check, name=name, modules=modules,
                              watch_buffers=watch_buffers, user_contexts=user_contexts,
                              statistics=statistics)
    try:
        out = torch.utils.checkpoint.checkpoint(
            fn, *args, use_reentrant=False, context_fn=contexts, **checkpoint_options(kwargs)
        )
    except ValueError as e:
        if "incompatible with non-default context_fn" not in str(e):
            raise
        raise debug_mode_error(name) from None
    watch_inputs(name, (args, kwargs), out)  # NOTE [the forward's tensors], rule 5
    return out


def debug_mode_error(name: str) -> MemfitError:
    """torch's global checkpoint debug mode is on: memfit's regions cannot run under it."""
    return MemfitError(
        f"{name} is a memfit region, and torch's checkpoint debug mode is on "
        "(torch.utils.checkpoint.set_checkpoint_debug_enabled(True)): torch runs no "
        "checkpoint with a context_fn in that mode, and memfit's regions need one. Turn the "
        "debug mode off around memfit's regions (set_checkpoint_debug_enabled(None)); "
        "memfit's divergence check names the first op that differs (check=\"always\")"
    )
