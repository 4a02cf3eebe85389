"""``fit``: profile, plan and apply in one call; ``apply``: the runtime's, a collective in a
distributed job. The one place that composes the stages (and the integrations they need).

NOTE [re-fitting]
    A model that already carries a plan is un-planned first, so the new profile describes the
    plain model (a profile of a checkpointed model would count its recomputation as forward
    work and its dropped activations as never saved). If planning fails (an infeasible budget),
    the old plan is put back and the model is left as it was.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from memfit.errors import InfeasibleBudget
from memfit.job.fit_checks import refuse_fit_arguments
from memfit.job.fit_options import OLD_FIT_KEYWORDS, Parallel, Search, Training
from memfit.planning.plan import Plan
from memfit.planning.solvers import SolverName
from memfit.profiling.profile import Profile, without_tails
from memfit.runtime.divergence import CheckArg
from memfit.step.families import family_of
from memfit.step.harness import Step

if TYPE_CHECKING:
    from memfit.job.device_memory import Job

__all__ = ["fit", "plan", "apply"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)


def fit(
    model: M,
    example_inputs: Any = None,
    job: Job | None = None,
    *,
    budget: int | float | str | Job | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    step: Callable[[], torch.Tensor] | Step | None = None,
    search: Search | None = None,
    training: Training | None = None,
    parallel: Parallel | None = None,
    **old_keywords: Any,
) -> M:
    """Make ``model``'s training step fit ``budget``: profile one step, plan, apply the plan.

    Args:
        model: the model to plan, changed in place (the same object is returned).
        example_inputs: inputs of one step: a tensor, a tuple of positional arguments or a dict
            of keyword arguments, of the shapes training will use.
        job: instead of (or with) ``budget``: the device the whole job must fit, a
            ``memfit.Job`` (``memfit.Job(device="80GiB", optimizer="adamw")``): weights,
            gradients, optimizer states, the optimizer step, activations and a reserve (NOTE
            [the job's memory] in ``memfit.planning.job``); the breakdown is
            ``model.memfit_plan.memory``.
        budget: the cap on peak activation memory: ``int`` bytes, a ``float`` fraction of the
            un-checkpointed peak (``0.6``), a string (``"6GiB"``, ``"60%"``), or ``"min"``:
            the smallest peak any plan reaches. A ``Job`` here is taken as ``job``; given
            both, the smaller cap holds.
        loss_fn: output -> scalar loss; default ``output.loss`` if present, else the sum of the
            floating outputs.
        step: instead of ``example_inputs``: a callable taking no arguments that runs the
            forward and returns the scalar loss (``lambda: module.training_step(batch, 0)``),
            or a ``memfit.step.Step`` of ``model``, run several times with the model's grads,
            buffers and RNG state put back after each run.
        search: how to search (``memfit.Search``: solver, tune, compress, the target preset of
            a model on the meta device); default ``memfit.Search()``.
        training: what the planned model does while it trains (``memfit.Training``: on a new
            input shape, the shapes planned now, the monitor); default ``memfit.Training()``.
        parallel: how the job is split over processes (``memfit.Parallel``: the planning rank
            and group, a pipeline stage's in-flight micro-batches); default
            ``memfit.Parallel()``.
        **old_keywords: the keywords these values replace (``solver=``, ``tune=``,
            ``shapes=``, ``device_memory=``...) still work for one release, each with a
            ``DeprecationWarning`` naming the new spelling (NOTE [fit's option families] in
            ``memfit.job.fit_options``, NOTE [the old job keywords] in
            ``memfit.job.device_memory``).

    Returns:
        ``model`` itself, planned; the ``Plan`` is on ``model.memfit_plan`` (print it for the
        predicted peak and cost). ``memfit.unapply(model)`` removes it.

    Raises:
        memfit.InfeasibleBudget: no plan fits; ``min_feasible_bytes`` is the smallest peak. Also
            when a baseline solver's fixed plan peaks above the budget: nothing is applied.
        ValueError: Hugging Face's own checkpointing is on, or the inputs pass a KV cache
            (NOTE [model families] in ``memfit.step.families``); an option the model or job
            cannot honour (``memfit.job.fit_checks``), with what to do instead.
        TypeError: both or neither of ``example_inputs`` and ``step``, or ``step`` with
            ``loss_fn``; an option value of the wrong type; an old keyword beside its new value.

    Example:
        >>> model = memfit.zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=128)
        >>> x = torch.randint(0, 512, (8, 128))
        >>> model = memfit.fit(model, x, budget="80%")   # doctest: +SKIP
        >>> print(model.memfit_plan)                     # doctest: +SKIP
    """
    from memfit.job.device_memory import OLD_KEYWORDS, resolve_job
    from memfit.job.fit_options import resolve_fit_options

    if not isinstance(model, nn.Module):
        raise TypeError(f"fit expects an nn.Module, got {type(model).__name__}")
    budget, job = resolve_job("fit", job, _pop(old_keywords, OLD_KEYWORDS), budget)
    search, training, parallel = resolve_fit_options(search, training, parallel,
                                                     _pop(old_keywords, OLD_FIT_KEYWORDS, all_=True))
    return fit_with_profile(model, example_inputs, job, budget=budget, loss_fn=loss_fn, step=step,
                            search=search, training=training, parallel=parallel)[0]


def fit_with_profile(model: M, example_inputs: Any, job: Job | None, *, budget: Any, loss_fn: Any,
                     step: Any, search: Search, training: Training, parallel: Parallel,
                     profile: Profile | None = None) -> tuple[M, Profile]:
    """``fit`` with its options resolved, returning the profile it planned too; with
    ``profile`` (of this model's step, from an earlier call), that one is planned instead of a
    new one (``memfit.compile``'s rounds: NOTE [budgets measured under compilation])."""
    from memfit.job.shape_plans import PlanForShape
    from memfit.planning.planner import refuse_over_budget

    the_step = _the_step(model, example_inputs, loss_fn, step)
    refuse_fit_arguments(model, budget, job, search, training, parallel,
                         stepped=step is not None, on_meta=_on_meta(model))
    family = family_of(model, the_step.kwargs)  # NOTE [model families] in memfit.step.families
    family.refuse_carried_state(model, the_step.kwargs)
    previous = _unapply_previous(model)  # NOTE [re-fitting]
    try:
        with family.cache_off_for_training(model):
            prof = _profile(the_step, search) if profile is None else profile
            new_plan = _plan(prof, the_step, example_inputs, budget, job, search, parallel)
        refuse_over_budget(new_plan)  # a baseline's fixed plan may not fit
        # another shape's plan: the same budget in bytes (or device), NOTE [a fitted model pickles]
        for_shape = PlanForShape(
            None if budget is None else "min" if budget == "min" else new_plan.budget_bytes,
            search.solver, job)
        shaped: dict[str, Any] = {}
        if training.shapes is not None:
            with family.cache_off_for_training(model):
                new_plan, shaped = _plan_shapes(the_step, example_inputs, training.shapes, prof,
                                                new_plan, for_shape, mode=prof.mode,
                                                target=search.target or "cpu")
    except BaseException:
        for _, m, old, settings in previous:
            apply(m, old, check_ranks=False, **settings)
        raise
    _apply_fitted(model, new_plan, the_step, prof, for_shape, shaped, family, search, training,
                  parallel, stepped=step is not None)
    log.info("%s", new_plan)
    return model, prof


def _pop(keywords: dict[str, Any], known: Any, *, all_: bool = False) -> dict[str, Any]:
    """The entries of ``keywords`` named in ``known``, removed from it; with ``all_``, any name
    left that ``known`` does not hold is a ``TypeError``, as Python's own."""
    taken = {k: keywords.pop(k) for k in list(keywords) if k in known}
    if all_ and keywords:
        raise TypeError(f"fit() got an unexpected keyword argument {next(iter(keywords))!r}")
    return taken


def _unapply_previous(model: nn.Module) -> list[tuple[str, nn.Module, Plan, dict[str, Any]]]:
    """NOTE [re-fitting]: the plans ``model`` and its modules carry, removed (``fit`` puts them
    back if it fails), to re-plan the whole model."""
    from memfit.runtime.apply import unapply
    from memfit.runtime.marks import applied_plan

    previous = [(path, m, old_plan, _guard_settings(m)) for path, m in model.named_modules()
                if (old_plan := applied_plan(m)) is not None]
    for path, m, _, _ in previous:
        if m is not model:
            log.warning("memfit: removing the plan on %s (%s, planned before it was wrapped?) "
                        "to re-plan the whole %s", path, type(m).__name__, type(model).__name__)
        unapply(m)
    return previous


def _profile(the_step: Step, search: Search) -> Profile:
    """The profile ``fit`` plans: fake mode for a model on the meta device, else measured."""
    from memfit.measuring.calibration import profile
    from memfit.parallel.distributed import warm_up_fsdp

    mode = "fake" if _on_meta(the_step.model) else "measure"
    if mode == "measure":
        warm_up_fsdp(the_step)  # NOTE [FSDP's first step] in memfit.parallel.distributed
    if not search.compiled:
        prof = profile(the_step, mode=mode, target=search.target or "cpu")
        return prof if search.tails else without_tails(prof)
    from memfit.profiling.compiled_costs import for_compiler

    # NOTE [compiled costs]: not fitted to timed eager steps
    return for_compiler(profile(the_step, mode=mode, target=search.target or "cpu", calibrate_time=False))


def _plan(prof: Profile, the_step: Step, example_inputs: Any, budget: Any, job: Job | None,
          search: Search, parallel: Parallel) -> Plan:
    """``fit``'s plan of ``prof``: tuned, a pipeline stage's own, or one plan per job."""
    from memfit.parallel.distributed import is_distributed, plan_once
    from memfit.planning.planner import plan_for_budget
    from memfit.planning.stages import plan_stage

    if search.tune:
        from memfit.measuring.tuning import tune

        return tune(the_step, prof, budget, solver=search.solver,
                    time_limit_s=search.tune_time_limit_s)
    spec = None if job is None else job.spec(prof)

    def solve(b: Any) -> Plan:
        return plan_for_budget(prof, budget=b, solver=search.solver, job=spec)

    def first_plan() -> Plan:
        if search.compress is None:
            return solve(budget)
        from memfit.measuring.codec_cost import codec_costs_for
        from memfit.planning.compress_pass import choose

        def solve_on(p: Profile, b: int) -> Plan:  # NOTE [variants planned with the regions]
            return plan_for_budget(p, budget=b, solver=search.solver, job=None if job is None else job.spec(p))

        return choose(prof, solve, budget, mode=search.compress, lossy_codec=search.lossy_codec,
                      costs=codec_costs_for(search.compress, search.lossy_codec, prof), solve_on=solve_on)

    try:
        if parallel.in_flight is not None:  # a stage's own plan: no one plan per job
            return plan_stage(prof, budget=budget or 0, in_flight=parallel.in_flight,
                              solver=search.solver, extra_bytes=parallel.kept_bytes)
        return plan_once(first_plan, src=parallel.src, group=parallel.group)  # NOTE [one plan per job]
    except InfeasibleBudget as e:
        if job is None or is_distributed() or example_inputs is None:
            raise
        from memfit.job.capacity import batch_of, sliced_maker, with_largest_batch

        raise with_largest_batch(
            e, sliced_maker(the_step.model, example_inputs), batch_of(example_inputs), job,
            loss_fn=the_step.loss_fn, solver=search.solver, target=search.target) from None


def _apply_fitted(model: nn.Module, new_plan: Plan, the_step: Step, prof: Profile,
                  for_shape: Any, shaped: dict[str, Any], family: Any, search: Search,
                  training: Training, parallel: Parallel, *, stepped: bool) -> None:
    """Apply ``fit``'s plan with its input guard (a re-planner for new shapes where it can),
    then the monitor; in a distributed job, checks that every rank holds ``new_plan``."""
    from memfit.job.shape_plans import resolve_on_new_shape
    from memfit.parallel.distributed import is_distributed

    new_shape = resolve_on_new_shape(training.on_new_shape, callable_step=stepped,
                                     distributed=is_distributed() or parallel.in_flight is not None)
    replan = None
    if new_shape.value == "replan":
        from memfit.job.shape_plans import Replanner

        replan = Replanner(the_step, prof, for_shape, mode=prof.mode, target=search.target or "cpu",
                           around=family.cache_off_for_training)
    apply(model, new_plan, on_new_shape=new_shape.value, replan=replan,
          check_ranks=parallel.in_flight is None, plans=shaped.get("plans"),
          ranges=shaped.get("ranges", ()))
    if training.monitor_every is not None:
        from memfit.runtime.monitor import install_monitor

        install_monitor(model, training.monitor_every)


def _plan_shapes(step: Step, example_inputs: Any, shapes: Sequence[Any], first: Profile,
                 first_plan: Plan, plan_profile: Callable[[Profile], Plan], *, mode: str,
                 target: str) -> tuple[Plan, dict[str, Any]]:
    """``fit(shapes=...)``: profile every shape (the fit's own calibration reused) and plan the
    range (NOTE [shape ranges] in ``memfit.job.shape_plans``); the plan to apply first and the
    guard's ``plans`` and ``ranges``."""
    from memfit.job.shape_plans import inputs_of_shape, plan_range
    from memfit.measuring.calibration import profile
    from memfit.profiling.compiled_costs import costs_like
    from memfit.runtime.shapes import signature_of

    if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Sequence) or not shapes:
        raise TypeError(f"shapes must be a non-empty list of sizes or example inputs, got "
                        f"{type(shapes).__name__}")
    given = list(shapes)
    if len(given) == 2 and all(isinstance(g, (tuple, list, torch.Size)) and g
                               and all(isinstance(d, int) for d in g) for g in given):
        given.append(tuple((a + b) // 2 for a, b in zip(given[0], given[1], strict=False)))
    profiles = [first]
    for g in given:
        s = step.with_inputs(*_normalized(inputs_of_shape(example_inputs, g))).with_input_copies()
        p = costs_like(profile(s, mode=mode, target=target, calibrate_time=False), first)
        if all(p.input_signature != q.input_signature for q in profiles):
            profiles.append(p)
    assert first_plan.budget_bytes is not None
    _, plans, ranges, checked = plan_range(profiles, plan_profile, first_plan.budget_bytes)
    applied = plans[signature_of(first.input_signature)]
    applied = dataclasses.replace(applied, extra={**applied.extra, "shapes": checked})
    plans[signature_of(first.input_signature)] = applied
    return applied, {"plans": plans, "ranges": ranges}


def _normalized(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    from memfit.step.inputs import normalize_inputs

    return normalize_inputs(inputs)


def _guard_settings(model: nn.Module) -> dict[str, Any]:
    """The input guard's keywords of the plan on ``model``, to put it back as it was."""
    from memfit.runtime.apply import input_guard

    guard = input_guard(model)
    return guard.settings() if guard is not None else {}


def _the_step(model: nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
              step: Callable[[], torch.Tensor] | Step | None) -> Step:
    """The step ``fit`` profiles: of ``example_inputs`` (and ``loss_fn``) or of ``step``."""
    if step is None:
        if example_inputs is None:
            raise TypeError(
                "fit needs example_inputs (a tensor, a tuple or a dict, of the shapes training "
                "uses) or step= (a function returning the loss), got neither")
        return Step.of(model, example_inputs, loss_fn=loss_fn)
    if example_inputs is not None:
        raise TypeError(
            f"fit got both example_inputs ({type(example_inputs).__name__}) and step= "
            f"({type(step).__name__}); give one: step= replaces the forward on example_inputs")
    if loss_fn is not None:
        raise TypeError("fit got step= and loss_fn=; a step returns the loss itself: fold the "
                        "loss into it and drop loss_fn")
    if _on_meta(model):
        raise ValueError(
            f"{type(model).__name__} is on the meta device, which fit profiles in fake mode on "
            "example_inputs; a step given as a callable runs real tensors: materialize the model "
            "or pass example_inputs")
    if isinstance(step, Step):
        if step.model is not model:
            raise TypeError(
                f"the Step given to fit is the step of another module ({step.name}), not of the "
                f"{type(model).__name__} to plan; make it with Step.of(model, ...)")
        return step
    if not callable(step):
        raise TypeError(f"step must be a function returning the loss or a Step, got "
                        f"{type(step).__name__}")
    return Step.of(model, call=step)


def _on_meta(model: nn.Module) -> bool:
    for p in model.parameters():
        return p.device.type == "meta"
    return False


def plan(profile: Profile, job: Job | None = None, *, budget: int | float | str | Job | None = None,
         solver: SolverName = "auto", time_limit_s: float = 10.0, offload: bool = False,
         host_budget: int | str | None = None, target: str | None = None,
         **old_job_keywords: Any) -> Plan:
    """The fastest plan for ``budget`` (``memfit.planning.planner.plan_for_budget``: its
    arguments), or for a device the whole job must fit: ``job``, a ``memfit.Job``, as in
    ``fit``. ``memfit.plan(profile, memfit.Job(device="80GiB", optimizer="adamw"))``.

    The old job keywords are deprecated (NOTE [the old job keywords] in
    ``memfit.job.device_memory``).

    Raises:
        InfeasibleBudget: nothing fits; with a job, its ``memory`` is the breakdown with the
            smallest plan and ``fits_with`` what would fit.
    """
    from memfit.job.device_memory import resolve_job, with_state_dtype_hint
    from memfit.planning.planner import plan_for_budget

    budget, job = resolve_job("plan", job, old_job_keywords, budget)
    spec = None if job is None else job.spec(profile)
    options: dict[str, Any] = {"time_limit_s": time_limit_s, "offload": offload, "host_budget": host_budget,
               "target": target}
    try:
        return plan_for_budget(profile, budget=budget, solver=solver, job=spec, **options)
    except InfeasibleBudget as e:
        raise with_state_dtype_hint(e, profile, job, spec, budget, solver, options) from None


def apply(model: M, plan: Plan, *, check: CheckArg = True, host_budget: int | str | None = None,
          check_ranks: bool = True, on_new_shape: str = "warn",
          replan: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Plan] | None = None,
          plans: dict[Any, Plan] | None = None, ranges: tuple[Any, ...] = ()) -> M:
    """Apply ``plan`` to ``model`` in place (``memfit.runtime.apply.apply_plan``; a plan applied
    before is removed first).

    In a distributed job (``torch.distributed`` initialised) ``apply`` is a collective: every
    rank must call it, and all raise ``PlansDiffer`` unless every rank holds the same plan
    (NOTE [one plan per job] in ``memfit.parallel.distributed``).

    Args:
        model, plan, check, host_budget, on_new_shape, replan, plans, ranges: as
            ``memfit.runtime.apply.apply_plan``.
        check_ranks: in a distributed job, gather every rank's plan digest and raise unless
            all agree (default True); False skips the collective, for ranks that train
            different models.

    Returns:
        ``model``, with ``model.memfit_plan`` set to ``plan``.

    Raises:
        As ``memfit.runtime.apply.apply_plan``; and ``PlansDiffer`` (distributed): the ranks hold
        different plans, or another rank's plan does not fit its model.

    Example:
        >>> memfit.apply(model, memfit.Plan.load("plan.json"))   # doctest: +SKIP
    """
    from memfit.parallel.distributed import rank_agreement
    from memfit.runtime.apply import apply_plan

    agree = rank_agreement() if check_ranks else None
    apply_plan(model, plan, check=check, host_budget=host_budget, agree=agree,
               on_new_shape=on_new_shape, replan=replan, plans=plans, ranges=ranges)
    return model
