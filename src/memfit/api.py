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
from memfit.planning.plan import Plan
from memfit.planning.solvers import SolverName
from memfit.profiling.profile import Profile
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
    solver: SolverName = "auto",
    step: Callable[[], torch.Tensor] | Step | None = None,
    tune: bool = False,
    tune_time_limit_s: float | None = None,
    src: int = 0,
    group: Any = None,
    target: str | None = None,
    on_new_shape: str | None = None,
    shapes: Sequence[Any] | None = None,
    monitor_every: int | None = None,
    in_flight: int | None = None,
    kept_bytes: int = 0,
    compress: str | None = None,
    lossy_codec: str = "bf16",
    **old_job_keywords: Any,
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
            ``model.memfit_plan.memory``. The keywords it replaces (``device_memory=``,
            ``optimizer=``, ...) still work for one release, with a ``DeprecationWarning``
            (NOTE [the old job keywords] in ``memfit.job.device_memory``).
        budget: the cap on peak activation memory: ``int`` bytes, a ``float`` fraction of the
            un-checkpointed peak (``0.6``), a string (``"6GiB"``, ``"60%"``), or ``"min"``:
            the smallest peak any plan reaches. A ``Job`` here is taken as ``job``; given
            both, the smaller cap holds.
        loss_fn: output -> scalar loss; default ``output.loss`` if present, else the sum of the
            floating outputs.
        solver: ``"auto"`` (default), ``"chain"``, ``"milp"``, ``"greedy"``, or a baseline
            (``"every_block"``, ``"sqrt"``, ``"save_matmuls"``, ``"none"``).
        step: instead of ``example_inputs``: a callable taking no arguments that runs the
            forward and returns the scalar loss (``lambda: module.training_step(batch, 0)``),
            or a ``memfit.step.harness.Step`` of ``model``. It is profiled in place of
            ``loss_fn(model(*example_inputs))``; it must call ``model`` (or its submodules) the
            way training will, and is run several times with the model's grads, buffers and
            RNG state put back after each run.
        tune: time the solver's best few plans and the baseline plans that fit on the model
            itself and apply the fastest measured (``memfit.measuring.tuning.tune``); the medians are on
            ``model.memfit_plan.tuning``. Default False: the solver's plan, untimed.
        tune_time_limit_s: seconds of stepping tuning may spend (default: 10 profiled plain
            steps).
        src: in a distributed job, the global rank whose profile is planned (default 0);
            every rank profiles, then gets that rank's plan (NOTE [one plan per job] in
            ``memfit.parallel.distributed``): every rank of ``group`` must call ``fit``.
        group: the ``torch.distributed`` process group to plan for (default the whole job).
        target: for a model on the meta device (profiled in fake mode), the device preset it
            is planned for (``"a100"``, ``"h100"``, ``"h200"``): its kernels (NOTE [CUDA
            kernels in fake mode]) and cost model; default ``"cpu"``. Refused for a model
            with weights, which is profiled where it is.
        on_new_shape: what a training call on inputs of another shape or dtype than the
            plan's does (NOTE [inputs other than the profiled ones] in
            ``memfit.runtime.shapes``): ``"replan"`` profiles that step once, plans it for the
            same budget in bytes and keeps the plan for later calls of that signature (NOTE
            [re-planning inside a training call] in ``memfit.job.shape_plans``); ``"warn"`` warns
            once per new signature and keeps the plan; ``"raise"`` raises
            ``memfit.NewInputShape``. Default None: ``"replan"`` for ``example_inputs``
            (exact, and once per shape), ``"warn"`` for a callable ``step`` or in a
            distributed job, where a re-plan cannot run.
        shapes: the shapes training will use, planned now (NOTE [shape ranges] in
            ``memfit.job.shape_plans``): each a size of the single input tensor (``(8, 128)``,
            sliced or tiled from ``example_inputs``) or full example inputs. Every one is
            profiled (and the midpoint of two given sizes); every shape in their range runs
            a plan whose predicted peak fits the budget at the range's ends, or ``fit``
            raises ``InfeasibleBudget``.
        monitor_every: monitor one training call in N (the first, then every N-th): its
            measured peak, the plan's prediction and budget, and its seconds are appended to
            ``model.memfit_monitor`` (``memfit.runtime.monitor.MonitorRecord``); a peak over
            the budget or more than 10% from the prediction warns (NOTE [monitoring a
            training run] in ``memfit.runtime.monitor``). On CPU a monitored step runs under
            the profiler (+24% of a zoo GPT's step): N >= 25 keeps it within 1%. Default None.
        in_flight, kept_bytes: for a pipeline stage: the micro-batches whose activations it
            holds at once (``memfit.parallel.pipeline.in_flight``) and the bytes its schedule keeps
            besides (``memfit.parallel.pipeline.kept_by_sends``; default 0); ``example_inputs`` are one
            micro-batch's, ``budget`` caps the stage's peak over the schedule step (NOTE [pipeline
            stage memory model] in ``memfit.planning.stages``). Each rank plans its own stage.
        compress: also keep saved tensors outside the regions packed (NOTE [compress or
            recompute] in ``memfit.planning.compress_pass``): ``"lossless"`` (exact codecs
            only; the step stays bitwise plain), ``"lossy"`` (also bf16: gradients change;
            NOTE [what lossy means]); default None: no compression.
        lossy_codec: with ``compress="lossy"``, the codec of the other fp32 activations:
            ``"bf16"`` (default, 2 bytes), ``"fp8_e4m3"`` or ``"int8_blockwise"`` (about 1 byte).

    Returns:
        ``model`` itself, planned; the ``Plan`` is on ``model.memfit_plan`` (print it for the
        predicted peak and cost). ``memfit.unapply(model)`` removes it.

    Raises:
        memfit.InfeasibleBudget: no plan fits; ``min_feasible_bytes`` is the smallest peak. Also
            when a baseline ``solver``'s fixed plan peaks above the budget (its peak is then
            ``min_feasible_bytes``): nothing is applied.
        ValueError: Hugging Face's own checkpointing is on, or the inputs pass a KV cache
            (NOTE [Hugging Face models in fit]); a ``step`` on a model on the meta device;
            ``tune=True`` on a model on the meta device (tuning times real steps); a baseline
            ``solver`` that finds no blocks to checkpoint
            (``memfit.planning.solvers.baselines.NoBlocks``).
        TypeError: both or neither of ``example_inputs`` and ``step`` are given, or ``step``
            with ``loss_fn``, or a ``Step`` of another model; a ``Job`` and the old job
            keywords together.

    Example:
        >>> model = memfit.zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=128)
        >>> x = torch.randint(0, 512, (8, 128))
        >>> model = memfit.fit(model, x, budget="60%")   # doctest: +SKIP
        >>> print(model.memfit_plan)                     # doctest: +SKIP
    """
    from memfit.job.device_memory import resolve_job
    from memfit.job.shape_plans import PlanForShape, resolve_on_new_shape
    from memfit.measuring.calibration import profile
    from memfit.parallel.distributed import is_distributed, plan_once, warm_up_fsdp
    from memfit.planning.planner import plan_for_budget, refuse_over_budget
    from memfit.planning.stages import plan_stage
    from memfit.runtime.apply import unapply
    from memfit.runtime.marks import applied_plan

    if not isinstance(model, nn.Module):
        raise TypeError(f"fit expects an nn.Module, got {type(model).__name__}")
    budget, job = resolve_job("fit", job, old_job_keywords, budget)
    the_step = _the_step(model, example_inputs, loss_fn, step)
    refuse_fit_arguments(model, monitor_every=monitor_every, shapes=shapes, tune=tune, step=step,
                         in_flight=in_flight, target=target, compress=compress, budget=budget,
                         lossy_codec=lossy_codec, job=job, on_meta=_on_meta(model))
    new_shape = resolve_on_new_shape(on_new_shape, callable_step=step is not None,
                                     distributed=is_distributed() or in_flight is not None)
    family = family_of(model, the_step.kwargs)  # NOTE [model families] in memfit.step.families
    family.refuse_carried_state(model, the_step.kwargs)
    cache_off_for_training = family.cache_off_for_training
    previous = [(path, m, old_plan, _guard_settings(m)) for path, m in model.named_modules()
                if (old_plan := applied_plan(m)) is not None]
    for path, m, _, _ in previous:  # NOTE [re-fitting]
        if m is not model:
            log.warning("memfit: removing the plan on %s (%s, planned before it was wrapped?) "
                        "to re-plan the whole %s", path, type(m).__name__, type(model).__name__)
        unapply(m)
    try:
        with cache_off_for_training(model):
            mode = "fake" if _on_meta(model) else "measure"
            if mode == "measure":
                warm_up_fsdp(the_step)  # NOTE [FSDP's first step] in memfit.parallel.distributed
            prof = profile(the_step, mode=mode, target=target or "cpu")
            if tune:
                from memfit.measuring.tuning import tune as measure_plans

                assert budget is not None  # refused above
                new_plan = measure_plans(the_step, prof, budget, solver=solver,
                                         time_limit_s=tune_time_limit_s)
            else:
                spec = None if job is None else job.spec(prof)
                if in_flight is not None and (job is not None or budget is None):
                    raise TypeError("fit(in_flight=...) needs budget=, without a job")
                if job is None and budget is None:
                    raise TypeError("fit needs budget= (a cap on the activation peak) or a job "
                                    "(memfit.Job(device='80GiB', ...): the device the whole job "
                                    "must fit)")
                def solve(b: Any) -> Plan:
                    return plan_for_budget(prof, budget=b, solver=solver, job=spec)

                def first_plan() -> Plan:
                    if compress is None:
                        return solve(budget)
                    from memfit.measuring.codec_cost import codec_costs_for
                    from memfit.planning.compress_pass import choose
                    return choose(prof, solve, budget, mode=compress, lossy_codec=lossy_codec,
                                  costs=codec_costs_for(compress, lossy_codec))

                try:
                    if in_flight is not None:  # a stage's own plan: no one plan per job
                        new_plan = plan_stage(prof, budget=budget or 0, in_flight=in_flight,
                                              solver=solver, extra_bytes=kept_bytes)
                    else:
                        new_plan = plan_once(first_plan, src=src, group=group)  # NOTE [one plan per job]
                except InfeasibleBudget as e:
                    if job is None or is_distributed() or step is not None:
                        raise
                    from memfit.job.capacity import batch_of, sliced_maker, with_largest_batch

                    raise with_largest_batch(
                        e, sliced_maker(model, example_inputs), batch_of(example_inputs),
                        job, loss_fn=loss_fn, solver=solver, target=target) from None
        refuse_over_budget(new_plan)  # a baseline's fixed plan may not fit
        # another shape's plan: the same budget in bytes (or device), NOTE [a fitted model pickles]
        plan_profile = PlanForShape(
            None if budget is None else "min" if budget == "min" else new_plan.budget_bytes,
            solver, job)

        shaped: dict[str, Any] = {}
        if shapes is not None:
            with cache_off_for_training(model):
                new_plan, shaped = _plan_shapes(the_step, example_inputs, shapes, prof, new_plan,
                                                plan_profile, mode=mode, target=target or "cpu")
    except BaseException:
        for _, m, old, settings in previous:
            apply(m, old, check_ranks=False, **settings)
        raise
    replan = None
    if new_shape.value == "replan":
        from memfit.job.shape_plans import Replanner

        replan = Replanner(the_step, prof, plan_profile, mode=mode, target=target or "cpu",
                           around=cache_off_for_training)
    # in a distributed job, checks that every rank holds new_plan
    apply(model, new_plan, on_new_shape=new_shape.value, replan=replan, check_ranks=in_flight is None,
          plans=shaped.get("plans"), ranges=shaped.get("ranges", ()))
    if monitor_every is not None:
        from memfit.runtime.monitor import install_monitor

        install_monitor(model, monitor_every)
    log.info("%s", new_plan)
    return model


def _plan_shapes(step: Step, example_inputs: Any, shapes: Sequence[Any], first: Profile,
                 first_plan: Plan, plan_profile: Callable[[Profile], Plan], *, mode: str,
                 target: str) -> tuple[Plan, dict[str, Any]]:
    """``fit(shapes=...)``: profile every shape (the fit's own calibration reused) and plan the
    range (NOTE [shape ranges] in ``memfit.job.shape_plans``); the plan to apply first and the
    guard's ``plans`` and ``ranges``."""
    from memfit.job.shape_plans import inputs_of_shape, plan_range
    from memfit.measuring.calibration import profile
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
        p = profile(s, mode=mode, target=target, calibrate_time=False)
        if first.calibration is not None:
            p = dataclasses.replace(p, calibration=first.calibration)
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
         solver: SolverName = "auto", **options: Any) -> Plan:
    """The fastest plan for ``budget`` (``memfit.planning.planner.plan_for_budget``), or for a device the
    whole job must fit: ``job``, a ``memfit.Job``, as in ``fit``.

    ``options`` go to the planner (``time_limit_s``, ``offload``, ``host_budget``,
    ``target``); the old job keywords are deprecated (NOTE [the old job keywords] in
    ``memfit.job.device_memory``). ``memfit.plan(profile, memfit.Job(device="80GiB",
    optimizer="adamw"))``.

    Raises:
        InfeasibleBudget: nothing fits; with a job, its ``memory`` is the breakdown with the
            smallest plan and ``fits_with`` what would fit.
    """
    from memfit.job.device_memory import OLD_KEYWORDS, resolve_job, with_state_dtype_hint
    from memfit.planning.planner import plan_for_budget

    old = {k: options.pop(k) for k in list(options) if k in OLD_KEYWORDS}
    budget, job = resolve_job("plan", job, old, budget)
    spec = None if job is None else job.spec(profile)
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
