"""Plan.cost and the FLOPs a plan recomputes (NOTE [run cost] in memfit.planning.runcost)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from memfit import zoo
from memfit.planning.plan import Plan, Region
from memfit.planning.planner import plan_for_budget
from memfit.planning.runcost import RunCost
from memfit.planning.simulate import simulate
from memfit.profiling.tracer import trace
from memfit.timemodel.devices import PRESETS

CFG = {"n_layer": 3, "d_model": 32, "n_head": 2, "seq_len": 16, "vocab_size": 64}


def _gpt_and_inputs() -> tuple[zoo.GPT, torch.Tensor]:
    model = zoo.gpt(**CFG)
    return model, zoo.example_inputs(model, batch=2)


def _forward_flops(model: zoo.GPT, x: torch.Tensor, modules: list[torch.nn.Module]) -> int:
    """FLOPs of one forward of ``modules`` (blocks in order), as FlopCounterMode counts them,
    on the activations the step feeds them."""
    h = model.drop(model.tok(x) + model.pos(torch.arange(x.shape[1])))
    total = 0
    with torch.no_grad():
        for block in model.blocks:
            if any(m is block or any(m is s for s in block.modules()) for m in modules):
                with FlopCounterMode(display=False) as fc:
                    for m in modules:
                        if m is block:
                            block(h)
                        elif any(m is s for s in block.modules()):
                            m(block.ln1(h))  # the attention's input: its block's first norm
                total += fc.get_total_flops()
            h = block(h)
    return total


# ---- the FLOPs a plan recomputes -----------------------------------------------------------
@pytest.mark.parametrize("mode,target", [("measure", "cpu"), ("fake", "h100")], ids=["measured-cpu", "fake-h100"])
def test_every_block_recomputes_one_forward_of_the_blocks(mode, target):
    """The issue's acceptance number: every-block checkpointing's extra FLOPs are one more
    forward of the blocks, as torch's FlopCounterMode counts it."""
    model, x = _gpt_and_inputs()
    prof = trace(model, x, mode=mode, target=target)
    p = plan_for_budget(prof, budget=1.0, solver="every_block")
    assert [r.modules for r in p.regions] == [(f"blocks.{i}",) for i in range(CFG["n_layer"])]
    want = _forward_flops(model, x, list(model.blocks))
    assert want > 0
    torch.testing.assert_close(float(p.extra_flops), float(want), rtol=0.01, atol=0)
    assert p.profile_device == target
    assert p.extra_flops == simulate(prof, p).recompute_flops == sum(simulate(prof, p).region_recompute_flops)


def test_a_nested_region_is_recomputed_twice():
    """NOTE [nested regions]: an attention checkpointed inside its checkpointed block reruns in
    the block's replay and again in its own."""
    model, x = _gpt_and_inputs()
    prof = trace(model, x)
    nested = Plan((Region(("blocks.1",)), Region(("blocks.1.attn",))), 0, 0.0, None, "manual", "")
    sim = simulate(prof, nested)
    block = _forward_flops(model, x, [model.blocks[1]])
    attn = _forward_flops(model, x, [model.blocks[1].attn])
    assert 0 < attn < block
    torch.testing.assert_close(float(sim.recompute_flops), float(block + attn), rtol=0.01, atol=0)
    assert sim.region_recompute_flops[1] == pytest.approx(attn, rel=0.01)


def test_saved_matmuls_are_not_recomputed():
    """save_matmuls keeps every matmul's output: what reruns has no FLOP formula."""
    model, x = _gpt_and_inputs()
    prof = trace(model, x)
    every = plan_for_budget(prof, budget=1.0, solver="every_block")
    saving = plan_for_budget(prof, budget=1.0, solver="save_matmuls")
    assert every.extra_flops > 0 and saving.extra_flops == 0
    assert plan_for_budget(prof, budget=1.0).extra_flops == 0  # nothing to checkpoint


# ---- cost arithmetic on a hand-built plan ----------------------------------------------------
def _hand_plan(device: str = "h100", recompute_s: float = 0.0375, flops: int | None = 6_000_000_000) -> Plan:
    return Plan((Region(("blocks.0",), recompute_s=recompute_s),), predicted_peak_bytes=1000,
                recompute_s=recompute_s, budget_bytes=2000, solver="every_block", profile_signature="sig",
                plain_peak_bytes=3000, plain_step_s=0.25, model="GPT", extra_flops=flops,
                profile_device=device)


@pytest.mark.parametrize("target,watts", [("v100", 300), ("a100", 400), ("h100", 700), ("h200", 700)])
def test_cost_arithmetic_is_exact(target, watts):
    c = _hand_plan(target).cost(steps=100_000, gpus=8, price_per_gpu_hour=2.5)
    hours = 0.0375 * 100_000 * 8 / 3600
    assert c.extra_gpu_hours == hours == pytest.approx(8 + 1 / 3, rel=1e-15)
    assert c.board_power_w == watts == PRESETS[target].board_power_w
    assert c.extra_energy_kwh == hours * watts / 1000
    assert c.extra_cost == hours * 2.5
    assert (c.extra_flops_per_step, c.extra_s_per_step, c.target) == (6_000_000_000, 0.0375, target)
    assert c.extra_flops == 6_000_000_000 * 100_000 * 8
    assert "datasheet" in c.power_source and c.times_from == target


