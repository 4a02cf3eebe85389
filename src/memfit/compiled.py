"""``memfit.compile``: fit a model for a budget, compile it, and spend on the plan the memory
the compiled step measures below the prediction.

NOTE [budgets measured under compilation]
    Under ``torch.compile`` the graph saves what memfit's plan saves, but inductor's fusions
    never allocate most of the eager step's transients, and outside the plan's regions the
    partitioner keeps fewer tensors than eager autograd does. So a plan's predicted peak (an
    eager timeline, NOTE [compiled costs] in ``memfit.profiling.compiled_costs``) bounds the
    compiled step's peak from above, often far above: memory a faster plan could use.
    ``memfit.compile`` closes the loop on the measured peak:

    1. Fit with compiled costs (``Search(compiled=True)``) for the budget ``B`` (bytes; a
       fraction or ``"80%"`` is of the eager plain step's peak, as in ``fit``), compile the
       model, and measure one compiled step's peak ``P`` (after a first, compiling step; the
       allocator's peak on CPU, ``max_memory_allocated`` on CUDA; the model's gradients,
       buffers and RNG state are put back).
    2. While rounds are left and ``P`` is not within ``tolerance`` below ``B``: plan the same
       profile for another budget of prediction and measure again. Until a round measures
       above ``B`` the next budget is the last one plus the slack ``B - P``; after, it bisects
       between the largest budget measured within ``B`` and the smallest measured above it.
       A budget whose plan is one measured already ends the search.
    3. The model ends with the plan of the largest budget measured within ``B`` (a larger
       budget never plans more recompute), compiled; one compile more when that is not the
       last round's.

    NOTE [a compiled model's own frame]
    ``torch.compile(model)`` compiles ``nn.Module.__call__``, code every module in the
    process shares, and dynamo keeps its compiled entries by code object, guarded on what each
    trace read. An entry another compile made there for a module of the same class (entered as
    its own frame after a graph break: a memfit plan compiled without the setting below) can
    pass the guards on this model, which then runs that code: measured on the peer harness's
    HF Llama (``benchmarks/compile_isolation.py``), ``memfit.compile``'s model ran the other
    row's graph-broken code, its regions eagerly, at 1.33-1.39x the compiler's budget at its
    0.5 peak, where alone it ran at 0.98-1.01x. With the default compiler, the model returned
    calls a function of memfit's (compiled with ``torch.compile``) that calls the model: a
    frame no other compile enters (0.96-1.01x beside that row, in either order). A
    ``compiler`` given is used as given.

    Every round recompiles (a new plan is a new graph): with ``rounds=3`` the call compiles up
    to five times. ``"min"`` needs no round. The rounds are on ``model.memfit_compiled``
    (``CompiledRound``: the budget each was planned for, its predicted and measured peaks).

    A region whose forward mutates Python state is a dynamo graph break under compilation
    ("HOP: Unsafe side effect"), which runs the region eagerly. Where the model's family says
    that state is bookkeeping (``ModelFamily.bookkeeping_side_effects``: Hugging Face's output
    collector), the compiles run with dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``
    and so does every later call of the compiled model it returns (a recompile, on a new shape
    or a guard that fails, compiles as the rounds did: one graph). On a 4-layer HF Llama that
    took the planned compiled step from 0.418 s (14 graph breaks) to 0.300 s (one graph),
    against 0.293 s compiled without a plan. Before, a new shape after the call recompiled
    with 7 graph breaks (a 6-layer HF Llama of the tests).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from memfit.errors import InfeasibleBudget, MemfitError
from memfit.job.fit_options import Parallel, Search, Training

__all__ = ["CompiledRound", "compile_planned"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)
DEFAULT_TOLERANCE = 0.02


@dataclasses.dataclass(frozen=True)
class CompiledRound:
    """One round of NOTE [budgets measured under compilation].

    Attributes:
        planned_for_bytes: the budget of prediction the round's plan was made for.
        predicted_peak_bytes: that plan's predicted peak (the eager timeline).
        measured_peak_bytes: the compiled step's measured peak.
        recompute_s: the plan's predicted recompute seconds (compiled costs).
        within: the measured peak is at most the caller's budget.
    """

    planned_for_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    recompute_s: float
    within: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def compile_planned(model: M, example_inputs: Any, budget: int | float | str, *,
                    loss_fn: Callable[[Any], torch.Tensor] | None = None,
                    search: Search | None = None, training: Training | None = None,
                    compiler: Callable[[nn.Module], Any] | None = None, rounds: int = 3,
                    tolerance: float = DEFAULT_TOLERANCE) -> Any:
    """Fit ``model`` for ``budget`` with compiled costs, compile it, and re-plan on the compiled
    step's measured peak (NOTE [budgets measured under compilation]).

    Args:
        model: the model, planned in place (as ``fit``).
        example_inputs: one step's inputs, as ``fit``'s.
        budget: the cap on the compiled step's peak activation memory: bytes, a fraction or a
            string of the eager plain peak (``0.5``, ``"60%"``, ``"6GiB"``), or ``"min"``.
        loss_fn: as ``fit``'s.
        search: as ``fit``'s, with compiled costs (``compiled=True``; a ``Search`` with
            ``compiled=False`` is a ValueError); default ``memfit.Search(compiled=True)``.
        training: as ``fit``'s (re-planning a new shape recompiles too).
        compiler: model -> compiled model; default ``torch.compile``
            (``functools.partial(torch.compile, mode="max-autotune")`` for another mode; NOTE [a
            compiled model's own frame] applies to the default only).
        rounds: re-plans after the first (default 3; 0: fit and compile once).
        tolerance: stop when the measured peak is within this fraction below the budget
            (default 0.02).

    Returns:
        The compiled model; ``model.memfit_plan`` is its plan and ``model.memfit_compiled``
        its rounds.

    Raises:
        memfit.InfeasibleBudget: as ``fit``; and when no round's compiled step measured within
            the budget, naming the smallest measured peak.
        ValueError: ``search.compiled`` is False, ``rounds`` below 0, ``tolerance`` outside
            [0, 1).

    Example:
        >>> m = memfit.zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=64, vocab_size=64)
        >>> compiled = memfit.compile(m, torch.randint(0, 64, (8, 64)), budget=0.6)  # doctest: +SKIP
        >>> m.memfit_compiled[-1].measured_peak_bytes <= m.memfit_plan.budget_bytes     # doctest: +SKIP
        True
    """
    from memfit.api import fit_with_profile
    from memfit.planning.plan import Plan

    if not isinstance(model, nn.Module):
        raise TypeError(f"memfit.compile expects an nn.Module, got {type(model).__name__}")

    search = search if search is not None else Search(compiled=True)
    if not search.compiled:
        raise ValueError("memfit.compile plans with compiled costs: pass "
                         "search=memfit.Search(compiled=True, ...), or use memfit.fit for eager costs")
    if not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an int >= 0, got {rounds!r}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    compile_fn: Callable[[nn.Module], Any] = compiler if compiler is not None else torch.compile

    def fitted(b: Any, prof: Any = None) -> tuple[Plan, Any]:
        _, p = fit_with_profile(model, example_inputs, None, budget=b, loss_fn=loss_fn, step=None,
                                search=search, training=training or Training(),
                                parallel=Parallel(), profile=prof)
        return model.__dict__["memfit_plan"], p

    previous: Plan | None = model.__dict__.get("memfit_plan")  # put back if no round fits
    plan, prof = fitted(budget)
    cap = None if budget == "min" else plan.budget_bytes  # "min": the smallest plan, measured
    done: list[CompiledRound] = []
    seen: dict[tuple[Any, ...], CompiledRound] = {}

    def run(plan: Plan, planned_for: int) -> tuple[Any, CompiledRound]:
        compiled = compile_fn(model)
        if compiler is None:
            compiled = _own_frame(compiled, model)
        compiled = _compiling_under(compiled, side_effects)
        with side_effects():  # the first call compiles
            peak = _compiled_peak(compiled, model, example_inputs, loss_fn)
        r = CompiledRound(planned_for, int(plan.predicted_peak_bytes), peak, float(plan.recompute_s),
                          cap is None or peak <= cap)
        done.append(r)
        seen[_decisions(plan)] = r
        log.info("memfit.compile: planned for %d B, predicted %d B, compiled step measured %d B "
                 "(budget %s B)", planned_for, r.predicted_peak_bytes, peak, cap)
        return compiled, r

    side_effects = _side_effects_skipped(model, example_inputs)
    compiled, last = run(plan, int(plan.budget_bytes or plan.predicted_peak_bytes))
    if cap is not None:
        for _ in range(rounds):
            b = _next_budget(done, cap, tolerance)
            if b is None:
                break
            try:
                plan, _ = fitted(b, prof)
            except InfeasibleBudget:
                break
            if _decisions(plan) in seen:  # the same plan: nothing new to measure
                break
            compiled, last = run(plan, b)
    ok = [r for r in done if r.within]
    if not ok:
        _put_back(model, previous)
        raise InfeasibleBudget(
            f"memfit.compile: the compiled step measured {min(r.measured_peak_bytes for r in done)} B "
            f"at best, above the budget of {cap} B, in {len(done)} round(s); give a larger budget, "
            "or more rounds (the model is left as it was before the call)", budget_bytes=int(cap or 0),
            min_feasible_bytes=min(r.measured_peak_bytes for r in done))
    best = max(ok, key=lambda r: r.planned_for_bytes)
    if best is not last:  # compiled (and measured) again, in this call
        plan, _ = fitted(best.planned_for_bytes, prof)
        compiled, _ = run(plan, best.planned_for_bytes)
    model.memfit_compiled = tuple(done)  # type: ignore[assignment]
    return compiled


def _put_back(model: nn.Module, previous: Any) -> None:
    """The model as before ``compile``: the plan it had applied, or none."""
    from memfit.runtime.apply import apply_plan, unapply

    if previous is None:
        unapply(model)
    else:
        apply_plan(model, previous)


def _side_effects_skipped(model: nn.Module, example_inputs: Any) -> Callable[[], Any]:
    """A context for the compiling calls: dynamo's replay of forward side effects in a
    checkpoint's backward skipped where the model's family says they are bookkeeping."""
    import contextlib

    from memfit._torch import checkpoint_side_effects_skipped
    from memfit.step.families import family_of
    from memfit.step.inputs import normalize_inputs

    _, kwargs = normalize_inputs(example_inputs)
    if not family_of(model, kwargs).bookkeeping_side_effects or checkpoint_side_effects_skipped() is None:
        return contextlib.nullcontext
    return checkpoint_side_effects_skipped


def _own_frame(compiled: Any, model: nn.Module) -> Any:
    """``torch.compile(model)`` whose calls enter a frame of memfit's own (NOTE [a compiled
    model's own frame])."""
    if not isinstance(compiled, nn.Module) or "forward" not in compiled.__dict__:
        return compiled

    def memfit_compiled_forward(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    compiled.forward = torch.compile(memfit_compiled_forward)
    return compiled


def _compiling_under(compiled: Any, context: Callable[[], Any]) -> Any:
    """``compiled`` (a compiled module) whose every call runs in ``context()``: a recompile
    after ``memfit.compile`` returns (a new shape, a guard that fails) compiles as its rounds
    did (NOTE [budgets measured under compilation]). A compiler's result that is no module
    with its own ``forward`` is returned as it is."""
    import contextlib
    import functools

    if context is contextlib.nullcontext or not isinstance(compiled, nn.Module):
        return compiled
    forward = compiled.__dict__.get("forward")  # torch.compile's OptimizedModule sets its own
    if forward is None:
        return compiled

    @functools.wraps(forward)
    def under_context(*args: Any, **kwargs: Any) -> Any:
        with context():
            return forward(*args, **kwargs)

    compiled.forward = under_context
    return compiled


def _next_budget(done: list[CompiledRound], cap: int, tolerance: float) -> int | None:
    """The next budget of prediction to plan (NOTE [budgets measured under compilation], 2),
    or None when the search is over."""
    last = done[-1]
    if last.within and last.measured_peak_bytes >= cap * (1 - tolerance):
        return None
    ok = [r.planned_for_bytes for r in done if r.within]
    over = [r.planned_for_bytes for r in done if not r.within]
    if not over:
        return last.planned_for_bytes + (cap - last.measured_peak_bytes)
    hi = min(over)
    lo = max((b for b in ok if b < hi), default=None)
    if lo is None:  # nothing within yet: lower by the excess (none left to lower: stop)
        b = hi - (last.measured_peak_bytes - cap)
        return b if not last.within and b > 0 else None
    b = (lo + hi) // 2
    return None if hi - lo <= max(1, int(cap * tolerance)) else b


def _decisions(plan: Any) -> tuple[Any, ...]:
    """What a plan decides (its regions and what each saves), to spot a plan seen before."""
    return tuple(dataclasses.astuple(r) for r in plan.regions)


def _compiled_peak(compiled: Any, model: nn.Module, example_inputs: Any,
                   loss_fn: Callable[[Any], torch.Tensor] | None) -> int:
    """The peak of one compiled step after a first (compiling) one; the model's gradients,
    buffers and RNG state put back."""
    from memfit.measuring.twins import repeatable
    from memfit.profiling.measure import measure
    from memfit.step.harness import Step

    grads = [(p, p.grad) for p in model.parameters()]
    try:
        run = repeatable(Step.of(compiled, example_inputs, loss_fn=loss_fn).with_input_copies(),
                         seed=None)
        run()  # compiles
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        return int(measure(run, device=device, meter="allocator" if device.type == "cpu" else "both",
                           repeats=1).peak_bytes)
    except Exception as e:
        raise MemfitError(f"memfit.compile: the compiled step failed ({type(e).__name__}: {e}); "
                          "memfit.fit with Search(compiled=True) and your own torch.compile "
                          "call give the plan without the measured rounds") from e
    finally:
        for p, g in grads:
            p.grad = g
