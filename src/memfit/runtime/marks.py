"""What memfit marks on a module it checkpoints, and how to ask.

``wrap`` keeps its state as the instance attribute ``_memfit_wrap``, a chain segment its
handle as ``_memfit_segment`` on each of its blocks, ``apply`` what it changed as
``_memfit_applied`` on the planned model (read it with :func:`applied_plan`). Both wrap and segment refuse a module the
other already checkpoints; asking here, rather than in each other's module, keeps the runtime
free of import cycles.

NOTE [suspended plans]
    Inside ``with plans_suspended():`` every module memfit checkpoints (wrapped, by a plan or
    by hand, or a block of a chain segment) runs its forward plainly, as under
    ``torch.no_grad`` (NOTE [when a region checkpoints] in ``memfit.runtime.wrap``): no
    checkpoint, no region state, no call counted by the divergence check, no input guard.
    Nothing on the module changes, so leaving the block finds the plan exactly as it was (its
    wrappers, policies, check counters, host pool), unlike ``memfit.measuring.twins.lifted_plan``,
    which removes the plan and applies it afresh. ``memfit.profile`` traces a planned model
    so: a profile describes the plain step, whatever plan the model carries (traced under its
    plan, a fitted model's profile read its planned peak as the plain one, 3.05 MiB for 8.13,
    and ``plan`` found nothing to checkpoint). The flag is a counter on a class, not a
    context variable: ``torch.compile`` reads it (it cannot trace ``ContextVar.get``); the
    step is run on one thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from memfit.planning.plan import Plan

__all__ = ["WRAP_ATTR", "SEGMENT_ATTR", "APPLIED_ATTR", "is_wrapped", "segment_mark",
           "applied_plan", "plans_suspended", "suspended", "carries_plan"]

class _Suspended:
    depth = 0  # open ``plans_suspended`` blocks


@contextlib.contextmanager
def plans_suspended() -> Iterator[None]:
    """Run memfit's checkpointed modules plainly inside the block (NOTE [suspended plans]).

    Example:
        >>> with plans_suspended():
        ...     suspended()
        True
    """
    _Suspended.depth += 1
    try:
        yield
    finally:
        _Suspended.depth -= 1


def suspended() -> bool:
    """Whether memfit's checkpoints run plainly now (NOTE [suspended plans])."""
    return _Suspended.depth > 0


def carries_plan(model: nn.Module) -> bool:
    """Whether memfit checkpoints any module of ``model`` (a plan applied, a module wrapped, a
    chain segment)."""
    return any(WRAP_ATTR in m.__dict__ or SEGMENT_ATTR in m.__dict__ or APPLIED_ATTR in m.__dict__
               for m in model.modules())

WRAP_ATTR = "_memfit_wrap"
SEGMENT_ATTR = "_memfit_segment"
APPLIED_ATTR = "_memfit_applied"  # what ``apply`` changed (``memfit.runtime.apply``)


def applied_plan(module: nn.Module) -> Plan | None:
    """The plan ``memfit.apply`` (or ``fit``) applied to ``module`` itself, None if none is.

    Only the module the plan was applied to answers: its submodules, even those the plan
    checkpoints, answer None (``carries_plan`` asks the whole tree).

    Example:
        >>> applied_plan(torch.nn.Linear(2, 2)) is None
        True
    """
    if APPLIED_ATTR not in module.__dict__:
        return None
    return module.__dict__.get("memfit_plan")  # type: ignore[no-any-return]


def is_wrapped(module: nn.Module) -> bool:
    """True if ``wrap`` checkpointed this module."""
    return WRAP_ATTR in module.__dict__


def segment_mark(module: nn.Module) -> Any:
    """The segment handle a module belongs to, if any (None otherwise); typed as such by
    ``memfit.runtime.segment.segment_of``."""
    return module.__dict__.get(SEGMENT_ATTR)
