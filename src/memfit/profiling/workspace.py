"""Kernel workspaces: memory an op's kernel allocates inside itself, beyond its outputs.

NOTE [workspace measurement]
    A kernel's internal buffers (NOTE [kernel workspaces] in ``memfit.profiling.profile``) are
    invisible to a dispatch mode, so with ``measure_workspace=True`` the tracker runs an op
    that may have one (``memfit.ops.uses_workspace``: a convolution, an attention kernel, a
    batch norm, a matrix product) and that writes no input once more right after its real call (a batch norm
    in training without its running statistics, which it would update a second time;
    same outputs and, on CPU, the same workspace), inside its dispatch handler (where the mode is
    already off, so the rerun is not recorded), under ``torch.no_grad`` and the CPU allocator
    meter (``memfit.profiling.meters.AllocatorMeter``); its outputs are dropped.
    ``workspace = max(0, allocator peak - bytes of its new output storages)`` is the excess
    over its outputs at the op's local peak. :class:`WorkspaceProbe` caches the result per op
    and argument signature (shapes, strides, dtypes, devices, non-tensor arguments), so a
    network measures each distinct convolution once. The rerun is outside the op's timed
    span. CPU only: on CUDA workspaces come from the caching allocator
    (``torch.cuda.max_memory_allocated``), not modelled yet.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from memfit.ops import uses_workspace, without_statistics
from memfit.profiling.meters import allocator_peak
from memfit.profiling.storages import iter_arg_tensors, out_tensors, storage_key, storage_of

__all__ = ["WorkspaceProbe", "measure_workspace", "uses_workspace"]

log = logging.getLogger(__name__)


def measure_workspace(func: Any, args: Any, kwargs: dict[str, Any]) -> int:
    """Bytes ``func`` allocates inside itself beyond its new outputs, per the CPU allocator.

    Runs ``func(*args, **kwargs)`` once under ``torch.no_grad`` and the allocator meter; the
    outputs are dropped. Call it where no dispatch mode would record the rerun.

    Example:
        >>> x, w = torch.randn(1, 2, 8, 8, 8), torch.randn(4, 2, 3, 3, 3)
        >>> conv = torch.ops.aten.convolution.default
        >>> measure_workspace(conv, (x, w, None, [1] * 3, [1] * 3, [1] * 3, False, [0] * 3, 1), {}) > 0
        True
    """
    held = {storage_key(st) for t in iter_arg_tensors(args, kwargs) if (st := storage_of(t)) is not None}
    out_bytes: list[int] = []

    def rerun() -> None:
        out = func(*args, **kwargs)
        seen: set[int] = set()
        total = 0
        for t in out_tensors(out):
            st = storage_of(t)
            if st is None:
                continue
            key = storage_key(st)
            if key not in held and key not in seen:
                seen.add(key)
                total += st.nbytes()
        out_bytes.append(total)

    with torch.no_grad():
        peak = allocator_peak(rerun)
    return max(0, peak - out_bytes[0])


def _arg_key(x: Any) -> Any:
    """A hashable signature of op arguments: tensors by shape, strides, dtype and device."""
    if isinstance(x, torch.Tensor):
        strides = x.stride() if x.layout is torch.strided else ()
        return ("T", tuple(x.shape), tuple(strides), x.dtype, x.device.type, x.layout)
    if isinstance(x, (list, tuple)):
        return tuple(_arg_key(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((str(k), _arg_key(v)) for k, v in x.items()))
    return x


class WorkspaceProbe:
    """Measures kernel workspaces op by op, once per op and argument signature.

    Attributes:
        enabled: False once measuring became impossible (another profiler is active).
        runs: isolated reruns done (cache misses).
        seconds: wall seconds spent in them.
    """

    def __init__(self) -> None:
        self.enabled = True
        self.runs = 0
        self.seconds = 0.0
        self._cache: dict[Any, int] = {}

    def __call__(self, func: Any, args: Any, kwargs: dict[str, Any]) -> int:
        """Workspace bytes of this call of ``func`` (0 where not measured).

        Only plain CPU tensors are measured: CUDA workspaces are not modelled, and subclasses
        (fake tensors) allocate nothing.
        """
        if not self.enabled or not uses_workspace(func):
            return 0
        # batch norm in training: rerun without its statistics (same outputs, no second
        # update of the model's buffers; its workspace measured the same on CPU)
        args = without_statistics(func, args, kwargs)
        if any(t.device.type != "cpu" or type(t) not in (torch.Tensor, torch.nn.Parameter)
               for t in iter_arg_tensors(args, kwargs)):
            return 0
        key: Any
        try:
            key = (str(func), _arg_key(args), _arg_key(kwargs))
            hash(key)
        except TypeError:
            key = None
        hit = self._cache.get(key) if key is not None else None
        if hit is None:
            t0 = time.perf_counter()
            try:
                hit = measure_workspace(func, args, kwargs)
            except RuntimeError as e:  # another profiler active: the meter cannot start
                log.warning("workspace of %s not measured (%s); further ops are not measured", func, e)
                self.enabled = False
                return 0
            self.runs += 1
            self.seconds += time.perf_counter() - t0
            if key is not None:
                self._cache[key] = hit
        return hit
