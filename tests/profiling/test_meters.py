"""Memory meters behind one interface, chosen by device; no import cycle in profiling."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from profiling_models import mlp

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


@pytest.mark.processes
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


class _FakeAllocator:
    """torch.cuda's allocator counters, scripted: the previous step's peak (9000) is still
    recorded until ``reset_peak_memory_stats`` sets the peak to what is allocated now."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.allocated, self.peak = 1000, 9000
        self.reserved, self.reserved_peak = 4096, 16384

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def note(name, value=None):
            def f(*args, **kwargs):
                self.calls.append(name)
                return value() if value is not None else None
            return f

        monkeypatch.setattr(torch.cuda, "synchronize", note("synchronize"))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", note("reset", self._reset))
        monkeypatch.setattr(torch.cuda, "memory_allocated", note("allocated", lambda: self.allocated))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", note("max", lambda: self.peak))
        monkeypatch.setattr(torch.cuda, "memory_reserved", note("reserved", lambda: self.reserved))
        monkeypatch.setattr(torch.cuda, "max_memory_reserved",
                            note("max_reserved", lambda: self.reserved_peak))

    def _reset(self) -> None:
        self.peak, self.reserved_peak = self.allocated, self.reserved

    def run_step(self) -> None:
        """A step that allocates 3000 bytes above its start (a new 8 KiB segment), frees them."""
        self.peak = max(self.peak, self.allocated + 3000)
        self.reserved_peak = max(self.reserved_peak, self.reserved + 8192)


def test_cuda_meter_reads_the_peak_of_this_step_above_its_start(monkeypatch):
    fake = _FakeAllocator()
    fake.install(monkeypatch)
    with CudaMeter(torch.device("cuda", 0)) as m:
        fake.run_step()
    assert fake.calls[:2] == ["synchronize", "reset"]  # reset before the start is read
    assert fake.calls[-3:-2] == ["synchronize"]        # synchronised before the peak is read
    assert (m.peak_bytes, m.reserved_peak_bytes) == (3000, 8192)


class _FakeEvent:
    clock = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = None

    def record(self, stream=None) -> None:
        _FakeEvent.clock += 0.25  # ms of GPU time between two recorded events
        self.t = _FakeEvent.clock

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.t - self.t


def test_op_timer_times_cuda_ops_with_events_read_after_one_synchronize(monkeypatch):
    """No GPU here: the CUDA branch is forced and the events scripted, to check that times
    come from the events (in seconds), not from the launch, and are read once, synchronised."""
    from memfit.profiling import timer as timer_mod

    syncs: list[int] = []
    monkeypatch.setattr(timer_mod, "_on_cuda", lambda args, kwargs: True)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    t = timer_mod.OpTimer()
    with t:
        torch.ones(3).sin().cos()
    assert t.names == ["ones.default", "sin.default", "cos.default"]
    assert t.times == [0.25e-3] * 3 and syncs == [1]
    assert t.times == [0.25e-3] * 3 and syncs == [1]  # resolved once


def test_cuda_profile_takes_op_times_from_the_timing_runs_only(monkeypatch):
    """On CUDA the traced run's wall-clock op times are launch times: only the OpTimer runs'
    (event) times count, and one timing run is made even with ``repeats=1``."""
    import dataclasses

    import memfit.profiling.tracer as tracer_mod
    from memfit.profiling.tracker import OpTimer

    real_setup = tracer_mod._setup
    monkeypatch.setattr(tracer_mod, "_setup",
                        lambda *a, **k: dataclasses.replace(real_setup(*a, **k), device=torch.device("cuda")))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    runs: list[int] = []

    class Counting(OpTimer):  # the timing run's op times: 1 ms per op, recognisably
        @property
        def times(self) -> list[float]:
            runs.append(1)
            return [1e-3] * len(super().times)

    monkeypatch.setattr(tracer_mod, "OpTimer", Counting)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    prof = tracer_mod.trace(model, torch.randn(4, 8), repeats=1)
    assert runs, "no timing run on CUDA with repeats=1"
    assert [op.time_s for op in prof.ops] == [1e-3] * len(prof.ops)


def test_cpu_profile_takes_op_times_from_the_timing_runs_only(monkeypatch):
    """NOTE [traced op times]: on a CPU too, the traced run's op times (storage tracking,
    workspace meters, fresh heap pages) are left out when timing runs exist: two timing runs
    scripted at 1 ms and 3 ms per op give every op exactly their median, 2 ms; with
    ``repeats=1`` the traced run's own times are kept (never the scripted ones)."""
    import memfit.profiling.tracer as tracer_mod
    from memfit.profiling.tracker import OpTimer

    runs: list[int] = []

    class Scripted(OpTimer):
        @property
        def times(self) -> list[float]:
            n = len(super().times)
            if not hasattr(self, "_scripted"):
                runs.append(1)
                self._scripted = [(2 * len(runs) - 1) * 1e-3] * n  # 1 ms, then 3 ms
            return self._scripted

    monkeypatch.setattr(tracer_mod, "OpTimer", Scripted)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    prof = tracer_mod.trace(model, torch.randn(4, 8), repeats=3)
    assert len(runs) == 2
    assert [op.time_s for op in prof.ops] == [2e-3] * len(prof.ops)
    runs.clear()
    one = tracer_mod.trace(model, torch.randn(4, 8), repeats=1)
    assert not runs
    assert all(op.time_s > 0.0 and op.time_s not in (1e-3, 2e-3, 3e-3) for op in one.ops)
