"""benchmarks/gpu_fake_check.py: its dry run (no CUDA) takes every step but the measurement."""

from __future__ import annotations

import json

from benchmarks import gpu_fake_check


def test_dry_run_writes_every_case(tmp_path) -> None:
    assert gpu_fake_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu_fake_check.json").read_text())
    assert record["dry_run"] and record["target"] == "a100" and "context" not in record
    cases = {c["case"]: c for c in record["cases"]}
    assert list(cases) == ["megatron-eager", "megatron-sdpa", "zoo-gpt", "resnet"]
    for c in cases.values():
        assert c["measured"] == {"plain": None, "planned": None}
        assert 0 < c["fake"]["planned_peak_bytes"] < c["fake"]["peak_bytes"]
        assert c["fake"]["regions"] > 0
    # the fake profiles traced the A100's kernels; this CPU ran its own (what a GPU run checks)
    assert cases["megatron-eager"]["fake"]["cuda_kernels"] == {"native_dropout": 6}
    assert cases["megatron-sdpa"]["fake"]["cuda_kernels"] == {"native_dropout": 4, "sdpa:flash": 2}
    assert cases["zoo-gpt"]["fake"]["cuda_kernels"] == {"native_dropout": 7}
    assert not cases["megatron-eager"]["forward_ops_match"]
    assert "aten.native_dropout.default" in cases["megatron-eager"]["first_difference"]
    assert "aten.bernoulli_.float" in cases["megatron-eager"]["device_kernel_ops"]
    assert cases["resnet"]["forward_ops_match"]  # no dropout, attention: one kernel everywhere
    md = (tmp_path / "gpu_fake_check.md").read_text()
    assert "| megatron-sdpa |" in md and "dry run: nothing measured" in md
