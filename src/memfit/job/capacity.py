"""``largest_batch``: the largest batch (or sequence) whose best plan fits the device.

NOTE [largest batch search]
    ``make(n)`` builds the step for size ``n``; whether it fits is decided by profiling it
    and planning it for the device (NOTE [the job's memory] in ``memfit.planning.job``): it
    fits when the smallest plan's whole-job total fits the job's device and, with
    ``max_overhead``, the fastest plan that fits predicts at most that recompute. Profiles
    cost a traced step each, so the search makes few: it probes 1 and 2, then predicts the
    size where the smallest plan's total meets the device from the last two probes (the
    total is close to affine in the batch: activations grow with it, model states do not),
    probes that size and the next, and narrows the bracket between the largest size that
    fits and the smallest that does not, by the prediction while it falls inside the
    bracket, else by halving it (by doubling while nothing fails yet). It ends when the
    two are adjacent, so the answer ``n`` fits and ``n + 1`` was planned and does not fit
    with any plan (or ``n`` is ``limit``). Fitting is assumed monotone in ``n``.

    A size whose step the model refuses (``make(n)`` or the forward raises ``ValueError``,
    or a ``ModelError``: a sequence longer than its positions) does not fit either: its
    probe keeps the model's message (``Probe.error``), the search narrows below it, and the
    answer says that the model's own limit bounded it (``BatchFit.model_limit``). At
    ``n = 1`` the error is raised: the step does not run at all.

    Probes are traced with one run (``repeats=1``), which times ops slowly but counts every
    byte; with ``max_overhead`` they are calibrated profiles (``memfit.profile``), as the
    overhead is a time ratio. The answer's plan is made from a calibrated profile of it.

NOTE [largest batch on fake tensors]
    A search for a card this host lacks must not run that card's steps here: the README's
    example for an 80 GiB device ran real steps of a 4-layer GPT until the OOM killer
    stopped it at 20.2 GB on a 24 GB machine, and at ``"1GiB"`` real steps grew the process
    by 6.0 GB over 418 s (its answer, 490, has a 4 GB plain step). So each size is first
    traced on fake tensors (NOTE [fake mode]: storages of the true size and no data, about
    0.3 s for that GPT), which gives its plain step's peak exactly, and is traced for real
    only when that peak is at most the device's memory (a step the device could run without
    a plan) and at most ``1 / HOST_SHARE`` of the memory this host has available
    (``MemAvailable``); else the fake profile is the probe's. A model on the meta device, or
    a ``target`` other than the CPU, is profiled on fake tensors throughout, as before, and
    ``mode=`` forces one or the other. Each probe and the answer record which was done
    (``Probe.mode``, ``BatchFit.mode``), and the printout says so. At ``"80GiB"`` the search
    now ends in 14 s with the process grown by 297 MB; at ``"1GiB"`` in 51 s, 344 MB.

    Fake profiles on the CPU lack the kernel workspaces a real step measures (NOTE [kernel
    workspaces]: a matmul's packed operand in the LM head's backward, 1 MiB at a batch of 4 of
    that GPT), so the plain peak is 0.8-1.3% lower on fake tensors at batches 4-16. None sat
    at the smallest plan's peak in the GPTs tried: the real and fake searches found the same
    batch with the same whole-job bytes at every size (490 at ``"1GiB"``; tested), but where
    one does, a fake answer can be a size above the real one. A step that cannot run on fake
    tensors (it reads tensor values) is traced for real, as before.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import InfeasibleBudget, ModelError
from memfit.job.device_memory import Job, resolve_job
from memfit.planning.plan import Plan
from memfit.profiling.profile import Profile
from memfit.profiling.tracer import ProfileMode
from memfit.units import format_bytes

log = logging.getLogger(__name__)

__all__ = ["largest_batch", "BatchFit", "Probe", "with_largest_batch", "batch_of", "sliced_maker",
           "HOST_SHARE"]

HOST_SHARE = 4  # a real probe's plain step takes at most a quarter of the host's available memory


@dataclass(frozen=True)
class Probe:
    """One size the search profiled and planned."""

    n: int
    fits: bool
    smallest_total_bytes: int   # the whole job with the smallest plan (0: the model refused n)
    overhead: float | None      # the fastest fitting plan's predicted overhead (None: none fits)
    error: str | None = None    # what the model raised at n (NOTE [largest batch search])
    mode: ProfileMode = ProfileMode.MEASURE  # real or fake tensors (NOTE [largest batch on fake tensors])


@dataclass(frozen=True)
class BatchFit:
    """The answer of ``largest_batch``.

    Attributes:
        batch: the largest ``n`` whose best plan fits.
        plan: that plan (``plan.memory`` is its breakdown).
        probes: every size profiled, in order (NOTE [largest batch search]).
        mode: whether the answer's plan was made from a real step or from fake tensors
            (NOTE [largest batch on fake tensors]).
    """

    batch: int
    plan: Plan
    probes: tuple[Probe, ...]
    mode: ProfileMode = ProfileMode.MEASURE

    @property
    def overhead(self) -> float:
        """The plan's predicted recompute, a fraction of the plain step."""
        return self.plan.overhead

    @property
    def model_limit(self) -> str | None:
        """What the model raised at ``batch + 1`` when its own limit (a maximum sequence
        length), not the device, bounded the search; None otherwise."""
        over = next((p for p in self.probes if p.n == self.batch + 1), None)
        return over.error if over is not None else None

    def __str__(self) -> str:
        over = next((p for p in self.probes if p.n == self.batch + 1), None)
        tail = (f"; the model's own limit bounded the search: at {self.batch + 1} it raised "
                f"{over.error}" if over is not None and over.error is not None
                else f"; {self.batch + 1} needs {format_bytes(over.smallest_total_bytes)} with its "
                "smallest plan" if over is not None and not over.fits and over.overhead is None
                else f"; {self.batch + 1} fits no plan within the overhead cap" if over is not None
                else "")
        fake = sum(p.mode is ProfileMode.FAKE for p in self.probes)
        how = ("" if not fake else f", {fake} of them on fake tensors" if fake < len(self.probes)
               else ", on fake tensors")
        answer = ("its plan made on fake tensors" if self.mode is ProfileMode.FAKE
                  else "its plan made on a real step")
        return (f"largest batch that fits: {self.batch} (+{self.overhead:.1%} predicted step time, "
                f"{len(self.probes)} sizes profiled{how}{tail}; {answer})\n{self.plan}")


