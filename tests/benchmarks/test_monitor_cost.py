"""benchmarks.monitor_cost's arithmetic on hand-made rows: the amortized N and the target."""

from __future__ import annotations

import pytest
from benchmarks.monitor_cost import derived, meets


def _row(method: str, cpu_s: float, wall_s: float) -> dict:
    return {"method": method, "cpu_step_median_s": cpu_s, "step_median_s": wall_s,
            "cpu_ratio_to_none": cpu_s / 0.100, "ratio_to_none": wall_s / 0.200}


ROWS = [_row("none", 0.100, 0.200), _row("every=1", 0.125, 0.260),
        _row("every=10", 0.1025, 0.180), _row("every=50", 0.1005, 0.230)]


def test_derived_amortizes_one_monitored_step():
    d = derived(ROWS)
    assert d["cpu_extra_per_monitored_step_s"] == pytest.approx(0.025)
    assert d["extra_per_monitored_step_s"] == pytest.approx(0.060)
    assert d["least_every_within_target"] == 25  # 25 ms once in 25 steps of 100 ms: 1%


def test_meets_reads_cpu_time_only():
    assert meets({"rows": ROWS}) == ["every=50"]  # every=10's wall is faster, its CPU +2.5%


def test_derived_needs_every_1():
    assert derived([ROWS[0], ROWS[2]]) is None
