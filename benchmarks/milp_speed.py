"""How long the compressed MILP takes on a 12-block GPT-like profile with sub-modules (built
by hand, no model): its smallest peak and three budgets, the target being 5 s each on this
project's 2-core machine (the dense model took 8-11 s per solve, the compressed one 0.2-0.9 s).

Usage (from the repository root)::

    python -m benchmarks.milp_speed [--blocks 12] [--repeats 3]

Prints each solve's seconds and the median per budget; the unit test
(``tests/planning/test_milp.py::test_compressed_milp_is_proven_optimal``) checks the plans,
not the time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "planning"))

from profile_builders import gpt_like  # noqa: E402

from memfit.planning.candidates import PlanningContext  # noqa: E402
from memfit.planning.solvers import chain, milp  # noqa: E402

TARGET_S = 5.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    prof = gpt_like(args.blocks)
    ctx = PlanningContext(prof)
    lo = chain.min_peak(ctx, nested=False)
    cases = {"min_peak": None, "chain's smallest peak": lo,
             "50%": int(0.5 * prof.peak_bytes), "80%": int(0.8 * prof.peak_bytes)}
    for label, budget in cases.items():
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            if budget is None:
                milp.min_peak(ctx)
            else:
                milp.solve(ctx, budget)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"{args.blocks} blocks, {label}: runs {', '.join(f'{t:.2f}' for t in times)} s, "
              f"median {med:.2f} s (target {TARGET_S:g} s){'' if med < TARGET_S else '  OVER'}")


if __name__ == "__main__":
    main()
