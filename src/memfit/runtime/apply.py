"""``apply`` / ``unapply``: put a ``memfit.Plan`` into effect on a model, in place.

Each region with one module path wraps that module (``memfit.runtime.wrap``) with
``by_key(region.ops)``; a region with several consecutive sibling paths becomes a chain
segment (``memfit.runtime.segment``). The whole plan is checked against the model before
anything changes; a plan that does not fit raises ``PlanMismatch`` and leaves the model as
it was.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from memfit.errors import PlanMismatch, WrapError
from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.runtime import policies as _policies
from memfit.runtime.divergence import CheckArg, resolve_check
from memfit.runtime.fsdp import is_fsdp_unit_class
from memfit.runtime.hf_guard import install_guard, remove_guard
from memfit.runtime.marks import APPLIED_ATTR, applied_plan
from memfit.runtime.segment import SegmentHandle, checkpoint_segment
from memfit.runtime.shapes import InputGuard, OnNewShape, ShapeRange, Signature
from memfit.runtime.wrap import unwrap, wrap
from memfit.step.harness import model_device
from memfit.units import parse_bytes

__all__ = ["apply_plan", "unapply", "host_pool", "input_guard", "compressor"]


@dataclass
class _Applied:
    """What ``apply`` changed, kept as ``model._memfit_applied`` (``marks.APPLIED_ATTR``) so
    ``unapply`` can undo it; ``marks.applied_plan`` tells whether a plan is applied."""

    wrapped: list[str] = field(default_factory=list)
    segments: list[SegmentHandle] = field(default_factory=list)
    host: Any = None  # the HostPool of the plan's OFFLOAD decisions (None: none)
    guard: int | None = None  # id of the HF checkpointing guard (NOTE [checkpointed twice])
    inputs: Any = None  # the handle of the input guard (NOTE [inputs other than the profiled ones])
    input_guard: InputGuard | None = None  # the guard itself
    compressor: Any = None  # the plan's Compressor (memfit.runtime.compress), None: none
    compress_hooks: list[Any] = field(default_factory=list)  # its forward hook handles


def _split(path: str) -> tuple[str, str]:
    parent, _, child = path.rpartition(".")
    return parent, child


def _get(model: nn.Module, path: str, region: Region | None = None) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        where = f" (region {region.name})" if region is not None else ""
        raise PlanMismatch(
            f"the plan names module {path!r}{where}, which {type(model).__name__} does not "
            "have; the plan was made for another model (profile and plan this one again)"
        ) from None


def _class_names(cls: type) -> set[str]:
    """The names a plan may give a module of class ``cls``.

    NOTE [FSDP class names]
        ``fully_shard`` swaps a module's class for ``FSDP<Class>``, a subclass of
        ``FSDPModule`` and of ``<Class>``, so a plan made before sharding names ``<Class>``
        and one made after names ``FSDP<Class>``. Both describe the same module: either
        name matches either class.
    """
    names = {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}
    if is_fsdp_unit_class(cls):
        plain = next((c for c in cls.__mro__[1:] if not is_fsdp_unit_class(c)
                      and c.__name__ != "FSDPModule"), None)
        if plain is not None:
            names |= {plain.__name__, f"{plain.__module__}.{plain.__qualname__}"}
    else:
        names.add(f"FSDP{cls.__name__}")
    return names


def _check_shapes(model: nn.Module, plan: Plan) -> None:
    """Raise ``PlanMismatch`` if a parameter under the plan's regions has another shape than
    the profiled one (a model of another width: the plan's peak and decisions are not its)."""
    from memfit.profiling.model_state import local_part

    recorded = plan.extra.get("parameter_shapes", {}) if isinstance(plan.extra, dict) else {}
    if not recorded:
        return
    # a sharded parameter (FSDP2's DTensor) matches by its global or its local shape: a plan
    # made before sharding records the one, a plan made after it the other
    actual = {n: (list(p.shape), list(local_part(p).shape)) for n, p in model.named_parameters()}
    for name, shape in recorded.items():
        if name in actual and list(shape) not in actual[name]:
            raise PlanMismatch(
                f"the plan was made for a model whose parameter {name!r} has shape "
                f"{tuple(shape)}, but this {type(model).__name__}'s has {tuple(actual[name][1])}: its "
                "predicted peak and decisions are another model's; profile and plan this one again")


def _check(model: nn.Module, plan: Plan) -> list[tuple[Region, Any]]:
    """Validate the plan against the model; return, per region, its target."""
    types = plan.extra.get("module_types", {}) if isinstance(plan.extra, dict) else {}
    for path, expected in types.items():
        module = _get(model, path)
        if expected not in _class_names(type(module)):
            raise PlanMismatch(
                f"the plan expects module {path!r} to be a {expected}, but this model's is a "
                f"{type(module).__name__}; the plan was made for another model"
            )
    _check_shapes(model, plan)
    targets: list[tuple[Region, Any]] = []
    seen: dict[bool, set[str]] = {True: set(), False: set()}  # by region.is_segment
    for region in plan.regions:
        for path in region.modules:
            # a block of a segment may also be a region of its own, checkpointed inside the
            # segment (NOTE [nested segments] in memfit.planning.nesting)
            if path in seen[region.is_segment]:
                raise PlanMismatch(f"module {path!r} appears in two regions of the plan; "
                                   "a module can be checkpointed only once (or once on its own "
                                   "inside a segment)")
            seen[region.is_segment].add(path)
        if not region.is_segment:
            module = _get(model, region.modules[0], region)
            _refuse_fsdp_inside(region, [m for _, m in module.named_modules() if m is not module])
            targets.append((region, module))
            continue
        parents = {_split(p)[0] for p in region.modules}
        if len(parents) != 1:
            raise PlanMismatch(
                f"segment {region.name} spans modules of different parents {sorted(parents)}; "
                "a segment must be consecutive siblings"
            )
        parent_path = parents.pop()
        outer = plan.outer_of(region)
        if outer is not None:  # NOTE [segments nested in a block] in memfit.planning.nesting
            raise PlanMismatch(
                f"segment {region.name} is nested in region {outer.name}: the torch runtime runs a "
                "segment from its parent's calls and cannot replay one inside a checkpointed module "
                "(memfit.jax can); checkpoint the segment or the module, not both")
        parent = _get(model, parent_path, region)
        for path in region.modules:
            _get(model, path, region)
        children = [n for n, _ in parent.named_children()]
        names = [_split(p)[1] for p in region.modules]
        positions = [children.index(n) for n in names]
        if positions != list(range(positions[0], positions[0] + len(positions))):
            raise PlanMismatch(
                f"segment {region.name}: {names} are not consecutive children of "
                f"{parent_path or '<root>'} (their positions are {positions})"
            )
        _refuse_fsdp_inside(region, [m for n in names for m in parent.get_submodule(n).modules()])
        targets.append((region, (parent, names)))
    return targets


def _refuse_fsdp_inside(region: Region, inside: list[nn.Module]) -> None:
    """Raise ``PlanMismatch`` if an FSDP unit runs inside ``region`` (NOTE [collectives in a
    region] in ``memfit.planning.rules``): its hooks gather parameters in forward and skip
    the gather in backward, so the recomputation would diverge."""
    units = [type(m).__name__ for m in inside if is_fsdp_unit_class(type(m))]
    if units:
        raise PlanMismatch(
            f"region {region.name} would hold {len(units)} FSDP unit{'s' if len(units) != 1 else ''} "
            f"({units[0]}{', ...' if len(units) > 1 else ''}), whose parameter gathers cannot be "
            "recomputed; an FSDP unit may be a region itself, not inside one. Plan the sharded "
            "model (memfit.fit after fully_shard never proposes such a region)"
        )


def apply_plan(model: nn.Module, plan: Plan, *, check: CheckArg = True,
          host_budget: int | str | None = None,
          agree: Callable[[Plan, PlanMismatch | None], None] | None = None,
          on_new_shape: OnNewShape | str = OnNewShape.WARN,
          replan: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Plan] | None = None,
          plans: dict[Signature, Plan] | None = None,
          ranges: tuple[ShapeRange, ...] = ()) -> nn.Module:
    """Apply ``plan`` to ``model`` in place (unapplying a plan applied before).

    The public ``memfit.apply`` (``memfit.api.apply``) is this function made a collective in
    a distributed job (its ``agree``: NOTE [one plan per job] in ``memfit.parallel.distributed``); here
    nothing knows a process group.

    Args:
        model: the model the plan was made for.
        plan: a ``memfit.Plan``.
        check: compare each recomputation with its forward, op by op and value by value,
            and raise ``RecomputeMismatch`` at the first difference: True (default: each
            region's first 3 calls, then one in 100), "always", "ops" (no values, for
            nondeterministic GPU kernels), False, or a ``DivergenceCheck``
            (NOTE [check sampling] in ``memfit.runtime.divergence``).
        host_budget: the most host memory the outputs of the plan's OFFLOAD ops may hold,
            in bytes or as "64GiB" (default None: no cap). One pool of host buffers serves
            every region; a tensor that does not fit stays on the device (logged once).
            ``host_pool(model)`` returns the pool.
        agree: called once the plan is checked against the model and before anything
            changes, with this model's ``PlanMismatch`` (re-raised after it returns) or None;
            it raises to refuse the plan (``memfit.parallel.distributed.rank_agreement``: every rank
            must hold the same plan). Default None: no one else to agree with.
        on_new_shape: what a call on inputs without a plan does (NOTE [inputs other than the
            profiled ones] in ``memfit.runtime.shapes``): ``"warn"`` (default: once per new
            signature), ``"raise"`` (``NewInputShape``), or ``"replan"`` (with ``replan``).
        replan: ``(model, args, kwargs) -> Plan`` for a call on a new signature (``fit``
            gives it).
        plans, ranges: plans made ahead for other signatures, and ranges of signatures with
            their plans (``fit(shapes=...)``); a call on one switches to its plan.

    Returns:
        ``model``, with ``model.memfit_plan`` set to ``plan`` (to the plan in effect, after a
        call on other inputs switched plans). A plan that records the inputs it was profiled
        on (``Plan.input_signature``) guards the model's calls on others
        (``input_guard(model)``).

    Raises:
        PlanMismatch: a module path the model lacks, a segment whose modules are not
            consecutive siblings, a module whose class differs from the plan's
            ``extra["module_types"]``, or a region holding an FSDP unit (a segment over
            ``fully_shard`` blocks, a module holding one).
        WrapError: a planned module is already checkpointed by hand (``wrap``, segment).
            Also raised later, at a training forward, if Hugging Face checkpointing is switched
            on over the plan (NOTE [checkpointed twice] in ``memfit.runtime.hf_guard``).
        Whatever ``agree`` raises (``PlansDiffer``: the ranks hold different plans, or
            another rank's plan does not fit its model).

    Warns:
        UserWarning: a plan that offloads to host memory applied to a model on the CPU
            (NOTE [offload on a CPU model]).

    Example:
        >>> plan = memfit.plan(memfit.profile(model, x), budget="60%")   # doctest: +SKIP
        >>> apply(model, plan); loss = model(x).sum()     # doctest: +SKIP
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"apply expects a memfit.Plan, got {type(plan).__name__}")
    if applied_plan(model) is not None:
        unapply(model)
    resolve_check(check)  # a bad check= raises before anything is wrapped
    cap = parse_bytes(host_budget) if isinstance(host_budget, str) else host_budget
    if cap is not None and (not isinstance(cap, int) or cap < 0):
        raise ValueError(f"host_budget must be bytes (an int >= 0) or a string like '64GiB', "
                         f"got {host_budget!r}")
    if agree is None:
        targets = _check(model, plan)
    else:
        try:
            targets = _check(model, plan)
        except PlanMismatch as e:  # the other ranks must hear of it, not wait for this one
            agree(plan, e)  # PlansDiffer unless every rank failed too
            raise
        agree(plan, None)
    guard = None
    if plan.input_signature:  # NOTE [inputs other than the profiled ones] in memfit.runtime.shapes
        guard = InputGuard(model, plan, on_new=on_new_shape, replan=replan, plans=plans,
                           ranges=ranges, switch=functools.partial(_switch, check=check, cap=cap))
    elif on_new_shape == OnNewShape.REPLAN or plans or ranges:
        raise ValueError("the plan records no input signature (made before the field): it "
                         "cannot be re-planned or switched per input shape; plan it again")
    applied = _Applied()
    _wrap_regions(model, plan, targets, applied, check, cap)
    _compress(model, plan, applied)
    applied.guard = install_guard(model)  # NOTE [checkpointed twice] in memfit.runtime.hf_guard
    if applied.host is not None:
        _say_offload_on_cpu(model, plan)
    if guard is not None:
        # first, so that the model's other pre-hooks (the monitor's) see the plan in effect
        applied.inputs = model.register_forward_pre_hook(guard, with_kwargs=True, prepend=True)
        applied.input_guard = guard
    model.__dict__[APPLIED_ATTR] = applied
    model.memfit_plan = plan  # type: ignore[assignment]
    return model


def _wrap_regions(model: nn.Module, plan: Plan, targets: list[tuple[Region, Any]],
                  applied: _Applied, check: CheckArg, cap: int | None) -> None:
    """Checkpoint every region of ``plan`` (recorded in ``applied``); on a failure, undo what
    was wrapped and re-raise."""
    if applied.host is None and any(p is OpPolicy.OFFLOAD for region in plan.regions
                                    for _, p in region.ops):
        from memfit.runtime.offload import HostPool

        applied.host = HostPool(cap)
    try:
        # segments first: a block of one may be wrapped inside it (NOTE [nested segments])
        for region, target in sorted(targets, key=lambda t: not t[0].is_segment):
            policy = _policies.by_key(region.ops, host=applied.host) if region.ops else None
            if isinstance(target, nn.Module):
                wrap(target, policy, check=check, name=region.modules[0] or "<root>",
                     watch_buffers=region.writes_buffers,
                     tail_after=None if region.tail_after is None else model.get_submodule(region.tail_after))
                applied.wrapped.append(region.modules[0])
            else:
                parent, names = target
                applied.segments.append(
                    checkpoint_segment(parent, names, policy, check=check, name=region.name,
                                       watch_buffers=region.writes_buffers)
                )
    except (WrapError, ValueError):
        _undo_regions(model, applied)
        raise


def _switch(model: nn.Module, plan: Plan, *, check: CheckArg, cap: int | None) -> None:
    """Put ``plan`` (another input signature's) into effect on ``model`` in place of the plan
    in effect: its regions unwrapped, the new ones wrapped; the guards stay (NOTE [inputs
    other than the profiled ones] in ``memfit.runtime.shapes``)."""
    applied = model.__dict__[APPLIED_ATTR]
    targets = _check(model, plan)
    old: Plan = model.__dict__["memfit_plan"]
    _undo_regions(model, applied)
    try:
        _wrap_regions(model, plan, targets, applied, check, cap)
    except (WrapError, ValueError):
        _wrap_regions(model, old, _check(model, old), applied, check, cap)
        raise
    _compress(model, plan, applied)
    model.memfit_plan = plan  # type: ignore[assignment]


def _compress(model: nn.Module, plan: Plan, applied: _Applied) -> None:
    """Compress the saved tensors ``plan.compressed`` names while the model's forward runs
    (NOTE [compression through saved-tensor hooks] in ``memfit.runtime.compress``)."""
    for handle in applied.compress_hooks:
        handle.remove()
    applied.compress_hooks.clear()
    applied.compressor = None
    if not plan.compressed:
        return
    from memfit.runtime.compress import Compressor

    comp = applied.compressor = Compressor((c.module, c.key, c.codec, c.output, c.call)
                                                  for c in plan.compressed)
    applied.compress_hooks = comp.install(model)


def compressor(model: nn.Module) -> Any:
    """The ``memfit.runtime.compress.Compressor`` of the plan applied to ``model`` (its
    ``raw_bytes`` / ``packed_bytes`` so far); None: the plan compresses nothing, or no plan.

    Example:
        >>> compressor(torch.nn.Linear(2, 2)) is None   # doctest: +SKIP
        True
    """
    applied = model.__dict__.get(APPLIED_ATTR)
    return None if applied is None else applied.compressor


def input_guard(model: nn.Module) -> InputGuard | None:
    """The input guard of the plan applied to ``model`` (NOTE [inputs other than the profiled
    ones] in ``memfit.runtime.shapes``): its ``plans`` per signature, ``replans``, ``warned``.
    None: no plan is applied, or its plan records no input signature.

    Example:
        >>> input_guard(torch.nn.Linear(2, 2)) is None   # doctest: +SKIP
        True
    """
    applied = model.__dict__.get(APPLIED_ATTR)
    return None if applied is None else applied.input_guard


def _say_offload_on_cpu(model: nn.Module, plan: Plan) -> None:
    """Warn that a plan offloading to host memory is applied to a CPU model: one warning per
    ``apply`` (Python's default filter then shows it once per call site).

    NOTE [offload on a CPU model] An OFFLOAD decision copies an activation to host memory over
    the link of the device the plan was made for (``plan.extra["target"]``); on a CPU model the
    "device" is host memory already, so the copy frees nothing and costs a memcpy. The plan
    still runs correctly (tests exercise offload on CPU); the warning says it is useless here.
    """
    device = model_device(model)
    if device.type != "cpu":
        return
    target = plan.extra.get("target") if isinstance(plan.extra, dict) else None
    n = sum(1 for r in plan.regions for _, p in r.ops if p is OpPolicy.OFFLOAD)
    warnings.warn(
        f"memfit: the plan offloads {n} activation(s) to host memory over the host link of "
        f"{target or 'a GPU'} (planned with target={target!r}), but {type(model).__name__} is on "
        f"{device}: the activations are in host memory already, so offloading frees nothing and "
        "adds copies. Move the model to the device the plan is for, or plan for target='cpu' "
        "(offload is then a no-op)", UserWarning, stacklevel=3)


def _undo(model: nn.Module, applied: _Applied) -> None:
    remove_guard(model, applied.guard)
    if applied.inputs is not None:
        applied.inputs.remove()
    for handle in applied.compress_hooks:
        handle.remove()
    applied.compress_hooks.clear()
    _undo_regions(model, applied)


def _undo_regions(model: nn.Module, applied: _Applied) -> None:
    for path in applied.wrapped:
        unwrap(model.get_submodule(path))
    for handle in applied.segments:
        handle.remove()
    applied.wrapped.clear()
    applied.segments.clear()


def unapply(model: nn.Module) -> nn.Module:
    """Undo ``apply``: every planned module runs plainly again; ``model.memfit_plan`` is removed.

    Raises:
        PlanMismatch: no plan is applied to ``model``.

    Example:
        >>> unapply(model)   # doctest: +SKIP
    """
    applied = model.__dict__.pop(APPLIED_ATTR, None)
    if applied is None:
        raise PlanMismatch(f"no memfit plan is applied to this {type(model).__name__}")
    _undo(model, applied)
    model.__dict__.pop("memfit_plan", None)
    return model


def host_pool(model: nn.Module) -> Any:
    """The ``memfit.runtime.offload.HostPool`` of the plan applied to ``model`` (None: the plan
    offloads nothing, or no plan is applied).

    Example:
        >>> host_pool(torch.nn.Linear(2, 2)) is None   # doctest: +SKIP
        True
    """
    applied = model.__dict__.get(APPLIED_ATTR)
    return None if applied is None else applied.host
