"""The prepared GPU check: one command, a few minutes on one GPU, JSON + markdown.

    python -m benchmarks.gpu_check                      # CUDA, full sizes (<= 5 min on an H200)
    python -m benchmarks.gpu_check --device cpu --quick # the same code path on CPU, seconds

For the zoo GPT and a Hugging Face Llama on the device:
1. measured vs predicted peak of the plain step, every-block checkpointing and memfit plans at
   70/50/30% of the plain peak and at the smallest feasible budget;
2. gradients of each plan vs the plain step, bitwise, in deterministic mode;
3. step time of memfit vs every-block and selective checkpointing (save matmuls) at their
   peaks (memfit planned with the peer's measured peak as its budget);
4. an offload+recompute plan vs the recompute-only plan at the offload plan's measured peak.
   The planner cannot choose offload in this tree yet (``plan(..., offload=True)`` is absent),
   so the offload plan is made by hand: selective checkpointing (matmul outputs saved) with
   every SAVE decision turned OFFLOAD (said in the output). On CPU, offload only exercises the
   code path (a second CPU buffer stands in for the host).

Writes ``benchmarks/results/gpu_check.json`` and ``gpu_check.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("benchmarks.gpu_check")

FRACTIONS = (0.7, 0.5, 0.3)


def _cases(quick: bool, names: tuple[str, ...] = ("gpt", "llama")) -> list[Any]:
    from benchmarks.models import gpt_case, llama_case

    if quick:
        cases = {"gpt": lambda: gpt_case("gpt", n_layer=2, d_model=32, n_head=2, seq_len=32, batch=2),
                 "llama": lambda: llama_case(n_layer=2, hidden=32, heads=2, seq_len=32, batch=2)}
    else:
        cases = {"gpt": lambda: gpt_case("gpt", n_layer=8, d_model=768, n_head=12, seq_len=1024, batch=8),
                 "llama": lambda: llama_case(n_layer=8, hidden=1024, heads=16, seq_len=1024, batch=4)}
    return [cases[n]() for n in names]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Runner:
    """One case on one device: a model copy per method, its step, measured peak and time."""

    def __init__(self, case: Any, device: torch.device) -> None:
        self.case, self.device = case, device
        self.base = case.model.to(device)
        self.inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in case.inputs)

    def fresh(self) -> torch.nn.Module:
        return copy.deepcopy(self.base)

    def step(self, model: torch.nn.Module) -> Any:
        def run() -> torch.Tensor:
            loss = self.case.loss_fn(model(*self.inputs))
            loss.backward()
            return loss
        return run

    def peak(self, model: torch.nn.Module) -> int:
        from memfit.profiling.measure import measure

        torch.manual_seed(0)
        meter = "allocator" if self.device.type == "cuda" else "both"
        return int(measure(self.step(model), device=self.device, model=model,
                           meter=meter).peak_bytes)

    def grads(self, model: torch.nn.Module) -> Any:
        from benchmarks.harness import seeded_step_grads

        return seeded_step_grads(model, self.step(model), seed=0)


def _applied(runner: _Runner, plan: Any, **kw: Any) -> torch.nn.Module:
    import memfit

    model = runner.fresh()
    memfit.apply(model, plan, check=False, **kw)
    return model


def _time(runner: _Runner, models: dict[str, torch.nn.Module], repeats: int) -> dict[str, float]:
    from benchmarks.harness import time_interleaved

    def wrapped(m: torch.nn.Module) -> Any:
        step = runner.step(m)

        def run() -> None:
            step()
            _sync(runner.device)
        return run

    def clear(name: str) -> None:
        for p in models[name].parameters():
            p.grad = None
        _sync(runner.device)

    times = time_interleaved({n: wrapped(m) for n, m in models.items()}, warmup=1,
                             repeats=repeats, before=clear)
    return {n: statistics.median(ts) for n, ts in times.items()}


def _offload_by_hand(plan: Any) -> Any:
    from memfit.planning.plan import OpPolicy, Region

    regions = tuple(Region(r.modules, tuple((k, OpPolicy.OFFLOAD if p is OpPolicy.SAVE else p)
                                            for k, p in r.ops),
                           writes_buffers=r.writes_buffers) for r in plan.regions)
    return replace(plan, regions=regions, solver=f"{plan.solver}+offload-by-hand")


def _plan_at(prof: Any, budget: int | float) -> Any:
    """memfit's plan for ``budget``, or for the smallest feasible budget if that is above it."""
    import memfit
    from memfit.errors import InfeasibleBudget

    try:
        return memfit.plan(prof, budget=budget)
    except InfeasibleBudget as e:
        return memfit.plan(prof, budget=int(e.min_feasible_bytes))


