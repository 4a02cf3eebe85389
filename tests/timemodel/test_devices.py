"""``memfit.timemodel.devices``: collectives timed over the device's link in fake mode
(NOTE [collective times])."""

from __future__ import annotations

import pytest

from memfit.timemodel.devices import collective_time_s, preset


@pytest.mark.parametrize("name,world,expected_s", [
    # 2 (n - 1) / n of 1 MiB over H100's 450 GB/s each way, plus the 4 us op overhead
    ("_c10d_functional.all_reduce.default", 2, 2**20 / 450e9 + 4e-6),
    ("_c10d_functional.all_reduce.default", 4, 1.5 * 2**20 / 450e9 + 4e-6),
    ("_c10d_functional.all_gather_into_tensor.default", 4, 0.75 * 2**20 / 450e9 + 4e-6),
    ("_c10d_functional.reduce_scatter_tensor.default", 2, 0.5 * 2**20 / 450e9 + 4e-6),
    ("_c10d_functional.wait_tensor.default", 2, None),    # no transfer of its own
    ("_c10d_functional.all_reduce.default", 1, None),     # one device: nothing to send
], ids=["all_reduce-2", "all_reduce-4", "all_gather-4", "reduce_scatter-2", "wait", "one-rank"])
def test_collective_time_over_the_link(name, world, expected_s):
    got = collective_time_s(name, 2**20, world, preset("h100"))
    assert got == (None if expected_s is None else pytest.approx(expected_s, rel=1e-12))  # float sums


def test_no_link_on_the_cpu_preset():
    assert collective_time_s("_c10d_functional.all_reduce.default", 2**20, 2, preset("cpu")) is None
