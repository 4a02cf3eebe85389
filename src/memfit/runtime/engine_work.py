"""A training engine's own work inside a region's call (DeepSpeed ZeRO-3's parameter gathers
and releases), kept out of the region: no dispatch mode sees its ops.

NOTE [engine work in a region]
    1. An engine may run ops from a module's hooks that are not the module's computation:
       DeepSpeed ZeRO-3 gathers a module's parameters in its forward pre-hook (``empty``, a
       slice, ``copy_``, an all-gather), prefetches the next modules' parameters in the same
       hook, gathers an external parameter when the forward reads it, and frees parameters
       in its forward hook.
    2. Whether these ops run depends on the engine's state, not on the region's inputs. A
       parameter the forward gathered may still be whole when the region runs again in
       backward (persistent parameters, ``stage3_param_persistence_threshold``, stay gathered
       after their first gather; the engine's pre-backward hook gathers a module's
       parameters before its backward recomputes it), and one the forward found gathered (a
       prefetch from an earlier module's hook) may be gathered inside the replay. So a
       replay runs other ops than its forward, which broke three things:
       - the divergence check raised ``RecomputeMismatch`` ("the forward ran
         aten.empty.memory_format -> float32[11264], but the recomputation ran aten.mm":
         an HF Llama's ``mlp`` at its first step, every parameter persistent);
       - memfit's selective policy counts op occurrences per op (NOTE [op keys] in
         ``memfit.runtime.policies``): a gather's ops shift the region's own;
       - so does torch's selective-checkpoint cache (``func_counter``), which would hand
         the replay another occurrence's saved output.
    3. So the engine's work runs with the dispatch-mode stack emptied
       (``memfit._torch.without_dispatch_modes``; the modes come back when it returns):
       ``engine_work(fn)`` wraps one of its functions, ``hide_engine_work(obj, name)`` one
       method of an engine object in place. The values it produces are still checked where
       the region reads them: the ops that read a gathered parameter are the region's, and
       their outputs are fingerprinted (NOTE [value check]).
    4. Consequence: no dispatch mode sees these ops, a user's included (a dispatch-level
       memory meter misses the gathered parameters' allocation; the CPU allocator and
       CUDA's caching allocator see it). Tensor subclasses still dispatch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from memfit._torch import without_dispatch_modes

__all__ = ["engine_work", "hide_engine_work", "is_engine_work"]

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "__memfit_engine_work__"


def engine_work(fn: F) -> F:
    """``fn`` run with no dispatch mode active (NOTE [engine work in a region]).

    Example:
        >>> gather = engine_work(lambda p: p.all_gather())              # doctest: +SKIP
    """
    if is_engine_work(fn):
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with without_dispatch_modes():
            return fn(*args, **kwargs)

    setattr(run, _MARK, True)
    return run  # type: ignore[return-value]


def is_engine_work(fn: Any) -> bool:
    """Whether ``fn`` is already wrapped by ``engine_work``."""
    return bool(getattr(fn, _MARK, False))


def hide_engine_work(obj: Any, name: str) -> bool:
    """Replace ``obj.name`` (a method, or a function stored on it) by ``engine_work`` of it,
    on this object only; once. Returns False if ``obj`` has no such callable."""
    fn = getattr(obj, name, None)
    if not callable(fn):
        return False
    if not is_engine_work(fn):
        setattr(obj, name, engine_work(fn))
    return True