def largest_batch(make: Callable[[int], tuple[Any, ...]], job: Job | None = None, *,
                  max_overhead: float | None = None, target: str | None = None,
                  solver: str = "auto", limit: int = 1 << 20,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  mode: ProfileMode | str | None = None, **old_job_keywords: Any) -> BatchFit:
    """The largest ``n`` for which ``make(n)``'s step has a plan that fits ``job``'s device.

    Args:
        make: ``n -> (model, example_inputs)``, or ``(model, example_inputs, loss_fn)`` for
            a loss made for those inputs; the caller decides what ``n`` is (batch size,
            sequence length). It may return the same model each time.
        job: the job on its device, a ``memfit.Job`` (``memfit.Job(device="80GiB",
            optimizer="adamw")``), as in ``memfit.fit``; the old keywords
            (``device_memory=``, ``optimizer=``, ...) are deprecated (NOTE [the old job
            keywords] in ``memfit.job.device_memory``).
        max_overhead: the most predicted recompute allowed, a fraction of the plain step
            (``0.2``: +20%); default None: any.
        target: plan for a device preset in fake mode (``"h100"``); default: where the
            model is (fake mode for a model on the meta device).
        solver: the planner's solver. limit: the largest ``n`` tried.
        loss_fn: output -> loss, as in ``memfit.fit``.
        mode: ``"measure"`` (real steps) or ``"fake"`` (fake tensors) for every size;
            default None: fake tensors for a size whose plain step peaks above
            ``1 / HOST_SHARE`` of the host's available memory, real steps below (NOTE
            [largest batch on fake tensors]).

    Returns:
        A :class:`BatchFit`: ``.batch``, ``.plan``, ``.overhead``, ``.probes``, ``.mode``, and
        ``.model_limit``: what the model raised at ``batch + 1`` when its own limit (a maximum
        sequence length) bounded the search, not the device.

    Raises:
        InfeasibleBudget: not even ``n = 1`` fits (its breakdown on ``.memory``).

    Example:
        >>> make = lambda n: (model, torch.randint(0, 512, (n, 128)))      # doctest: +SKIP
        >>> memfit.largest_batch(make, memfit.Job(device="80GiB", optimizer="adamw")).batch  # doctest: +SKIP
    """
    _, found = resolve_job("largest_batch", job, old_job_keywords)
    if found is None:
        raise TypeError("largest_batch needs the device to search for: "
                        "largest_batch(make, memfit.Job(device='80GiB', optimizer=...))")
    job = found
    if max_overhead is not None and not (isinstance(max_overhead, int | float) and max_overhead >= 0):
        raise ValueError(f"max_overhead must be a fraction >= 0 (0.2 for +20%), got {max_overhead!r}")
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive int, got {limit!r}")
    sizes = _Sizes(make, loss_fn, target, None if mode is None else _profile_mode(mode),
                   job.device_memory_bytes)
    probes: dict[int, Probe] = {}

    def probe(n: int) -> Probe:
        if n not in probes:
            try:
                probes[n] = _probe(n, sizes, solver, max_overhead, job,
                                   calibrated=max_overhead is not None)
            except (ModelError, ValueError) as e:  # NOTE [largest batch search]: the model's limit
                if n == 1:
                    raise
                probes[n] = Probe(n, False, 0, None, error=_first_line(e))
        return probes[n]

    first = probe(1)
    if not first.fits:
        _raise_for_one(sizes, solver, job, max_overhead)
    lo, hi = 1, None if limit > 1 else 2
    while hi is None or hi - lo > 1:
        n = _next_size(lo, hi, probes, device_memory_bytes=sizes.device_bytes, limit=limit)
        if n is None:
            break
        if probe(n).fits:
            lo = n
        else:
            hi = n
    best, mode = _final_plan(lo, sizes, solver, job)
    return BatchFit(lo, best, tuple(probes.values()), mode)


