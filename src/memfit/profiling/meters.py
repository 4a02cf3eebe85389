"""Memory meters: each watches one run of a step and reports its peak bytes above the start.

A meter is a context manager; after the block, ``peak_bytes`` holds what it saw. Meters nest
(``measure`` runs the dispatch meter inside the allocator meter, so both watch the same run).
:func:`meters_for` picks them by device.

NOTE [two CPU meters]
    ``dispatch`` (:class:`DispatchMeter`): live storages seen by a dispatch mode, each counted
    once (``memfit.profiling.storages``). It sees every tensor an aten op returns, but not
    buffers a kernel allocates and frees inside itself (3D-convolution workspaces).
    ``allocator`` (:class:`AllocatorMeter`): the CPU allocator's own alloc/free events, from
    ``torch.profiler.profile(profile_memory=True)``; it sees kernel workspaces too, and is the
    ground truth on CPU. The dispatch meter allocates no tensor memory, so the two are
    comparable op for op. Neither counts memory freed during the step that was allocated
    before it in the same way: the dispatch meter ignores such frees, the allocator subtracts
    them; a step that should be measured cleanly starts with ``.grad`` set to None.

On CUDA, :class:`CudaMeter` reads the caching allocator's ``max_memory_allocated`` after
``reset_peak_memory_stats``, minus ``memory_allocated`` at the start (NOTE [CUDA meter]).
"""

from __future__ import annotations

import atexit
import enum
import logging
from collections.abc import Callable
from typing import Any

import torch

from memfit._native_output import silenced_fd
from memfit._torch import cpu_marked_spans, cpu_memory_events
from memfit.profiling.storages import LiveStorages

log = logging.getLogger(__name__)

__all__ = ["Meter", "PeakMeter", "AllocatorMeter", "DispatchMeter", "CudaMeter", "meters_for",
           "allocator_peak", "defer_end", "end_deferred"]


# NOTE [deferred meter ends] A meter that cannot end where its step ends (the training
# monitor's, started in a forward pre-hook and ended at the model's next call: NOTE [monitoring
# a training run] in memfit.runtime.monitor) registers its end here, and every CPU profiler
# memfit starts (AllocatorMeter, the workspace meter) ends those first: two torch profilers
# cannot record at once, and the monitored step is over by then. Those still waiting when the
# interpreter exits are ended by an atexit handler: a torch profiler left recording crashes
# the interpreter's shutdown (SIGSEGV, exit status 139: torch 2.13 CPU, profile_memory=True;
# a fitted model with monitor_every=1 whose records were never read did that).
_DEFERRED: list[Callable[[], None]] = []


def defer_end(end: Callable[[], None]) -> None:
    """Register ``end`` (idempotent) to run before memfit's next CPU profiler starts."""
    _DEFERRED.append(end)


def end_deferred() -> None:
    """Run the ends ``defer_end`` registered (NOTE [deferred meter ends])."""
    while _DEFERRED:
        _DEFERRED.pop()()


@atexit.register
def _end_deferred_at_exit() -> None:
    """End the meters still waiting before the interpreter shuts down, each on its own (one
    that fails leaves no other profiler recording): NOTE [deferred meter ends]."""
    while _DEFERRED:
        end = _DEFERRED.pop()
        try:
            end()
        except Exception:
            log.warning("memfit: ending a deferred meter at exit failed", exc_info=True)


class Meter(str, enum.Enum):
    """Which CPU meters ``measure`` runs (NOTE [two CPU meters])."""

    DISPATCH = "dispatch"
    ALLOCATOR = "allocator"
    BOTH = "both"


class PeakMeter:
    """Base class: a context manager that sets ``peak_bytes`` (bytes above the start) on exit."""

    peak_bytes: int = 0

    def __enter__(self) -> PeakMeter:
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        raise NotImplementedError


