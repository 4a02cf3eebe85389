"""``memfit plan MODEL --device-memory SIZE --optimizer NAME [--max-batch]``: the whole job."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memfit.cli.main import EXIT_BAD_INPUT, EXIT_INFEASIBLE, EXIT_OK, main

SMALL = "gpt:n_layer=2,d_model=64,n_head=2,seq_len=32,batch=2"


@pytest.mark.processes
def test_plan_for_a_device_prints_the_breakdown_and_its_json_carries_it():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "memfit", "plan", SMALL, "--device-memory", "3MiB",
                        "--optimizer", "adamw", "--json"], capture_output=True, text=True,
                       env=env, timeout=180)
    assert r.returncode == EXIT_OK, r.stderr
    data = json.loads(r.stdout)
    mem = data["memory"]
    assert mem["device_memory_bytes"] == 3 * 2**20
    assert mem["total_bytes"] <= mem["device_memory_bytes"]
    assert mem["total_bytes"] == (mem["weights_bytes"] + mem["optimizer_bytes"] + mem["reserve_bytes"]
                                  + max(mem["activations_bytes"],
                                        mem["gradients_bytes"] + mem["optimizer_step_bytes"]))
    assert mem["activations_bytes"] == data["predicted_peak_bytes"]


def test_a_job_that_does_not_fit_exits_3_with_the_breakdown_and_what_fits(capsys):
    # activations dominate at seq 128: the smallest plans' totals are 3.53, 4.57, 5.60 and
    # 6.63 MiB for batches 1 to 4
    model = "gpt:n_layer=2,d_model=64,n_head=2,seq_len=128,batch=4"
    code = main(["plan", model, "--device-memory", "5MiB", "--optimizer", "adamw", "--json"])
    assert code == EXIT_INFEASIBLE
    captured = capsys.readouterr()
    err = json.loads(captured.out)["error"]
    assert err["type"] == "InfeasibleBudget" and err["exit_code"] == EXIT_INFEASIBLE
    assert err["memory"]["total_bytes"] > err["memory"]["device_memory_bytes"] == 5 * 2**20
    assert any("a batch of 2 (the largest that fits" in f for f in err["fits_with"]), err["fits_with"]
    assert "does NOT fit" in captured.err


def test_max_batch_finds_the_largest_batch(capsys):
    code = main(["plan", SMALL, "--device-memory", "6MiB", "--optimizer", "adamw", "--max-batch",
                 "--json"])
    assert code == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    n = data["largest_batch"]
    probes = {p["n"]: p for p in data["probes"]}
    assert probes[n]["fits"] and not probes[n + 1]["fits"]
    assert data["memory"]["total_bytes"] <= 6 * 2**20


@pytest.mark.parametrize("argv, message", [
    (["plan", SMALL], "give --budget"),
    (["plan", SMALL, "--budget", "50%", "--optimizer", "adamw"], "count against --device-memory"),
    (["plan", SMALL, "--device-memory", "lots"], "cannot parse device='lots'"),
    (["plan", SMALL, "--device-memory", "1GiB", "--max-batch", "--budget", "50%"], "drop --budget"),
])
def test_bad_job_arguments_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
