"""Offload as a planner choice: when it is chosen, what it costs, the host cap, JSON.

The toy step (``_toy``): embed, two residual blocks (mm 256 B taking 8 ticks -> gelu 64 B
taking 1 tick -> add 64 B), head, loss. At the smallest peak (520 B) ``layers.0`` must be
checkpointed and can keep nothing on the device; its mm and gelu may be recomputed or
offloaded. Links are powers of two (bytes/s) so that copy seconds are exact.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest
from profile_builders import TICK, chain_profile, random_chain, residual_block

from memfit.planning.candidates import PlanningContext
from memfit.planning.costs import LinearModel
from memfit.planning.offload import OFFLOAD_TENSOR_S, OffloadSpec
from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import simulate
from memfit.planning.solvers import Infeasible, brute, milp
from memfit.timemodel.calibration import DEFAULT_OP_S, DEFAULT_REGION_S, DEFAULT_SELECTIVE_OP_S
from memfit.timemodel.devices import PRESETS, DevicePreset

MM, GELU = "aten.mm.default#0", "aten.gelu.default#0"
MIN_PEAK = 520  # the toy's smallest peak (hand-checked: layers.0 recompute-all)


def _toy():
    return chain_profile([residual_block([256, 64], times=[8 * TICK, TICK])] * 2)


def _link(rate: float) -> DevicePreset:
    return dataclasses.replace(PRESETS["h100"], name=f"link{rate:g}", host_link_bytes_per_s=rate)


def _sim(prof, *regions: Region, rate: float):
    return simulate(prof, Plan(tuple(regions), 0, 0.0, None, "test", ""), offload=OffloadSpec(rate))


def _ops(p: Plan) -> list[tuple[str, dict[str, OpPolicy]]]:
    return [(r.name, r.decisions) for r in p.regions]


# layers.0 reruns ops 1..3 (mm 8 ticks, gelu 1, add 1) after its region charge; offloading an
# op removes its ticks, adds OFFLOAD_TENSOR_S and the selective-mode charge of 3 ops
_RECOMPUTE_S = DEFAULT_REGION_S + 3 * DEFAULT_OP_S + 10 * TICK
_OFFLOAD_BOTH_S = DEFAULT_REGION_S + 3 * (DEFAULT_OP_S + DEFAULT_SELECTIVE_OP_S) + TICK + 2 * OFFLOAD_TENSOR_S


@pytest.mark.parametrize(("rate", "decisions", "expect_s"), [
    # 2**20 B/s: 256 B take 2**-12 s, hidden behind the 7 forward ticks after the mm
    (2.0**20, {MM: OpPolicy.OFFLOAD, GELU: OpPolicy.OFFLOAD}, _OFFLOAD_BOTH_S),
    # 2**12 B/s: the mm's copy takes 64 ticks, the gelu's 16: recomputing is cheaper
    (2.0**12, {}, _RECOMPUTE_S),
], ids=["fast-link-offloads", "slow-link-recomputes"])
def test_offload_chosen_exactly_when_it_beats_recompute(rate, decisions, expect_s):
    prof = _toy()
    p = plan_for_budget(prof, budget=MIN_PEAK, solver="milp", offload=True, target=_link(rate))
    assert _ops(p) == [("layers.0", decisions)]
    assert p.predicted_peak_bytes == MIN_PEAK
    assert p.recompute_s == expect_s
    assert p.host_peak_bytes == (320 if decisions else 0)
    offload_s = _sim(prof, Region(("layers.0",), {MM: OpPolicy.OFFLOAD, GELU: OpPolicy.OFFLOAD}),
                     rate=rate).recompute_s
    recompute_s = _sim(prof, Region(("layers.0",)), rate=rate).recompute_s
    assert (offload_s < recompute_s) == bool(decisions)


def test_offload_choice_follows_the_modelled_cost_across_link_rates():
    """Over link rates from 2**8 to 2**20 B/s the MILP picks, among the four ways to treat
    layers.0's two ops, the one whose simulated time is least (both answers occur)."""
    prof = _toy()
    seen = set()
    for k in range(8, 21):
        rate = 2.0**k
        p = plan_for_budget(prof, budget=MIN_PEAK, solver="milp", offload=True, target=_link(rate))
        times = {}
        for pols in itertools.product((None, OpPolicy.OFFLOAD), repeat=2):
            dec = {key: pol for key, pol in zip((MM, GELU), pols, strict=True) if pol}
            times[tuple(sorted(dec))] = _sim(prof, Region(("layers.0",), dec), rate=rate).recompute_s
        best = min(times.values())
        assert p.recompute_s == best, k
        assert times[tuple(sorted(p.regions[0].decisions))] == best
        seen.add(tuple(sorted(p.regions[0].decisions)))
    assert () in seen and (GELU, MM) in seen