def _next_size(lo: int, hi: int | None, probes: dict[int, Probe], *, device_memory_bytes: int,
               limit: int) -> int | None:
    """The next size to probe (NOTE [largest batch search]); None when the search is done."""
    top = limit if hi is None else hi - 1
    if lo >= top:
        return None
    guess: int | None = None
    pts = sorted(probes.values(), key=lambda p: p.n)[-2:] if hi is None else [
        probes[lo], probes[hi]]
    if len(pts) == 2 and pts[1].smallest_total_bytes > pts[0].smallest_total_bytes:
        slope = (pts[1].smallest_total_bytes - pts[0].smallest_total_bytes) / (pts[1].n - pts[0].n)
        guess = pts[0].n + math.floor((device_memory_bytes - pts[0].smallest_total_bytes) / slope)
    if guess is not None and lo < guess <= top and guess not in probes:
        return guess
    if guess is not None and guess in probes and guess + 1 <= top and guess + 1 not in probes:
        return guess + 1  # the prediction was probed: the size above it settles the bracket
    if hi is None:
        return min(2 * lo, limit)
    return (lo + hi) // 2


def _first_line(e: Exception) -> str:
    """``e`` for a one-line report: a ``ModelError`` says itself; another error its type too."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    return text if isinstance(e, ModelError) else f"{type(e).__name__}: {text}"


def _profile_mode(mode: ProfileMode | str) -> ProfileMode:
    try:
        return ProfileMode(mode)
    except ValueError:
        raise ValueError(f"mode must be 'measure', 'fake' or None (real steps where the host "
                         f"has room), got {mode!r}") from None


@dataclass(frozen=True)
class _Sizes:
    """``make`` and how its steps are profiled (NOTE [largest batch on fake tensors])."""

    make: Callable[[int], tuple[Any, ...]]
    loss_fn: Callable[[Any], torch.Tensor] | None
    target: str | None
    mode: ProfileMode | None  # None: fake tensors where the plain step is too large to run here
    device_bytes: int         # the device searched for: no real step above its size

    def profile(self, n: int, calibrated: bool) -> Profile:
        made = self.make(n)
        if not (isinstance(made, tuple) and len(made) in (2, 3)
                and isinstance(made[0], torch.nn.Module)):
            raise TypeError(f"make({n}) must return (model, example_inputs), got "
                            f"{type(made).__name__}")
        model, inputs = made[:2]
        # (model, inputs, loss_fn): a loss that depends on the inputs
        loss_fn = made[2] if len(made) == 3 else self.loss_fn
        from memfit.measuring.twins import lifted_plan

        # a fitted model's plan (and its re-planning at a new shape) lifted while its plain
        # step is traced, as fit does: a planned model does not trace on fake tensors, and a
        # real step at every probed size is what NOTE [largest batch on fake tensors] avoids
        with lifted_plan(model):
            return self._profile(n, model, inputs, loss_fn, calibrated)

    def _profile(self, n: int, model: torch.nn.Module, inputs: Any,
                 loss_fn: Callable[[Any], torch.Tensor] | None, calibrated: bool) -> Profile:
        on_meta = any(p.device.type == "meta" for p in model.parameters())
        mode = (ProfileMode.FAKE if on_meta or (self.target is not None and self.target != "cpu")
                else self.mode)
        if mode is not None:
            return _trace(model, inputs, loss_fn, self.target, mode, calibrated)
        try:
            fake = _trace(model, inputs, loss_fn, self.target, ProfileMode.FAKE, calibrated)
        except Exception as e:  # a step that reads tensor values: real tensors, as before
            log.info("largest_batch: make(%d)'s step does not run on fake tensors (%s: %s); "
                     "traced for real", n, type(e).__name__, e)
            return _trace(model, inputs, loss_fn, self.target, ProfileMode.MEASURE, calibrated)
        host_bytes = host_available_bytes()
        if fake.peak_bytes > min(host_bytes // HOST_SHARE, self.device_bytes):
            log.info("largest_batch: make(%d)'s plain step peaks at %s, above the device's %s "
                     "or 1/%d of the %s this host has available: profiled on fake tensors", n,
                     format_bytes(fake.peak_bytes), format_bytes(self.device_bytes), HOST_SHARE,
                     format_bytes(host_bytes))
            return fake
        return _trace(model, inputs, loss_fn, self.target, ProfileMode.MEASURE, calibrated)


def host_available_bytes() -> int:
    """The memory this host has available for new work (``MemAvailable``: free plus the
    page cache it can drop); the free pages where that is not known; 0 where neither is."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the line is in KiB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def _trace(model: torch.nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
           target: str | None, mode: ProfileMode, calibrated: bool) -> Profile:
    if calibrated:
        from memfit.measuring.calibration import profile

        return profile(model, inputs, loss_fn=loss_fn, mode=mode, target=target or "cpu")
    from memfit.profiling.tracer import trace

    return trace(model, inputs, loss_fn=loss_fn, mode=mode, target=target or "cpu", repeats=1)


