"""DeepSpeed: ``initialize`` plans the model for a memory budget, then hands it to DeepSpeed.

``deepspeed`` is imported when ``initialize`` runs (this module imports without it); without
it installed, ``initialize`` raises an ``ImportError`` that says what to install.

NOTE [planning under a DeepSpeed engine]
    1. The plan is made and applied before ``deepspeed.initialize``, on the model as the user
       built it: the engine's ZeRO stages 1 and 2 hook every parameter's gradient and assert
       that each is reduced once per step, and profiling runs the backward several times
       (found on 0.19.8: "has already been reduced"); ZeRO-3 partitions the parameters at
       ``initialize``, after which the model's parameters are empty placeholders.
    2. The budget comes from the config's ``"memfit"`` block (``{"budget": 0.6}``,
       ``{"device_memory": "80GiB"}``, and the other ``memfit.fit`` keywords in ``_KEYS``) or
       from the keywords of ``initialize``; a keyword given both ways is refused. The block is
       taken out of a copy of the config before DeepSpeed reads it; the caller's dict is not
       changed.
    3. With ``device_memory`` the whole job is planned per rank (NOTE [the job's memory] in
       ``memfit.planning.job``), as the ``memfit.Job`` ``fit_arguments`` makes of the block's
       ``device_memory``, ``reserve`` and ``optimizer_state_dtype`` (the Job's ``device``,
       ``reserve`` and ``state_dtype``) with the ZeRO stage's sharding over the job's world size:
       stage 0 none, 1 ``"optimizer"``, 2 ``"gradients"``, 3 ``"full"``; the optimizer from
       the config's ``"optimizer"`` block (``Adam``, ``AdamW``, ``SGD``, or the ``optimizer=``
       instance passed to ``initialize``); with ``bf16`` or ``fp16`` enabled, fp32 master
       weights and fp32 optimizer states, as DeepSpeed keeps them.
    4. With ``bf16`` or ``fp16`` enabled DeepSpeed casts the model at ``initialize``; a plan of
       the fp32 model would count twice its activation bytes, so a model whose floating
       parameters are not already in that dtype is refused (cast it first: the cast is then a
       no-op for DeepSpeed).
    5. Under ZeRO-3 the engine gathers each module's parameters in its forward pre-hook
       (with a prefetch of the next modules'), gathers an external parameter when the
       forward reads it, and releases parameters in its forward hook, also when a
       checkpointed region runs again in backward. Whether a gather runs depends on the
       engine's state (a persistent parameter stays whole after its first gather; the
       pre-backward hook gathers before the recomputation), so the forward and its replay
       run different gathers. After ``deepspeed.initialize`` these functions are wrapped as
       engine work (NOTE [engine work in a region] in ``memfit.runtime.engine_work``): no
       dispatch mode sees their ops, neither the divergence check nor the selective
       caches; the ops that read the gathered parameters are checked.
    6. A model already partitioned (built under ``deepspeed.zero.Init``) is refused: its
       parameters hold no values to profile.
    7. ZeRO-3 replaces ``torch.nn.functional.linear`` by its own autograd function at
       ``initialize`` (``memory_efficient_linear``, on by default), which saves the input
       and the weight and runs ``matmul`` (+ ``add_`` for a bias) where torch's runs
       ``addmm``: other ops, other op keys, other saved bytes. So under ZeRO-3 the
       replacement is made before the model is profiled, as DeepSpeed makes it (and keeps
       it) at ``initialize``.
    8. The engine's own buffers during forward and backward (``engine_memory``: ZeRO-1/2's
       gradient bucket, ``reduce_bucket_size`` elements of the gradients' dtype, two with
       ``overlap_comm``, when ``contiguous_gradients`` is on, as by default; DeepSpeed's
       defaults where a key is absent) count in the plan: with ``device_memory`` as lines
       of ``plan.memory`` (NOTE [engine memory] in ``memfit.planning.job``); with
       ``budget`` the budget caps activations + buckets, so the activations get the budget
       less the buckets (a fraction is resolved on the profile, then the model is planned
       again for the bytes left), and a budget the buckets alone fill is an
       ``InfeasibleBudget`` naming them. ``model.memfit_engine`` holds the lines and the
       step's predicted peak: with ``budget``, the plan's timeline with the gradients moved
       into the engine's buffers as DeepSpeed moves them (NOTE [DeepSpeed's gradients in the
       timeline] in ``memfit.integrations.deepspeed_peak``; the plain model is traced once
       more for it), and the plan made again for less when that exceeds the budget (ZeRO-2's
       gradient partition, which the bound leaves out); with ``device_memory``, or where the
       timeline cannot be modelled (``overlap_comm``, no ``contiguous_gradients``, mixed
       gradient dtypes), the upper bound: activation peak + buffers.
    9. ZeRO-3's gathered parameters in flight: a parameter over
       ``stage3_param_persistence_threshold`` elements (DeepSpeed's default 1e5) is gathered
       whole in forward and, its reuse in backward being within ``stage3_max_reuse_distance``
       (default 1e9 elements), kept until then: the line ``stage3_max_live_parameters`` is
       their bytes, at most that many elements (default 1e9). One under the threshold stays
       whole and is counted with the weights.

Example:
    >>> from memfit.integrations import deepspeed as memfit_ds
    >>> config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2},
    ...           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    ...           "memfit": {"budget": 0.5}}
    >>> engine, optimizer, _, _ = memfit_ds.initialize(
    ...     model=model, config=config, example_inputs=(x, y),
    ...     model_parameters=model.parameters())                      # doctest: +SKIP
    >>> print(engine.module.memfit_plan)                               # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import memfit

__all__ = ["initialize", "fit_arguments", "engine_memory", "EngineMemory"]

# The memfit.fit keywords a config's "memfit" block may hold (NOTE [planning under a
# DeepSpeed engine], rule 2).
_KEYS = ("budget", "device_memory", "solver", "reserve", "tune", "tune_time_limit_s", "target",
         "optimizer_state_dtype", "compress", "on_new_shape", "monitor_every", "src")
_SHARDING = {0: "none", 1: "optimizer", 2: "gradients", 3: "full"}
_OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd"}


def _load_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A copy of ``config`` (a dict, or the path of DeepSpeed's JSON config)."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be DeepSpeed's config dict or the path of its JSON file, "
                        f"got {type(config).__name__}")
    return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in config.items()}


def _enabled(block: Any) -> bool:
    return isinstance(block, Mapping) and bool(block.get("enabled", False))


def _half_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    if _enabled(config.get("bf16")) or _enabled(config.get("bfloat16")):
        return torch.bfloat16
    if _enabled(config.get("fp16")):
        return torch.float16
    return None


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def fit_arguments(config: Mapping[str, Any], model: nn.Module, *,
                  optimizer: torch.optim.Optimizer | None = None,
                  **overrides: Any) -> dict[str, Any]:
    """The ``memfit.fit`` keywords for ``model`` under DeepSpeed ``config`` (NOTE [planning
    under a DeepSpeed engine], rules 2-4): the config's ``"memfit"`` block, ``overrides``,
    and with ``device_memory`` a ``memfit.Job`` as ``job`` with the ZeRO sharding, world size
    and optimizer."""
    block = config.get("memfit")
    block = {} if block is None else block
    if not isinstance(block, Mapping):
        raise TypeError(f'the config\'s "memfit" block must be a dict of memfit.fit keywords, '
                        f"got {type(block).__name__}")
    unknown = sorted(set(block) - set(_KEYS))
    if unknown:
        raise ValueError(f'unknown key(s) {unknown} in the config\'s "memfit" block; it takes '
                         f"{list(_KEYS)}")
    both = sorted(set(block) & {k for k, v in overrides.items() if v is not None})
    if both:
        raise ValueError(f"{both} given both in the config's \"memfit\" block and as keywords "
                         "of initialize; give each once")
    args = {**block, **{k: v for k, v in overrides.items() if v is not None}}
    if args.get("budget") is None and args.get("device_memory") is None:
        raise ValueError('no memory budget: put {"memfit": {"budget": 0.6}} (a fraction, bytes '
                         'or "6GiB") or {"memfit": {"device_memory": "80GiB"}} in the config, or '
                         "pass budget= or device_memory= to initialize")
    half = _half_dtype(config)
    if half is not None:
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if dtypes - {half}:
            raise ValueError(
                f"the config enables {half} training, which DeepSpeed casts the model to at "
                f"initialize, but the model's parameters are {sorted(map(str, dtypes))}: a "
                f"plan of that model would not be the engine's; cast it first "
                f"(model.to({half}))")
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError("the model's parameters are already partitioned by DeepSpeed (built "
                         "under deepspeed.zero.Init): they hold no values to profile; build it "
                         "without zero.Init, or plan it on the meta device with target=")
    if args.get("device_memory") is not None:
        zero = config.get("zero_optimization") or {}
        stage = int(zero.get("stage", 0)) if isinstance(zero, Mapping) else 0
        if stage not in _SHARDING:
            raise ValueError(f"zero_optimization.stage must be 0-3, got {stage}")
        args["sharding"] = _SHARDING[stage]
        args["world_size"] = _world_size()
        args["optimizer"] = optimizer if optimizer is not None else _config_optimizer(config)
        if half is not None:
            args["master_weights"] = True
            args.setdefault("optimizer_state_dtype", torch.float32)
        args["engine"] = engine_memory(config, model)
    return _with_options(_with_job(args))


@dataclass(frozen=True)
class EngineMemory:
    """DeepSpeed's buffers during forward and backward on one rank, and the step they give
    (NOTE [planning under a DeepSpeed engine], rule 8); bytes.

    Attributes:
        lines: ``(name, bytes)`` per buffer, named as DeepSpeed's config names it.
        budget_bytes: the cap on activations + buffers (None: a device job's, in
            ``plan.memory``).
        predicted_peak_bytes: the plan's activation peak + the buffers.
    """

    lines: tuple[tuple[str, int], ...]
    budget_bytes: int | None
    predicted_peak_bytes: int

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.lines)

    def __str__(self) -> str:
        from memfit.units import format_bytes

        parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in self.lines) or "none"
        cap = "" if self.budget_bytes is None else f" of {format_bytes(self.budget_bytes)}"
        return (f"DeepSpeed's buffers during forward + backward: {parts}; the step's predicted "
                f"peak {format_bytes(self.predicted_peak_bytes)}{cap}")


def engine_memory(config: Mapping[str, Any], model: nn.Module) -> tuple[tuple[str, int], ...]:
    """What DeepSpeed's engine allocates on each rank during forward and backward, besides
    the model's tensors, for ``config`` (DeepSpeed's defaults where a key is absent; NOTE
    [planning under a DeepSpeed engine], rule 8): ``(name, bytes)`` lines.

    Example:
        >>> engine_memory({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}},
        ...               torch.nn.Linear(4, 4))
        (('reduce_bucket_size', 4000),)
    """
    zero = config.get("zero_optimization") or {}
    if isinstance(zero, Mapping) and _zero_stage(config) == 3:
        return _gathered(zero, model)
    if not isinstance(zero, Mapping) or _zero_stage(config) not in (1, 2):
        return ()
    if not zero.get("contiguous_gradients", True):
        return ()
    elements = int(float(zero.get("reduce_bucket_size", 5e8)))  # DeepSpeed's default: 5e8
    buffers = 2 if zero.get("overlap_comm", False) else 1  # a double buffer with overlap_comm
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}  # one bucket per dtype
    size = sum(torch.empty((), dtype=d).element_size() for d in dtypes)
    name = "reduce_bucket_size" + (" x2 (overlap_comm)" if buffers == 2 else "")
    return ((name, elements * buffers * size),)


def _gathered(zero: Mapping[str, Any], model: nn.Module) -> tuple[tuple[str, int], ...]:
    """ZeRO-3's gathered parameters in flight (rule 9): every parameter over
    ``stage3_param_persistence_threshold`` elements (DeepSpeed's default 1e5) is gathered
    whole in forward and, within ``stage3_max_reuse_distance`` (default 1e9 elements) of its
    use in backward, kept until then; at most ``stage3_max_live_parameters`` (default 1e9)
    elements."""
    threshold = int(float(zero.get("stage3_param_persistence_threshold", 1e5)))
    released = [p for p in model.parameters() if p.numel() > threshold]
    if not released:
        return ()
    live = int(float(zero.get("stage3_max_live_parameters", 1e9)))
    elements = min(sum(p.numel() for p in released), max(live, max(p.numel() for p in released)))
    return (("stage3_max_live_parameters", elements * released[0].element_size()),)


def _with_job(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with the job's keywords gathered into one ``memfit.Job`` as ``job``."""
    from memfit.job.device_memory import OLD_KEYWORDS, Job

    engine = args.pop("engine", ())
    job = {OLD_KEYWORDS[k]: args.pop(k) for k in list(args) if k in OLD_KEYWORDS}
    if engine and job:
        job["engine"] = engine
    if not job:
        return args
    if job.get("device") is None:
        raise ValueError(f"{sorted(k for k in OLD_KEYWORDS if OLD_KEYWORDS[k] in job)} in the "
                         'config\'s "memfit" block count against device_memory; add '
                         '{"device_memory": "80GiB"} or drop them')
    return {**args, "job": Job(**job)}


def _with_options(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with fit's option keywords gathered into their values (``search=``,
    ``training=``, ``parallel=``: NOTE [fit's option families] in ``memfit.job.fit_options``)."""
    from memfit.job.fit_options import OLD_FIT_KEYWORDS

    families: dict[type, dict[str, Any]] = {}
    for key in [k for k in args if k in OLD_FIT_KEYWORDS]:
        cls, name = OLD_FIT_KEYWORDS[key]
        families.setdefault(cls, {})[name] = args.pop(key)
    return {**args, **{cls.__name__.lower(): cls(**given) for cls, given in families.items()}}


def _config_optimizer(config: Mapping[str, Any]) -> str | None:
    block = config.get("optimizer")
    if not isinstance(block, Mapping):
        return None
    kind = str(block.get("type", "")).lower()
    if kind not in _OPTIMIZERS:
        raise ValueError(f"device_memory planning knows DeepSpeed optimizers {sorted(_OPTIMIZERS)}, "
                         f"got {block.get('type')!r}; pass the optimizer instance as optimizer=")
    if kind == "sgd" and (block.get("params") or {}).get("momentum"):
        return "sgd-momentum"
    return _OPTIMIZERS[kind]


def initialize(*, model: nn.Module, config: Mapping[str, Any] | str | os.PathLike[str],
               example_inputs: Any = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
               step: Callable[[], torch.Tensor] | None = None,
               budget: int | float | str | None = None,
               device_memory: int | str | None = None,
               **deepspeed_kwargs: Any) -> tuple[Any, ...]:
    """``deepspeed.initialize`` with ``model`` planned and checkpointed for a budget first.

    Args:
        model: the model, planned in place (``model.memfit_plan``), then given to DeepSpeed.
        config: DeepSpeed's config (a dict or a JSON file's path) with a ``"memfit"`` block of
            ``memfit.fit`` keywords, or none when ``budget`` / ``device_memory`` are given.
        example_inputs, loss_fn, step: one micro-batch's inputs and the loss, as for
            ``memfit.fit``.
        budget, device_memory: as for ``memfit.fit`` (rule 2 of the note: or in the block).
        deepspeed_kwargs: the other arguments of ``deepspeed.initialize`` (``optimizer``,
            ``model_parameters``, ``lr_scheduler``...), passed on unchanged.

    Returns: what ``deepspeed.initialize`` returns (engine, optimizer, dataloader, scheduler).
    """
    try:
        import deepspeed  # type: ignore[import-not-found]
    except ImportError as e:
        raise ImportError("memfit.integrations.deepspeed.initialize needs DeepSpeed: pip install "
                          "--no-build-isolation deepspeed (it builds against the installed "
                          "torch)") from e
    cfg = _load_config(config)
    user_optimizer = deepspeed_kwargs.get("optimizer")
    args = fit_arguments(cfg, model, budget=budget, device_memory=device_memory,
                         optimizer=user_optimizer if isinstance(user_optimizer, torch.optim.Optimizer)
                         else None)
    cfg.pop("memfit", None)
    if deepspeed_kwargs.get("dist_init_required", True) and not torch.distributed.is_initialized():
        deepspeed.init_distributed()  # what initialize would do; fit plans one plan per job
    if _zero_stage(cfg) == 3:
        _zero3_linear(cfg)  # rule 7: profile the linear the engine will run
    lines = engine_memory(cfg, model)
    # the step's timeline, for a budget (a device job keeps the upper bound: rule 8)
    timeline = None if "job" in args else _Timeline(cfg, model, example_inputs, loss_fn, step)
    _fit_with_engine(model, lines, example_inputs, loss_fn, step, args, timeline)
    out = deepspeed.initialize(model=model, config=cfg, **deepspeed_kwargs)
    _hide_gathers(out[0])
    return out


class _Timeline:
    """The plain model's profile (traced before the plan is applied) and what the engine does
    to its gradients on this rank: ``peak(plan)`` is the step's predicted peak (NOTE
    [DeepSpeed's gradients in the timeline] in ``memfit.integrations.deepspeed_peak``)."""

    def __init__(self, config: Mapping[str, Any], model: nn.Module, example_inputs: Any,
                 loss_fn: Any, step: Any) -> None:
        from memfit.integrations.deepspeed_peak import partition_elements
        from memfit.profiling.tracer import trace
        from memfit.step.families import family_of
        from memfit.step.harness import Step

        zero = config.get("zero_optimization") or {}
        self.stage = _zero_stage(config)
        trainable = [p for p in model.parameters() if p.requires_grad]
        size = trainable[0].element_size() if trainable else 0
        contiguous = isinstance(zero, Mapping) and zero.get("contiguous_gradients", True)
        overlap = isinstance(zero, Mapping) and zero.get("overlap_comm", False)
        self.modelled = bool(contiguous) and not overlap and len({p.dtype for p in trainable}) <= 1
        self.bucket_bytes = (int(float(zero.get("reduce_bucket_size", 5e8))) * size
                             if isinstance(zero, Mapping) and self.stage in (1, 2) else 0)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.partition_bytes = size * partition_elements(
            [p.numel() for p in trainable], _world_size(), rank) if self.stage in (1, 2) else 0
        self.gathered_bytes = (sum(n for _, n in _gathered(zero, model))
                               if isinstance(zero, Mapping) and self.stage == 3 else 0)
        self.profile = None
        if self.modelled and self.stage in (1, 2, 3):
            the_step = (Step.of(model, call=step) if step is not None
                        else Step.of(model, example_inputs, loss_fn=loss_fn))
            with family_of(model, the_step.kwargs).cache_off_for_training(model):  # as fit
                self.profile = trace(the_step, repeats=1)

    def peak(self, plan: Any) -> int | None:
        from memfit.integrations.deepspeed_peak import step_peak

        if self.profile is None:
            return None
        return step_peak(self.profile, plan, stage=self.stage, bucket_bytes=self.bucket_bytes,
                         partition_bytes=self.partition_bytes, gathered_bytes=self.gathered_bytes)


def _fit_with_engine(model: nn.Module, lines: tuple[tuple[str, int], ...], example_inputs: Any,
                     loss_fn: Any, step: Any, args: dict[str, Any],
                     timeline: _Timeline | None = None) -> None:
    """``memfit.fit`` with the engine's buffers inside the budget (rule 8)."""
    from memfit.errors import InfeasibleBudget
    from memfit.units import format_bytes

    engine = sum(n for _, n in lines)
    budget = args.get("budget")
    cap: int | None = None
    if "job" in args or not engine or budget is None or budget == "min":
        memfit.fit(model, example_inputs, loss_fn=loss_fn, step=step, **args)
    else:
        if isinstance(budget, int) or (isinstance(budget, str) and not budget.strip().endswith("%")):
            from memfit.units import parse_bytes

            cap = budget if isinstance(budget, int) else parse_bytes(budget)
        else:  # a fraction of the profile's plain peak: resolved by a first plan
            memfit.fit(model, example_inputs, loss_fn=loss_fn, step=step, **args)
            cap = _plan(model).budget_bytes
            memfit.unapply(model)
        assert cap is not None  # a budget in bytes, or resolved by the plan
        if engine >= cap:
            named = ", ".join(f"{name} {format_bytes(n)}" for name, n in lines)
            raise InfeasibleBudget(
                f"DeepSpeed's buffers during forward + backward ({named}) alone fill the "
                f"budget of {format_bytes(cap)}: no plan of the activations can fit; lower "
                f"reduce_bucket_size in the config's zero_optimization (DeepSpeed's default is "
                f"5e8 elements) or raise the budget", budget_bytes=cap, min_feasible_bytes=engine)
        memfit.fit(model, example_inputs, loss_fn=loss_fn, step=step, **{**args, "budget": cap - engine})
    peak = timeline.peak(_plan(model)) if timeline is not None and "job" not in args else None
    if cap is not None and peak is not None and peak > cap:  # the partition the bounds missed
        over = peak - cap
        for _ in range(3):  # lower the activations' peak by the excess, plan again
            planned = _plan(model)
            lowered = min(planned.budget_bytes, planned.predicted_peak_bytes) - over
            memfit.unapply(model)
            memfit.fit(model, example_inputs, loss_fn=loss_fn, step=step, **{**args, "budget": lowered})
            peak = timeline.peak(_plan(model)) if timeline is not None else None
            if peak is None or peak <= cap:
                break
            over = peak - cap
    if peak is None:  # an upper bound: the gradients in the bucket counted twice
        peak = _plan(model).predicted_peak_bytes + engine
    setattr(model, "memfit_engine",  # noqa: B010  (an attribute of the user's module)
            EngineMemory(lines, cap, peak))


def _plan(model: nn.Module) -> Any:
    return getattr(model, "memfit_plan")  # noqa: B009


def _zero_stage(config: Mapping[str, Any]) -> int:
    zero = config.get("zero_optimization") or {}
    return int(zero.get("stage", 0)) if isinstance(zero, Mapping) else 0


def _zero3_linear(config: Mapping[str, Any]) -> None:
    """``torch.nn.functional.linear`` replaced by ZeRO-3's, as ``deepspeed.initialize`` does
    under ``memory_efficient_linear`` (the default; it stays so), before the plan is made
    (NOTE [planning under a DeepSpeed engine], rule 7)."""
    zero = config.get("zero_optimization") or {}
    if isinstance(zero, Mapping) and not zero.get("memory_efficient_linear", True):
        return
    from deepspeed.runtime.zero.linear import zero3_linear_wrap  # type: ignore[import-not-found]
    from deepspeed.runtime.zero.partition_parameters import (  # type: ignore[import-not-found]
        InsertPostInitMethodToModuleSubClasses as patcher,
    )

    if not hasattr(patcher, "linear_bk"):  # where DeepSpeed keeps torch's own
        patcher.linear_bk = torch.nn.functional.linear
    if torch.nn.functional.linear is patcher.linear_bk:
        torch.nn.functional.linear = zero3_linear_wrap


#: The ZeRO-3 functions that gather or release parameters from a module's forward hooks
#: (``DeepSpeedZeRoOffload``), and a ZeRO parameter's own gather (external parameters).
_GATHERS = ("pre_sub_module_forward_function", "post_sub_module_forward_function")


def _hide_gathers(engine: Any) -> None:
    """ZeRO-3's parameter gathers and releases kept out of the planned regions (NOTE
    [planning under a DeepSpeed engine], rule 5; NOTE [engine work in a region])."""
    from memfit.runtime.engine_work import hide_engine_work

    opt = getattr(engine, "optimizer", None)
    offload = getattr(opt, "parameter_offload", opt)
    if offload is None or not all(hasattr(offload, name) for name in _GATHERS):
        return  # not ZeRO-3
    for name in _GATHERS:
        hide_engine_work(offload, name)
    for p in engine.module.parameters():
        if hasattr(p, "ds_id"):
            hide_engine_work(p, "all_gather")