@pytest.mark.parametrize("seeds", [range(0, 4), range(4, 8)], ids=["seeds0-3", "seeds4-7"])
def test_simulate_agrees_with_linear_model_on_offload_plans(seeds):
    """One region at a time, every mix of save/offload over its first three ops: the linear
    model's peak and host bytes equal simulate's exactly; times agree to float rounding
    (sums taken in another order, relative 1e-12)."""
    checked = 0
    for seed in seeds:
        checked += _agree(random_chain(random.Random(seed), workspace=True))
    assert checked > 0  # some plans did offload


def _agree(prof) -> int:
    spec = OffloadSpec(2.0**14)
    ctx = PlanningContext(prof, offload=spec)
    cands = ctx.region_candidates()
    lm = LinearModel(ctx, cands)
    checked = 0
    for c in cands:
        ops = sorted({ch.op for ch in c.choices})[:3]
        for pols in itertools.product((None, OpPolicy.SAVE, OpPolicy.OFFLOAD), repeat=len(ops)):
            picks = tuple(j for j, ch in enumerate(c.choices)
                          for op, pol in zip(ops, pols, strict=True) if ch.op == op and ch.policy is pol)
            sim = simulate(prof, Plan((c.region(picks),), 0, 0.0, None, "t", ""), offload=spec)
            assert lm.peak([(c.index, picks)]) == sim.peak_bytes
            assert lm.host_bytes([(c.index, picks)]) == sim.host_peak_bytes
            assert math.isclose(lm.time_s([(c.index, picks)]), sim.recompute_s, rel_tol=1e-12, abs_tol=0)
            checked += any(c.choices[j].policy is OpPolicy.OFFLOAD for j in picks)
    return checked


@pytest.mark.parametrize(("seed", "rate", "cap"), [
    (s, r, cap) for s in range(4) for r, cap in ((2.0**20, None), (2.0**12, None), (2.0**20, 96))
], ids=lambda v: str(v))
def test_milp_matches_brute_force_with_offload(seed, rate, cap):
    prof = random_chain(random.Random(seed), max_blocks=3, max_ops=2)
    ctx = PlanningContext(prof, offload=OffloadSpec(rate, cap))
    lo = brute.min_peak(ctx, "regions")
    for budget in sorted({lo, (lo + prof.peak_bytes) // 2, prof.peak_bytes}):
        want = brute.solve(ctx, budget, mode="regions")
        got = milp.solve(ctx, budget)
        assert math.isclose(got.recompute_s, want.recompute_s, rel_tol=1e-9, abs_tol=1e-15), budget
        assert got.predicted_peak_bytes <= budget
        host = sum(c.nbytes for r in got.regions for c in _copies(ctx, r))
        assert cap is None or host <= cap


def _copies(ctx, region):
    cand = ctx.candidate(region.modules)
    keys = set(region.keys_with(OpPolicy.OFFLOAD))
    return [ch.copy for ch in cand.choices if ch.policy is OpPolicy.OFFLOAD and cand.keys[ch.op] in keys]


@pytest.mark.parametrize(("cap", "decisions", "host"), [
    ("0", {}, 0),                                   # nothing may go to the host
    (256, {MM: OpPolicy.OFFLOAD}, 256),             # room for the mm only: it saves 8 ticks
    ("319B", {MM: OpPolicy.OFFLOAD}, 256),          # one byte short of both
    (320, {MM: OpPolicy.OFFLOAD, GELU: OpPolicy.OFFLOAD}, 320),
], ids=["cap0", "cap256", "cap319", "cap320"])
def test_host_cap_holds(cap, decisions, host):
    prof = _toy()
    if cap == "0":
        cap = 0
    p = plan_for_budget(prof, budget=MIN_PEAK, solver="milp", offload=True, host_budget=cap, target=_link(2.0**20))
    assert _ops(p) == [("layers.0", decisions)]
    assert p.host_peak_bytes == host
    sim = _sim(prof, *p.regions, rate=2.0**20)
    assert sim.host_peak_bytes == host and sim.peak_bytes == p.predicted_peak_bytes == MIN_PEAK


def test_plan_json_round_trip_with_offload(tmp_path):
    p = plan_for_budget(_toy(), budget=MIN_PEAK, solver="milp", offload=True, target=_link(2.0**20))
    path = tmp_path / "plan.json"
    p.save(path)
    back = Plan.load(path)
    assert back == p and back.host_peak_bytes == 320
    assert back.regions[0].decisions == {MM: OpPolicy.OFFLOAD, GELU: OpPolicy.OFFLOAD}
    row = next(line for line in str(back).splitlines() if line.strip().startswith("layers.0"))
    assert row.split()[1] == "0+2"  # saved + offloaded
    data = json.loads(path.read_text())
    del data["host_peak_bytes"]  # a file written before offload
    assert Plan.from_dict(data).host_peak_bytes == 0


def test_offload_on_a_cpu_profile_is_a_noted_no_op():
    prof = _toy()  # measured on "cpu": the CPU preset has no host link
    p = plan_for_budget(prof, budget=MIN_PEAK, solver="milp", offload=True)
    assert p.regions == plan_for_budget(prof, budget=MIN_PEAK, solver="milp").regions
    assert not any(r.keys_with(OpPolicy.OFFLOAD) for r in p.regions) and p.host_peak_bytes == 0
    assert any("offload=True ignored" in n and "cpu" in n for n in p.notes)


def test_offload_on_a_gpu_measured_profile_needs_a_target():
    prof = dataclasses.replace(_toy(), device="cuda:0")
    with pytest.raises(ValueError, match=r"measured on 'cuda:0'.*target='a100', 'h100' or 'h200'"):
        plan_for_budget(prof, budget=MIN_PEAK, offload=True)
    p = plan_for_budget(prof, budget=MIN_PEAK, solver="milp", offload=True, target="h100")
    assert p.host_peak_bytes == 320  # 51.2 GB/s: copies of 320 B hide
    assert p.extra["target"] == "h100"  # NOTE [offload on a CPU model] in memfit.runtime.apply
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))).extra["target"] == "h100"
    assert "target" not in plan_for_budget(prof, budget=MIN_PEAK, solver="milp").extra  # no offload, no target


