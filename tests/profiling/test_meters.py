"""Memory meters behind one interface, chosen by device; no import cycle in profiling."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import mlp

from memfit.profiling.meters import (
    AllocatorMeter,
    CudaMeter,
    DispatchMeter,
    Meter,
    allocator_peak,
    meters_for,
)


@pytest.mark.parametrize(("device", "meter", "kinds"), [
    ("cpu", Meter.BOTH, [AllocatorMeter, DispatchMeter]),
    ("cpu", Meter.ALLOCATOR, [AllocatorMeter]),
    ("cpu", Meter.DISPATCH, [DispatchMeter]),
    ("meta", Meter.BOTH, [DispatchMeter]),
    ("cuda", Meter.BOTH, [CudaMeter, DispatchMeter]),  # constructed only: no GPU needed
    ("cuda", Meter.ALLOCATOR, [CudaMeter]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_meters_are_chosen_by_device(device: str, meter: Meter, kinds: list[type]) -> None:
    assert [type(m) for m in meters_for(torch.device(device), meter)] == kinds


def test_unsupported_device_is_refused() -> None:
    with pytest.raises(ValueError, match="supports cpu and cuda devices, got mps"):
        meters_for(torch.device("mps"), Meter.BOTH)


def test_nested_cpu_meters_agree_to_the_byte_on_one_run() -> None:
    model, x = mlp(), torch.randn(32, 64)
    with AllocatorMeter() as alloc, DispatchMeter() as dispatch:
        model(x).sum().backward()
    # Linear(64,128) -> ReLU -> Linear(128,10) on 32 rows: the dispatch meter sees every
    # activation and gradient; nothing here has a kernel workspace.
    assert dispatch.peak_bytes == alloc.peak_bytes > 0


def test_allocator_peak_is_the_allocator_meter() -> None:
    with AllocatorMeter() as m:
        torch.ones(2048)
    assert m.peak_bytes == allocator_peak(lambda: torch.ones(2048)) == 8192


def test_measuring_imports_no_op_recorder() -> None:
    # measure -> meters -> storages: the profiler's recorder (tracker, which measures kernel
    # workspaces with the allocator meter) is not needed, so the two cannot import each other.
    code = textwrap.dedent("""
        import sys
        import memfit.profiling.measure
        import memfit.profiling.workspace
        print(sorted(m for m in sys.modules if m == "memfit.profiling.tracker"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
