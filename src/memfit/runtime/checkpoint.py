"""``checkpoint``: torch's non-reentrant checkpoint plus policies, buffers written once and a
divergence check.

A checkpointed call runs under two context managers that torch's ``context_fn`` provides:
the forward context (entered while the region runs the first time) and the recompute context
(entered each time backward recomputes it). memfit composes into them, bottom to top:

- forward:   buffer watcher, selective-checkpoint caching mode (if a policy; its policy
             function also feeds the op recorder), op recorder (if no policy)
- recompute: buffer restore, selective-checkpoint cached mode (if a policy), op checker

The checker sits above the cached mode so that it sees every op, also those whose saved
outputs the cached mode returns without running them; torch consults the policy for every
forward op (not just the saved ones), so the recorder sees them all too. The buffer watcher
sits below both, so the buffer copies it makes are not ops of the region (NOTE [buffers
written in forward] in ``memfit.runtime.buffers``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from memfit.runtime import policies as _policies
from memfit.runtime.buffers import BufferGuard
from memfit.runtime.divergence import CheckSampler, OpChecker, OpRecorder, resolve_check
from memfit.runtime.offload import pool_of, selective_contexts

__all__ = ["checkpoint", "RegionContexts"]


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


_TORCH_OPTIONS = ("preserve_rng_state", "determinism_check", "debug", "early_stop")


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
    contexts = RegionContexts(policy, check=check, name=name, modules=modules,
                              watch_buffers=watch_buffers)
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, context_fn=contexts, **kwargs
    )
