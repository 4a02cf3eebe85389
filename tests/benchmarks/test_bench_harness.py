"""The benchmark harness's logic: interleaving, malloc pinning, ratios, gradient checks, JSON.

Benchmarks are not tests: nothing here times a model. The peers are checked on tiny models
only for being applied correctly (bitwise-equal gradients, the right non-applicable reasons).
"""

from __future__ import annotations

import json

import pytest
import torch
from benchmarks.models import gpt_case, resnet_case

from benchmarks import harness, peers, plot, tables, tradeoff


# ---- interleaving ------------------------------------------------------------------------
def test_interleaved_order_is_round_robin() -> None:
    # each round starts one method later: every method in every position
    assert harness.interleaved_order(["a", "b", "c"], 3) == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert harness.interleaved_order(["a"], 0) == []
    with pytest.raises(ValueError, match="rounds"):
        harness.interleaved_order(["a"], -1)


def test_time_interleaved_runs_round_robin_and_drops_warmup() -> None:
    calls: list[str] = []
    cleared: list[str] = []
    now = [0.0]
    cost = {"a": 1.0, "b": 10.0, "c": 100.0}

    def make(name: str):
        def step() -> None:
            calls.append(name)
            now[0] += cost[name] * (1 + len(calls))  # drift: later calls take longer

        return step

    cpu: dict[str, list[float]] = {}
    times = harness.time_interleaved({n: make(n) for n in "abc"}, warmup=1, repeats=2,
                                     before=cleared.append, clock=lambda: now[0],
                                     cpu_clock=lambda: now[0] / 4, cpu_times=cpu)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert cleared == calls
    # call k (1-based) costs cost * (k + 1); warm-up calls 1-3 are dropped
    assert times == {"a": [7.0, 9.0], "b": [50.0, 100.0], "c": [600.0, 800.0]}
    assert cpu == {"a": [1.75, 2.25], "b": [12.5, 25.0], "c": [150.0, 200.0]}
    assert harness.median([3.0, 1.0, 2.0]) == 2.0


# ---- malloc ------------------------------------------------------------------------------
def test_pinned_env_only_when_missing() -> None:
    assert harness.pinned_env(dict(harness.PINNED_MALLOC)) is None
    env = harness.pinned_env({"PATH": "/bin", "MALLOC_TOP_PAD_": "1"})
    assert env is not None
    assert env["PATH"] == "/bin"
    assert {k: env[k] for k in harness.PINNED_MALLOC} == harness.PINNED_MALLOC
    assert env["MEMFIT_BENCH_REEXEC"] == "1"


def test_ensure_pinned_malloc_reexecs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in harness.PINNED_MALLOC:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("MEMFIT_BENCH_REEXEC", raising=False)
    seen: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(harness.os, "execve", lambda exe, argv, env: seen.append((exe, argv, env)))
    harness.ensure_pinned_malloc("benchmarks.tradeoff", ["--model", "gpt"])
    assert len(seen) == 1
    exe, argv, env = seen[0]
    assert argv[1:] == ["-m", "benchmarks.tradeoff", "--model", "gpt"]
    assert env["MALLOC_MMAP_THRESHOLD_"] == "33554432"
    # a re-executed process that still lacks them must not loop
    monkeypatch.setenv("MEMFIT_BENCH_REEXEC", "1")
    with pytest.raises(RuntimeError, match="still missing"):
        harness.ensure_pinned_malloc("benchmarks.tradeoff", [])
    for k, v in harness.PINNED_MALLOC.items():
        monkeypatch.setenv(k, v)
    harness.ensure_pinned_malloc("benchmarks.tradeoff", [])  # pinned: returns, no exec
    assert len(seen) == 1


# ---- gradient comparison -----------------------------------------------------------------
def test_compare_grads_bitwise_and_reports_largest_difference() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    x = torch.randn(5, 4)

    def step() -> torch.Tensor:
        loss = model(x).square().sum()
        loss.backward()
        return loss

    ref = harness.seeded_step_grads(model, step, seed=0)
    again = harness.seeded_step_grads(model, step, seed=0)  # buffers were put back: same start
    same = harness.compare_grads(ref, again)
    assert (same.grads_equal, same.buffers_equal, same.max_abs_grad_diff, same.n_grads) == (True, True, 0.0, 4)

    nudged = harness.StepResult(ref.loss, {**ref.grads, "0.bias": ref.grads["0.bias"] + 0.25}, ref.buffers)
    diff = harness.compare_grads(ref, nudged)
    assert not diff.grads_equal and diff.loss_equal
    assert diff.max_abs_grad_diff == pytest.approx(0.25, abs=1e-6)  # float32 rounding of g + 0.25

    missing = harness.StepResult(ref.loss, {k: v for k, v in ref.grads.items() if k != "1.weight"}, ref.buffers)
    assert harness.compare_grads(ref, missing).missing == ("1.weight",)


