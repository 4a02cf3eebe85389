"""What the training monitor costs: training steps of a planned zoo GPT with no monitor, and
with ``fit(..., monitor_every=N)``'s monitor for each N given, in one run.

Usage (from the repository root)::

    python -m benchmarks.monitor_cost [--every 1 10] [--block 10] [--rounds 7]

Every method is a deep copy of one planned model with the same plan (``memfit.apply``), and
the monitor installed as ``fit(monitor_every=N)`` installs it
(``memfit.runtime.monitor.install_monitor``): one ``fit`` and one plan for all, so the
methods differ in the monitor only (two ``fit`` calls can choose different plans when their
timings differ). A training step is forward, loss, backward, an SGD step and
``zero_grad(set_to_none=True)``.

A monitored step's cost falls on it (the profiler on CPU) and on the next call (the meter
is stopped and its events read there, NOTE [monitoring a training run] rule 3), and with
N > 1 only one step in N is monitored: a per-step median would hide it. So the timed unit
is a block of ``--block`` consecutive steps (a multiple of every N, so that each block holds
the same number of monitored steps and ends their meters inside it); blocks are timed
interleaved (NOTE [interleaving] in ``benchmarks.harness``), with the pinned malloc (NOTE
[pinned malloc]), after one warm-up block each. The table gives each method's median block
time per step, and its ratio to no monitor: the steady-state cost as a fraction of a step.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness

log = logging.getLogger("benchmarks.monitor_cost")

SCHEMA_VERSION = 1
TARGET = 0.01  # the monitor, at the recommended N, within 1% of a step
CONFIG: dict[str, Any] = dict(n_layer=4, d_model=128, n_head=4, seq_len=128, dropout=0.1)
BATCH = 4


def run(*, every: list[int], block: int, rounds: int, budget: float) -> dict[str, Any]:
    """Time ``block``-step blocks of each method; medians per step and ratios to none."""
    import memfit
    from memfit import zoo
    from memfit.runtime.monitor import install_monitor

    bad = [n for n in every if block % n]
    if bad:
        raise ValueError(f"--block {block} must be a multiple of every N (not of {bad})")
    model = zoo.gpt(**CONFIG, seed=0).train()
    idx = zoo.example_inputs(model, batch=BATCH, seed=0)      # (batch, time)
    targets = zoo.example_inputs(model, batch=BATCH, seed=1)  # (batch, time)
    memfit.fit(model, (idx, targets), budget=budget)
    plan = model.memfit_plan
    memfit.unapply(model)
    methods: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    for name, n in [("none", None), *((f"every={n}", n) for n in every)]:
        m = copy.deepcopy(model)
        memfit.apply(m, plan)
        if n is not None:
            install_monitor(m, n)
        methods[name] = (m, torch.optim.SGD(m.parameters(), lr=1e-3))

    def steps(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        for _ in range(block):
            m(idx, targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        # end the last monitored step's meter (the next call would), inside the block: an
        # open CPU meter would also keep the next method's monitor from starting one
        len(getattr(m, "memfit_monitor", ()))

    blocks = {name: (lambda m=m, o=o: steps(m, o)) for name, (m, o) in methods.items()}
    cpu: dict[str, list[float]] = {}
    times = harness.time_interleaved(blocks, warmup=1, repeats=rounds, cpu_times=cpu)
    med = {k: harness.median(v) / block for k, v in times.items()}
    med_cpu = {k: harness.median(v) / block for k, v in cpu.items()}
    rows = []
    for name, (m, _) in methods.items():
        records = list(getattr(m, "memfit_monitor", []))
        rows.append({"method": name, "step_median_s": med[name], "cpu_step_median_s": med_cpu[name],
                     "ratio_to_none": med[name] / med["none"],
                     "cpu_ratio_to_none": med_cpu[name] / med_cpu["none"],
                     "monitored_steps": len(records),
                     "peak_bytes": sorted({r.peak_bytes for r in records}),
                     "block_times_s": times[name], "block_cpu_times_s": cpu[name]})
    return {"config": {**CONFIG, "batch": BATCH}, "budget": budget, "derived": derived(rows),
            "plan": {"regions": len(plan.regions), "predicted_peak_bytes": plan.predicted_peak_bytes,
                     "budget_bytes": plan.budget_bytes},
            "block": block, "rounds": rounds, "rows": rows}


def derived(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One monitored step's extra seconds (every=1, all steps monitored, against none) and
    the least N whose amortized CPU cost (that extra once in N steps) is within ``TARGET``."""
    none = rows[0]
    one = next((r for r in rows if r["method"] == "every=1"), None)
    if one is None:
        return None
    extra_cpu = max(0.0, one["cpu_step_median_s"] - none["cpu_step_median_s"])
    return {"extra_per_monitored_step_s": max(0.0, one["step_median_s"] - none["step_median_s"]),
            "cpu_extra_per_monitored_step_s": extra_cpu,
            # rounded first: 0.025 / 0.001 is 25.000000000000004 in floats
            "least_every_within_target": math.ceil(round(
                extra_cpu / (TARGET * none["cpu_step_median_s"]), 9))}


