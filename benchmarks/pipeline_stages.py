"""Per-stage plans of a 4-stage pipeline vs one recipe on every stage, on 4 gloo processes.

The zoo GPT split by blocks into 4 stages (``memfit.zoo.gpt_stages``), GPipe and 1F1B over 8
micro-batches, one stage per process (``tests/distributed/pipeline_ranks.py``: the same rank
script as the 2-stage tests, which are the CI check; 4 processes on this machine's 2 cores
take about a minute a schedule). Every stage gets the same device memory; each stage is
planned for its own in-flight count (per-stage) and for the largest of any stage (uniform: one
recipe, sized for the worst stage, as Megatron-LM and torchtitan apply one). Peaks are the
CPU allocator's over a schedule step; stage times are the stage's compute seconds (forward
and backward chunks), median of 3, the two plans interleaved.

Usage (from the repository root)::

    python -m benchmarks.pipeline_stages [--out benchmarks/results/pipeline-stages-2026-12-02]

Writes ``<out>.json`` (every rank's result) and ``<out>.md`` (the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RANKS = ROOT / "tests" / "distributed"
STAGES = 4
MODEL = ["--layers", "8", "--d-model", "64", "--seq", "128", "--mb", "2"]
# (name, schedule, vocab): vocab 8192 makes the last stage (head, loss) the slowest
RUNS = [("gpipe", "gpipe", 512), ("1f1b", "1f1b", 512), ("1f1b, vocab 8192", "1f1b", 8192)]
TIMING_ENV = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "17179869184",
              "MALLOC_TOP_PAD_": "268435456"}  # DESIGN.md: freed activations stay mapped


def launch(schedule: str, n: int, vocab: int = 512) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, **TIMING_ENV, "MEMFIT_DIST_OUT": out, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(RANKS)])}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(STAGES),
               "--standalone", str(RANKS / "pipeline_ranks.py"), schedule, str(n), *MODEL,
               "--vocab", str(vocab)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            raise SystemExit(f"{schedule} failed:\n{done.stderr[-4000:]}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(STAGES)]


def summary(results: list[dict[str, Any]]) -> str:
    lines = ["| stage | in flight (order / formula / counted) | budget | plain peak (pred / meas) "
             "| per-stage peak (pred / meas) | uniform peak (pred / meas) | grads equal |",
             "| ---: | :---: | ---: | ---: | ---: | ---: | :---: |"]
    for r in results:
        per, uni = r["per_stage"], r["uniform"]
        lines.append(
            f"| {r['rank']} | {r['in_flight']} / {r['in_flight_formula']} / {r['in_flight_counted']} "
            f"| {r['budget_bytes']:,} | {r['plain_predicted_bytes']:,} / {r['plain_measured_bytes']:,} "
            f"| {per['predicted_peak_bytes']:,} / {per['measured_peak_bytes']:,} "
            f"({per['measured_peak_bytes'] / r['budget_bytes']:.1%}) "
            f"| {uni['predicted_peak_bytes']:,} / {uni['measured_peak_bytes']:,} "
            f"({uni['measured_peak_bytes'] / r['budget_bytes']:.1%}) "
            f"| {'yes' if not per['unequal'] and not uni['unequal'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline-stages-2026-12-02"))
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    runs = {name: launch(s, args.microbatches, vocab) for name, s, vocab in RUNS}
    counts = launch("interleaved", args.microbatches)
    md = [f"# Per-stage plans of a {STAGES}-stage pipeline (2026-12-02)", "",
          f"torch {torch.__version__}, CPU (2 shared cores, {STAGES} gloo processes), commit "
          f"{commit}; zoo GPT {' '.join(MODEL)} (vocab 512 unless said), {args.microbatches} micro-batches, "
          "split by blocks (2 a stage). Bytes are activation bytes over one schedule step "
          "(weights and gradients are static, outside the budget); every stage has the same "
          "device memory. Measured peaks: the CPU allocator's; times: each stage's compute "
          "(forward and backward chunks), median of 3 — on 2 shared cores for 4 processes, "
          "so measured times are noisy; predicted stage time = micro-batches x (profiled "
          "step + plan's recompute).", ""]
    for s, results in runs.items():
        md += [f"## {s}", "", summary(results), "",
               "Per-stage plans (each stage planned for its own in-flight count):", "",
               results[0]["tables"]["per_stage"], "",
               "One recipe on every stage (each planned as if it held the most of any stage):", "",
               results[0]["tables"]["uniform"], ""]
    md += ["## ScheduleInterleaved1F1B: in-flight per stage (2 stages a rank)", "",
           "| rank | from the action order | counted by hooks |", "| ---: | :---: | :---: |"]
    md += [f"| {c['rank']} | {c['in_flight']} | {c['in_flight_counted']} |" for c in counts]
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    Path(args.out + ".json").write_text(json.dumps(
        {"torch": torch.__version__, "device": "cpu", "commit": commit, "runs": runs,
         "interleaved": counts}, indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()