def check_case(case: Any, device: torch.device, repeats: int) -> dict[str, Any]:
    import memfit
    from benchmarks.harness import compare_grads
    from memfit.errors import InfeasibleBudget

    runner = _Runner(case, device)
    t0 = time.perf_counter()
    prof = memfit.profile(runner.base, runner.inputs, loss_fn=case.loss_fn, device=device)
    plain_peak = runner.peak(runner.fresh())
    plans: dict[str, Any] = {"every_block": memfit.plan(prof, budget="100%", solver="every_block"),
                             "selective": memfit.plan(prof, budget="100%", solver="save_matmuls")}
    for f in FRACTIONS:
        try:
            plans[f"memfit_{f:.0%}"] = memfit.plan(prof, budget=f)
        except InfeasibleBudget as e:
            log.info("%s: %.0f%% is infeasible (%s)", case.name, 100 * f, e)
    plans["memfit_min"] = _plan_at(prof, 1)

    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        ref = runner.grads(runner.fresh())
        rows = [{"plan": "plain", "predicted_peak_bytes": prof.peak_bytes,
                 "measured_peak_bytes": plain_peak,
                 "ratio": plain_peak / prof.peak_bytes if prof.peak_bytes else None,
                 "bitwise": True}]
        measured: dict[str, int] = {}
        for name, plan in plans.items():
            model = _applied(runner, plan)
            measured[name] = runner.peak(model)
            got = compare_grads(ref, runner.grads(model))
            rows.append({"plan": name, "predicted_peak_bytes": plan.predicted_peak_bytes,
                         "measured_peak_bytes": measured[name],
                         "ratio": measured[name] / plan.predicted_peak_bytes
                         if plan.predicted_peak_bytes else None,
                         "bitwise": got.grads_equal})
    finally:
        torch.use_deterministic_algorithms(deterministic)

    speed = []
    for peer in ("every_block", "selective"):
        ours = _plan_at(prof, max(measured[peer], 1))
        times = _time(runner, {peer: _applied(runner, plans[peer]),
                               "memfit": _applied(runner, ours)}, repeats)
        speed.append({"peer": peer, "budget_bytes": measured[peer],
                      "memfit_budget_bytes": ours.budget_bytes,
                      "peer_s": times[peer], "memfit_s": times["memfit"],
                      "memfit_over_peer": times["memfit"] / times[peer]})

    planner_offload = "offload" in inspect.signature(memfit.plan).parameters
    base = plans["selective"]
    off_plan = (memfit.plan(prof, budget=0.7, offload=True) if planner_offload  # type: ignore[call-arg]
                else _offload_by_hand(base))
    off_model = _applied(runner, off_plan)
    off_peak = runner.peak(off_model)
    off_bitwise = compare_grads(ref, runner.grads(off_model)).grads_equal
    rec_plan = _plan_at(prof, max(off_peak, 1))
    rec_model = _applied(runner, rec_plan)
    rec_peak = runner.peak(rec_model)
    times = _time(runner, {"offload": off_model, "recompute": rec_model}, repeats)
    pool = memfit.runtime.apply.host_pool(off_model)
    offload = {"how": "planner offload=True" if planner_offload else
               "by hand: selective (save matmuls) with its SAVE decisions turned OFFLOAD",
               "offload_peak_bytes": off_peak, "recompute_peak_bytes": rec_peak,
               "offload_s": times["offload"], "recompute_s": times["recompute"],
               "offload_over_recompute": times["offload"] / times["recompute"],
               "offload_bitwise": off_bitwise,
               "host_peak_bytes": pool.peak_bytes if pool is not None else 0}
    return {"case": case.name, "description": case.description, "rows": rows, "speed": speed,
            "offload": offload, "seconds": time.perf_counter() - t0}


def _markdown(record: dict[str, Any]) -> str:
    lines = [f"# GPU check ({record['device']}, torch {record['torch']}, commit {record['commit']})",
             "", f"{record['note']}", ""]
    for case in record["cases"]:
        lines += [f"## {case['case']}: {case['description']}", "",
                  "| plan | predicted peak | measured peak | measured/predicted | bitwise |",
                  "| --- | ---: | ---: | ---: | --- |"]
        for r in case["rows"]:
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
            lines.append(f"| {r['plan']} | {r['predicted_peak_bytes']:,} | "
                         f"{r['measured_peak_bytes']:,} | {ratio} | {r['bitwise']} |")
        lines += ["", "| peer at its peak | peer s | memfit s | memfit/peer |", "| --- | ---: | ---: | ---: |"]
        for s in case["speed"]:
            lines.append(f"| {s['peer']} ({s['budget_bytes']:,} B) | {s['peer_s']:.4f} | "
                         f"{s['memfit_s']:.4f} | {s['memfit_over_peer']:.3f} |")
        o = case["offload"]
        lines += ["", f"Offload ({o['how']}): peak {o['offload_peak_bytes']:,} B vs recompute-only "
                  f"{o['recompute_peak_bytes']:,} B; {o['offload_s']:.4f} s vs {o['recompute_s']:.4f} s "
                  f"(ratio {o['offload_over_recompute']:.3f}); bitwise {o['offload_bitwise']}; host peak "
                  f"{o['host_peak_bytes']:,} B.", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny models (for CPU tests)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5, quick 2)")
    parser.add_argument("--cases", default="gpt,llama", help="comma-separated: gpt, llama")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    names = tuple(n.strip() for n in args.cases.split(",") if n.strip())
    if not names or any(n not in ("gpt", "llama") for n in names):
        parser.error(f"--cases takes gpt and/or llama, got {args.cases!r}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            log.error("no CUDA device here; run with --device cpu --quick to check the code path")
            return 2
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    repeats = args.repeats or (2 if args.quick else 5)
    from benchmarks.harness import collect_environment

    env = collect_environment(torch.get_num_threads())
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "commit": env.git_commit, "quick": args.quick,
        "note": ("Peaks in bytes above the step's start (CUDA: max_memory_allocated; CPU: the "
                 "allocator meter). Times: median of interleaved steps."),
        "cases": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for case in _cases(args.quick, names):
        log.info("gpu_check: %s", case.description)
        record["cases"].append(check_case(case, device, repeats))
        # written after each case: a run stopped at its time limit keeps the cases it finished
        (out / "gpu_check.json").write_text(json.dumps(record, indent=2) + "\n")
        (out / "gpu_check.md").write_text(_markdown(record))
        log.info("gpu_check: wrote %s and %s", out / "gpu_check.json", out / "gpu_check.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
