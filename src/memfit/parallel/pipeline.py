"""Pipeline parallelism: how many micro-batches a stage holds, and the stages' plans side by side.

A stage of a pipeline schedule holds several micro-batches' activations at once, a different
number on each stage, so each stage is planned for its own count (NOTE [pipeline stage memory
model] in ``memfit.planning.stages``): ``memfit.fit(stage_module, micro_batch, budget=...,
in_flight=in_flight(schedule, stage_index))``. The plans differ per stage, so a pipeline job
has no "one plan per job"; :func:`gather_stages` collects every stage's :class:`StageReport`
and :func:`format_stages` prints them with the pipeline's step time: the slowest stage's.

NOTE [in-flight micro-batches per schedule]
    ``in_flight`` reads the schedule's own action order (``schedule.pipeline_order``, the
    schedule IR torch builds for ``ScheduleGPipe``, ``Schedule1F1B`` and the multi-stage
    schedules): walking a stage's actions, a forward ``F`` adds a micro-batch, a full
    backward ``B`` (or the weight half ``W`` of a split one) removes it; the count's maximum
    is ``k``. Read that way, and counted on 2 and 4 gloo ranks by hooks on the stage module
    (``tests/distributed/pipeline_ranks.py``): GPipe holds all ``n`` micro-batches on every
    stage; 1F1B holds ``min(n, p - i)`` on stage ``i`` of ``p`` (its runtime runs ``p - i``
    warm-up forwards, then one backward before each further forward). Without a schedule
    object, :func:`in_flight_of` gives those two formulas.

Example:
    >>> schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss)   # doctest: +SKIP
    >>> k = memfit.parallel.pipeline.in_flight(schedule, stage.stage_index)         # doctest: +SKIP
    >>> memfit.fit(stage.submod, micro_batch, budget="3MiB", in_flight=k)  # doctest: +SKIP
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from memfit.planning.plan import Plan
from memfit.units import format_bytes

__all__ = ["in_flight", "in_flight_of", "count_in_flight", "kept_by_sends", "StageReport", "stage_report",
           "gather_stages", "pipeline_step_s", "format_stages"]

STAGE_REPORT_SCHEMA_VERSION = 1
_ACTION = re.compile(r"^(\d+)(F|B|I|W)(\d+)$")


def count_in_flight(actions: Iterable[Any]) -> dict[int, int]:
    """The most micro-batches each stage holds at once in ``actions`` (one rank's action
    order: ``_Action`` objects or their text ``"0F3"``; ``None`` for idle steps).

    Example:
        >>> count_in_flight(["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"])
        {0: 2}
    """
    held: dict[int, int] = {}
    most: dict[int, int] = {}
    for action in actions:
        if action is None:
            continue
        subs = getattr(action, "sub_actions", None)
        for a in (subs if subs else (action,)):
            m = _ACTION.match(str(a))
            if m is None:
                continue  # communication, unshard, reduce-grad: no activations
            stage, kind = int(m.group(1)), m.group(2)
            if kind == "F":
                held[stage] = held.get(stage, 0) + 1
                most[stage] = max(most.get(stage, 0), held[stage])
            elif kind in ("B", "W"):
                held[stage] = held.get(stage, 0) - 1
    return most


def in_flight(schedule: Any, stage_index: int) -> int:
    """Micro-batches stage ``stage_index`` holds at once under ``schedule`` (a
    ``torch.distributed.pipelining`` schedule), read from its action order (NOTE [in-flight
    micro-batches per schedule]).

    Raises:
        ValueError: the schedule has no action order (``pipeline_order``), or the stage
            runs no forward in it.
    """
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        raise ValueError(f"{type(schedule).__name__} has no pipeline_order (action order) to "
                         "count; use in_flight_of(name, stage, n_stages, n_microbatches)")
    counts: dict[int, int] = {}
    for actions in order.values():
        for stage, k in count_in_flight(actions).items():
            counts[stage] = max(counts.get(stage, 0), k)
    if stage_index not in counts:
        raise ValueError(f"stage {stage_index} runs no forward in {type(schedule).__name__}'s "
                         f"action order (stages {sorted(counts)})")
    return counts[stage_index]


def in_flight_of(schedule: str, stage_index: int, n_stages: int, n_microbatches: int) -> int:
    """The formula for ``"gpipe"`` (``n_microbatches``) and ``"1f1b"`` (``min(n, p - i)``).

    Example:
        >>> [in_flight_of("1f1b", i, 4, 8) for i in range(4)]
        [4, 3, 2, 1]
    """
    if not 0 <= stage_index < n_stages or n_microbatches < 1:
        raise ValueError(f"stage {stage_index} of {n_stages}, {n_microbatches} micro-batches")
    name = schedule.lower().replace("schedule", "")
    if name == "gpipe":
        return n_microbatches
    if name == "1f1b":
        return min(n_microbatches, n_stages - stage_index)
    raise ValueError(f"in_flight_of knows 'gpipe' and '1f1b', got {schedule!r}; pass the "
                     "schedule object to in_flight")


def kept_by_sends(schedule: Any, stage_index: int, n_stages: int, *, output_bytes: int,
                  input_grad_bytes: int, n_microbatches: int | None = None) -> int:
    """Bytes ``schedule`` keeps on a stage besides its held micro-batches (NOTE [pipeline
    stage memory model] in ``memfit.planning.stages``, rule 3): under ``Schedule1F1B`` one
    micro-batch's output (``output_bytes``, on every stage but the last) and one input
    gradient (``input_grad_bytes``, on every stage but the first); 0 under other schedules.
    Given ``n_microbatches``, the output only where the stage runs at least two steady-state
    forwards (``n >= p - i + 2``): measured on 4 stages, stage 0 at 4 and 5 micro-batches and
    stage 1 at 4 peak one output lower, at 8 (and stage 1 at 5) with it.

    Example:
        >>> kept_by_sends("1f1b", 1, 4, output_bytes=64, input_grad_bytes=64)
        128
        >>> kept_by_sends("1f1b", 0, 4, output_bytes=64, input_grad_bytes=64, n_microbatches=5)
        0
    """
    name = schedule if isinstance(schedule, str) else type(schedule).__name__
    if name.lower().replace("schedule", "") != "1f1b":
        return 0
    sends_output = stage_index < n_stages - 1 and (
        n_microbatches is None or n_microbatches >= n_stages - stage_index + 2)
    return (output_bytes if sends_output else 0) + (input_grad_bytes if stage_index > 0 else 0)


@dataclass(frozen=True)
class StageReport:
    """One stage's plan, as predicted and (optionally) measured. Bytes and seconds; the
    budget and peaks are the stage's activation peak over a schedule step."""

    stage: int
    in_flight: int
    n_microbatches: int
    budget_bytes: int
    static_bytes: int          # weights + gradients, counted once
    predicted_peak_bytes: int  # (in_flight - 1) * held + one micro-batch's step peak
    held_bytes: int
    regions: int
    recompute_s: float         # per micro-batch
    step_s: float              # one micro-batch's plain step, profiled
    measured_peak_bytes: int | None = None
    measured_s: float | None = None  # the stage's compute seconds in one schedule step
    schema_version: int = STAGE_REPORT_SCHEMA_VERSION

    @property
    def stage_s(self) -> float:
        """Predicted compute seconds of the stage in one schedule step."""
        return self.n_microbatches * (self.step_s + self.recompute_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageReport:
        return cls(**data)


def stage_report(plan: Plan, *, stage: int, n_microbatches: int, static_bytes: int = 0,
                 measured_peak_bytes: int | None = None,
                 measured_s: float | None = None) -> StageReport:
    """The report of a stage planned with ``in_flight`` (``plan.extra["pipeline"]``).

    Raises:
        ValueError: ``plan`` was not made for a pipeline stage
            (``fit(..., parallel=memfit.Parallel(in_flight=k))``).
    """
    info = plan.extra.get("pipeline")
    if info is None:
        raise ValueError("the plan was not made for a pipeline stage; plan it with "
                         "memfit.fit(stage_module, micro_batch, budget=..., "
                         "parallel=memfit.Parallel(in_flight=k))")
    return StageReport(stage=stage, in_flight=int(info["in_flight"]), n_microbatches=n_microbatches,
                       budget_bytes=int(info["stage_budget_bytes"]), static_bytes=static_bytes,
                       predicted_peak_bytes=int(info["stage_peak_bytes"]),
                       held_bytes=int(info["held_bytes"]), regions=len(plan.regions),
                       recompute_s=plan.recompute_s, step_s=plan.plain_step_s,
                       measured_peak_bytes=measured_peak_bytes, measured_s=measured_s)


def gather_stages(report: StageReport, *, group: Any = None) -> list[StageReport]:
    """Every rank's report, in stage order: a collective (``all_gather_object``) every rank
    of ``group`` must call; ``[report]`` without an initialised process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [report]
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, report.to_dict(), group=group)
    return sorted((StageReport.from_dict(d) for d in every), key=lambda r: r.stage)


def pipeline_step_s(reports: Sequence[StageReport], *, measured: bool = False) -> float:
    """The pipeline's step time: its slowest stage's compute seconds (predicted, or
    measured where every stage has ``measured_s``). A pipeline runs at the pace of its
    slowest stage, so recompute costs least on the stages with time to spare."""
    if measured:
        times = [r.measured_s for r in reports]
        if any(t is None for t in times):
            raise ValueError("not every stage has a measured time")
        return max(t for t in times if t is not None)
    return max(r.stage_s for r in reports)


def format_stages(reports: Sequence[StageReport]) -> str:
    """The stages as a markdown table, then the pipeline step time (slowest stage)."""
    rows = ["| stage | in flight | budget | predicted peak | measured peak | regions | "
            "recompute / mb | stage time (pred) | stage time (meas) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in reports:
        meas = "-" if r.measured_peak_bytes is None else (
            f"{format_bytes(r.measured_peak_bytes)} ({r.measured_peak_bytes / r.budget_bytes:.1%})")
        ms = "-" if r.measured_s is None else f"{r.measured_s * 1e3:.1f} ms"
        rows.append(f"| {r.stage} | {r.in_flight} | {format_bytes(r.budget_bytes)} | "
                    f"{format_bytes(r.predicted_peak_bytes)} | {meas} | {r.regions} | "
                    f"{r.recompute_s * 1e3:.2f} ms | {r.stage_s * 1e3:.1f} ms | {ms} |")
    line = f"pipeline step (slowest stage): predicted {pipeline_step_s(reports) * 1e3:.1f} ms"
    if all(r.measured_s is not None for r in reports):
        line += f", measured {pipeline_step_s(reports, measured=True) * 1e3:.1f} ms"
    return "\n".join(rows) + "\n\n" + line