def test_cost_with_given_power_and_no_price():
    c = _hand_plan("cpu", recompute_s=0.9).cost(1000, board_power_w=125)
    assert c.gpus == 1 and c.extra_gpu_hours == 0.9 * 1000 * 1 / 3600 == 0.25
    assert c.extra_energy_kwh == 0.25 * 125 / 1000 and c.power_source == "given"
    assert c.extra_cost is None and c.price_per_gpu_hour is None
    h100 = _hand_plan().cost(10, 1, board_power_w=350)
    assert h100.board_power_w == 350 and h100.extra_energy_kwh == h100.extra_gpu_hours * 350 / 1000


def test_cost_str_states_the_figures_and_assumptions():
    c = _hand_plan().cost(steps=100_000, gpus=8, price_per_gpu_hour=2.5)
    text = str(c)
    assert text.splitlines()[0] == "extra per step: 6 GFLOP recomputed, +37.5 ms on h100"
    assert "over 100,000 steps on 8 x h100: +8.33 GPU-hours, 5.83 kWh, cost 20.83 at 2.5 per GPU-hour" in text
    assert "700 W per device (NVIDIA H100 datasheet, SXM5, max TDP)" in text
    assert "assumes seconds per step as profiled for h100" in text
    assert "cost" not in str(_hand_plan().cost(100_000, 8)).splitlines()[1]


def test_a_gpu_no_preset_names_is_taken_as_the_target_and_said_so():
    c = _hand_plan("cuda:0").cost(100, 2, target="a100")
    assert c.target == "a100" and c.times_from == "cuda:0" and c.board_power_w == 400
    assert c.assumptions[0] == "seconds per step as profiled for cuda:0, taken as a100"


@pytest.mark.parametrize(("device", "kw", "error", "match"), [
    ("h100", {"steps": 0}, ValueError, r"steps must be positive, got 0; pass the run's training steps"),
    ("h100", {"steps": -5}, ValueError, r"steps must be positive, got -5"),
    ("h100", {"steps": 1.5}, TypeError, r"steps must be an int, got float 1.5"),
    ("h100", {"gpus": 0}, ValueError, r"gpus must be positive, got 0; pass the devices"),
    ("h100", {"target": "tpu"}, ValueError, r"unknown target 'tpu'; pass one of \['a100', 'cpu', 'h100'"),
    ("h100", {"target": "a100"}, ValueError,
     r"the plan's seconds are for h100 .* not a100: charging them to a100 would mix devices. Profile for a100"),
    ("cpu", {"target": "h100"}, ValueError, r"seconds are for cpu .*--target h100"),
    ("cpu", {}, ValueError, r"the cpu preset has no board power .* pass board_power_w= in watts"),
    ("cuda:0", {}, ValueError, r"measured on 'cuda:0', which no preset names; pass target="),
    ("", {}, ValueError, r"not recorded .*; pass target="),
    ("h100", {"board_power_w": -1}, ValueError, r"board_power_w must be positive, got -1"),
    ("h100", {"board_power_w": 0}, ValueError, r"board_power_w must be positive, got 0"),
    ("h100", {"price_per_gpu_hour": -2}, ValueError, r"price_per_gpu_hour must be >= 0, got -2"),
], ids=["steps-0", "steps-negative", "steps-float", "gpus-0", "unknown-target", "other-target",
        "cpu-plan-gpu-target", "cpu-no-power", "unnamed-gpu-no-target", "old-plan-no-target",
        "negative-power", "zero-power", "negative-price"])
def test_bad_cost_arguments_say_what_to_pass(device, kw, error, match):
    args = {"steps": 100, "gpus": 1, **kw}
    with pytest.raises(error, match=match):
        _hand_plan(device).cost(**args)


# ---- display and JSON ------------------------------------------------------------------------
def test_print_plan_has_one_line_of_extra_flops_and_seconds():
    lines = str(_hand_plan()).splitlines()
    assert lines[1] == "  extra per step: 6 GFLOP recomputed, +37.5 ms on h100"
    assert sum("extra per step" in line for line in lines) == 1
    assert "FLOPs not recorded" in str(_hand_plan(flops=None))


def test_json_round_trip_keeps_flops_and_device(tmp_path):
    p = _hand_plan()
    p.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["extra_flops"] == 6_000_000_000 and data["profile_device"] == "h100"
    back = Plan.load(tmp_path / "plan.json")
    assert back == p and back.cost(100, 8) == p.cost(100, 8)


def test_a_plan_written_before_the_fields_loads_and_asks_for_a_target():
    data = _hand_plan().to_dict()
    del data["extra_flops"], data["profile_device"]
    old = Plan.from_dict(data)
    assert old.extra_flops is None and old.profile_device == ""
    c = old.cost(100, 8, target="h100")
    assert isinstance(c, RunCost) and c.extra_flops_per_step is None and c.extra_flops is None
    assert c.extra_gpu_hours == 0.0375 * 100 * 8 / 3600
    assert "FLOPs not recorded" in str(c) and "taken as h100" in str(c)


def test_a_planned_profile_json_round_trip():
    model, x = _gpt_and_inputs()
    p = plan_for_budget(trace(model, x, mode="fake", target="a100"), budget="min")
    back = Plan.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back == p and back.extra_flops == p.extra_flops > 0 and back.profile_device == "a100"
    assert back.cost(1000, 4).board_power_w == 400
