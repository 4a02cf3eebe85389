"""``fit``'s option families as values: how to search for the plan (:class:`Search`), what the
planned model does while it trains (:class:`Training`), and how the job is split over processes
(:class:`Parallel`); and the keywords they replace, deprecated for one release.

NOTE [fit's option families]
    ``fit`` took 19 keywords; a reader could not see which belong together, and every new
    capability added one. They are now four values, each validated when made, beside the
    step's own arguments (``example_inputs`` or ``step``, ``loss_fn``) and the cap
    (``budget`` and/or ``job``, ``memfit.Job``)::

        memfit.fit(model, x, budget=0.5,
                   search=memfit.Search(solver="milp", tune=True),
                   training=memfit.Training(on_new_shape="replan", monitor_every=100),
                   parallel=memfit.Parallel(src=0))

    The old keywords (``solver=``, ``tune=``, ``shapes=``, ``in_flight=``...) still work for
    one release: each warns once with a ``DeprecationWarning`` that spells the new value
    (``fit(solver=...) is deprecated: pass search=memfit.Search(solver=...)``), and an old
    keyword beside the value that replaces it is a ``TypeError`` (two answers to one
    question). Defaults are the old keywords' defaults: ``fit(model, x, budget=b)`` plans,
    applies and behaves exactly as before.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from memfit.planning.compression import DEFAULT_LOSSY_CODEC
from memfit.planning.solvers import SolverName

__all__ = ["Search", "Training", "Parallel", "OLD_FIT_KEYWORDS", "resolve_fit_options"]

_COMPRESS = (None, "lossless", "lossy")
_ON_NEW_SHAPE = (None, "replan", "warn", "raise")


@dataclass(frozen=True)
class Search:
    """How ``fit`` searches for the plan.

    Args:
        solver: ``"auto"`` (default), ``"chain"``, ``"milp"``, ``"greedy"``, ``"brute"``, or a
            baseline (``"every_block"``, ``"sqrt"``, ``"save_matmuls"``, ``"none"``).
        tune: time the solver's best few plans and the baseline plans that fit on the model
            itself and apply the fastest measured (``memfit.measuring.tuning.tune``; the
            medians are on ``model.memfit_plan.tuning``). Default False: the solver's plan.
        tune_time_limit_s: seconds of stepping tuning may spend (default: 10 profiled plain
            steps).
        compress: also keep saved tensors outside the regions packed (NOTE [compress or
            recompute] in ``memfit.planning.compress_pass``): ``"lossless"`` (exact codecs;
            the step stays bitwise plain), ``"lossy"`` (also bf16: gradients change); default
            None.
        lossy_codec: with ``compress="lossy"``, the codec of the other fp32 activations:
            ``"bf16"`` (default), ``"fp8_e4m3"`` or ``"int8_blockwise"``; None: no codec on
            them, the batch-norm variants alone (``inplace_abn``, ``bn_from_output``).
        target: for a model on the meta device (profiled in fake mode), the device preset it is
            planned for (``"a100"``, ``"h100"``, ``"h200"``): its kernels and cost model;
            default None (``"cpu"``).
        compiled: plan for a model that ``torch.compile`` will run: recompute priced as the
            compiled step pays it (NOTE [compiled costs] in ``memfit.profiling.compiled_costs``:
            pointwise ops fuse for free, no per-op charges). Compile the fitted model
            afterwards (``torch.compile(model)``); the compiled graph saves what the plan saves.
            Default False (eager costs).
        tails: let a region's last ops whose saves outlive it keep them as the plain step does,
            so that its replay stops before them (NOTE [region tails] in
            ``memfit.planning.tails``). Default True; False for a double backward
            (``create_graph=True``) through the regions.

    Example:
        >>> Search(solver="milp", tune=True)
        Search(solver='milp', tune=True)
    """

    solver: SolverName = "auto"
    tune: bool = False
    tune_time_limit_s: float | None = None
    compress: str | None = None
    lossy_codec: str | None = DEFAULT_LOSSY_CODEC
    target: str | None = None
    compiled: bool = False
    tails: bool = True

    def __post_init__(self) -> None:
        from memfit.planning.solvers import solver_names

        if self.solver not in solver_names():
            raise ValueError(f"unknown solver {self.solver!r}; choose one of "
                             f"{', '.join(solver_names())}")
        if not isinstance(self.tune, bool):
            raise TypeError(f"tune must be True or False, got {self.tune!r}")
        if self.tune_time_limit_s is not None and not self.tune_time_limit_s > 0:
            raise ValueError(f"tune_time_limit_s must be > 0 seconds, got {self.tune_time_limit_s!r}")
        if self.compress not in _COMPRESS:
            raise ValueError(f"compress must be one of {_COMPRESS}, got {self.compress!r}")
        if self.lossy_codec != DEFAULT_LOSSY_CODEC and self.compress != "lossy":
            raise ValueError(f"lossy_codec={self.lossy_codec!r} chooses the codec of "
                             f"compress='lossy'; got compress={self.compress!r}: pass "
                             "compress='lossy' too, or drop lossy_codec")
        if not isinstance(self.tails, bool):
            raise TypeError(f"tails must be True or False, got {self.tails!r}")
        if not isinstance(self.compiled, bool):
            raise TypeError(f"compiled must be True or False, got {self.compiled!r}")
        if self.compiled and self.tune:
            raise ValueError("Search(compiled=True, tune=True): tuning times the candidate plans "
                             "eagerly, which ranks them by eager costs, not compiled ones; drop "
                             "tune, or time compiled candidates yourself")
        if self.compiled and self.compress is not None:
            raise ValueError(f"Search(compiled=True, compress={self.compress!r}): compressed "
                             "saved tensors under torch.compile are not supported (not tested "
                             "against the compiled graph); drop compress, or plan for eager "
                             "(compiled=False)")
        if self.compress == "lossy":
            from memfit.planning.compression import check_lossy_codec

            check_lossy_codec(self.lossy_codec)

    def __repr__(self) -> str:
        return _repr(self)


@dataclass(frozen=True)
class Training:
    """What the planned model does while it trains.

    Args:
        on_new_shape: what a training call on inputs of another shape or dtype than the plan's
            does (NOTE [inputs other than the profiled ones] in ``memfit.runtime.shapes``):
            ``"replan"`` profiles that step once and plans it for the same budget in bytes
            (NOTE [re-planning inside a training call] in ``memfit.job.shape_plans``);
            ``"warn"`` warns once per new signature and keeps the plan; ``"raise"`` raises
            ``memfit.NewInputShape``. Default None: ``"replan"`` for ``example_inputs``,
            ``"warn"`` for a callable ``step`` or in a distributed job.
        shapes: the shapes training will use, planned now (NOTE [shape ranges] in
            ``memfit.job.shape_plans``): each a size of the single input tensor (``(8, 128)``)
            or full example inputs; every shape in their range runs a plan that fits.
        monitor_every: monitor one training call in N: its measured peak against the plan's
            prediction and budget, on ``model.memfit_monitor`` (NOTE [monitoring a training
            run] in ``memfit.runtime.monitor``; N >= 25 keeps the cost within 1% on CPU).
            Default None.

    Example:
        >>> Training(on_new_shape="warn", monitor_every=100)
        Training(on_new_shape='warn', monitor_every=100)
    """

    on_new_shape: str | None = None
    shapes: Sequence[Any] | None = None
    monitor_every: int | None = None

    def __post_init__(self) -> None:
        if self.on_new_shape not in _ON_NEW_SHAPE:
            raise ValueError(f"on_new_shape must be one of {_ON_NEW_SHAPE}, got "
                             f"{self.on_new_shape!r}")
        if self.shapes is not None and (isinstance(self.shapes, (str, bytes))
                                        or not isinstance(self.shapes, Sequence) or not self.shapes):
            raise TypeError(f"shapes must be a non-empty list of sizes or example inputs, got "
                            f"{type(self.shapes).__name__}")
        every = self.monitor_every
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ValueError(f"monitor_every must be an int >= 1 (monitor one training call in "
                             f"N), got {every!r}")

    def __repr__(self) -> str:
        return _repr(self)


@dataclass(frozen=True)
class Parallel:
    """How the job is split over processes.

    Args:
        src: in a distributed job, the global rank whose profile is planned (default 0); every
            rank profiles, then gets that rank's plan (NOTE [one plan per job] in
            ``memfit.parallel.distributed``): every rank of ``group`` must call ``fit``.
        group: the ``torch.distributed`` process group to plan for (default the whole job).
        in_flight: for a pipeline stage, the micro-batches whose activations it holds at once
            (``memfit.parallel.pipeline.in_flight``); each rank then plans its own stage, and
            ``budget`` caps the stage's peak over the schedule step (NOTE [pipeline stage
            memory model] in ``memfit.planning.stages``). Default None: not a stage.
        kept_bytes: with ``in_flight``, the bytes the schedule keeps besides
            (``memfit.parallel.pipeline.kept_by_sends``; default 0).

    Example:
        >>> Parallel(in_flight=4)
        Parallel(in_flight=4)
    """

    src: int = 0
    group: Any = None
    in_flight: int | None = None
    kept_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.src, int) or isinstance(self.src, bool) or self.src < 0:
            raise ValueError(f"src must be a global rank (an int >= 0), got {self.src!r}")
        if self.in_flight is not None and (not isinstance(self.in_flight, int)
                                           or isinstance(self.in_flight, bool) or self.in_flight < 1):
            raise ValueError(f"in_flight must be an int >= 1 (micro-batches a stage holds at "
                             f"once), got {self.in_flight!r}")
        if not isinstance(self.kept_bytes, int) or self.kept_bytes < 0:
            raise ValueError(f"kept_bytes must be an int >= 0 (bytes), got {self.kept_bytes!r}")
        if self.kept_bytes and self.in_flight is None:
            raise ValueError("kept_bytes is a pipeline stage's: give in_flight too")

    def __repr__(self) -> str:
        return _repr(self)


def _repr(value: Any) -> str:
    """The fields that differ from their defaults, as the call that makes the value."""
    given = [f"{f.name}={getattr(value, f.name)!r}" for f in fields(value)
             if getattr(value, f.name) != f.default]
    return f"{type(value).__name__}({', '.join(given)})"


#: fit's keywords before the option families, and where each went (NOTE [fit's option families]).
OLD_FIT_KEYWORDS: dict[str, tuple[type, str]] = {
    **{k: (Search, k) for k in ("solver", "tune", "tune_time_limit_s", "compress", "lossy_codec",
                                "target")},
    **{k: (Training, k) for k in ("on_new_shape", "shapes", "monitor_every")},
    **{k: (Parallel, k) for k in ("src", "group", "in_flight", "kept_bytes")},
}
_ARGUMENT = {Search: "search", Training: "training", Parallel: "parallel"}


def resolve_fit_options(search: Search | None, training: Training | None,
                        parallel: Parallel | None, old: dict[str, Any]
                        ) -> tuple[Search, Training, Parallel]:
    """The three values of a ``fit`` call, the deprecated keywords ``old`` folded in (NOTE
    [fit's option families]; the warning points at ``fit``'s caller).

    Raises:
        TypeError: a value of the wrong type; an old keyword beside the value that replaces it.
        ValueError: as the values' constructors.
    """
    given: dict[type, Any] = {Search: search, Training: training, Parallel: parallel}
    for cls, value in given.items():
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"fit's {_ARGUMENT[cls]}= must be a memfit.{cls.__name__}, got "
                            f"{type(value).__name__} {value!r}")
    by_family: dict[type, dict[str, Any]] = {}
    for key, value in old.items():
        cls, name = OLD_FIT_KEYWORDS[key]
        by_family.setdefault(cls, {})[name] = value
    for cls, moved in by_family.items():
        spelled = ", ".join(f"{k}={v!r}" for k, v in moved.items())
        if given[cls] is not None:
            raise TypeError(f"fit() got {_ARGUMENT[cls]}= and {spelled}, which {_ARGUMENT[cls]}= "
                            f"replaces: put them in memfit.{cls.__name__}(...)")
        warnings.warn(f"fit({spelled}) is deprecated: pass "
                      f"{_ARGUMENT[cls]}=memfit.{cls.__name__}({spelled})",
                      DeprecationWarning, stacklevel=3)
        given[cls] = cls(**moved)
    return (given[Search] or Search(), given[Training] or Training(),
            given[Parallel] or Parallel())

