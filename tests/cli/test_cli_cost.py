"""``memfit plan ... --steps N --gpus G [--price-per-gpu-hour X] [--board-power W]``."""

from __future__ import annotations

import json
import re

import pytest

from memfit.cli.main import EXIT_BAD_INPUT, EXIT_OK, main

TINY = "gpt:n_layer=2,d_model=32,n_head=2,seq_len=16,vocab_size=64,batch=2"


def _code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse errors
        return int(e.code or 0)


def test_plan_prints_the_runs_extra_gpu_hours_energy_and_cost(capsys):
    argv = ["plan", TINY, "--target", "h100", "--budget", "min", "--steps", "100000", "--gpus", "8",
            "--price-per-gpu-hour", "2.5"]
    assert _code([*argv, "--json"]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    cost = data["run_cost"]
    hours = data["recompute_s"] * 100_000 * 8 / 3600
    assert (cost["steps"], cost["gpus"], cost["target"], cost["board_power_w"]) == (100_000, 8, "h100", 700)
    assert cost["extra_gpu_hours"] == hours > 0
    assert cost["extra_energy_kwh"] == hours * 700 / 1000
    assert cost["extra_cost"] == hours * 2.5
    assert cost["extra_flops_per_step"] == data["extra_flops"] > 0 and data["profile_device"] == "h100"
    assert _code(argv) == EXIT_OK
    out = capsys.readouterr().out
    m = re.search(r"over 100,000 steps on 8 x h100: \+([\d.,]+) GPU-hours, ([\d.,]+) kWh, cost ([\d.,]+)", out)
    assert m is not None, out
    shown = [float(g.replace(",", "")) for g in m.groups()]
    assert shown == pytest.approx([hours, hours * 0.7, hours * 2.5], rel=6e-3)  # 3 figures shown
    assert "at 2.5 per GPU-hour" in out and "700 W per device (NVIDIA H100 datasheet" in out
    assert out.count("extra per step:") == 1  # the plan's line, not repeated by the cost


def test_board_power_overrides_the_preset_and_is_required_on_cpu(capsys):
    argv = ["plan", TINY, "--budget", "min", "--steps", "1000", "--board-power", "150", "--json"]
    assert _code(argv) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    cost = data["run_cost"]
    assert (cost["target"], cost["gpus"], cost["board_power_w"], cost["extra_cost"]) == ("cpu", 1, 150, None)
    assert cost["extra_energy_kwh"] == data["recompute_s"] * 1000 / 3600 * 150 / 1000
    assert "run_cost" not in json.loads(_out(capsys, ["plan", TINY, "--budget", "min", "--json"]))


def _out(capsys, argv: list[str]) -> str:
    assert _code(argv) == EXIT_OK
    return capsys.readouterr().out


@pytest.mark.parametrize(("extra", "message"), [
    (["--steps", "0"], "argument --steps: expected a positive integer, got 0"),
    (["--steps", "100", "--gpus", "-8"], "argument --gpus: expected a positive integer, got -8"),
    (["--steps", "ten"], "argument --steps: expected a positive integer, got 'ten'"),
    (["--gpus", "8"], "--gpus price a run; give its length too (--steps 100000)"),
    (["--price-per-gpu-hour", "2", "--board-power", "300"],
     "--price-per-gpu-hour, --board-power price a run; give its length too"),
    (["--steps", "100"], "--steps on --target cpu needs --board-power (watts per device)"),
    (["--steps", "100", "--target", "h100", "--board-power", "0"],
     "argument --board-power: expected a positive number of watts, got '0'"),
    (["--steps", "100", "--target", "h100", "--price-per-gpu-hour", "-1"],
     "argument --price-per-gpu-hour: expected a price >= 0, got '-1'"),
    (["--steps", "100", "--device-memory", "1GiB", "--max-batch"],
     "--steps prices a plan's recompute; give it without --max-batch"),
], ids=["steps-0", "gpus-negative", "steps-not-a-number", "gpus-without-steps", "price-without-steps",
        "cpu-without-power", "zero-power", "negative-price", "with-max-batch"])
def test_bad_cost_options_exit_2_with_what_to_pass(extra, message, capsys):
    assert _code(["plan", TINY, "--budget", "min", *extra]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err, err