class AllocatorMeter(PeakMeter):
    """The CPU allocator's alloc/free events (``torch.profiler``, ``profile_memory=True``).

    Args:
        until: count only the events up to the last span of this name
            (``memfit._torch.profiler_marker``) recorded in the block, when there is one: a
            step whose end is marked from inside autograd, where the profiler cannot be
            stopped (NOTE [monitoring a training run] in ``memfit.runtime.monitor``).
    """

    def __init__(self, until: str | None = None) -> None:
        self.until = until

    def __enter__(self) -> AllocatorMeter:
        from torch.profiler import ProfilerActivity, profile

        end_deferred()  # NOTE [deferred meter ends]
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                             record_shapes=False)
        # The profiler's native side prints a line at each start and stop.
        with silenced_fd(2):
            self._prof.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with silenced_fd(2):
            self._prof.stop()
        end = None
        if self.until is not None:
            spans = cpu_marked_spans(self._prof, self.until)
            end = spans[-1][0] if spans else None
        live = peak = 0
        for t, nbytes in cpu_memory_events(self._prof):
            if end is not None and t > end:
                break
            live += nbytes
            peak = max(peak, live)
        self.peak_bytes = peak
        del self._prof


class DispatchMeter(PeakMeter):
    """Live storages seen by a dispatch mode (``memfit.profiling.storages.LiveStorages``)."""

    def __enter__(self) -> DispatchMeter:
        self._mode = LiveStorages()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._mode.close()
        self.peak_bytes = self._mode.peak_bytes
        del self._mode


class CudaMeter(PeakMeter):
    """The CUDA caching allocator's peak above the start, allocated and reserved.

    NOTE [CUDA meter]
        1. Synchronise first: work queued before the step must not free or allocate inside
           the measurement (the allocator counts at launch, kernels finish later, but frees
           of the previous step's tensors can still be pending on other streams).
        2. ``reset_peak_memory_stats`` BEFORE reading the start: the reset sets the peak to
           what is allocated now, so ``max_memory_allocated() - start`` is the step's peak
           above its start (never negative), not an older step's peak.
        3. Synchronise again before reading the peak.
        The allocator's counts are the ground truth on CUDA (kernel workspaces included), as
        the CPU allocator's events are on CPU. ``reserved_peak_bytes`` is the same for the
        segments the caching allocator holds (what ``nvidia-smi`` sees, fragmentation
        included). A CudaMeter inside another on the same device resets the outer's peak:
        do not nest them.
    """

    reserved_peak_bytes: int = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> CudaMeter:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._start = torch.cuda.memory_allocated(self.device)
        self._start_reserved = torch.cuda.memory_reserved(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)
        self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        self.reserved_peak_bytes = (torch.cuda.max_memory_reserved(self.device)
                                    - self._start_reserved)


def meters_for(device: torch.device, meter: Meter) -> list[PeakMeter]:
    """The meters ``measure`` runs on ``device``, outermost first.

    CPU: the allocator meter, the dispatch meter, or both (the dispatch meter inside).
    ``meta``: the dispatch meter (nothing is allocated). CUDA: the CUDA meter, with the
    dispatch meter inside unless ``meter`` is ``"allocator"``.

    Raises:
        ValueError: a device other than cpu, meta and cuda.
    """
    if device.type == "cuda":
        return [CudaMeter(device)] + ([] if meter is Meter.ALLOCATOR else [DispatchMeter()])
    if device.type == "meta":
        return [DispatchMeter()]
    if device.type == "cpu":
        if meter is Meter.DISPATCH:
            return [DispatchMeter()]
        if meter is Meter.ALLOCATOR:
            return [AllocatorMeter()]
        return [AllocatorMeter(), DispatchMeter()]
    raise ValueError(f"measure supports cpu and cuda devices, got {device}")


def allocator_peak(step: Callable[[], object]) -> int:
    """Peak bytes above the start seen by the CPU allocator while ``step`` runs.

    Example:
        >>> allocator_peak(lambda: torch.ones(1024))   # 4 KiB allocated, then freed
        4096
    """
    with AllocatorMeter() as m:
        step()
    return m.peak_bytes
