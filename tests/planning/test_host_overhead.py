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

import memfit
from memfit.planning.effects import ProfileArrays
from memfit.planning.hidden_host import device_only, plan_hides
from memfit.planning.hosttime import HOST_OP_S, OFFLOAD_TENSOR_S, max_disjoint
from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate
from memfit.timemodel.calibration import (
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
    p = plan_for_budget(prof, budget=0.9, solver="milp")
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


def test_a_plan_whose_own_host_work_hides_costs_its_device_seconds():
    """Rule 4: at ops 32x shorter the bound fails (H 2.98 ms > D 69 ticks / 32 = 2.11 ms), but
    the fastest plan by device seconds (layers.0 saving its gelu: mm + add, 9 ticks) needs
    18 plain ops + 3 replayed ops of host launches, its 3 ops' charges and one region's:
    0.66 ms <= 69 + 9 ticks / 32 = 2.38 ms of device work, so it costs its 9 ticks alone
    (the charges of rule 3 would add 0.34 ms, +16% of the step)."""
    scale = 2.0**-5
    prof = _toy("h100", "roofline:h100", DEFAULT, scale)
    host = ProfileArrays(prof).host
    assert (host.hidden, host.device_s) == (False, 69 * TICK * scale) and host.host_bound_s > host.device_s
    p = plan_for_budget(prof, budget=0.9, solver="milp")
    assert p.regions == (Region(("layers.0",), (("aten.gelu.default#0", OpPolicy.SAVE),),
                                9 * TICK * scale, 128, False),)
    assert p.recompute_s == 9 * TICK * scale == simulate(device_only(prof), p).recompute_s
    assert simulate(prof, p).recompute_s == 9 * TICK * scale + DEFAULT_REGION_S + 3 * (
        DEFAULT_OP_S + DEFAULT_SELECTIVE_OP_S)
    assert plan_hides(prof, p, p.recompute_s) == (
        True, 18 * HOST_OP_S + 3 * (HOST_OP_S + DEFAULT_OP_S + DEFAULT_SELECTIVE_OP_S) + DEFAULT_REGION_S,
        78 * TICK * scale)
    assert "hidden for this plan" in p.notes[0]
    # memfit.simulate applies rule 4 too: the plan simulates to the seconds it was planned at
    assert memfit.simulate(prof, p).recompute_s == p.recompute_s
    assert memfit.simulate(prof, p).peak_bytes == simulate(prof, p).peak_bytes


@pytest.mark.parametrize(("scale", "charged"), [(2.0**-5, False), (2.0**-8, True)], ids=["hides", "host-bound"])
def test_a_baseline_plan_is_costed_by_rule_4_too(scale, charged):
    """every_block's fixed plan (layers.0 and layers.1 whole, 10 ticks each): at ops 32x
    shorter its host work (18 + 6 launches, 6 checked ops, 2 regions) hides behind its 69 + 20
    ticks; at 256x it does not, and its 2 regions and 6 ops are charged."""
    prof = _toy("h100", "roofline:h100", DEFAULT, scale)
    p = plan_for_budget(prof, budget=0.9, solver="every_block")
    assert [r.modules for r in p.regions] == [("layers.0",), ("layers.1",)]
    assert p.recompute_s == 20 * TICK * scale + charged * (2 * DEFAULT_REGION_S + 6 * DEFAULT_OP_S)
    assert plan_hides(prof, p, 20 * TICK * scale) == (
        not charged, 24 * HOST_OP_S + 6 * DEFAULT_OP_S + 2 * DEFAULT_REGION_S, 89 * TICK * scale)


def test_a_plan_whose_own_host_work_does_not_hide_keeps_the_charges():
    """At ops 256x shorter the fastest plan by device seconds does not hide (its host work
    exceeds 69 + its ticks / 256): the charged solve's plan, layers.0 whole (10 ticks, one
    region, 3 ops checked), as without rule 4."""
    scale = 2.0**-8
    prof = _toy("h100", "roofline:h100", DEFAULT, scale)
    p = plan_for_budget(prof, budget=0.9, solver="milp")
    assert p.regions == (Region(("layers.0",), (), 10 * TICK * scale + DEFAULT_REGION_S + 3 * DEFAULT_OP_S,
                                64, False),)
    assert p.recompute_s == simulate(prof, p).recompute_s == 10 * TICK * scale + DEFAULT_REGION_S + 3 * DEFAULT_OP_S
    assert not any("hidden for this plan" in n for n in p.notes)
    assert memfit.simulate(prof, p).recompute_s == p.recompute_s
    assert any("host overhead on an async device not hidden" in n for n in p.notes)


@pytest.mark.parametrize(("spans", "want"), [
    ([(0, 9), (0, 3), (4, 9), (2, 5)], 2),
    ([(0, 0), (1, 1), (1, 2), (3, 3)], 3),
    ([(0, 5), (1, 2), (3, 4), (2, 3)], 2),
], ids=["nested", "touching", "overlapping"])
def test_max_disjoint_intervals(spans, want):
    import numpy as np

    assert max_disjoint(np.array([s for s, _ in spans]), np.array([e for _, e in spans])) == want
