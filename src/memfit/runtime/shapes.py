"""The planned model's input guard: a plan holds for the inputs it was profiled on.

NOTE [inputs other than the profiled ones]
    A plan's peak is predicted for one step: the shapes and dtypes of the inputs it was
    profiled on (``Plan.input_signature``, NOTE [input signature] in
    ``memfit.step.inputs``). Twice the sequence length ran a plan at 259% of its budget,
    twice the batch at 190%, ``.to(float64)`` at 197%, silently. So ``apply`` puts a forward
    pre-hook on the planned model (:class:`InputGuard`) that compares each call's signature
    with the one of the plan in effect. A call on another signature is never silent:

    1. a signature the model holds a plan for (``fit(shapes=...)`` planned it, or an earlier
       re-plan did), or one inside a planned range (:class:`ShapeRange`), switches to that
       plan: its regions are wrapped anew (``switch``), nothing is traced;
    2. else, by ``on_new_shape`` (:class:`OnNewShape`): ``"raise"`` raises
       ``NewInputShape`` naming both signatures; ``"warn"`` warns (``warnings.warn``) once
       per new signature and runs the plan in effect; ``"replan"`` calls ``replan`` (given
       by ``fit``: a profile of that step and a plan for the same budget in bytes) once and
       keeps its plan for the signature, so later calls of it are case 1.

    Not compared: calls that record no autograd graph (``torch.no_grad``, evaluation: they run
    no checkpoint and keep no activations, NOTE [when a region checkpoints] in
    ``memfit.runtime.wrap``), calls while the plan is suspended (``memfit.profile`` of the
    planned model, and the re-plan's own profile: NOTE [suspended plans] in
    ``memfit.runtime.marks``), and calls traced by ``torch.compile`` (dynamo guards on shapes
    itself, and would trace the comparison into the graph). A plan without a signature (made
    before the field) installs no guard.

    Cost: a call on the signature of the last call compares its positional tensors' shapes and
    dtypes in place (and the dtype of one parameter); other calls build the signature
    (``call_signature``) and look it up. Measured on this project's shared 2-core machine
    (``tests/runtime/test_shapes.py`` prints it): 5.4 us per call on the last call's
    signature, 15.4 us on another (a warned one), against 0.42 ms for a step of a 2-layer
    8-wide MLP and 56 ms for a 6-layer, 32-wide zoo GPT at 4x128 tokens.

    A switch re-wraps the regions (each region's divergence check starts its sampling again:
    NOTE [check sampling] in ``memfit.runtime.divergence``), so a run alternating between
    shapes on every call pays the checked calls' cost more often. A plan whose region is the
    root module itself is switched to from the root's own pre-hook, after ``nn.Module`` has
    looked up its ``forward``: that one call runs the root unwrapped (no plan makes the root
    a region today).
"""

from __future__ import annotations

import enum
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import NewInputShape
from memfit.planning.plan import Plan
from memfit.runtime.marks import suspended
from memfit.step.inputs import PARAMETERS_KEY, call_signature, first_floating_parameter

__all__ = ["OnNewShape", "ShapeRange", "InputGuard", "Signature", "signature_of", "describe"]

log = logging.getLogger(__name__)

_TENSORS = (torch.Tensor, nn.Parameter)

# A call's signature as ``call_signature`` gives it, hashable: ``((name, torch.Size,
# torch.dtype), ...)``.
Signature = tuple[tuple[str, torch.Size, Any], ...]


class OnNewShape(str, enum.Enum):
    """What a planned model does on a call whose inputs' signature has no plan (NOTE [inputs
    other than the profiled ones])."""

    REPLAN = "replan"
    WARN = "warn"
    RAISE = "raise"


def _dtype(name: str) -> Any:
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else name


def signature_of(plain: tuple[tuple[str, tuple[int, ...], str], ...]) -> Signature:
    """A plan's ``input_signature`` (plain data) as a call's :data:`Signature`.

    Example:
        >>> signature_of((("0", (2, 3), "int64"),))
        (('0', torch.Size([2, 3]), torch.int64),)
    """
    return tuple((n, torch.Size(s), _dtype(d)) for n, s, d in plain)


@dataclass(frozen=True)
class ShapeRange:
    """Calls whose signature lies between ``low`` and ``high`` run ``plan``: the same tensor
    names, ranks and dtypes, and each dimension between the two (both included).

    Example:
        >>> r = ShapeRange(signature_of((("0", (2, 32), "int64"),)),
        ...                signature_of((("0", (2, 128), "int64"),)), plan=None)  # doctest: +SKIP
        >>> r.covers(signature_of((("0", (2, 96), "int64"),)))   # doctest: +SKIP
        True
    """

    low: Signature
    high: Signature
    plan: Plan

    def covers(self, sig: Signature) -> bool:
        if len(sig) != len(self.low):
            return False
        for (n, s, d), (ln, ls, ld), (_, hs, _) in zip(sig, self.low, self.high, strict=True):
            if n != ln or d != ld or len(s) != len(ls):
                return False
            if any(not lo <= x <= hi for x, lo, hi in zip(s, ls, hs, strict=True)):
                return False
        return True