def meets(result: dict[str, Any]) -> list[str]:
    """The methods within ``TARGET`` of no monitor in CPU time (on a shared machine wall time
    moves with the neighbours' load far more than the monitor moves it)."""
    return [r["method"] for r in result["rows"]
            if r["method"] != "none" and r["cpu_ratio_to_none"] - 1 <= TARGET]


def markdown(result: dict[str, Any], env: dict[str, Any]) -> str:
    p = result["plan"]
    lines = ["# Cost of the training monitor (`fit(monitor_every=N)`)", "",
             f"torch {env['torch_version']}, {env['cpu_model']}, {env['threads']} threads, "
             f"commit {env['git_commit'][:10]}{' (dirty)' if env['git_dirty'] else ''}, "
             f"load {env['extra'].get('load_average_1m')}. Zoo GPT {result['config']}, planned "
             f"for {result['budget']:.0%} of its plain peak ({p['regions']} regions, predicted "
             f"{p['predicted_peak_bytes']} of {p['budget_bytes']} bytes). Blocks of "
             f"{result['block']} training steps, {result['rounds']} interleaved rounds; medians "
             "per step, ratios to no monitor. CPU time is this process's (all threads): on a "
             "shared machine it moves far less than wall time.", "",
             "| method | monitored steps | CPU per step | CPU ratio | wall per step | wall ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['monitored_steps']} | {r['cpu_step_median_s'] * 1e3:.2f} ms"
                     f" | {r['cpu_ratio_to_none']:.4f} | {r['step_median_s'] * 1e3:.2f} ms | "
                     f"{r['ratio_to_none']:.4f} |")
    ok = meets(result)
    lines += ["", f"Within {TARGET:.0%} of a step in CPU time, measured: "
              f"{', '.join(ok) if ok else 'none of the N measured'}."]
    d = result["derived"]
    if d is not None:
        lines.append(f"A monitored step costs {d['cpu_extra_per_monitored_step_s'] * 1e3:.1f} ms "
                     f"of CPU ({d['extra_per_monitored_step_s'] * 1e3:.1f} ms wall) more than an "
                     f"unmonitored one (every=1 against none); once in N steps that is within "
                     f"{TARGET:.0%} of a step's CPU time from N = {d['least_every_within_target']}.")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.monitor_cost",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--every", nargs="+", type=int, default=[1, 10, 20])
    parser.add_argument("--block", type=int, default=None,
                        help="steps per timed block (default: the least common multiple of --every)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--out", default="benchmarks/results", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-reexec", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not args.no_reexec:
        harness.ensure_pinned_malloc("benchmarks.monitor_cost", argv)
    env = harness.collect_environment(args.threads).to_dict()
    block = args.block or math.lcm(*args.every)
    result = run(every=args.every, block=block, rounds=args.rounds, budget=args.budget)
    md = markdown(result, env)
    stem = f"monitor-cost-{dt.date.today().isoformat()}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"kind": "memfit.benchmark.monitor_cost", "schema_version": SCHEMA_VERSION,
         "target": TARGET, "environment": env, "result": result}, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(md)
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