def _probe(n: int, sizes: _Sizes, solver: str, max_overhead: float | None, job: Job,
           calibrated: bool) -> Probe:
    from memfit.planning.job import job_memory, model_memory
    from memfit.planning.planner import plan_for_budget

    prof = sizes.profile(n, calibrated)
    mode = ProfileMode(prof.mode)
    spec = job.spec(prof)
    try:
        p = plan_for_budget(prof, job=spec, solver=solver)
    except InfeasibleBudget as e:
        assert e.memory is not None
        return Probe(n, False, e.memory.total_bytes, None, mode=mode)
    smallest = plan_for_budget(prof, budget="min", solver=solver)
    total = job_memory(model_memory(prof.parameters, prof.buffer_bytes, spec), spec,
                       smallest.predicted_peak_bytes).total_bytes
    fits = max_overhead is None or p.overhead <= max_overhead
    return Probe(n, fits, total, p.overhead, mode=mode)


def _plan(prof: Profile, solver: str, job: Job) -> Plan:
    from memfit.planning.planner import plan_for_budget

    return plan_for_budget(prof, solver=solver, job=job.spec(prof))


def _final_plan(n: int, sizes: _Sizes, solver: str, job: Job) -> tuple[Plan, ProfileMode]:
    prof = sizes.profile(n, calibrated=True)
    return _plan(prof, solver, job), ProfileMode(prof.mode)