class InputGuard:
    """Forward pre-hook of a planned model: on inputs other than those of the plan in effect,
    switch to their plan, or raise, warn or re-plan (NOTE [inputs other than the profiled
    ones]).

    Args:
        model: the planned model.
        plan: the plan in effect (its ``input_signature`` is the first one expected).
        on_new: what to do on a signature without a plan (default ``OnNewShape.WARN``).
        switch: ``(model, plan)``: puts another plan into effect on the model
            (``memfit.runtime.apply``); needed for ``ranges``, ``plans`` and re-plans.
        replan: ``(model, args, kwargs) -> Plan`` for a call on a new signature (``on_new``
            replan). Both take the module the hook is called for, so that a deep copy of the
            planned model switches and re-plans itself, not the original.
        plans: plans of other signatures, made ahead (``fit(shapes=...)``).
        ranges: ranges of signatures and their plans, tried in order after ``plans``.

    Attributes:
        plans: every signature with a plan: the first, those given, those re-planned.
        replans: how many re-plans ran.
        warned: the signatures warned about.
        switches: how many times another plan was put into effect.
    """

    def __init__(self, model: nn.Module, plan: Plan, *, on_new: OnNewShape | str = OnNewShape.WARN,
                 switch: Callable[[nn.Module, Plan], None] | None = None,
                 replan: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Plan] | None = None,
                 plans: dict[Signature, Plan] | None = None,
                 ranges: tuple[ShapeRange, ...] = ()) -> None:
        self.on_new = OnNewShape(on_new)
        if self.on_new is OnNewShape.REPLAN and (replan is None or switch is None):
            raise ValueError("on_new_shape='replan' needs a replan function and a switch")
        first = signature_of(plan.input_signature)
        self.plans: dict[Signature, Plan] = {first: plan, **(plans or {})}
        self.ranges = ranges
        self.switch = switch
        self.replan = replan
        self.parameter = (first_floating_parameter(model)
                          if any(n == PARAMETERS_KEY for n, _, _ in first) else None)
        self.model_name = plan.model or type(model).__name__
        self.active = plan
        self.replans = 0
        self.switches = 0
        self.warned: set[Signature] = set()
        self._expect(first)

    def _expect(self, sig: Signature) -> None:
        """Make ``sig`` the signature the fast path compares with."""
        self.current = sig
        tensors = [(s, d) for n, s, d in sig if n != PARAMETERS_KEY]
        names = [n for n, _, _ in sig if n != PARAMETERS_KEY]
        # the common call: tensors as positional arguments only, compared without building
        # the signature
        self._positional = tensors if names == [str(i) for i in range(len(tensors))] else None
        self._parameter_dtype = next((d for n, _, d in sig if n == PARAMETERS_KEY), None)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() or suspended():
            return
        pos = self._positional
        if (pos is not None and not kwargs and len(args) == len(pos)
                and all(type(a) in _TENSORS and a.shape == s and a.dtype == d
                        for a, (s, d) in zip(args, pos, strict=True))
                and (self.parameter is None or self.parameter.dtype == self._parameter_dtype)):
            return
        got: Signature = tuple(call_signature(args, kwargs, self.parameter))
        if got == self.current:
            return
        plan = self._plan_for(got)
        if plan is None:
            if self.on_new is OnNewShape.RAISE:
                raise NewInputShape(
                    f"memfit: {self.model_name} was planned for inputs "
                    f"{' or '.join(describe(s) for s in self.plans)} and is called with "
                    f"{describe(got)}, which no plan covers; on_new_shape='raise' refuses it "
                    "(the plan's peak and budget hold for the profiled shapes and dtypes only). "
                    "Fit with shapes=[...] covering this shape, or with on_new_shape='replan'",
                    planned=tuple(self.plans), got=got)
            if self.on_new is OnNewShape.WARN:
                if got not in self.warned:
                    self.warned.add(got)
                    warnings.warn(
                        f"memfit: {self.model_name} was planned for inputs "
                        f"{describe(self.current)} and is now called with {describe(got)}; the "
                        "plan's peak (and its budget) holds for the profiled shapes and dtypes "
                        "only: fit with on_new_shape='replan' (a plan per new shape, same "
                        "budget) or shapes=[...] (a range planned up front), or fit it again "
                        "(memfit.fit) on inputs of the new shape", UserWarning, stacklevel=2)
                return
            assert self.replan is not None  # checked in __init__
            plan = self.replan(module, args, kwargs)
            self.replans += 1
            log.info("memfit: re-planned %s for inputs %s: %s", self.model_name, describe(got), plan)
        self.plans[got] = plan
        if plan is not self.active and plan != self.active:
            assert self.switch is not None  # a plan for another signature exists only with one
            self.switch(module, plan)
            self.active = plan
            self.switches += 1
        self._expect(got)

    def settings(self) -> dict[str, Any]:
        """``apply``'s keywords that make this guard again (the plan lifted and put back:
        ``memfit.measuring.twins.lifted_plan``)."""
        return {"on_new_shape": self.on_new, "replan": self.replan, "plans": dict(self.plans),
                "ranges": self.ranges}

    def _plan_for(self, sig: Signature) -> Plan | None:
        plan = self.plans.get(sig)
        if plan is not None:
            return plan
        return next((r.plan for r in self.ranges if r.covers(sig)), None)


def describe(sig: Signature) -> str:
    """A signature for people: ``(0=4x64:int64, parameters:float32)``."""
    parts = [f"{n}={'x'.join(map(str, s)) or '()'}:{str(d).removeprefix('torch.')}"
             if n != PARAMETERS_KEY else f"parameters:{str(d).removeprefix('torch.')}"
             for n, s, d in sig]
    return "(" + ", ".join(parts) + ")"
