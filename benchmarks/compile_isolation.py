"""memfit.compile at a compile peer's peak: alone in its process, and with a compiled memfit
row that has graph breaks run in the same process (as the tradeoff harness runs them).

Per order: ``alone`` (the peer and ``memfit.compile`` only), ``row_first`` (the graph-broken
row compiled and run one step before ``memfit.compile``), ``row_after`` (after it). Prints the
rounds ``memfit.compile`` measured, the graph breaks and graphs dynamo counted, and the step
time of each method over the peer's (medians of interleaved rounds, same process). Run each
order in a fresh process:

    PYTHONPATH=src python -m benchmarks.compile_isolation --order alone [--model llama]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.compiled_memfit import compile_method, loop_method
from benchmarks.models import build_case
from benchmarks.peers import compiled, warm_compiled
from benchmarks.planned import BudgetSpec, build_memfit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama")
    ap.add_argument("--budget", type=float, default=0.5, help="the compile peer's budget")
    ap.add_argument("--order", choices=("alone", "row_first", "row_after"), default="alone")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from torch._dynamo.utils import counters

    torch.set_num_threads(2)
    case = build_case(args.model)
    peer_name = f"compile_budget_{args.budget:g}"
    peer = compiled(case, args.budget)
    warm_compiled(peer)
    peak = int(_peak(peer))

    def row() -> object:
        sweep = build_memfit(case, [BudgetSpec(f"compiled_memfit@{peer_name}", peak, peer_name)], tune=False)
        m = compile_method(sweep.methods[0])
        warm_compiled(m)
        return m

    methods = {"peer": peer}
    if args.order == "row_first":
        methods["row"] = row()
    mine = loop_method(case, peer_name, peak)
    warm_compiled(mine)
    methods["memfit.compile"] = mine
    if args.order == "row_after":
        methods["row"] = row()
    print(f"{args.model}, {peer_name} peak {peak} B, order {args.order}")
    print("memfit.compile rounds (planned for, measured):",
          [(r["planned_for_bytes"], r["measured_peak_bytes"]) for r in mine.info["rounds"]])
    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(2):
        for m in methods.values():
            m.step()
            m.clear_grads()
    for _ in range(args.rounds):
        for k, m in methods.items():
            t = time.perf_counter()
            m.step()
            times[k].append(time.perf_counter() - t)
            m.clear_grads()
    print("graph breaks", sum(counters["graph_break"].values()), "graphs", counters["stats"]["unique_graphs"])
    base = statistics.median(times["peer"])
    for k in methods:
        print(f"{k:16s} {statistics.median(times[k]):.4f} s  {statistics.median(times[k]) / base:.3f}x the peer")


def _peak(method: object) -> int:
    from memfit.profiling.measure import measure

    def run() -> None:
        method.step()  # type: ignore[attr-defined]
        method.clear_grads()  # type: ignore[attr-defined]

    return int(measure(run, device=torch.device("cpu"), meter="allocator", repeats=1).peak_bytes)


if __name__ == "__main__":
    main()