def _raise_for_one(sizes: _Sizes, solver: str, job: Job, max_overhead: float | None) -> None:
    prof = sizes.profile(1, calibrated=max_overhead is not None)
    try:
        p = _plan(prof, solver, job)
    except InfeasibleBudget as e:
        raise InfeasibleBudget(f"not even a batch of 1 fits: {e}", budget_bytes=e.budget_bytes,
                               min_feasible_bytes=e.min_feasible_bytes, memory=e.memory,
                               fits_with=e.fits_with) from None
    raise InfeasibleBudget(
        f"a batch of 1 fits only with a plan of +{p.overhead:.1%} predicted step time, above "
        f"max_overhead={max_overhead}; raise max_overhead or the device memory",
        budget_bytes=p.budget_bytes or 0, min_feasible_bytes=p.predicted_peak_bytes,
        memory=p.memory)


def with_largest_batch(e: InfeasibleBudget, make: Callable[[int], tuple[Any, ...]],
                       batch: int | None, job: Job, **search: Any) -> InfeasibleBudget:
    """``e`` (a job that does not fit at ``batch``) with the largest smaller batch that fits
    with its smallest plan named, found by ``largest_batch``; ``e`` itself when none does, or
    when the device holds the job and ``budget=`` is the cap that binds (``e.memory.fits``)."""
    if e.memory is None or e.memory.fits or batch is None or batch <= 1:
        return e
    try:
        found = largest_batch(make, job, limit=batch - 1, **search)
    except (InfeasibleBudget, ValueError, TypeError):
        return e
    hint = f"a batch of {found.batch} (the largest that fits, +{found.overhead:.1%} step time)"
    return InfeasibleBudget(f"{e}; {hint}" if e.fits_with else f"{e}\nWould fit: {hint}",
                            budget_bytes=e.budget_bytes, min_feasible_bytes=e.min_feasible_bytes,
                            memory=e.memory, fits_with=(*e.fits_with, hint))


def batch_of(inputs: Any) -> int | None:
    """The batch of example inputs: the leading size their tensors share (None: none)."""
    from memfit.step.inputs import iter_tensors

    sizes = {int(t.shape[0]) for t in iter_tensors(inputs) if t.dim()}
    return sizes.pop() if len(sizes) == 1 else None


def sliced_maker(model: torch.nn.Module, inputs: Any) -> Callable[[int], tuple[torch.nn.Module, Any]]:
    """``n -> (model, the first n rows of every input tensor)``, for sizes below the batch."""
    from memfit.step.inputs import map_tensors

    return lambda n: (model, map_tensors(lambda t: t[:n] if t.dim() else t, inputs))
