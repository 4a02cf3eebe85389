"""Op timing alone: the cheap dispatch mode of the profiler's repeated timing runs.

NOTE [CUDA op times]
    A CUDA op returns as soon as its kernels are queued, so ``perf_counter`` around it
    measures the launch, not the work. For an op on a CUDA tensor the timer records a CUDA
    event before and after it on the current stream instead, and reads the elapsed times
    once, after one ``synchronize`` when ``times`` is first read. CPU ops keep
    ``perf_counter``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from memfit._torch import TorchDispatchMode

__all__ = ["OpTimer"]


def _on_cuda(args: Any, kwargs: dict) -> bool:
    """True if a tensor argument (top level or in a list) of the call lives on a CUDA device."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.is_cuda
        if isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, torch.Tensor):
                    return v.is_cuda
    return False


class OpTimer(TorchDispatchMode):
    """Times every op of a step and nothing else (cheap repeats): ``perf_counter`` on CPU,
    CUDA events on CUDA (NOTE [CUDA op times]).

    Attributes:
        times: seconds per op, in dispatch order (read after the step).
        names: the ops' names.
    """

    def __init__(self) -> None:
        super().__init__()
        self._times: list[float] = []
        self._events: dict[int, tuple[Any, Any]] = {}  # op index -> (start, end) CUDA events
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _on_cuda(args, kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = func(*args, **kwargs)
            end.record()
            self._events[len(self._times)] = (start, end)
            self._times.append(0.0)
        else:
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            self._times.append(time.perf_counter() - t0)
        self.names.append(func.__name__)
        return out

    @property
    def times(self) -> list[float]:
        if self._events:
            torch.cuda.synchronize()
            for i, (start, end) in self._events.items():
                self._times[i] = start.elapsed_time(end) / 1e3  # ms -> s
            self._events.clear()
        return self._times
