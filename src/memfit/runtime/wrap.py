"""``wrap`` / ``unwrap``: checkpoint a submodule in place.

NOTE [how wrap works]
    ``wrap`` sets an instance attribute ``forward`` (a small picklable callable object) that
    runs the class's forward, or a ``forward`` already set on the instance, through
    ``memfit.runtime.checkpoint``. ``nn.Module.__call__`` looks ``self.forward`` up on the
    instance, so hooks still run outside the checkpoint, exactly once. Nothing is added to
    parameters, buffers or submodules: ``state_dict()`` keys and ``named_parameters()`` are
    unchanged; ``deepcopy`` and pickling copy the wrapper along with the module (a policy
    given as a lambda cannot be pickled, the policy builders can). ``repr`` shows the module
    as ``memfit.checkpoint(<Class>)``.

    Wrapping a wrapped module raises ``WrapError`` (also with the same policy): a double
    checkpoint would recompute the region twice, and a silent no-op would hide a changed
    policy. Unwrap first.

NOTE [when a region checkpoints]
    A region checkpoints whenever autograd records its forward: grad mode is on and an input
    or a parameter of the module requires grad, in ``train()`` and in ``eval()`` mode alike
    (fine-tuning with frozen BatchNorm statistics trains in ``eval()``; its profile is an
    ``eval()`` step and the plan is made for it). Under ``torch.no_grad()`` or
    ``torch.inference_mode()``, or when nothing requires grad, nothing is saved for backward,
    so the module runs its forward directly: no checkpoint, no region state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit._torch import clear_display_name, set_display_name
from memfit.errors import WrapError
from memfit.runtime import policies as _policies
from memfit.runtime.checkpoint import run_region
from memfit.runtime.divergence import CheckArg, CheckSampler
from memfit.runtime.marks import WRAP_ATTR, is_wrapped, suspended
from memfit.runtime.norm_statistics import StatisticsFinding, drop_scratch, prepare_scratch
from memfit.runtime.policies import PolicyArg
from memfit.runtime.tails import RegionTail

__all__ = ["wrap", "unwrap", "is_wrapped"]


class _WrapState:
    """What ``wrap`` stored on a module; kept as ``module._memfit_wrap`` (``WRAP_ATTR``)."""

    def __init__(self, policy: _policies.Policy | None, check: Any, name: str,
                 instance_forward: Any, watch_buffers: bool | None = None,
                 tail: RegionTail | None = None) -> None:
        self.policy = policy
        self.tail = tail  # NOTE [region tails] in memfit.planning.tails
        self.watch_buffers = watch_buffers
        self.check = CheckSampler(check)  # one call counter per wrapped module
        # NOTE [buffers written in forward], rule 7: what its watched calls found
        self.statistics = StatisticsFinding()
        self.name = name
        self.instance_forward = instance_forward  # None: the class's forward

    def __repr__(self) -> str:
        return f"_WrapState(policy={self.policy!r}, check={self.check}, name={self.name!r})"


def _requires_grad(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return True
        if isinstance(value, (tuple, list)) and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in value
        ):
            return True
    return any(p.requires_grad for p in module.parameters())


class _CheckpointedForward:
    """The instance-level ``forward`` that ``wrap`` installs."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        state: _WrapState = module.__dict__[WRAP_ATTR]
        inner: Callable[..., Any]
        if state.instance_forward is None:
            inner = functools.partial(type(module).forward, module)
        else:
            inner = state.instance_forward
        # NOTE [when a region checkpoints]: whenever autograd records, train() or eval(),
        # and no one suspended the plans (NOTE [suspended plans] in memfit.runtime.marks)
        if suspended() or not (torch.is_grad_enabled() and _requires_grad(module, args, kwargs)):
            return inner(*args, **kwargs)
        if state.tail is not None and not torch.compiler.is_compiling():
            inner = state.tail.around(inner)
        return run_region(inner, args, kwargs, policy=state.policy, check=state.check,
                          name=state.name, modules=(module,), watch_buffers=state.watch_buffers,
                          statistics=state.statistics)


