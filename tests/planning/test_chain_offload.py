"""The chain DP with offload (NOTE [chain DP with offload]): exact against brute force where
every copy hides, conservative where the link is slow, and the trade it exists for: an op
moved from the device to the host so that another one can be saved."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
from profile_builders import TICK, chain_profile, random_chain, residual_block

from memfit.planning.candidates import PlanningContext
from memfit.planning.offload import OFFLOAD_TENSOR_S, OffloadSpec
from memfit.planning.plan import OpPolicy, Plan
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate
from memfit.planning.solvers import Infeasible, brute, chain, chain_offload
from memfit.planning.solvers.chain_offload import d2h_excess, link_windows
from memfit.timemodel.calibration import DEFAULT_OP_S, DEFAULT_REGION_S, DEFAULT_SELECTIVE_OP_S
from memfit.timemodel.devices import PRESETS


def _link(rate: float):
    return dataclasses.replace(PRESETS["h100"], name=f"link{rate:g}", host_link_bytes_per_s=rate)


def _sim(prof, regions, spec):
    return simulate(prof, Plan(tuple(regions), 0, 0.0, None, "t", ""), offload=spec)


# seeds of random_chain(max_blocks=3, max_ops=2) that draw a chain (most draws of one block do not)
SEEDS = (5, 6, 7, 9, 10, 20, 27, 29, 30, 37)


@pytest.mark.parametrize(("seed", "rate", "cap"), [
    (s, r, c) for s in SEEDS for r, c in ((2.0**30, None), (2.0**12, None), (2.0**30, 64))
], ids=lambda v: str(v))
def test_chain_dp_with_offload_against_brute_force(seed, rate, cap):
    """Where every copy hides behind its own block's windows (2**30 B/s) the DP's model is
    the exact one and the DP finds brute force's optimum (dyadic times: exact equality); on a
    slow link (2**12 B/s) or under a host cap its plan is never faster than the optimum, fits
    the budget and the cap, and its time is simulate's."""
    prof = random_chain(random.Random(seed), max_blocks=3, max_ops=2)
    spec = OffloadSpec(rate, cap)
    ctx = PlanningContext(prof, offload=spec)
    assert ctx.chains
    lo = brute.min_peak(ctx, "chain")
    for budget in sorted({lo, (2 * lo + prof.peak_bytes) // 3, prof.peak_bytes}):
        want = brute.solve(ctx, budget, mode="chain")
        got = chain_offload.solve(ctx, budget, nested=False)
        sim = _sim(prof, got.regions, spec)
        assert sim.recompute_s == got.recompute_s
        assert sim.peak_bytes <= budget
        assert cap is None or sim.host_peak_bytes <= cap
        if rate == 2.0**30 and cap is None:
            assert got.recompute_s == want.recompute_s, budget
        else:
            assert got.recompute_s >= want.recompute_s


def test_brute_force_seeds_offload_on_the_fast_link():
    """Most of the brute-force test's smallest-peak plans offload on the fast link."""
    offloading = 0
    for s in SEEDS:
        prof = random_chain(random.Random(s), max_blocks=3, max_ops=2)
        ctx = PlanningContext(prof, offload=OffloadSpec(2.0**30))
        assert ctx.chains
        got = chain_offload.solve(ctx, brute.min_peak(ctx, "chain"), nested=False)
        offloading += any(r.keys_with(OpPolicy.OFFLOAD) for r in got.regions)
    assert offloading == 7


def test_chain_dp_infeasible_below_the_smallest_peak_with_offload():
    prof = chain_profile([residual_block([256, 64], times=[8 * TICK, TICK])] * 3)
    ctx = PlanningContext(prof, offload=OffloadSpec(2.0**20))
    lo = brute.min_peak(ctx, "chain")
    with pytest.raises(Infeasible) as e:
        chain_offload.solve(ctx, lo - 1, nested=False)
    assert e.value.min_bytes == lo


# the trade: block ops mm#0 (16 B, 8 ticks) -> gelu (256 B, 7 ticks) -> mm#1 (16 B, 1 tick) -> add;
# at 2**12 B/s an mm's copy takes 4 ticks and hides, the gelu's takes 64 and does not
MM0, GELU, MM1 = "aten.mm.default#0", "aten.gelu.default#0", "aten.mm.default#1"
_TRADE_BUDGET = 792  # the smallest peak (536) plus the gelu's 256 bytes


def test_chain_dp_moves_a_saved_op_to_the_host_to_save_another():
    """Without offload, layers.0 saves both mms (32 B, 9 ticks) rather than the gelu (256 B,
    7 ticks); with offload the mms go to the host and the gelu is saved: 16 ticks not rerun,
    at the same budget. Exact seconds: the add reruns (1 tick) plus the fixed charges of 4
    forward ops with selective mode, and the two copies' per-storage charges."""
    prof = chain_profile([residual_block([16, 256, 16], times=[8 * TICK, 7 * TICK, TICK])] * 2)
    without = plan_for_budget(prof, budget=_TRADE_BUDGET, solver="chain")
    with_ = plan_for_budget(prof, budget=_TRADE_BUDGET, solver="chain", offload=True, target=_link(2.0**12))
    assert [(r.name, r.decisions) for r in without.regions] == [
        ("layers.0", {MM0: OpPolicy.SAVE, MM1: OpPolicy.SAVE})]
    assert [(r.name, r.decisions) for r in with_.regions] == [
        ("layers.0", {MM0: OpPolicy.OFFLOAD, GELU: OpPolicy.SAVE, MM1: OpPolicy.OFFLOAD})]
    assert without.predicted_peak_bytes <= _TRADE_BUDGET and with_.predicted_peak_bytes == _TRADE_BUDGET
    fixed = DEFAULT_REGION_S + 4 * (DEFAULT_OP_S + DEFAULT_SELECTIVE_OP_S)
    assert without.recompute_s == fixed + (1 + 7) * TICK
    assert with_.recompute_s == fixed + TICK + 2 * OFFLOAD_TENSOR_S
    assert with_.host_peak_bytes == 32


def test_link_windows_tile_the_forward_and_the_backward():
    """Own windows: block k's D2H window runs from its first op (shift 0) to the next block's;
    shared by the offloading blocks, the others get none and the total is unchanged."""
    prof = chain_profile([residual_block([256, 64], times=[8 * TICK, TICK])] * 4)
    ctx = PlanningContext(prof, offload=OffloadSpec(2.0**20))
    blocks = [ctx.candidate(b) for b in ctx.chains[0].blocks]
    a = [c.a for c in blocks]
    fwd_hi = [a[k + 1] - 1 for k in range(3)] + [blocks[-1].b]
    rp = [c.rp for c in blocks]
    cum = ctx.arrays.op_cumtime
    own = link_windows(ctx.arrays, a, fwd_hi, rp)
    assert own.t0.tolist() == [cum[x] for x in a]
    assert own.t1[-1] == cum[ctx.arrays.n_forward]
    shared = link_windows(ctx.arrays, a, fwd_hi, rp, using=frozenset({0, 1}))
    assert shared.d2h[2:].max() < 1e-12 and shared.h2d[2:].tolist() == [0.0, 0.0]
    assert math.isclose(shared.d2h.sum(), own.d2h.sum(), rel_tol=1e-12)
    assert math.isclose(shared.h2d.sum(), own.h2d.sum(), rel_tol=1e-12)
    assert (shared.d2h[:2] > own.d2h[:2]).all() and (shared.h2d[:2] > own.h2d[:2]).all()


def test_d2h_excess_is_the_lateness_of_the_block_queue():
    """Copies of 3 and 2 s released at 1 and 4, window ending at 6: the queue ends at 6
    (3 + 2 after 1, the second waits); with the first released at 2 it ends at 7."""
    x = np.array([3.0, 2.0])
    got = d2h_excess(np.array([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]]), x, np.array([1.0, 4.0]), 6.0)
    assert got.tolist() == [0.0, 0.0, 0.0]
    assert d2h_excess(np.array([[1.0, 1.0]]), x, np.array([2.0, 4.0]), 6.0).tolist() == [1.0]


@pytest.mark.parametrize(("cap", "blocks_offloading", "priced"), [
    (None, 3, False), (1000, 3, False), (640, 2, True), (320, 1, True), (0, 0, True),
], ids=["no-cap", "cap1000", "cap640", "cap320", "cap0"])
def test_chain_dp_host_cap_by_price(cap, blocks_offloading, priced):
    """Four blocks (mm 256 B, 8 ticks -> gelu 64 B), smallest peak: layers.0..2 checkpointed,
    each offloading 320 B when the host allows. A cap below 960 B makes the DP price host bytes
    (NOTE [chain DP with offload] 3); the plan fits the cap and, here, equals brute force's."""
    prof = chain_profile([residual_block([256, 64], times=[8 * TICK, TICK])] * 4)
    spec = OffloadSpec(2.0**20, cap)
    ctx = PlanningContext(prof, offload=spec)
    lo = brute.min_peak(ctx, "chain")
    got = chain_offload.solve(ctx, lo, nested=False)
    assert got.recompute_s == brute.solve(ctx, lo, mode="chain").recompute_s
    sim = _sim(prof, got.regions, spec)
    assert sim.host_peak_bytes == 320 * blocks_offloading and sim.peak_bytes == lo
    assert sum(bool(r.keys_with(OpPolicy.OFFLOAD)) for r in got.regions) == blocks_offloading
    assert any("host price" in n for n in got.notes) is priced


def test_the_plain_chain_solver_refuses_an_offload_context() -> None:
    """The chain DP with offload is ``chain_offload.solve``; ``chain.solve`` says so."""
    prof = chain_profile([residual_block([256, 64], times=[8 * TICK, TICK])] * 3)
    ctx = PlanningContext(prof, offload=OffloadSpec(link_bytes_per_s=1e9))
    with pytest.raises(ValueError, match="cannot model offload"):
        chain.solve(ctx, 10**12, nested=False)
