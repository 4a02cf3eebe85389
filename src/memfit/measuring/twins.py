"""A step run on a twin: a plain copy of the model, with or without a plan, measured.

``verify`` compares the step of a planned twin with that of a plain twin; ``sweep`` meters
the first step of each plan on a fresh planned twin. What a step is and how a run leaves the
model as found are ``memfit.step``'s (``Step``, ``ModelState``); this module adds the copies,
the plan put on and taken off, and the measured run that records what a step left behind.

NOTE [twins carry no wrappers]
    A twin is a deep copy of the model made while its plan is lifted (``lifted_plan``), with
    the plan to test applied afresh. A copy never carries checkpoint wrappers (their state is
    the runtime's business), and re-applying a plan to a copy checks the plan itself, which is
    also what a fresh process loading the plan would run. The model itself ends as it began.

Example:
    >>> model = torch.nn.Linear(4, 1)
    >>> step = Step.of(model, torch.ones(2, 4))
    >>> result = record_step(twin_step(step, None))
    >>> result.loss.shape, result.peak_bytes > 0
    (torch.Size([]), True)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.planning.plan import Plan
from memfit.step.harness import ModelState, Step, model_device
from memfit.step.inputs import iter_tensors

__all__ = ["StepResult", "UncopyableModel", "no_twin_reason", "lifted_plan", "plain_copy", "step_of", "twin_step", "repeatable", "make_step",
           "measure_step", "record_step"]


@dataclass
class StepResult:
    """What one step left behind, for comparison (tensors detached), and its measurement."""

    loss: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    outputs: list[torch.Tensor] = field(default_factory=list)
    param_grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    input_grads: list[torch.Tensor | None] = field(default_factory=list)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    rng_after: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    peak_bytes: int = 0
    tracked_peak_bytes: int = 0
    times_s: tuple[float, ...] = ()


@contextlib.contextmanager
def lifted_plan(model: nn.Module) -> Iterator[Plan | None]:
    """The model without its memfit plan for the duration; yields the plan it carried, and
    re-applies it at the end (removing any plan applied meanwhile)."""
    from memfit.runtime.apply import apply_plan, input_guard, unapply

    original: Plan | None = model.__dict__.get("memfit_plan")
    guard = input_guard(model)
    # the plans of other input shapes too (NOTE [inputs other than the profiled ones])
    settings = guard.settings() if guard is not None else {}
    if original is not None:
        unapply(model)
    try:
        yield original
    finally:
        if model.__dict__.get("memfit_plan") is not None:
            unapply(model)
        if original is not None:
            # the plan it carried, checked across ranks when first applied
            apply_plan(model, original, **settings)


class UncopyableModel(TypeError):
    """``copy.deepcopy`` of the model failed (or would not give an independent twin)."""


def no_twin_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot have a deep-copied twin, or None if it can.

    NOTE [models without twins]
        A model sharded by FSDP (``fully_shard``: FSDP units hold DTensor shards and
        communication state; FSDP refuses ``deepcopy``) or wrapped in
        ``DistributedDataParallel`` (a copy would share or lack the reducer and process group)
        has no twin. ``verify`` then runs both steps on the model itself, the plan lifted for
        the plain one (``lifted_plan``) and applied afresh for the planned one, with ``.grad``,
        buffers and the RNG state put back after each run (``ModelState``); parameters are
        not written by a step (no optimizer runs). Every rank must call ``verify`` then: the
        steps run the model's collectives.
    """
    from memfit.runtime.fsdp import is_fsdp_unit_class

    for m in model.modules():
        cls = type(m)
        if is_fsdp_unit_class(cls):
            return f"{cls.__name__} is sharded by FSDP"
        if any(c.__name__ == "DistributedDataParallel" for c in cls.__mro__):
            return f"{cls.__name__} is DistributedDataParallel"
    return None


