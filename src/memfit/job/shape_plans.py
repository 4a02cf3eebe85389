"""``fit``'s plans for other input shapes: a re-plan per new shape (``on_new_shape``), and a
range of shapes planned up front (``shapes=``). Like ``api.py``, it composes the stages.

NOTE [re-planning inside a training call]
    ``on_new_shape="replan"`` profiles the new shape from the planned model's forward
    pre-hook, inside the training call that brought it, the way ``fit`` profiles: the plain
    step (the plan suspended, NOTE [suspended plans] in ``memfit.runtime.marks``) of the
    same ``Step`` (loss, autocast) on detached copies of the call's inputs
    (``Step.with_input_copies``: the caller's graph and tensors are not touched), under
    ``ModelState`` (``.grad`` of every parameter put back as it was, buffers copied back, the
    RNG of every device reset), so the training call that follows computes exactly what it
    would have without the re-plan: its gradients are bitwise those of the plain step
    (``tests/test_shape_plans.py``). The time model is not calibrated again: the fit's
    calibration (its scales and charges) is reused, so a re-plan costs one traced profile
    (about 4.5 plain steps of the new shape) and one solve, once per signature: the training
    call that re-planned the 6-layer zoo GPT of ``tests/test_shape_plans.py`` at 4x256 tokens
    took 17.6 s on this project's shared 2-core machine (its ``fit`` at 4x64: 30 s). The plan is
    made for the budget in BYTES of the first plan (a fraction of the fit's plain peak stays
    the same number of bytes), or for the same device (the fit's ``Job``).

    Costs and limits: the profile runs the plain step of the new shape once, at its
    un-checkpointed peak (a GPU that cannot hold it runs out of memory there: plan such
    shapes up front with ``shapes=``, whose profiles run in ``fit``). A new shape no plan
    fits raises ``InfeasibleBudget`` from the call. Not with ``step=`` (a callable's inputs
    are its own: it cannot be run on the call's), nor in a distributed job (ranks meet new
    shapes at different calls, and a plan is made once per job, NOTE [one plan per job]).
    Re-plans are not tuned (``tune=True`` tunes the first plan only).

NOTE [shape ranges]
    ``fit(shapes=[...])`` declares the shapes training will call the model on (each a shape
    of the single input tensor, sliced or tiled from ``example_inputs``, or full example
    inputs). Activation memory need not grow monotonically with a dimension (a kernel or
    attention path chosen by size, a bucketed allocation), so nothing between two profiled
    shapes is assumed: every given shape is profiled, and the midpoint of the two extremes
    too when only two are given (corners and middle). Then:

    1. one plan, made for the shape with the largest plain peak, is simulated on every
       profile; if it fits the budget on all of them, it covers the whole range (the box
       between the smallest and the largest shapes, every dimension between the two);
    2. else each profiled shape gets its own plan (the largest shape's regions when they fit
       there, to avoid a switch), and the range between two consecutive profiled shapes is
       covered by the plan of the larger one, when its simulated peak fits at both ends;
       a range whose ends it does not fit is left to ``on_new_shape``.

    Shapes outside the range go to ``on_new_shape``. ``model.memfit_plan.extra["shapes"]``
    records what was checked: per profiled shape, the predicted peak of the plan it runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memfit.errors import InfeasibleBudget, MemfitError
from memfit.job.device_memory import Job
from memfit.planning.plan import Plan
from memfit.profiling.compiled_costs import for_compiler, is_for_compiler
from memfit.profiling.profile import Profile
from memfit.runtime.shapes import OnNewShape, ShapeRange, Signature, describe, signature_of
from memfit.step.harness import Step
from memfit.step.inputs import call_signature, first_floating_parameter, normalize_inputs

__all__ = ["resolve_on_new_shape", "PlanForShape", "Replanner", "inputs_of_shape",
           "plan_range"]

log = logging.getLogger(__name__)

PlanProfile = Callable[[Profile], Plan]


def resolve_on_new_shape(on_new_shape: str | None, *, callable_step: bool,
                         distributed: bool) -> OnNewShape:
    """``fit``'s ``on_new_shape``: the given value checked, or the default: ``"replan"`` for a
    step of example inputs, ``"warn"`` where a re-plan cannot run (NOTE [re-planning inside a
    training call]).

    Raises:
        ValueError: an unknown value, or ``"replan"`` with a callable step or in a
            distributed job.
    """
    if on_new_shape is None:
        return OnNewShape.WARN if callable_step or distributed else OnNewShape.REPLAN
    try:
        mode = OnNewShape(on_new_shape)
    except ValueError:
        raise ValueError(f"on_new_shape must be 'replan', 'warn' or 'raise', got "
                         f"{on_new_shape!r}") from None
    if mode is OnNewShape.REPLAN and callable_step:
        raise ValueError("on_new_shape='replan' re-profiles the step on a call's inputs, and a "
                         "step given as a callable runs inputs of its own; pass example_inputs "
                         "(and loss_fn), or on_new_shape='warn' / 'raise'")
    if mode is OnNewShape.REPLAN and distributed:
        raise ValueError("on_new_shape='replan' is not supported in a distributed job: ranks "
                         "meet a new shape at different calls and a plan is made once per job; "
                         "plan the shapes up front with shapes=[...], or on_new_shape='warn' / "
                         "'raise'")
    return mode


class PlanForShape:
    """``fit``'s plan for another shape's profile, for the same budget in bytes (or the same
    device): a picklable callable (a fitted model pickles with it, NOTE [a fitted model
    pickles]).

    Args:
        budget: bytes, ``"min"``, or None (the device alone bounds the plan).
        solver: the fit's solver.
        job: the fit's ``memfit.Job`` (None: ``budget`` alone), its ``JobSpec`` made for
            each profile.
    """

    def __init__(self, budget: int | str | None, solver: str, job: Job | None) -> None:
        self.budget = budget
        self.solver = solver
        self.job = job

    def __call__(self, p: Profile) -> Plan:
        from memfit.planning.planner import plan_for_budget, refuse_over_budget

        made = plan_for_budget(p, budget=self.budget, solver=self.solver,
                         job=None if self.job is None else self.job.spec(p))
        refuse_over_budget(made)
        return made


class Replanner:
    """The input guard's ``replan``: profile ``step`` on a call's inputs and plan it
    (NOTE [re-planning inside a training call]); ``around(model)``: the context ``fit``
    profiles in (NOTE [Hugging Face models in fit] in ``memfit.api``).

    NOTE [a fitted model pickles]
        ``torch.save(model)``, ``copy.deepcopy`` and ``copy.copy`` of a fitted model carry
        what ``fit`` put on it: the plan, the wrapped regions, the input guard and this
        re-planner, the monitor. So each is an object of a module-level class (no closure,
        no lambda), and holds only what it needs: the step without its example inputs (a
        re-plan runs the call's), the first profile's calibration and input signature (not
        the profile). The step's ``loss_fn`` is the user's: one pickle cannot save (a
        lambda) is left out of the pickle with a warning, and the loaded model raises
        ``MemfitError`` at the call that would re-plan, saying so (its other calls run as
        planned); a deep copy keeps it.
    """

    def __init__(self, step: Step, first: Profile, plan_profile: PlanProfile, *, mode: str,
                 target: str, around: Callable[[torch.nn.Module], Any] | None = None) -> None:
        self.step = step.with_inputs((), {})
        self.calibration = first.calibration
        self.compiled = is_for_compiler(first)
        self.planned_for = first.input_signature
        self.plan_profile = plan_profile
        self.mode = mode
        self.target = target
        self.around = around
        self.lost_loss: str | None = None  # the loss_fn pickle could not save, for the error

    def __call__(self, model: torch.nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Plan:
        with self.around(model) if self.around is not None else contextlib.nullcontext():
            return self._replan(model, args, kwargs)

    def _replan(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
        from memfit.measuring.calibration import profile

        if self.lost_loss is not None:
            raise MemfitError(
                f"memfit: {type(model).__name__} was loaded from a pickle without its loss_fn "
                f"({self.lost_loss}, which pickle cannot save), so it cannot re-plan inputs "
                f"{describe(tuple(call_signature(args, kwargs, first_floating_parameter(model))))} "
                "(on_new_shape='replan'); fit the loaded model again (memfit.fit) with its "
                "loss_fn, or give fit a module-level loss function before saving")
        s = (self.step if model is self.step.model else self.step.for_model(model))
        s = s.with_inputs(args, kwargs).with_input_copies()
        prof = profile(s, mode=self.mode, target=self.target, calibrate_time=False)
        if self.calibration is not None:
            prof = dataclasses.replace(prof, calibration=self.calibration)
        if getattr(self, "compiled", False):  # NOTE [compiled costs]; pickles of before
            prof = for_compiler(prof)
        return _planned(prof, self.plan_profile, (
            f"memfit: {prof.model} was called on inputs "
            f"{describe(signature_of(prof.input_signature))}, planned for "
            f"{describe(signature_of(self.planned_for))}; re-planning for the same budget "
            "(on_new_shape='replan') found no plan"))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_checking", None)
        loss_fn = self.step.loss_fn
        if loss_fn is None or self.__dict__.get("_checking"):  # a loss_fn that holds the model
            return state
        self._checking = True
        try:
            picklable = _picklable(loss_fn)
        finally:
            del self._checking
        if not picklable:
            log.warning("memfit: the fitted model's loss_fn %r cannot be pickled; the loaded "
                        "model cannot re-plan a new input shape (it raises there): fit it again "
                        "after loading, or give fit a module-level loss function", loss_fn)
            state["step"] = dataclasses.replace(self.step, loss_fn=None)
            state["lost_loss"] = repr(loss_fn)
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> Replanner:
        new = Replanner.__new__(Replanner)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))  # functions are kept as they are
        return new


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def _picklable(obj: Any) -> bool:
    """Whether pickle can save ``obj`` (written nowhere: a bound method's model is large)."""
    try:
        pickle.Pickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception:  # pickle raises what the object's own reduction raises
        return False
    return True


def _planned(prof: Profile, plan_profile: PlanProfile, context: str) -> Plan:
    """``plan_profile(prof)``, an ``InfeasibleBudget`` naming the inputs (``context``)."""
    try:
        return plan_profile(prof)
    except InfeasibleBudget as e:
        raise InfeasibleBudget(f"{context}: {e}", budget_bytes=e.budget_bytes,
                               min_feasible_bytes=e.min_feasible_bytes, memory=e.memory,
                               fits_with=e.fits_with) from None


def _for_shapes(prof: Profile, plan_profile: PlanProfile) -> Plan:
    return _planned(prof, plan_profile, (
        f"Training(shapes=...): no plan fits inputs {describe(signature_of(prof.input_signature))} "
        "in the budget; narrow the range or raise the budget"))


def inputs_of_shape(example_inputs: Any, shape: Any) -> Any:
    """Example inputs of another shape (NOTE [shape ranges]): full inputs are returned as
    given; a shape (a sequence of ints) is made from ``example_inputs``' single tensor, each
    dimension sliced or tiled to its size (values are the example's own, so token ids stay in
    the vocabulary).

    Example:
        >>> inputs_of_shape(torch.arange(4).view(1, 4), (2, 6))
        tensor([[0, 1, 2, 3, 0, 1],
                [0, 1, 2, 3, 0, 1]])

    Raises:
        TypeError: a shape for inputs that are not a single tensor, or of another rank.
    """
    if not (isinstance(shape, (tuple, list, torch.Size)) and shape
            and all(isinstance(d, int) for d in shape)):
        return shape
    args, kwargs = normalize_inputs(example_inputs)
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        raise TypeError(f"shapes=[...] given as sizes ({tuple(shape)}) needs example_inputs of one "
                        "tensor; for other inputs, give each shape's example inputs")
    x = args[0]
    if len(shape) != x.dim():
        raise TypeError(f"shape {tuple(shape)} has {len(shape)} dimensions, the example input "
                        f"{tuple(x.shape)} has {x.dim()}")
    for dim, size in enumerate(shape):
        if size < 1:
            raise ValueError(f"shape {tuple(shape)}: sizes must be at least 1")
        reps = -(-size // x.shape[dim])
        if reps > 1:
            x = x.repeat(*(reps if d == dim else 1 for d in range(x.dim())))
        x = x.narrow(dim, 0, size)
    return x.contiguous()


def _key(sig: Signature) -> tuple[int, ...]:
    return tuple(d for _, s, _ in sig for d in s)


def plan_range(profiles: Sequence[Profile], plan_profile: PlanProfile,
               budget_bytes: int) -> tuple[Plan, dict[Signature, Plan], tuple[ShapeRange, ...],
                                           dict[str, Any]]:
    """The plans of NOTE [shape ranges] for ``profiles`` (one per declared shape, the fit's
    own among them): the plan of the largest, the plans per signature, the ranges, and what
    was checked (for ``Plan.extra["shapes"]``).

    Raises:
        InfeasibleBudget: a declared shape no plan fits.
        ValueError: the shapes' signatures differ in tensor names, ranks or dtypes.
    """
    from memfit.planning.simulate import simulate

    sigs = [signature_of(p.input_signature) for p in profiles]
    if len({tuple((n, len(s), d) for n, s, d in sig) for sig in sigs}) != 1:
        raise ValueError("shapes=[...] must differ in sizes only (the same tensors, ranks and "
                         f"dtypes), got {', '.join(describe(s) for s in sigs)}")
    def peak(p: Profile, plan: Plan) -> int:
        try:
            return simulate(p, plan).peak_bytes
        except ValueError:  # the plan names ops this shape's step does not run
            return sys.maxsize

    order = sorted(range(len(profiles)), key=lambda i: (profiles[i].peak_bytes, _key(sigs[i])))
    largest = order[-1]
    top = _for_shapes(profiles[largest], plan_profile)
    peaks = [peak(p, top) for p in profiles]
    checked: dict[str, Any] = {"budget_bytes": budget_bytes}
    if all(pk <= budget_bytes for pk in peaks):
        low = tuple((n, torch.Size(min(s[d] for s in (sig[k][1] for sig in sigs))
                                   for d in range(len(sg))), dt)
                    for k, (n, sg, dt) in enumerate(sigs[0]))
        high = tuple((n, torch.Size(max(s[d] for s in (sig[k][1] for sig in sigs))
                                    for d in range(len(sg))), dt)
                     for k, (n, sg, dt) in enumerate(sigs[0]))
        checked["one_plan"] = True
        checked["predicted_peak_bytes"] = {describe(s): pk for s, pk in zip(sigs, peaks, strict=True)}
        return top, {s: top for s in sigs}, (ShapeRange(low, high, top),), checked
    plans: dict[Signature, Plan] = {}
    predicted: dict[str, int] = {}
    for i, (p, sig) in enumerate(zip(profiles, sigs, strict=True)):
        plans[sig] = top if peaks[i] <= budget_bytes else _for_shapes(p, plan_profile)
        predicted[describe(sig)] = peak(p, plans[sig])
    ranges = []
    by_size = sorted(range(len(profiles)), key=lambda i: _key(sigs[i]))
    for lo, hi in zip(by_size, by_size[1:], strict=False):
        plan = plans[sigs[hi]]
        if (peak(profiles[lo], plan) <= budget_bytes
                and all(a <= b for a, b in zip(_key(sigs[lo]), _key(sigs[hi]), strict=True))):
            ranges.append(ShapeRange(sigs[lo], sigs[hi], plan))
        else:
            log.info("memfit: no one plan fits both %s and %s; shapes between them go to "
                     "on_new_shape", describe(sigs[lo]), describe(sigs[hi]))
    checked["one_plan"] = False
    checked["predicted_peak_bytes"] = predicted
    return top, plans, tuple(ranges), checked
