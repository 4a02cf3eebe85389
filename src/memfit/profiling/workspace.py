"""Kernel workspaces: memory an op's kernel allocates inside itself, beyond its outputs.

NOTE [workspace measurement]
    A kernel's internal buffers (NOTE [kernel workspaces] in ``memfit.profiling.profile``) are
    invisible to a dispatch mode. With ``measure_workspace=True`` the traced run runs under
    the CPU allocator's event log (``torch.profiler`` with ``profile_memory=True``, as
    ``memfit.profiling.meters.AllocatorMeter``), and the tracker marks each op's kernel call
    with a profiler span (``memfit._torch.profiler_marker``, about 1 us). After the run, the
    allocator events inside op ``i``'s span give its local peak (above the memory live when
    it started), and ``workspace = max(0, local peak - bytes of its new output storages)``.
    Every op is measured where it runs, with its real arguments, once: no op is named in
    advance and none is run twice (a batch norm's running statistics are updated once, a
    random op draws once). Measured so, with no list of ops:
    - convolutions (im2col buffers), flash attention (its backward's per-thread scratch:
      16,640 B on a 4-layer ViT's attention, +8.6% before), batch norm (per-channel
      vectors), matrix products packing their operands (bfloat16 with AMX, or a transposed
      float32 operand: 128 KiB for a 128 x 256 one);
    - the ``linalg`` kernels and ``matrix_exp`` (Pade approximants: several products of the
      matrix with itself; ``torch.nn.utils.parametrizations.orthogonal``'s backward of two
      128 x 128 maps peaked 3,080,216 B over its profile before, 4.5x the plain peak).
    The collector is off while the meter runs: a kernel releases the GIL, and a collection
    in another thread (pytest-xdist's, a user's) that frees a tensor inside an op's span
    lowered that op's workspace (a convolution's 110,592 B read 110,556 once). Before this,
    a rerun of each op on a list, each under its own profiler session (4 ms per
    distinct call), missed every op not on the list. The spans and events share the
    profiler's clock. Under another torch profiler the meter does not start (it would end
    that profiler's session) and measures nothing, with a warning. CPU only: on CUDA workspaces come from the caching allocator
    (``torch.cuda.max_memory_allocated``), not modelled yet.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from memfit._native_output import silenced_fd
from memfit._torch import cpu_marked_spans, cpu_memory_events, profiler_active, profiler_marker
from memfit.profiling.meters import end_deferred

__all__ = ["WorkspaceMeter"]

log = logging.getLogger(__name__)

_MARK = "memfit.workspace_op"


class WorkspaceMeter:
    """Kernel workspaces of every op of one run, from the CPU allocator's events (NOTE
    [workspace measurement]).

    ``start()`` before the run, ``span()`` around each op's kernel call, ``stop()`` after it,
    then ``workspaces(new_output_bytes)``.

    Attributes:
        enabled: False when the meter did not start (another profiler is recording).
        seconds: wall seconds spent starting, stopping and reading the meter.

    Example:
        >>> import torch
        >>> meter = WorkspaceMeter(); meter.start()
        >>> x, w = torch.randn(1, 2, 8, 8, 8), torch.randn(4, 2, 3, 3, 3)
        >>> with meter.span():
        ...     y = torch.nn.functional.conv3d(x, w, padding=1)
        >>> meter.stop(); meter.workspaces([y.untyped_storage().nbytes()])[0] > 0
        True
    """

    def __init__(self) -> None:
        self.enabled = True
        self.seconds = 0.0
        self._prof: Any = None
        self._gc_was_enabled = False
        self._spans: list[tuple[int, int]] = []
        self._events: list[tuple[int, int]] = []

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        end_deferred()  # NOTE [deferred meter ends] in memfit.profiling.meters
        if profiler_active():  # starting one would end the caller's session
            log.warning("kernel workspaces not measured: another torch profiler is recording")
            self.enabled = False
            return
        t0 = time.perf_counter()
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        try:
            with silenced_fd(2):  # the profiler's native side prints a line at each start and stop
                prof.start()
        except RuntimeError as e:  # another profiler active
            log.warning("kernel workspaces not measured (%s)", e)
            self.enabled = False
        else:
            self._prof = prof
            self._gc_was_enabled = gc.isenabled()
            gc.disable()  # no collection frees a tensor inside an op's span (NOTE above)
        self.seconds += time.perf_counter() - t0

    def span(self) -> Any:
        """A context manager marking one op's kernel call."""
        return profiler_marker(_MARK) if self._prof is not None else contextlib.nullcontext()

    def stop(self) -> None:
        if self._prof is None:
            return
        t0 = time.perf_counter()
        if self._gc_was_enabled:
            gc.enable()
        with silenced_fd(2):
            self._prof.stop()
        self._events = cpu_memory_events(self._prof)
        self._spans = cpu_marked_spans(self._prof, _MARK)
        self._prof = None
        self.seconds += time.perf_counter() - t0

    def workspaces(self, new_output_bytes: Sequence[int]) -> list[int]:
        """Per op (in span order): bytes its kernel held beyond its new outputs at its local
        peak; all 0 when nothing was measured or the spans do not match the ops."""
        n = len(new_output_bytes)
        if not self._spans:
            return [0] * n
        if len(self._spans) != n:
            log.warning("kernel workspaces not measured: %d op spans recorded for %d ops",
                        len(self._spans), n)
            return [0] * n
        at = np.array([t for t, _ in self._events], dtype=np.int64)
        cum = np.concatenate([[0], np.cumsum(np.array([b for _, b in self._events], dtype=np.int64))])
        out = []
        for (s, e), new in zip(self._spans, new_output_bytes, strict=True):
            lo, hi = int(np.searchsorted(at, s, "left")), int(np.searchsorted(at, e, "right"))
            peak = int((cum[lo + 1: hi + 1] - cum[lo]).max()) if hi > lo else 0
            out.append(max(0, peak - int(new)))
        return out