def plain_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` without its memfit plan (NOTE [twins carry no wrappers]).

    Raises:
        UncopyableModel: the model cannot be deep-copied (NOTE [models without twins]).
    """
    reason = no_twin_reason(model)
    if reason is not None:
        raise UncopyableModel(f"cannot make a twin of {type(model).__name__}: {reason}")
    with lifted_plan(model):
        try:
            return copy.deepcopy(model)
        except Exception as e:  # e.g. a module holding a process group or a lock
            raise UncopyableModel(f"cannot deep-copy {type(model).__name__}: {type(e).__name__}: {e}") from e


def step_of(model: nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
              step: Step | None) -> Step:
    """``step``, checked to be a step of ``model`` with no inputs beside it that can run on
    twins, or else the step of ``model`` on ``example_inputs`` (what ``verify`` and ``sweep``
    accept)."""
    if step is None:
        return Step.of(model, example_inputs, loss_fn=loss_fn)
    if not isinstance(step, Step):
        raise TypeError(f"step must be a memfit.step.harness.Step, got {type(step).__name__}")
    step.for_model(model)  # a step given as a callable raises here: it cannot run on a twin
    if example_inputs is not None or loss_fn is not None:
        raise TypeError("a Step carries its inputs and loss: pass no example_inputs or loss_fn with step=")
    if step.model is not model:
        raise ValueError(f"step= is a step of another model ({step.name}), not of the {type(model).__name__} "
                         "given with it; make it with Step.of(model, ...)")
    return step


def twin_step(step: Step, plan: Plan | None) -> Step:
    """``step`` run by a plain copy of its model with ``plan`` applied (``None``: plain), on
    fresh copies of its inputs.

    Raises:
        PlanMismatch, WrapError: the plan does not apply to the model.
        TypeError: the step was given as a callable (it cannot run on a copy).
    """
    from memfit.runtime.apply import apply_plan

    step.for_model(step.model)  # a step given as a callable raises here, before any copy
    twin = plain_copy(step.model)
    if plan is not None:
        apply_plan(twin, plan)  # a twin of this rank's model: no collective
    return step.for_model(twin).with_input_copies()


def repeatable(step: Step, *, seed: int | None = 0,
               keep: Callable[[Any, torch.Tensor], None] | None = None) -> Callable[[], None]:
    """A callable running ``step`` again and again from the same start (``ModelState.run``,
    NOTE [repeatable runs]): the model's ``.grad`` are dropped now and after each run, its
    buffers copied back, the RNG re-seeded with ``seed`` (``None``: reset to its state now).

    Example:
        >>> run = repeatable(Step.of(torch.nn.Linear(2, 2), torch.ones(1, 2)))
        >>> run()
    """
    state = ModelState(step.model, step.inputs, seed=seed)
    state.clear_grads()

    def run() -> None:
        state.run(step, keep=keep)

    return run


def make_step(model: nn.Module, example_inputs: Any, *,
              loss_fn: Callable[[Any], torch.Tensor] | None = None, seed: int | None = 0) -> Callable[[], None]:
    """``repeatable`` for the step of ``model`` on copies of ``example_inputs``.

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> memfit.measure(make_step(m, torch.ones(1, 2)), model=m).peak_bytes > 0   # doctest: +SKIP
        True
    """
    return repeatable(Step.of(model, example_inputs, loss_fn=loss_fn).with_input_copies(), seed=seed)


def _local(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached; of a DTensor (FSDP's shards), this rank's shard: comparing shards
    rank by rank compares the whole tensor, with no collective."""
    t = t.detach()
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _rng_state(device: torch.device) -> torch.Tensor:
    state = torch.get_rng_state()
    if device.type == "cuda":
        state = torch.cat([state, torch.cuda.get_rng_state(device)])
    return state


def measure_step(step: Step, *, seed: int | None = 0, device: torch.device | None = None,
                 result: StepResult | None = None) -> StepResult:
    """One metered run of ``step`` (and one timed run), each from the same start; returns its
    peak and time, and, in ``result`` if given, what the step left (loss, outputs, gradients,
    buffers, RNG state after it). The model is changed: its buffers hold the step's results,
    its ``.grad`` are None."""
    from memfit.profiling.measure import measure

    model = step.model
    dev = device or model_device(model)
    keep = None
    if result is not None:
        rec = result
        grad_inputs = [t for t in iter_tensors(step.inputs) if t.requires_grad and t.is_leaf]

        def keep(out: Any, loss: torch.Tensor) -> None:
            rec.loss = loss.detach()
            rec.outputs = [t.detach() for t in iter_tensors(out)]
            rec.input_grads = [t.grad.detach() if t.grad is not None else None for t in grad_inputs]
            rec.param_grads = {n: (_local(p.grad) if p.grad is not None else None)
                               for n, p in model.named_parameters()}

    m = measure(repeatable(step, seed=seed, keep=keep), device=dev, repeats=1)
    out = result if result is not None else StepResult()
    out.peak_bytes = int(m.peak_bytes)
    out.tracked_peak_bytes = int(m.tracked_peak_bytes)
    out.times_s = tuple(m.times_s)
    if result is not None:
        # clones: a step run on the model itself (NOTE [models without twins]) has its
        # buffers put back after it
        out.buffers = {n: _local(b).clone() for n, b in model.named_buffers()}
        out.rng_after = _rng_state(dev)
    return out


def record_step(step: Step, *, seed: int | None = 0, device: torch.device | None = None) -> StepResult:
    """``measure_step`` keeping what the step left, for comparison."""
    return measure_step(step, seed=seed, device=device, result=StepResult())
