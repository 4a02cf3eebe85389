"""NOTE [host overhead on an async device]: the fixed charges count 0 s exactly where the
step is device-bound for any plan, on an asynchronous device with the default calibration.

The toy step (``_toy``): embed, two residual blocks (mm 8 ticks -> gelu 1 tick -> add 1
tick), head, loss; backward ops take twice their forward op's time. Region ``layers.0``
reruns mm, gelu and add (10 ticks); saving its mm leaves gelu and add (2 ticks).
"""

from __future__ import annotations

import dataclasses

import pytest
from profile_builders import TICK, chain_profile, residual_block

from memfit.planning.effects import ProfileArrays
from memfit.planning.hosttime import HOST_OP_S, OFFLOAD_TENSOR_S, max_disjoint
from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.planning.planner import plan
from memfit.planning.simulate import simulate
from memfit.timemodel import (
    DEFAULT_OP_S,
    DEFAULT_REGION_S,
    DEFAULT_SELECTIVE_OP_S,
    Calibration,
    CalibrationSource,
)

MM = "aten.mm.default#0"
DEFAULT = Calibration.default("fake mode")
FITTED = Calibration(matmul_scale=1.0, other_scale=1.0, source=CalibrationSource.FIT, fitted=("matmul_scale",))


def _toy(device: str, cost_model: str, cal: Calibration | None, scale: float = 1.0):
    prof = chain_profile([residual_block([256, 64], times=[8 * TICK, TICK])] * 2)
    ops = tuple(dataclasses.replace(op, time_s=op.time_s * scale) for op in prof.ops)
    return dataclasses.replace(prof, device=device, cost_model=cost_model, calibration=cal, ops=ops)


def _times(prof) -> tuple[float, float]:
    """Simulated seconds of layers.0 recomputed whole, and saving its mm."""
    whole = simulate(prof, Plan((Region(("layers.0",)),), 0, 0.0, None, "t", "")).recompute_s
    sel = simulate(prof, Plan((Region(("layers.0",), {MM: OpPolicy.SAVE}),), 0, 0.0, None, "t", "")).recompute_s
    return whole, sel


@pytest.mark.parametrize(("device", "cost_model", "cal", "scale", "hidden"), [
    ("h100", "roofline:h100", DEFAULT, 1.0, True),      # fake mode for a GPU, device-bound
    ("a100", "roofline:a100", DEFAULT, 1.0, True),
    ("cuda:0", "measured", None, 1.0, True),            # measured on CUDA, never calibrated
    ("cpu", "measured", None, 1.0, False),              # the host is the device
    ("cpu", "roofline:cpu", DEFAULT, 1.0, False),
    ("h100", "roofline:h100", FITTED, 1.0, False),      # fitted: measured what the charges cost
    ("h100", "roofline:h100", DEFAULT, 2.0**-14, False),  # host-bound: ops of ~60 ns
], ids=["h100-fake", "a100-fake", "cuda-measured", "cpu-measured", "cpu-fake", "h100-fitted",
        "h100-host-bound"])
def test_fixed_charges_hide_only_on_a_device_bound_async_step(device, cost_model, cal, scale, hidden):
    prof = _toy(device, cost_model, cal, scale)
    whole, sel = _times(prof)
    charged = not hidden
    assert whole == 10 * TICK * scale + charged * (DEFAULT_REGION_S + 3 * DEFAULT_OP_S)
    assert sel == 2 * TICK * scale + charged * (DEFAULT_REGION_S + 3 * (DEFAULT_OP_S + DEFAULT_SELECTIVE_OP_S))
    host = ProfileArrays(prof).host
    assert host.hidden is hidden
    p = plan(prof, budget=0.9, solver="milp")
    assert any("host overhead on an async device hidden" in n for n in p.notes) is hidden


def test_host_bound_counts_every_plan_host_work():
    """H = HOST_OP_S x (ops + 2 x forward ops) + the deepest plan's per-op charges + region_s x
    twice the most disjoint modules (embed, layers.0, layers.1, head: 4) + a per-storage
    offload charge for each forward storage; D = the plain step's device seconds (69 ticks)."""
    prof = _toy("h100", "roofline:h100", DEFAULT)
    host = ProfileArrays(prof).host
    n, nf = len(prof.ops), prof.n_forward
    fwd_storages = sum(1 for s in prof.storages if s.created_by is not None and s.created_by < nf)
    want = (HOST_OP_S * (n + 2 * nf) + nf * (2 * DEFAULT_OP_S + DEFAULT_SELECTIVE_OP_S)
            + 8 * DEFAULT_REGION_S + fwd_storages * OFFLOAD_TENSOR_S)
    assert host.host_bound_s == want
    assert host.device_s == sum(op.time_s for op in prof.ops) == 69 * TICK
    assert host.calibration == dataclasses.replace(DEFAULT, region_s=0.0, op_s=0.0, selective_op_s=0.0)


@pytest.mark.parametrize(("spans", "want"), [
    ([(0, 9), (0, 3), (4, 9), (2, 5)], 2),
    ([(0, 0), (1, 1), (1, 2), (3, 3)], 3),
    ([(0, 5), (1, 2), (3, 4), (2, 3)], 2),
], ids=["nested", "touching", "overlapping"])
def test_max_disjoint_intervals(spans, want):
    import numpy as np

    assert max_disjoint(np.array([s for s, _ in spans]), np.array([e for _, e in spans])) == want
