"""How well memfit predicts memory and time: simulated peak vs the CPU allocator's measured
peak, predicted vs measured step time.

Usage (from the repository root)::

    python -m benchmarks.accuracy [--model gpt gpt-act unet3d resnet] [--rounds 5] [--out benchmarks/results]

For each model: profile once, then for the plain step (solver ``none``), every block
checkpointed (``every_block``), a selective baseline (``save_matmuls``) and memfit's own plan at
a budget halfway between its smallest feasible peak and the plain peak, and its plan at the
smallest feasible peak, compare ``simulate(profile, plan).peak_bytes`` with the peak the CPU
allocator measures while the plan runs. Target: within 3%. The dispatch tracker's peak of the
same run is reported too, to tell a simulator error from a meter's blind spot (3D-convolution
workspaces are invisible to the tracker and so to the profile).

Time: each plan's predicted step time (``Plan.predicted_step_s``: the profiled plain step plus
the predicted recompute, from the profile's calibration where it has one) against the median
of ``--rounds`` steps timed interleaved (NOTE [interleaving] in ``benchmarks.harness``) after
warm-up steps that take apply's default sampled check past its first checked calls: the steady
state the time model predicts (NOTE [calibrated steady state] in ``memfit.measuring.calibration``).
Target: within 5%.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

log = logging.getLogger("benchmarks.accuracy")

SCHEMA_VERSION = 2
TARGET = 0.03
TIME_TARGET = 0.05
WARMUP = 4  # steps before timing: apply's default check samples a region's first 3 calls
DEFAULT_MODELS = ("gpt", "gpt-act", "unet3d", "resnet")
MIDWAY = -1.0  # markers: see PLANS
SMALLEST = -2.0
PLANS: tuple[tuple[str, str, float], ...] = (
    # (row name, solver, budget as a fraction of the plain peak)
    ("none", "none", 1.0),
    ("every_block", "every_block", 1.0),
    ("save_matmuls", "save_matmuls", 1.0),
    # memfit's own plan halfway between its smallest feasible peak and the plain peak: a
    # budget every model can meet, where the plan must choose ops to keep (selective)
    ("memfit_mid", "auto", MIDWAY),
    # memfit's smallest-peak plan: where nested regions appear (NOTE [nested regions])
    ("memfit_min", "auto", SMALLEST),
)


def run_model(name: str, *, seed: int = 0, rounds: int = 5) -> dict[str, Any]:
    """Predicted vs measured peak and step time for each plan of ``PLANS`` on one model."""
    import memfit
    from benchmarks.models import build_case
    from memfit.errors import InfeasibleBudget
    from memfit.planning.planner import plan_for_budget
    from memfit.planning.simulate import simulate
    from memfit.profiling.measure import measure
    from memfit.runtime.apply import apply_plan

    case = build_case(name)
    t0 = time.perf_counter()
    prof = memfit.profile(copy.deepcopy(case.model).train(), case.inputs, loss_fn=case.loss_fn)
    uncalibrated = dataclasses.replace(prof, calibration=None)  # the constants' time model
    rows: list[dict[str, Any]] = []
    steps: dict[str, Any] = {}
    models: dict[str, Any] = {}
    for row, solver, budget in PLANS:
        rec: dict[str, Any] = {"plan": row, "solver": solver, "budget": budget}
        try:
            if budget in (MIDWAY, SMALLEST):
                try:
                    plan_for_budget(prof, budget=1, solver=solver)
                except InfeasibleBudget as e:
                    low = int(e.min_feasible_bytes)
                    rec["budget"] = (low + prof.peak_bytes) // 2 if budget == MIDWAY else low
            plan = plan_for_budget(prof, budget=rec["budget"], solver=solver)
            predicted = simulate(prof, plan).peak_bytes
            model = copy.deepcopy(case.model).train()
            apply_plan(model, plan)

            def step(model: Any = model) -> None:
                case.loss_fn(model(*case.inputs)).backward()

            step()  # first run allocates lazily-created state (e.g. masks); not metered
            m = measure(step, model=model, repeats=1)
            rec.update(
                n_regions=len(plan.regions),
                predicted_peak_bytes=int(predicted),
                plan_predicted_peak_bytes=int(plan.predicted_peak_bytes),
                measured_peak_bytes=m.peak_bytes,
                tracked_peak_bytes=m.tracked_peak_bytes,
                rel_error=(predicted - m.peak_bytes) / m.peak_bytes,
                tracked_rel_error=(predicted - m.tracked_peak_bytes) / m.tracked_peak_bytes
                if m.tracked_peak_bytes else None,
                predicted_step_s=plan.predicted_step_s,
                predicted_recompute_s=plan.recompute_s,
                uncalibrated_step_s=prof.step_time_s + simulate(uncalibrated, plan).recompute_s,
            )
            rec["within_target"] = abs(rec["rel_error"]) <= TARGET
            key = tuple(plan.regions)
            same = next((r["plan"] for r in rows if r.get("_key") == key), None)
            rec["_key"] = key
            if same is not None:
                rec["same_plan_as"] = same
            else:
                steps[row], models[row] = step, model
        except Exception as e:  # noqa: BLE001 - report every plan, failures included
            log.exception("%s/%s failed", name, row)
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(rec)
    _time_rows(rows, steps, models, rounds)
    for rec in rows:
        rec.pop("_key", None)
    cal = prof.calibration
    return {"model": name, "description": case.description, "profile_peak_bytes": prof.peak_bytes,
            "profile_step_s": prof.step_time_s,
            "calibration": cal.to_dict() if cal is not None else None,
            "rows": rows, "wall_s": time.perf_counter() - t0}


def _time_rows(rows: list[dict[str, Any]], steps: dict[str, Any], models: dict[str, Any],
               rounds: int) -> None:
    """Measured step time of every distinct plan, interleaved, after the check's warm-up."""
    if rounds < 1 or not steps:
        return
    load0 = harness.load_average()

    def before(row: str) -> None:
        for p in models[row].parameters():
            p.grad = None

    times = harness.time_interleaved(steps, warmup=WARMUP, repeats=rounds, before=before)
    load1 = harness.load_average()
    measured = {row: harness.median(ts) for row, ts in times.items()}
    for rec in rows:
        src = rec.get("same_plan_as", rec["plan"])
        if "error" in rec or src not in measured:
            continue
        rec["measured_step_s"] = measured[src]
        rec["step_times_s"] = times[src]
        rec["time_rel_error"] = (rec["predicted_step_s"] - measured[src]) / measured[src]
        rec["time_within_target"] = abs(rec["time_rel_error"]) <= TIME_TARGET
        rec["uncalibrated_time_rel_error"] = (rec["uncalibrated_step_s"] - measured[src]) / measured[src]
        rec["load_average"] = [load0, load1]


