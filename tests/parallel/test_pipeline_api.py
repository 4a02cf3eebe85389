"""``memfit.parallel.pipeline``: in-flight counts from action orders, the stage table, and
``fit(in_flight=...)`` on one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import memfit
from memfit.parallel.pipeline import (
    StageReport,
    count_in_flight,
    format_stages,
    in_flight,
    in_flight_of,
    kept_by_sends,
    pipeline_step_s,
    stage_report,
)
from memfit.planning.stages import stage_peak
from memfit.zoo.gpt import gpt
from memfit.zoo.gpt_stages import gpt_stage, lm_loss


def one_f_one_b(stage: int, p: int, n: int) -> list[str | None]:
    """The 1F1B runtime's order of stage ``stage`` of ``p`` (Schedule1F1B._step_microbatches)."""
    warm = min(n, p - stage)
    order: list[str | None] = [None] * stage + [f"{stage}F{i}" for i in range(warm)]
    f = warm
    for b in range(n):
        order.append(f"{stage}B{b}")
        if f < n:
            order.append(f"{stage}F{f}")
            f += 1
    return order


@pytest.mark.parametrize(("p", "n"), [(2, 4), (4, 4), (4, 8), (4, 2)], ids=lambda v: str(v))
def test_counts_of_1f1b_and_gpipe_orders_match_the_formulas(p, n):
    for s in range(p):
        assert count_in_flight(one_f_one_b(s, p, n)) == {s: in_flight_of("1f1b", s, p, n)}
        gpipe = [f"{s}F{i}" for i in range(n)] + [f"{s}B{i}" for i in range(n)]
        assert count_in_flight(gpipe) == {s: in_flight_of("ScheduleGPipe", s, p, n) == n and n}


@pytest.mark.parametrize(("stage", "n", "kept"), [
    (0, 8, 64), (0, 6, 64), (0, 5, 0), (0, 4, 0),      # 4 stages: output kept from n = p - i + 2
    (1, 5, 64 + 32), (1, 4, 32), (2, 4, 64 + 32), (3, 4, 32), (3, 1, 32),
])
def test_1f1b_sends_keep_an_output_from_two_steady_forwards_and_an_input_gradient(stage, n, kept):
    # measured on 4 gloo stages (tests/distributed/test_pipeline.py): outputs 64 B, grads 32 B
    assert kept_by_sends("1f1b", stage, 4, output_bytes=64, input_grad_bytes=32, n_microbatches=n) == kept
    assert kept_by_sends("gpipe", stage, 4, output_bytes=64, input_grad_bytes=32, n_microbatches=n) == 0


def test_split_backward_frees_at_the_weight_half_and_comms_are_ignored():
    order = ["0F0", "0SEND_F0", "0F1", "0I0", "0F2", "0W0", "0I1", "0W1", "0F3", None]
    assert count_in_flight(order) == {0: 3}


def test_in_flight_reads_every_rank_s_order_of_a_schedule():
    interleaved = SimpleNamespace(pipeline_order={0: ["0F0", "2F0", "0F1", "0B0", "2B0"],
                                                  1: ["1F0", "3F0", "1B0", "3B0"]})
    assert [in_flight(interleaved, s) for s in range(4)] == [2, 1, 1, 1]
    with pytest.raises(ValueError, match="no pipeline_order"):
        in_flight(SimpleNamespace(), 0)
    with pytest.raises(ValueError, match="stage 5 runs no forward"):
        in_flight(interleaved, 5)
    with pytest.raises(ValueError, match="knows 'gpipe' and '1f1b'"):
        in_flight_of("zerobubble", 0, 2, 4)


def report(stage: int, recompute_s: float, measured_s: float | None = None) -> StageReport:
    return StageReport(stage=stage, in_flight=2 - stage, n_microbatches=4, budget_bytes=1000,
                       static_bytes=10, predicted_peak_bytes=900, held_bytes=300, regions=1,
                       recompute_s=recompute_s, step_s=0.01, measured_peak_bytes=950,
                       measured_s=measured_s)


def test_the_pipeline_step_is_the_slowest_stage_and_reports_round_trip():
    reports = [report(0, 0.005, 0.07), report(1, 0.001, 0.05)]
    assert pipeline_step_s(reports) == pytest.approx(4 * 0.015)
    assert pipeline_step_s(reports, measured=True) == 0.07
    assert StageReport.from_dict(reports[0].to_dict()) == reports[0]
    table = format_stages(reports)
    assert table.count("\n| ") == 3 and "950 B (95.0%)" in table
    assert "predicted 60.0 ms, measured 70.0 ms" in table
    with pytest.raises(ValueError, match="not every stage"):
        pipeline_step_s([report(0, 0.0)], measured=True)


def test_fit_with_in_flight_plans_the_stage_for_the_micro_batches_it_holds():
    model = gpt(n_layer=2, d_model=32, n_head=2, seq_len=32, vocab_size=128, dropout=0.0)
    stage = gpt_stage(model, 1, 2)  # the last stage: a block and the head
    x = torch.randn(2, 32, 32, requires_grad=True)
    y = torch.randint(0, 128, (2, 32))
    for q in stage.parameters():
        q.grad = torch.zeros_like(q)
    prof = memfit.profile(stage, (x,), loss_fn=lambda out: lm_loss(out, y))
    none = memfit.plan(prof, budget=prof.peak_bytes, solver="none")
    plain3 = stage_peak(prof, none, 3).peak_bytes
    memfit.fit(stage, (x,), loss_fn=lambda out: lm_loss(out, y), budget=int(0.7 * plain3), parallel=memfit.Parallel(in_flight=3))
    p = stage.memfit_plan
    info = p.extra["pipeline"]
    assert info["in_flight"] == 3 and info["stage_budget_bytes"] == int(0.7 * plain3)
    assert info["stage_peak_bytes"] <= info["stage_budget_bytes"] and p.regions
    r = stage_report(p, stage=1, n_microbatches=4)
    assert (r.in_flight, r.predicted_peak_bytes, r.regions) == (3, info["stage_peak_bytes"], len(p.regions))
    with pytest.raises(TypeError, match="in_flight"):
        memfit.fit(stage, (x,), loss_fn=lambda out: lm_loss(out, y), job=memfit.Job(device="1GiB"), parallel=memfit.Parallel(in_flight=3))
    with pytest.raises(ValueError, match="not made for a pipeline stage"):
        stage_report(none, stage=0, n_microbatches=4)


def test_fit_with_in_flight_refuses_what_it_cannot_plan_per_stage():
    model = gpt_stage(gpt(n_layer=2, d_model=32, n_head=2, seq_len=32, vocab_size=128), 0, 2)
    x = torch.randint(0, 128, (2, 32))
    for bad in ({"search": memfit.Search(tune=True)},
                {"training": memfit.Training(shapes=[(2, 16), (2, 32)])}):
        with pytest.raises(ValueError, match="in_flight"):
            memfit.fit(model, x, budget=0.5, parallel=memfit.Parallel(in_flight=2), **bad)
