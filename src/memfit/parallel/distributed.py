"""One plan per distributed job: plan on one rank, broadcast it, check it where it is applied.

NOTE [one plan per job]
    Each rank of a job profiles its own step, and its op times differ from the other ranks'
    (another core, another moment), so plans made on every rank differ: a region here, a
    saved matmul there. Under DDP that costs only speed; under FSDP a region recomputed on one
    rank and not on another runs other collectives in backward, and the job deadlocks or gloo
    reports "Connection closed by peer". So, when ``torch.distributed`` is initialised:
      1. every rank profiles (under DDP and FSDP the step itself has collectives: all ranks
         run the same number of steps, in lockstep);
      2. only the source rank plans (:func:`plan_once`); the outcome, the plan
         (``Plan.to_dict()``) or the error planning raised, goes to every rank with
         ``broadcast_object_list``, so a failure on the source (``InfeasibleBudget``) is the
         same failure everywhere, never a hang;
      3. ``apply`` is a collective: every rank gathers every rank's plan digest (and whether
         its plan fits its model) and all raise ``PlansDiffer`` if they disagree
         (:func:`check_same_plan`), before any module changes. ``memfit.apply`` passes
         :func:`rank_agreement` to the runtime's ``apply``, which knows no process group.
    ``memfit.fit`` does all three; with ``memfit.profile`` + ``memfit.plan`` + ``memfit.apply``
    wrap the planning in :func:`plan_once`.

Example:
    >>> prof = memfit.profile(model, x)                                   # doctest: +SKIP
    >>> plan = memfit.parallel.distributed.plan_once(lambda: memfit.plan(prof, budget=0.6))  # doctest: +SKIP
    >>> memfit.apply(model, plan)   # every rank: a collective            # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import pickle
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from memfit.errors import MemfitError, PlansDiffer
from memfit.planning.collectives import ReplayedCollectives
from memfit.planning.plan import Plan
from memfit.runtime.fsdp import is_fsdp_unit_class
from memfit.step.harness import ModelState, Step
from memfit.units import format_bytes

__all__ = ["is_distributed", "is_fsdp_unit_class", "warm_up_fsdp", "plan_once", "plan_digest",
           "check_same_plan", "rank_agreement", "RankReport", "rank_report", "gather_ranks",
           "format_ranks"]

log = logging.getLogger(__name__)


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def warm_up_fsdp(step: Step) -> bool:
    """Run ``step`` once, model left as found (``ModelState``), if its model holds FSDP units;
    whether it ran. Every rank must call it (the step runs the model's collectives).

    NOTE [FSDP's first step]
        FSDP2 initialises lazily on its first forward: it allocates the buffers parameters
        are gathered into (57 on the tiny Llama of the tests, 953600 bytes), which then live
        as long as the model. A profile of that first step counts them as activation memory
        and predicts a peak 7% above what the planned steps reach (tiny Llama, 6 units). So
        ``fit`` runs one step before profiling a model holding FSDP units.
    """
    if not any(is_fsdp_unit_class(type(m)) for m in step.model.modules()):
        return False
    with ModelState(step.model, step.inputs) as state:
        state.reset()
        step.with_input_copies().run()
    return True


def plan_digest(plan: Plan) -> str:
    """A short hash of ``plan.to_dict()``: equal on two ranks exactly when their plans are.

    Example:
        >>> plan_digest(Plan((), 0, 0.0, None, "none", ""))[:4]   # doctest: +SKIP
        '5e2b'
    """
    text = json.dumps(plan.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_once(make: Callable[[], Plan], *, src: int = 0, group: Any = None) -> Plan:
    """``make()`` run on rank ``src`` only, its plan (or its error) given to every rank.

    Without an initialised process group it is just ``make()``. Every rank of ``group`` must
    call it (NOTE [one plan per job]).

    Args:
        make: a function returning the plan (``lambda: memfit.plan(profile, budget=0.6)``).
        src: the global rank that plans (default 0).
        group: the process group (default the whole job).

    Returns:
        The source rank's plan, on every rank (rebuilt from ``Plan.to_dict()``, so the same
        digest everywhere).

    Raises:
        Whatever ``make`` raised on ``src`` (its type, message and attributes), on every rank.

    Example:
        >>> plan = plan_once(lambda: memfit.plan(prof, budget="60%"))   # doctest: +SKIP
    """
    if not is_distributed():
        return make()
    rank = dist.get_rank()
    outcome: list[Any] = [None]
    if rank == src:
        try:
            outcome[0] = {"plan": make().to_dict()}
        except Exception as e:  # sent to the other ranks, then raised here too
            outcome[0] = {"error": _describe(e)}
            dist.broadcast_object_list(outcome, src=src, group=group)
            raise
    dist.broadcast_object_list(outcome, src=src, group=group)
    sent = outcome[0]
    if "error" in sent:
        raise _rebuild(sent["error"], src)
    plan = Plan.from_dict(sent["plan"])
    log.info("rank %d: plan %s from rank %d (%d regions)", rank, plan_digest(plan), src,
             len(plan.regions))
    return plan


def check_same_plan(plan: Plan, *, local_error: Exception | None = None, group: Any = None) -> None:
    """Raise ``PlansDiffer`` on every rank unless every rank of ``group`` holds ``plan``'s
    digest and none reports ``local_error``. A collective (``all_gather_object``); a no-op
    without an initialised process group.

    Args:
        plan: this rank's plan.
        local_error: why this rank cannot apply its plan (its ``PlanMismatch``), if it cannot.
            When every rank holds the same plan and every rank reports an error, nothing is
            raised here: each rank raises its own.
        group: the process group (default the whole job).

    Raises:
        PlansDiffer: the ranks' digests differ, or some rank reported an error; the message
            names the ranks of each plan.
    """
    if not is_distributed():
        return
    mine = (plan_digest(plan), len(plan.regions),
            None if local_error is None else f"{type(local_error).__name__}: {local_error}")
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    by_digest: dict[str, tuple[int, ...]] = {}
    errors: dict[int, str] = {}
    for r, (digest, _, err) in enumerate(every):
        rank = dist.get_global_rank(group, r) if group is not None else r
        by_digest[digest] = (*by_digest.get(digest, ()), rank)
        if err is not None:
            errors[rank] = err
    if len(by_digest) == 1 and len(errors) in (0, len(every)):
        return  # one plan; it applies everywhere, or nowhere (each rank raises its own error)
    ranks = dict(by_digest)
    for rank, err in errors.items():
        ranks[f"error: {err}"] = (*ranks.get(f"error: {err}", ()), rank)
    held = "; ".join(
        f"ranks {', '.join(map(str, rs))} hold plan {d} ({every[_local(rs[0], group)][1]} regions)"
        for d, rs in by_digest.items())
    failed = "".join(f"; rank {r} cannot apply its plan: {e}" for r, e in errors.items())
    raise PlansDiffer(
        f"apply was given {len(by_digest)} different plan{'s' if len(by_digest) != 1 else ''} "
        f"across the job's ranks ({held}){failed}. Every rank must run the same plan: under "
        "FSDP different recomputation means different collectives, a deadlock. Plan on one "
        "rank and broadcast it (memfit.fit does; or memfit.parallel.distributed.plan_once around "
        "memfit.plan), or pass check_ranks=False to apply if the ranks train different models",
        ranks=ranks)


def rank_agreement(*, group: Any = None) -> Callable[[Plan, Exception | None], None] | None:
    """The ``agree=`` of ``memfit.runtime.apply.apply_plan`` that makes it a collective: every rank
    of ``group`` must hold the same plan (:func:`check_same_plan`, step 3 of NOTE [one plan per
    job]); None without an initialised process group (nothing to agree with).

    Example:
        >>> memfit.runtime.apply.apply_plan(model, plan, agree=rank_agreement())   # doctest: +SKIP
    """
    if not is_distributed():
        return None

    def agree(plan: Plan, local_error: Exception | None) -> None:
        check_same_plan(plan, local_error=local_error, group=group)

    return agree


RANK_REPORT_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class RankReport:
    """One rank's plan, peak and the communication its recomputation adds. Bytes and
    seconds per step; the collectives are those the plan's replays issue again (NOTE
    [collectives in a region] in ``memfit.planning.rules``)."""

    rank: int
    plan_digest: str
    regions: int
    budget_bytes: int | None
    predicted_peak_bytes: int
    recompute_s: float
    collectives: int              # collective calls the replays issue again
    collective_bytes: int         # bytes they return on this rank
    collective_s: float           # their profiled seconds (waits included)
    saved_collectives: int        # collective outputs kept instead of re-sent
    measured_peak_bytes: int | None = None
    schema_version: int = RANK_REPORT_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankReport:
        if int(data.get("schema_version", 1)) > RANK_REPORT_SCHEMA_VERSION:
            raise ValueError(f"a rank report of schema {data['schema_version']} is newer than "
                             f"this memfit reads ({RANK_REPORT_SCHEMA_VERSION}); upgrade memfit")
        return cls(**data)


def rank_report(plan: Plan, *, measured_peak_bytes: int | None = None) -> RankReport:
    """This rank's report of ``plan`` (``model.memfit_plan``), with the peak you measured.

    Example:
        >>> r = rank_report(model.memfit_plan, measured_peak_bytes=peak)   # doctest: +SKIP
        >>> print(format_ranks(gather_ranks(r)))                          # doctest: +SKIP
    """
    sent = plan.extra.get("collectives")
    coll = ReplayedCollectives.from_dict(sent) if sent else ReplayedCollectives()
    return RankReport(rank=dist.get_rank() if is_distributed() else 0, plan_digest=plan_digest(plan),
                      regions=len(plan.regions), budget_bytes=plan.budget_bytes,
                      predicted_peak_bytes=plan.predicted_peak_bytes, recompute_s=plan.recompute_s,
                      collectives=coll.count, collective_bytes=coll.nbytes,
                      collective_s=coll.seconds, saved_collectives=coll.saved,
                      measured_peak_bytes=measured_peak_bytes)


def gather_ranks(report: RankReport, *, group: Any = None) -> list[RankReport]:
    """Every rank's report, in rank order: a collective (``all_gather_object``) every rank of
    ``group`` must call; ``[report]`` without an initialised process group."""
    if not is_distributed():
        return [report]
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, report.to_dict(), group=group)
    return sorted((RankReport.from_dict(d) for d in every), key=lambda r: r.rank)


def format_ranks(reports: Sequence[RankReport]) -> str:
    """The ranks as a markdown table: plan, budget, predicted and measured peaks, recompute,
    and the collectives the recompute sends again."""
    rows = ["| rank | plan | regions | budget | predicted peak | measured peak | recompute | "
            "collectives re-run | their bytes | their time | kept instead |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in reports:
        budget = "-" if r.budget_bytes is None else format_bytes(r.budget_bytes)
        meas = "-" if r.measured_peak_bytes is None else format_bytes(r.measured_peak_bytes)
        rows.append(f"| {r.rank} | {r.plan_digest} | {r.regions} | {budget} | "
                    f"{format_bytes(r.predicted_peak_bytes)} | {meas} | {r.recompute_s * 1e3:.2f} ms | "
                    f"{r.collectives} | {format_bytes(r.collective_bytes)} | "
                    f"{r.collective_s * 1e3:.2f} ms | {r.saved_collectives} |")
    return "\n".join(rows)


def _local(global_rank: int, group: Any) -> int:
    return global_rank if group is None else dist.get_group_rank(group, global_rank)


def _describe(e: Exception) -> dict[str, Any]:
    """An exception as picklable data: its class's import path, message and attributes."""
    attrs = {}
    for k, v in vars(e).items():
        try:
            pickle.dumps(v)
        except Exception:  # an attribute that cannot travel is left behind
            continue
        attrs[k] = v
    cls = type(e)
    return {"type": f"{cls.__module__}:{cls.__qualname__}", "message": str(e), "attrs": attrs}


def _rebuild(sent: dict[str, Any], src: int) -> Exception:
    """The source rank's exception, of its class where this rank can import it."""
    message = f"{sent['message']} [raised while planning on rank {src}]"
    module, _, qualname = sent["type"].partition(":")
    cls: Any = None
    try:
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return MemfitError(f"{sent['type']}: {message}")
    err = cls.__new__(cls)  # its __init__ may take keyword-only attributes: set them as data
    Exception.__init__(err, message)
    err.__dict__.update(sent["attrs"])
    return err  # type: ignore[no-any-return]