def markdown(results: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = [
        "## memfit's predicted vs measured peak and step time (CPU)",
        "",
        f"torch {env['torch_version']}, {env['cpu_model']}, {env['threads']} threads, {env['date']}. "
        f"Error = (predicted - measured) / measured; target |error| <= {TARGET:.0%}. "
        "'vs tracker' compares with the dispatch tracker's peak of the same run. "
        f"Time: predicted step (plain + recompute) vs the median of interleaved steps after "
        f"{WARMUP} warm-up steps; target |error| <= {TIME_TARGET:.0%}; 'uncalibrated' prices the "
        "same plan with the default time model (today's constants).",
        "",
        "| model | plan | regions | predicted MiB | measured MiB | error | vs tracker | within 3% "
        "| pred. step s | measured step s | time error | within 5% | uncalibrated error |",
        "|---|---|---:|---:|---:|---:|---:|:-:|---:|---:|---:|:-:|---:|",
    ]
    for r in results:
        for row in r["rows"]:
            if "error" in row:
                lines.append(f"| {r['model']} | {row['plan']} | - | - | - | - | - | failed: "
                             f"{row['error'].replace('|', '/')} | - | - | - | - | - |")
                continue
            tr = row["tracked_rel_error"]
            lines.append(
                f"| {r['model']} | {row['plan']} | {row['n_regions']} | {row['predicted_peak_bytes'] / 2**20:.2f} | "
                f"{row['measured_peak_bytes'] / 2**20:.2f} | {row['rel_error']:+.2%} | "
                f"{'-' if tr is None else f'{tr:+.2%}'} | {'yes' if row['within_target'] else 'NO'} | "
                + _time_cells(row)
            )
    lines += _calibration_lines(results)
    return "\n".join(lines) + "\n"


def _time_cells(row: dict[str, Any]) -> str:
    if "measured_step_s" not in row:
        return "- | - | - | - | - |"
    return (f"{row['predicted_step_s']:.3f} | {row['measured_step_s']:.3f} | {row['time_rel_error']:+.1%} | "
            f"{'yes' if row['time_within_target'] else 'NO'} | {row['uncalibrated_time_rel_error']:+.1%} |")


def _calibration_lines(results: list[dict[str, Any]]) -> list[str]:
    out = ["", "Time model per profile (NOTE [calibration] in ``memfit.timemodel``):", ""]
    for r in results:
        cal = r.get("calibration")
        if cal is None:
            out.append(f"- {r['model']}: not calibrated (today's constants)")
            continue
        out.append(f"- {r['model']}: {cal['source']}: matmul x{cal['matmul_scale']:.3f}, other "
                   f"x{cal['other_scale']:.3f}, region {cal['region_s'] * 1e6:.0f} us, op "
                   f"{cal['op_s'] * 1e6:.1f} us, selective op {cal['selective_op_s'] * 1e6:.1f} us"
                   + (f" ({cal['reason']})" if cal.get("reason") else ""))
    return out


def _write(results: list[dict[str, Any]], env: dict[str, Any], out: Path) -> str:
    md = markdown(results, env)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps(
        {"kind": "memfit.benchmark.accuracy", "schema_version": SCHEMA_VERSION, "target": TARGET,
         "time_target": TIME_TARGET, "environment": env, "results": results}, indent=1) + "\n")
    (out / "accuracy.md").write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.accuracy", description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--out", default="benchmarks/results", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per plan (0: no timing)")
    parser.add_argument("--no-reexec", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not args.no_reexec:
        harness.ensure_pinned_malloc("benchmarks.accuracy", argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    env = harness.collect_environment(args.threads).to_dict()
    results: list[dict[str, Any]] = []
    md = ""
    for name in args.model:
        log.info("accuracy: %s", name)
        results.append(run_model(name, rounds=args.rounds))
        md = _write(results, env, args.out)  # after each model: a long run keeps what it measured
    print(md, flush=True)
    failed = [row for r in results for row in r["rows"] if "error" in row or not row.get("within_target")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
