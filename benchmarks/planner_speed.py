"""How long the planner takes on a 96-block decoder profile (built by hand, no model), the
target being 5 s on this project's 2-core machine.

Usage (from the repository root)::

    python -m benchmarks.planner_speed [--blocks 96] [--repeats 3]

Prints each run's seconds and the median; the unit test
(``tests/planning/test_planner.py::test_96_block_decoder_plans_with_the_chain_solver``)
checks the plan, not the time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "planning"))

from profile_builders import decoder_profile  # noqa: E402

from memfit.planning.planner import plan_for_budget  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    prof = decoder_profile(args.blocks, param_bytes=512)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        p = plan_for_budget(prof, budget=0.4)
        times.append(time.perf_counter() - t0)
    print(f"{args.blocks} blocks, {len(prof.forward_ops)} forward ops: solver {p.solver}, "
          f"runs {', '.join(f'{t:.2f}' for t in times)} s, median {statistics.median(times):.2f} s "
          f"(target 5 s)")


if __name__ == "__main__":
    main()