@pytest.mark.parametrize(("kw", "err", "match"), [
    ({"offload": True, "host_budget": "50%"}, ValueError, "percentage"),
    ({"offload": True, "host_budget": 0.5}, TypeError, "float 0.5"),
    ({"offload": True, "host_budget": "lots"}, ValueError, "cannot parse host_budget 'lots'"),
    ({"offload": True, "host_budget": -1}, ValueError, "got -1"),
    ({"host_budget": "64GiB"}, ValueError, "without offload=True"),
    ({"offload": "yes"}, TypeError, "True or False"),
], ids=["percent", "float", "garbage", "negative", "no-offload", "not-bool"])
def test_bad_offload_arguments_say_what_was_wrong(kw, err, match):
    with pytest.raises(err, match=match):
        plan_for_budget(_toy(), budget=MIN_PEAK, target=_link(2.0**20), **kw)


def test_chain_solver_plans_without_offload_then_offloads():
    """NOTE [chain and offload]: the chain DP plans, the offload pass turns recomputed ops into
    offloaded ones; simulate's figures are the plan's."""
    prof = chain_profile([residual_block([256, 64], times=[8 * TICK, TICK])] * 4)
    budget = plan_for_budget(prof, budget="min", solver="chain").predicted_peak_bytes
    base = plan_for_budget(prof, budget=budget, solver="chain")
    p = plan_for_budget(prof, budget=budget, solver="chain", offload=True, target=_link(2.0**20))
    assert any(r.keys_with(OpPolicy.OFFLOAD) for r in p.regions)
    assert [r.modules for r in p.regions] == [r.modules for r in base.regions]
    assert p.predicted_peak_bytes <= budget and p.recompute_s < base.recompute_s
    sim = _sim(prof, *p.regions, rate=2.0**20)
    assert (sim.peak_bytes, sim.recompute_s, sim.host_peak_bytes) == (
        p.predicted_peak_bytes, p.recompute_s, p.host_peak_bytes)
    assert any("offload pass" in n for n in p.notes)


def test_infeasible_is_unchanged_by_offload():
    """Offload keeps no less on the device than recompute: the smallest peak is the same."""
    ctx = PlanningContext(_toy(), offload=OffloadSpec(2.0**20))
    with pytest.raises(Infeasible) as e:
        milp.solve(ctx, MIN_PEAK - 1)
    assert e.value.min_bytes == MIN_PEAK


@pytest.mark.parametrize(("device", "cost_model", "link"), [
    ("h100", "roofline:h100", 0.8 * 128e9 / 2),   # PCIe Gen5 x16: 128 GB/s both ways
    ("h200", "roofline:h200", 0.8 * 128e9 / 2),
    ("a100", "roofline:a100", 0.8 * 64e9 / 2),    # PCIe Gen4 x16: 64 GB/s both ways
    ("cpu", "measured", 0.0),
    ("cpu", "roofline:cpu", 0.0),
], ids=["h100", "h200", "a100", "cpu-measured", "cpu-fake"])
def test_host_link_of_a_profile(device, cost_model, link):
    from memfit.planning.offload import link_of

    prof = dataclasses.replace(_toy(), device=device, cost_model=cost_model)
    assert link_of(prof)[0] == link


def test_host_link_of_a_gpu_measured_profile_is_unknown():
    from memfit.planning.offload import link_of

    prof = dataclasses.replace(_toy(), device="cuda:0")
    assert link_of(prof)[0] == 0.0
    assert link_of(prof, "a100")[0] == 0.8 * 64e9 / 2


def test_greedy_refuses_an_offload_context():
    from memfit.planning.solvers import get_solver

    ctx = PlanningContext(_toy(), offload=OffloadSpec(2.0**20))
    with pytest.raises(ValueError, match="solver 'greedy' cannot model offload"):
        get_solver("greedy")(ctx, MIN_PEAK)