# ---- peers applied correctly -------------------------------------------------------------
@pytest.mark.parametrize("make", [
    pytest.param(lambda: gpt_case("tiny", n_layer=2, d_model=32, n_head=2, seq_len=16, batch=2), id="gpt"),
    pytest.param(lambda: resnet_case(blocks_per_stage=(1, 1), width=4, side=8, batch=4), id="resnet"),
])
def test_peers_give_bitwise_equal_gradients(make) -> None:
    torch.set_num_threads(1)
    case = make()
    methods = {m.name: m for m in peers.build_peers(case, compile_budgets=())}
    ref = harness.seeded_step_grads(methods["none"].model, methods["none"].step, seed=0)
    checked = []
    for m in methods.values():
        if not m.applicable:
            continue
        check = harness.compare_grads(ref, harness.seeded_step_grads(m.model, m.step, seed=0))
        assert check.grads_equal, m.name
        checked.append(m.name)
    if case.sequential is None:
        assert methods["sqrt_sequential"].reason.startswith("not applicable: blocks are called from a Python loop")
        assert checked == ["none", "every_block", "selective"]
    else:
        assert methods["sqrt_sequential"].info == {"segments": 1, "n_blocks": 2}
        assert checked == ["none", "every_block", "sqrt_sequential", "selective"]


# ---- ratios and the result file ----------------------------------------------------------
def _rec(name: str, family: str, peak: int | None, step: float | None, **extra) -> dict:
    return {"name": name, "label": name, "family": family, "peak_bytes": peak, "step_s": step,
            "cpu_s": None if step is None else 2 * step,
            "predicted_peak_bytes": None, "overhead": None, "planning_s": None, "compile_s": None,
            "grads_equal": True, "buffers_equal": True, "reason": "", "error": "", "info": {},
            "step_times_s": [], **extra}


def test_comparisons_ratio_at_peak_within_peer() -> None:
    recs = [
        _rec("none", "none", 1000, 1.0),
        _rec("every_block", "peer", 400, 1.5),
        _rec("selective", "peer", 700, 1.2),
        _rec("memfit_0.60", "memfit", 600, 1.1),
        _rec("memfit@every_block", "memfit", 410, 1.2),   # over the peer's peak by 10 B
        _rec("memfit@selective", "memfit", 690, 1.05),
    ]
    rows = {r["peer"]: r for r in tradeoff.comparisons(recs)}
    eb, sel = rows["every_block"], rows["selective"]
    assert eb["matched_time_ratio"] == pytest.approx(1.2 / 1.5)
    assert eb["matched_cpu_ratio"] == pytest.approx(2.4 / 3.0)
    assert eb["matched_peak_ok"] is False
    assert "best" not in eb  # no memfit point measured at or below 400 B
    assert sel["matched_time_ratio"] == pytest.approx(1.05 / 1.2) and sel["matched_peak_ok"] is True
    assert sel["best"] == "memfit@selective" and sel["best_time_ratio"] == pytest.approx(1.05 / 1.2)
    assert "none" not in rows


def test_result_json_and_markdown(tmp_path) -> None:
    recs = [_rec("none", "none", 2**20, 1.0, overhead=0.0),
            _rec("sqrt_sequential", "peer", None, None, reason="not applicable: a | pipe")]
    result = {"kind": tradeoff.RESULT_KIND, "schema_version": tradeoff.SCHEMA_VERSION, "model": "m",
              "description": "d", "config": {}, "settings": {"warmup": 1, "repeats": 3}, "memfit": {},
              "methods": recs, "comparisons": tradeoff.comparisons(recs), "errors": ["x"], "wall_s": 1.0}
    env = harness.collect_environment(torch.get_num_threads()).to_dict()
    md = tradeoff.write_outputs(result, tmp_path, env)
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["kind"] == "memfit.benchmark.tradeoff" and data["schema_version"] == 1
    assert set(data["environment"]) >= {"torch_version", "cpu_model", "threads", "git_commit", "date", "malloc"}
    assert data["environment"]["torch_version"] == torch.__version__
    assert [m["name"] for m in data["methods"]] == ["none", "sqrt_sequential"]
    assert (tmp_path / "m.md").read_text() == md
    assert "| none | 1.0 | 100% |" in md and "a \\| pipe" in md
    assert (tmp_path / "m.png").stat().st_size > 1000


def test_pareto_front() -> None:
    pts = [(1.0, 10.0), (1.2, 6.0), (1.1, 8.0), (1.3, 7.0), (2.0, 3.0)]
    assert plot.pareto(pts) == [(1.0, 10.0), (1.1, 8.0), (1.2, 6.0), (2.0, 3.0)]
    assert tables._mib(3 * 2**20) == "3.0"


def test_methods_table_gives_memfit_predicted_step_time() -> None:
    recs = [_rec("none", "none", 2**20, 1.0, overhead=0.0),
            _rec("memfit_60", "memfit", 2**19, 1.25, overhead=0.25, info={"predicted_step_s": 1.2}),
            _rec("every_block", "peer", 2**19, 1.5, overhead=0.5)]
    rows = tables.methods_table({"methods": recs}).splitlines()
    assert "| step s | pred. time s |" in rows[0]
    cells = {r.split(" | ")[0].lstrip("| "): r.split(" | ") for r in rows[2:]}
    assert cells["memfit_60"][4:6] == ["1.250", "1.200"]
    assert cells["every_block"][4:6] == ["1.500", "-"]
