"""``benchmarks.gpu_check``'s verdicts and tables: each number set against issue 40's target.

Targets: a plan's measured peak at most its budget x 1.03 and within 3% of its prediction
(from the real-device profile, and from the fake-mode profile); 0 gradient, buffer and RNG
differences in deterministic mode; ``memfit.verify`` passes; memfit's step at most 1.00x
every-block's and selective's at their measured peaks, compiled memfit's at most 1.00x
``torch.compile``'s budget at its peak; the offload plan faster than recompute only at its
measured peak; the largest batch trains. ``None``: not measured (skipped, failed, or not
applicable), never a pass.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PEAK_RTOL", "annotate", "markdown"]

PEAK_RTOL = 0.03


def _near(measured: int | None, predicted: int | None) -> bool | None:
    if measured is None or not predicted:
        return None
    return abs(measured - predicted) <= PEAK_RTOL * predicted


def plan_checks(row: dict[str, Any]) -> dict[str, bool | None]:
    m, b = row.get("measured_peak_bytes"), row.get("budget_bytes")
    return {"within_budget": None if m is None or b is None else m <= b * (1 + PEAK_RTOL),
            "near_prediction": _near(m, row.get("predicted_peak_bytes")),
            "near_fake_prediction": _near(m, row.get("fake_predicted_peak_bytes")),
            "bitwise": row.get("bitwise"),
            "verify": row["verify"]["ok"] if "verify" in row else None}


def _all(values: list[bool | None]) -> bool | None:
    """False if any failed, else None if any was not measured, else True."""
    if any(v is False for v in values):
        return False
    return None if any(v is None for v in values) else True


def _ratio_ok(part: dict[str, Any] | None, key: str = "memfit_over_peer") -> list[bool | None]:
    if not part or "comparisons" not in part:
        return [None]
    return [None if c[key] is None else c[key] <= 1.0 for c in part["comparisons"]]


def annotate(case: dict[str, Any]) -> dict[str, Any]:
    """``case`` with ``checks`` on every plan row and a ``summary`` of verdicts."""
    plans = [r for r in case.get("plans", []) if r["plan"] != "plain"]
    for r in case.get("plans", []):
        r["checks"] = plan_checks(r)
    speed, comp = case.get("speed"), case.get("compile")
    off, big = case.get("offload") or {}, case.get("largest_batch") or {}
    ratio = off.get("offload_over_recompute")
    case["summary"] = {
        **{k: _all([r.get("checks", {}).get(k) for r in plans]) if plans else None
           for k in ("within_budget", "near_prediction", "near_fake_prediction", "bitwise", "verify")},
        "memfit_vs_every_block": _ratio_ok(speed)[0] if speed and "comparisons" in speed else None,
        "memfit_vs_selective": _ratio_ok(speed)[-1] if speed and "comparisons" in speed else None,
        "compiled_vs_compile": _ratio_ok(comp)[0],
        "offload_vs_recompute": None if ratio is None else ratio < 1.0,
        "largest_batch_trains": _all([(big.get("found") or {}).get(k) for k in ("ran", "within_device")]),
    }
    return case


def _v(x: bool | None) -> str:
    return "-" if x is None else "pass" if x else "FAIL"


def _b(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _r(a: float | None, b: float | None = None, fmt: str = "{:.3f}") -> str:
    if a is None or (b is not None and not b):
        return "-"
    return fmt.format(a / b if b is not None else a)


SUMMARY_KEYS = ("within_budget", "near_prediction", "near_fake_prediction", "bitwise", "verify",
                "memfit_vs_every_block", "memfit_vs_selective", "compiled_vs_compile",
                "offload_vs_recompute", "largest_batch_trains")


def _plans_table(case: dict[str, Any]) -> list[str]:
    lines = ["| plan | how | budget | predicted (profile) | predicted (fake) | measured | "
             "/profile | /fake | <= budget x1.03 | profile +-3% | fake +-3% | bitwise | verify | note |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- | --- | --- |"]
    for r in case.get("plans", []):
        c = r.get("checks", {})
        m = r.get("measured_peak_bytes")
        what = ", ".join(k for k in ("grads_equal", "buffers_equal", "rng_equal") if r.get(k) is False)
        note = "; ".join(x for x in (r.get("note"), r.get("error"), r.get("fake_error"),
                                     what and f"differs: {what}",
                                     *(r.get("verify") or {}).get("failures", []),
                                     *(r.get("nondeterministic_ops") or [])) if x)
        lines.append(f"| {r['plan']} | {r['how']} | {_b(r.get('budget_bytes'))} | "
                     f"{_b(r.get('predicted_peak_bytes'))} | {_b(r.get('fake_predicted_peak_bytes'))} | "
                     f"{_b(m)} | {_r(m, r.get('predicted_peak_bytes'))} | "
                     f"{_r(m, r.get('fake_predicted_peak_bytes'))} | {_v(c.get('within_budget'))} | "
                     f"{_v(c.get('near_prediction'))} | {_v(c.get('near_fake_prediction'))} | "
                     f"{_v(c.get('bitwise'))} | {_v(c.get('verify'))} | {note} |")
    return lines


def _timed_table(part: dict[str, Any], title: str) -> list[str]:
    if "median_s" not in part:
        return [f"{title}: {part.get('skipped') or part.get('error') or 'not run'}", ""]
    plain = part["median_s"].get("plain")
    lines = [f"{title} ({part['rounds']} of {part['rounds_wanted']} interleaved rounds, medians):", "",
             "| method | measured peak | step s | x plain |", "| --- | ---: | ---: | ---: |"]
    for n, t in part["median_s"].items():
        lines.append(f"| {n} | {_b(part.get('peaks', {}).get(n))} | {t:.4f} | {_r(t, plain)} |")
    lines += ["", "| peer | peer peak | memfit peak | peer s | memfit s | memfit/peer | <= 1.00 |",
              "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for c in part.get("comparisons", []):
        ok = None if c["memfit_over_peer"] is None else c["memfit_over_peer"] <= 1.0
        lines.append(f"| {c['peer']} | {_b(c['peer_peak_bytes'])} | {_b(c['memfit_peak_bytes'])} | "
                     f"{_r(c['peer_s'], fmt='{:.4f}')} | {_r(c['memfit_s'], fmt='{:.4f}')} | "
                     f"{_r(c['memfit_over_peer'])} | {_v(ok)} |")
    return [*lines, ""]


def _offload_text(o: dict[str, Any]) -> str:
    if "offload_over_recompute" not in o:
        return f"Offload: {o.get('skipped') or o.get('error') or 'not run'}"
    return (f"Offload (planner, target {o['target']}, {o['offloaded_ops']} ops offloaded, budget "
            f"{_b(o['budget_bytes'])} B): measured peak {_b(o['offload']['measured_peak_bytes'])} B, "
            f"{o['median_s']['offload']:.4f} s, bitwise {o['offload']['bitwise']}, host peak "
            f"{_b(o['host_peak_bytes'])} B; recompute only at that peak: "
            f"{_b(o['recompute']['measured_peak_bytes'])} B, {o['median_s']['recompute']:.4f} s; "
            f"offload/recompute {o['offload_over_recompute']:.3f} ({_v(o['offload_over_recompute'] < 1)}).")


def _batch_text(b: dict[str, Any]) -> str:
    if "found" not in b:
        return f"Largest batch: {b.get('skipped') or b.get('error') or 'not run'}"

    def run(r: dict[str, Any]) -> str:
        got = (f"ran, job peak {_b(r.get('job_peak_bytes'))} B "
               f"({'within' if r.get('within_device') else 'over'} the device memory)" if r.get("ran")
               else f"out of memory ({r.get('error', '')})")
        return (f"batch {r['batch']} ({r['solver']}, predicted job {_b(r['predicted_total_bytes'])} B "
                f"with reserve {_b(r['reserve_bytes'])} B): {got}")

    return (f"Largest batch for {_b(b['device_memory_bytes'])} B with AdamW: {b['batch']} "
            f"(+{b['predicted_overhead']:.1%} predicted, {b['probes']} sizes profiled). 3 AdamW steps: "
            f"{run(b['found'])}; {run(b['next'])}.")


def markdown(record: dict[str, Any]) -> str:
    lines = [f"# GPU check: {record['device']}, torch {record['torch']}, commit {record['commit']}"
             f"{' (dirty)' if record.get('dirty') else ''}, {record['date']}", "", record["note"], "",
             "| case | " + " | ".join(SUMMARY_KEYS) + " | seconds | errors |",
             "| --- |" + " --- |" * (len(SUMMARY_KEYS) + 2)]
    for c in record["cases"]:
        s = c.get("summary", {})
        lines.append(f"| {c['case']} | " + " | ".join(_v(s.get(k)) for k in SUMMARY_KEYS)
                     + f" | {c.get('seconds', 0):.0f} | {'; '.join(c.get('errors', {})) or '-'} |")
    for c in record["cases"]:
        lines += ["", f"## {c['case']}: {c.get('description', '')}", ""]
        lines += [f"- {k}: {v}" for k, v in c.get("errors", {}).items()]
        lines += [*_plans_table(c), ""]
        lines += _timed_table(c.get("speed") or {}, "Step time")
        lines += _timed_table(c.get("compile") or {}, "torch.compile")
        lines += [_offload_text(c.get("offload") or {}), "", _batch_text(c.get("largest_batch") or {})]
    return "\n".join(lines) + "\n"
