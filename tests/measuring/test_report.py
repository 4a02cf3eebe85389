"""report: the Sweep data (table, JSON, plot) and sweep() on a small model."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from memfit import zoo
from memfit.measuring.report import RowKind, Sweep, SweepRow, print_sweep
from memfit.measuring.tradeoff import sweep
from memfit.planning.plan import Plan, Region

MIB = 1024**2


def _plan(peak: int, solver: str = "chain") -> Plan:
    return Plan(regions=(Region.saving(("blocks.0",), ("aten.mm.default#0",), recompute_s=0.01, saved_bytes=1000),), predicted_peak_bytes=peak,
                recompute_s=0.01, budget_bytes=peak + 1, solver=solver, profile_signature="abc",
                plain_peak_bytes=10 * MIB, plain_step_s=0.1, model="GPT")


def _hand_sweep() -> Sweep:
    rows = (
        SweepRow("plain", RowKind.PLAIN, "none", predicted_peak_bytes=10 * MIB, measured_peak_bytes=10 * MIB,
                 step_time_s=0.100, overhead=0.0),
        SweepRow("60%", RowKind.MEMFIT, "chain", "60%", 6 * MIB, 6 * MIB - 10, 6 * MIB, 0.110, 0.10, 0.08, 1,
                 None, _plan(6 * MIB - 10)),
        SweepRow("40%", RowKind.MEMFIT, "chain", "40%", 4 * MIB,
                 error="infeasible: smallest feasible 5.00 MiB"),
        SweepRow("every_block", RowKind.BASELINE, "every_block", "", 10 * MIB, 5 * MIB, 5 * MIB + 7, 0.130, 0.30,
                 0.3, 8, None, _plan(5 * MIB, "every_block")),
    )
    return Sweep(rows, "GPT", "cpu", 10 * MIB, 0.100, 3)


def test_table_lists_every_row_with_units():
    s = _hand_sweep()
    md = s.table()
    lines = md.splitlines()
    assert len(lines) == 2 + len(s.rows)
    assert lines[0].startswith("| config") and set(lines[1]) <= {"|", "-", ":"}
    assert "| 60%" in lines[3] and "6.00 MiB" in lines[3] and "+10.0%" in lines[3] and "60%" in lines[3]
    assert "infeasible: smallest feasible 5.00 MiB" in lines[4]
    assert "every_block" in lines[5] and "+30.0%" in lines[5] and "50%" in lines[5]
    plain = s.table("plain")
    assert "|" not in plain and len(plain.splitlines()) == 2 + len(s.rows)
    with pytest.raises(ValueError, match="'html'"):
        s.table("html")


def test_table_has_an_extra_flops_column():
    s = _hand_sweep()
    rows = list(s.rows)
    rows[0] = dataclasses.replace(rows[0], extra_flops=0)
    rows[3] = dataclasses.replace(rows[3], extra_flops=6_980_000_000)
    lines = dataclasses.replace(s, rows=tuple(rows)).table().splitlines()
    col = lines[0].split("|").index(" extra FLOPs ")
    cells = [line.split("|")[col].strip() for line in lines[2:]]
    # plain: none; 60%: not known (a row without the field); 40%: no plan; every_block: 6.98 G
    assert cells == ["0 FLOP", "-", "-", "6.98 GFLOP"]
    back = Sweep.from_dict(json.loads(json.dumps(dataclasses.replace(s, rows=tuple(rows)).to_dict())))
    assert [r.extra_flops for r in back.rows] == [0, None, None, 6_980_000_000]


def test_json_round_trip(tmp_path):
    s = _hand_sweep()
    path = s.to_json(tmp_path / "sweep.json")
    data = json.loads(path.read_text())
    assert data["kind"] == "memfit.Sweep" and data["schema_version"] == 1
    assert data["rows"][1]["measured_peak_bytes"] == 6 * MIB
    assert data["rows"][1]["plan"]["kind"] == "memfit.Plan"
    back = Sweep.load(path)
    assert back == s
    assert back.rows[1].plan == s.rows[1].plan


def test_plot_writes_a_png(tmp_path):
    path = _hand_sweep().plot(tmp_path / "sweep.png")
    head = path.read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000  # axes, curve and labels, not an empty canvas


def test_print_sweep_prints_summary_and_table(capsys):
    print_sweep(_hand_sweep())
    out = capsys.readouterr().out
    assert out.startswith("GPT on cpu: plain step 100.0 ms, peak 10.00 MiB")
    assert "| every_block" in out


def test_str_of_a_sweep_is_its_summary_and_an_aligned_table():
    """print(sweep) printed the dataclass repr (issue #39)."""
    s = _hand_sweep()
    lines = str(s).splitlines()
    assert lines[:2] == ["GPT on cpu: plain step 100.0 ms, peak 10.00 MiB (median of 3)",
                         "smallest memfit peak: 6.00 MiB (60% of plain) at +10.0% step time "
                         "(budget 60%)"]
    assert lines[2].split() == ["config", "solver", "budget", "predicted", "peak", "measured",
                                "peak", "vs", "plain", "step", "time", "overhead", "extra",
                                "FLOPs", "regions"]
    assert lines[4].split()[:4] == ["plain", "none", "-", "10.00"]
    assert "infeasible: smallest feasible 5.00 MiB" in lines[6] and len(lines) == 4 + len(s.rows)
    assert str(s) == f"{s.summary()}\n{s.table('plain')}"


@pytest.mark.slow
def test_sweep_measures_budgets_and_baselines(tmp_path):
    # activations dominate at this size: 70% of the plain peak is feasible
    model = zoo.gpt(n_layer=3, d_model=32, n_head=2, seq_len=32, vocab_size=64)
    x = zoo.example_inputs(model, batch=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    s = sweep(model, x, (1.0, 0.7, "min"), baselines=("every_block",), repeats=1, progress=False)
    # the model is left as it was: unplanned, same weights and buffers, no gradients
    assert getattr(model, "memfit_plan", None) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert [r.label for r in s.rows] == ["plain", "100%", "70%", "min", "every_block"]
    assert [r.kind for r in s.rows] == [RowKind.PLAIN, RowKind.MEMFIT, RowKind.MEMFIT, RowKind.MEMFIT,
                                        RowKind.BASELINE]
    plain = s.rows[0]
    assert plain.measured_peak_bytes == s.plain_peak_bytes > 0 and plain.overhead == 0.0
    for r in s.rows[1:]:
        assert r.error is None, r
        assert r.plan is not None and r.measured_peak_bytes is not None and r.step_time_s > 0
        assert r.predicted_peak_bytes == r.plan.predicted_peak_bytes
        assert r.n_regions == len(r.plan.regions)
        assert r.extra_flops == r.plan.extra_flops
    row100, row70, rowmin, every = s.rows[1:]
    assert row100.n_regions == 0 and row100.predicted_peak_bytes == plain.predicted_peak_bytes
    assert plain.extra_flops == row100.extra_flops == 0 and every.extra_flops > 0
    assert row70.predicted_peak_bytes <= row70.budget_bytes == int(0.7 * plain.predicted_peak_bytes)
    assert rowmin.predicted_peak_bytes <= row70.predicted_peak_bytes
    assert every.budget_bytes is None and every.budget == ""
    # the measured peaks are this machine's: metering the first step of each plan again on a
    # fresh copy, as sweep does, gives the same bytes (the CPU allocator meter is exact and
    # repeatable when no step frees memory allocated before it: NOTE [repeatable steps])
    import copy

    from memfit.measuring.twins import make_step
    from memfit.profiling.measure import measure
    from memfit.runtime.apply import apply_plan

    for r in (row70, rowmin, every):
        twin = apply_plan(copy.deepcopy(model), r.plan)
        again = measure(make_step(twin, x)).peak_bytes
        assert r.measured_peak_bytes == again, (r.label, r.measured_peak_bytes, again)
        assert r.measured_peak_bytes < 0.8 * plain.measured_peak_bytes, r.label
    s.to_json(tmp_path / "s.json")
    s.plot(tmp_path / "s.png")
    assert Sweep.load(tmp_path / "s.json") == s
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_reports_an_infeasible_budget_as_a_row():
    model = zoo.gpt(n_layer=1, d_model=16, n_head=2, seq_len=8, vocab_size=32)
    x = zoo.example_inputs(model, batch=1)
    s = sweep(model, x, (100,), baselines=(), repeats=1, progress=False)  # 100 bytes
    row = s.rows[1]
    assert row.label == "100 B" and row.plan is None and row.measured_peak_bytes is None
    assert row.error is not None and row.error.startswith("infeasible: smallest feasible ")
    assert "infeasible" in s.table()


@pytest.mark.parametrize(("plain_spread", "row_spread", "cell"), [
    (0.002, 0.003, "+10.0%"),                                    # spreads of 2-3 ms < 10 ms
    (0.080, 0.003, "~+10% (noisy: repeats spread 80%)"),         # the plain step's repeats
    (0.002, 0.120, "~+10% (noisy: repeats spread 120%)"),        # the row's own repeats
    (None, None, "+10.0%"),                                      # one repeat: nothing to judge
], ids=["quiet", "noisy-plain", "noisy-row", "single-repeat"])
def test_overhead_is_marked_noisy_when_repeats_spread_more_than_it(plain_spread, row_spread, cell):
    s = _hand_sweep()
    rows = list(s.rows)
    rows[0] = dataclasses.replace(rows[0], step_spread_s=plain_spread)
    rows[1] = dataclasses.replace(rows[1], step_spread_s=row_spread)  # overhead +10% = 10 ms
    s = dataclasses.replace(s, rows=tuple(rows))
    line = s.table().splitlines()[3]
    assert f" {cell} |" in line, line
    assert s.table().splitlines()[2].split("|")[8].strip() == "+0.0%"  # the plain row as is
    assert Sweep.from_dict(json.loads(json.dumps(s.to_dict()))) == s  # the spread round-trips


def test_sweep_keeps_the_spread_of_its_repeats():
    model = zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    x = zoo.example_inputs(model, batch=2)
    s = sweep(model, x, (0.8,), baselines=(), repeats=2, progress=False)
    assert [r.label for r in s.rows] == ["plain", "80%"] and s.rows[1].error is None
    for r in s.rows:  # a spread above the median is possible on a loaded machine
        assert r.step_spread_s is not None and 0.0 <= r.step_spread_s < math.inf, r
        assert r.step_time_s is not None and r.step_time_s > 0.0, r


def test_sweep_of_a_step_measures_that_step_and_leaves_the_model_as_found():
    # a Step carries its autocast state: swept outside autocast, the bf16 step still runs in
    # bf16 (a smaller plain peak than the float32 step of the same inputs)
    from memfit.step.harness import Step

    model = zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    x = zoo.example_inputs(model, batch=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step = Step.of(model, x)
    model(x).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    bf16 = sweep(model, budgets=("min",), baselines=(), repeats=1, progress=False, step=step)
    assert torch.equal(torch.get_rng_state(), rng)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
    fp32 = sweep(model, x, ("min",), baselines=(), repeats=1, progress=False)
    assert bf16.rows[0].predicted_peak_bytes < fp32.rows[0].predicted_peak_bytes
    assert bf16.plain_peak_bytes < fp32.plain_peak_bytes
    row = bf16.rows[1]
    assert row.error is None and row.n_regions > 0 and row.measured_peak_bytes is not None
