"""Tensor-parallel blocks planned by memfit against torch's checkpoint on every block, on 2
gloo processes (issue 44: regions that re-run their collectives).

Runs ``tests/distributed/tp_blocks_ranks.py`` (the CI check's rank script) with a number of
timing rounds: plain TP, ``checkpoint(block)`` on every block, and memfit's plans at
``"min"``, 0.6 and 0.8 (the ``mlp`` case; ``"min"`` for ``attn`` and ``sp``). Peaks are the
CPU allocator's over one forward + backward (the smallest of 3 steps: NOTE [collective
outputs held by gloo] in ``tests/distributed/test_tensor_parallel.py``); step times are
medians over interleaved rounds, each method once per round, ranks starting together; ratios
are to the every-block checkpoint in the same run: the ratio of the medians, and the median
of each round's ratio.

Usage (from the repository root)::

    python -m benchmarks.tp_recompute [--rounds 15] [--out benchmarks/results/tp-recompute]

Writes ``<out>.json`` (every rank's result) and ``<out>.md`` (the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RANKS = ROOT / "tests" / "distributed"
TIMING_ENV = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "17179869184",
              "MALLOC_TOP_PAD_": "268435456"}  # DESIGN.md: freed activations stay mapped


LABELS = {"plain": "plain TP", "every_block": "torch checkpoint, every block",
          "min": 'memfit, budget "min"', "at_every_block_peak": "memfit, budget = every block's peak",
          "block0_full": "hand plan: block 0, all-reduce replayed",
          "block0_keep_all_reduce": "hand plan: block 0, all-reduce output kept"}


def launch(case: str, rounds: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, **TIMING_ENV, "MEMFIT_DIST_OUT": out, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(RANKS)])}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--standalone", str(RANKS / "tp_blocks_ranks.py"), case, str(rounds)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            raise SystemExit(f"{case} failed:\n{done.stderr[-4000:]}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


def table(case: str, results: list[dict[str, Any]]) -> str:
    r0 = results[0]
    names = ["plain", *r0["plans"]]
    ref = statistics.median(r0["step_s"]["every_block"])
    lines = [f"### {case}", "",
             "| method | peak rank 0 / rank 1 (MiB) | budget (MiB) | collectives re-run / step "
             "| step, median (ms) | vs every block | per-round ratio, median | grads equal |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for name in names:
        rows = [r["plans"].get(name) for r in results]
        peaks = [r["plain_peak"] if name == "plain" else row["peak"] for r, row in zip(results, rows, strict=True)]
        rep = rows[0].get("report") if rows[0] else None
        budget = f"{rep['budget_bytes'] / 2**20:.2f}" if rep and rep["budget_bytes"] else "-"
        if rows[0] and "predicted_collectives" in rows[0]:  # a hand-made plan
            coll = str(rows[0]["predicted_collectives"]["count"])
        else:
            coll = str(rep["collectives"]) if rep else ("0" if name == "plain" else
                                                       str(r0["every_block_collectives"]["count"]))
        med = statistics.median(r0["step_s"][name])
        # each round's step over every block's in the same round: the load other jobs put on
        # the shared cores drifts between rounds more than within one
        paired = statistics.median(t / e for t, e in zip(r0["step_s"][name], r0["step_s"]["every_block"], strict=True))
        equal = "yes" if all(not row or not row["unequal"] for row in rows) else "NO"
        label = LABELS.get(name, f"memfit, budget {name}")
        lines.append(f"| {label} | {peaks[0] / 2**20:.2f} / {peaks[1] / 2**20:.2f} | {budget} | {coll} "
                     f"| {med * 1e3:.1f} | {med / ref:.2f} | {paired:.2f} | {equal} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tp-recompute"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--cases", nargs="+", default=["mlp", "attn", "sp"])
    args = ap.parse_args()
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    runs = {case: launch(case, args.rounds) for case in args.cases}
    head = (f"torch {torch.__version__}, CPU (2 shared cores, 2 gloo processes), commit {commit}; "
            f"{args.rounds} interleaved rounds after one warm-up, medians of rank 0")
    md = "\n\n".join([head, *(table(c, r) for c, r in runs.items())]) + "\n"
    Path(args.out + ".md").write_text(md)
    Path(args.out + ".json").write_text(json.dumps(
        {"torch": torch.__version__, "device": "cpu", "commit": commit, "rounds": args.rounds,
         "runs": runs}, indent=1))
    print(md)


if __name__ == "__main__":
    main()