class _WrappedName:
    """The class name ``repr`` shows for a wrapped module (``set_display_name``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self) -> str:
        return f"memfit.checkpoint({type(self.module).__name__})"


def wrap(module: nn.Module, policy: PolicyArg = None, *, check: CheckArg = True,
         name: str | None = None, watch_buffers: bool | None = None,
         tail_after: nn.Module | None = None) -> nn.Module:
    """Checkpoint ``module`` in place: its activations are recomputed in backward.

    Args:
        module: the module to checkpoint (changed in place and returned).
        policy: which op outputs to keep, as for ``memfit.runtime.checkpoint.checkpoint``
            (default None: recompute everything).
        check: compare the recomputation with the forward op by op and value by value:
            True (default: the first 3 calls, then one in 100), "always", "ops" (no
            values), False, or a ``DivergenceCheck`` (NOTE [check sampling] in
            ``memfit.runtime.divergence``).
        name: how errors name the module (default: its class name); ``apply`` passes the
            module's path in the model.
        watch_buffers: watch the forward for in-place writes to buffers (NOTE [buffers
            written in forward], rule 6); None (default): when the module has buffers.
        tail_after: a sub-module after whose call the region's tail runs, its saves kept as
            the plain step keeps them (NOTE [region tails] in ``memfit.planning.tails``; the
            plan's ``Region.tail_after``); default None.

    Returns:
        ``module``.

    Raises:
        WrapError: the module is already wrapped. A block of a chain segment may be wrapped
            (after the segment is made): it is then checkpointed inside the segment (NOTE
            [nested segments] in ``memfit.planning.nesting``).
        TypeError, ValueError: a bad policy (see ``memfit.runtime.policies.resolve``).

    Example:
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> wrap(block, save_matmuls())              # doctest: +SKIP
        memfit.checkpoint(Sequential)(...)
        >>> unwrap(block)                            # doctest: +SKIP
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"wrap expects an nn.Module, got {type(module).__name__}; "
                        "use memfit.checkpoint for functions")
    label = name or type(module).__name__
    if is_wrapped(module):
        raise WrapError(
            f"{label} is already wrapped (policy {module.__dict__[WRAP_ATTR].policy!r}); "
            "wrapping twice would checkpoint it twice. Call memfit.unwrap(module) first"
        )
    resolved = _policies.resolve(policy)
    instance_forward = module.__dict__.get("forward")
    tail = RegionTail(tail_after, label) if tail_after is not None else None
    setattr(module, WRAP_ATTR, _WrapState(resolved, check, label, instance_forward,
                                          watch_buffers, tail))
    module.forward = _CheckpointedForward(module)  # type: ignore[method-assign]
    set_display_name(module, _WrappedName(module))
    prepare_scratch(module)  # NOTE [scratch statistics] in memfit.runtime.norm_statistics
    return module


def unwrap(module: nn.Module) -> nn.Module:
    """Undo ``wrap``: the module runs its forward plainly again.

    Raises:
        WrapError: the module is not wrapped.

    Example:
        >>> unwrap(wrap(torch.nn.Linear(2, 2)))
        Linear(in_features=2, out_features=2, bias=True)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"unwrap expects an nn.Module, got {type(module).__name__}")
    if not is_wrapped(module):
        raise WrapError(
            f"{type(module).__name__} is not wrapped by memfit, so there is nothing to unwrap "
            "(is it the module you wrapped, or a copy made before wrapping?)"
        )
    state: _WrapState = module.__dict__.pop(WRAP_ATTR)
    if state.tail is not None:
        state.tail.remove()
    clear_display_name(module)
    drop_scratch(module)
    if state.instance_forward is None:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = state.instance_forward
    return module
