"""The benchmark tables' memfit (tuned) rows: next to every peer, with ratios to the peer."""

from __future__ import annotations

from benchmarks import tables, tradeoff


def _rec(name: str, family: str, peak: int, step: float, **info) -> dict:
    return {"name": name, "label": name, "family": family, "peak_bytes": peak, "step_s": step,
            "cpu_s": 2 * step, "reason": "", "error": "", "info": info}


def test_tuned_rows_next_to_every_peer() -> None:
    tuning = {"candidates": [{"name": "auto=milp", "measured_s": 1.3}, {"name": "sqrt", "measured_s": 1.1},
                             {"name": "every_block", "measured_s": None}], "chosen": "sqrt"}
    recs = [
        _rec("none", "none", 1000, 1.0),
        _rec("every_block", "peer", 400, 1.5),
        _rec("selective", "peer", 700, 1.2),
        _rec("memfit@every_block", "memfit", 390, 1.2, solver="milp"),
        _rec("memfit_tuned@every_block", "memfit", 395, 1.125, solver="sqrt", tuning=tuning),
        _rec("memfit@selective", "memfit", 690, 1.08, solver="chain"),
    ]
    md = tables.tuned_table({"methods": recs, "comparisons": tradeoff.comparisons(recs)})
    lines = md.splitlines()
    assert lines[2] == "| every_block | 0.0 | 1.500 | memfit | milp | 0.0 | 1.200 | 0.800 | 0.800 | yes |"
    assert lines[3] == "| every_block | 0.0 | 1.500 | memfit (tuned) | sqrt | 0.0 | 1.125 | 0.750 | 0.750 | yes |"
    assert lines[4] == "| selective | 0.0 | 1.200 | memfit | chain | 0.0 | 1.080 | 0.900 | 0.900 | yes |"
    assert lines[5] == "| selective | 0.0 | 1.200 | memfit (tuned) | not run | - | - | - | - | - |"
    assert "tuned: chose sqrt of 2 timed candidates" in tables._notes(recs[4])
