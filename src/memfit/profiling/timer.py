"""Op timing alone: the cheap dispatch mode of the profiler's repeated timing runs."""

from __future__ import annotations

import time
from typing import Any

from memfit._torch import TorchDispatchMode

__all__ = ["OpTimer"]


class OpTimer(TorchDispatchMode):
    """Times every op of a step with ``time.perf_counter`` and nothing else (cheap repeats)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.times.append(time.perf_counter() - t0)
        self.names.append(func.__name__)
        return out
