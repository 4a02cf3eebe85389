"""How well memfit predicts memory: simulated peak vs the CPU allocator's measured peak.

Usage (from the repository root)::

    python -m benchmarks.accuracy [--model gpt gpt-act unet3d resnet] [--out benchmarks/results]

For each model: profile once, then for the plain step (solver ``none``), every block
checkpointed (``every_block``), a selective baseline (``save_matmuls``) and memfit's own plan at
a budget halfway between its smallest feasible peak and the plain peak, and its plan at the
smallest feasible peak, compare ``simulate(profile, plan).peak_bytes`` with the peak the CPU
allocator measures while the plan runs. Target: within 3%. The dispatch tracker's peak of the
same run is reported too, to tell a simulator error from a meter's blind spot (3D-convolution
workspaces are invisible to the tracker and so to the profile).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

log = logging.getLogger("benchmarks.accuracy")

SCHEMA_VERSION = 1
TARGET = 0.03
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


def run_model(name: str, *, seed: int = 0) -> dict[str, Any]:
    """Predicted vs measured peak for each plan of ``PLANS`` on one benchmark model."""
    from benchmarks.models import build_case
    from memfit.errors import InfeasibleBudget
    from memfit.planning.planner import plan as make_plan
    from memfit.planning.simulate import simulate
    from memfit.profiling.measure import measure
    from memfit.profiling.tracer import profile
    from memfit.runtime.apply import apply

    case = build_case(name)
    t0 = time.perf_counter()
    prof = profile(copy.deepcopy(case.model).train(), case.inputs, loss_fn=case.loss_fn)
    rows: list[dict[str, Any]] = []
    for row, solver, budget in PLANS:
        rec: dict[str, Any] = {"plan": row, "solver": solver, "budget": budget}
        try:
            if budget in (MIDWAY, SMALLEST):
                try:
                    make_plan(prof, budget=1, solver=solver)
                except InfeasibleBudget as e:
                    low = int(e.min_feasible_bytes)
                    rec["budget"] = (low + prof.peak_bytes) // 2 if budget == MIDWAY else low
            plan = make_plan(prof, budget=rec["budget"], solver=solver)
            predicted = simulate(prof, plan).peak_bytes
            model = copy.deepcopy(case.model).train()
            apply(model, plan)

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
            )
            rec["within_target"] = abs(rec["rel_error"]) <= TARGET
        except Exception as e:  # noqa: BLE001 - report every plan, failures included
            log.exception("%s/%s failed", name, row)
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(rec)
    return {"model": name, "description": case.description, "profile_peak_bytes": prof.peak_bytes,
            "rows": rows, "wall_s": time.perf_counter() - t0}


def markdown(results: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = [
        "## memfit's predicted vs measured peak (CPU)",
        "",
        f"torch {env['torch_version']}, {env['cpu_model']}, {env['threads']} threads, {env['date']}. "
        f"Error = (predicted - measured) / measured; target |error| <= {TARGET:.0%}. "
        "'vs tracker' compares with the dispatch tracker's peak of the same run.",
        "",
        "| model | plan | regions | predicted MiB | measured MiB | error | vs tracker | within 3% |",
        "|---|---|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in results:
        for row in r["rows"]:
            if "error" in row:
                lines.append(f"| {r['model']} | {row['plan']} | - | - | - | - | - | failed: "
                             f"{row['error'].replace('|', '/')} |")
                continue
            tr = row["tracked_rel_error"]
            lines.append(
                f"| {r['model']} | {row['plan']} | {row['n_regions']} | {row['predicted_peak_bytes'] / 2**20:.2f} | "
                f"{row['measured_peak_bytes'] / 2**20:.2f} | {row['rel_error']:+.2%} | "
                f"{'-' if tr is None else f'{tr:+.2%}'} | {'yes' if row['within_target'] else 'NO'} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.accuracy", description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--out", default="benchmarks/results", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-reexec", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not args.no_reexec:
        harness.ensure_pinned_malloc("benchmarks.accuracy", argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    env = harness.collect_environment(args.threads).to_dict()
    results = []
    for name in args.model:
        log.info("accuracy: %s", name)
        results.append(run_model(name))
    md = markdown(results, env)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.json").write_text(json.dumps(
        {"kind": "memfit.benchmark.accuracy", "schema_version": SCHEMA_VERSION, "target": TARGET,
         "environment": env, "results": results}, indent=1) + "\n")
    (args.out / "accuracy.md").write_text(md)
    print(md, flush=True)
    failed = [row for r in results for row in r["rows"] if "error" in row or not row.get("within_target")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
