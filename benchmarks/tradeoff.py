"""Memory vs step time: memfit against every alternative, on the same model, in one run.

Usage (from the repository root)::

    python -m benchmarks.tradeoff --model gpt|gpt-act|unet3d|resnet|llama|all [--quick] [--repeats N] [--out DIR]

Per model it writes ``DIR/<model>.json`` (every number, plus the environment), ``DIR/<model>.md``
(the tables, also printed) and ``DIR/<model>.png`` (memory vs time). The process re-executes
itself with the pinned glibc malloc when started without it (see ``benchmarks/harness.py``).

Order of a run, per model:
1. build every method on its own copy of the seeded model; compile the compiled ones;
2. one seeded step each, gradients compared bitwise with the plain step;
3. peak memory of each, in a separate untimed run (memfit's allocator meter);
4. memfit: profile once, plan for the budget sweep and for each peer's measured peak, apply,
   then 2 and 3 for each distinct plan;
5. all methods timed together, interleaved (A B C, B C A, C A B, ...), medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness

log = logging.getLogger("benchmarks.tradeoff")

SCHEMA_VERSION = 1
RESULT_KIND = "memfit.benchmark.tradeoff"


@dataclass(frozen=True)
class Settings:
    """How hard a run measures. ``quick`` trades repeats and budgets for time."""

    threads: int = 2
    warmup: int = 2
    repeats: int = 7
    fractions: tuple[float, ...] = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3)
    include_min: bool = True
    compile_budgets: tuple[float, ...] = (0.5, 0.2)
    match_peers: bool = True
    seed: int = 0
    quick: bool = False
    compiled_only: bool = False  # the plain steps, the compile peers and compiled memfit at their peaks

    @classmethod
    def make(cls, *, quick: bool, threads: int, no_compile: bool = False,
             compiled_only: bool = False) -> Settings:
        if compiled_only and no_compile:
            raise ValueError("--compiled-only times the torch.compile peers: drop --no-compile")
        if quick:
            return cls(threads=threads, warmup=1, repeats=3, fractions=(0.6, 0.4),
                       compile_budgets=() if no_compile else (0.5,), quick=True,
                       compiled_only=compiled_only)
        return cls(threads=threads, compile_budgets=() if no_compile else (0.5, 0.2),
                   compiled_only=compiled_only)


def _record(method: Any, **numbers: Any) -> dict[str, Any]:
    info = {k: v for k, v in method.info.items() if k != "plan"}
    return {
        "name": method.name,
        "label": method.label,
        "family": method.family.value,
        "applicable": method.applicable or bool(method.info.get("same_plan_as")),
        "reason": method.reason,
        "peak_bytes": None,
        "predicted_peak_bytes": method.info.get("predicted_peak_bytes"),
        "step_s": None,
        "step_times_s": [],
        "step_min_s": None,
        "cpu_s": None,
        "cpu_times_s": [],
        "overhead": None,
        "cpu_overhead": None,
        "planning_s": method.info.get("planning_s"),
        "compile_s": None,
        "grads_equal": None,
        "loss_equal": None,
        "buffers_equal": None,
        "max_abs_grad_diff": None,
        "error": "",
        "info": info,
        "plan": method.info.get("plan"),
        **numbers,
    }


def _fresh_compiler() -> None:
    """Each model compiles from an empty dynamo cache (``peers.room_for_recompiles`` keeps
    its compiled methods from running eagerly past dynamo's recompile limit)."""
    import torch

    torch.compiler.reset()


def _is_compiled(name: str) -> bool:
    return name.startswith(("compile_", "compiled_memfit", "memfit_compile"))


def _check_and_measure(method: Any, ref: Any, rec: dict[str, Any], seed: int,
                       compiled_ref: Any = None) -> None:
    """Gradients and peak memory of one method, from one seeded step that nothing times.

    The peak comes from the CPU allocator's own events (memfit's ``allocator_peak``, the ground
    truth ``measure`` uses); gradients are cleared first, so the step allocates them afresh as a
    training step after ``zero_grad(set_to_none=True)`` does. The meter changes no numerics, so
    the same step's gradients are compared bitwise with the plain step's.
    """
    from memfit.profiling.measure import allocator_peak

    box: dict[str, Any] = {}

    def metered_step() -> Any:
        def inner() -> None:
            box["loss"] = method.step()

        # Garbage collected mid-step (an earlier method's reference cycles) would be counted
        # as frees below the start and hide part of this step's peak: collect first, then
        # keep the collector off while metering (seen once: a plan metered 29% below its
        # repeatable peak).
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            box["peak"] = allocator_peak(inner)
        finally:
            if was_enabled:
                gc.enable()
        return box["loss"]

    try:
        got = harness.seeded_step_grads(method.model, metered_step, seed=seed)
        check = harness.compare_grads(ref, got)
        rec.update(peak_bytes=int(box["peak"]), grads_equal=check.grads_equal, loss_equal=check.loss_equal,
                   buffers_equal=check.buffers_equal, max_abs_grad_diff=check.max_abs_grad_diff)
        if compiled_ref is not None and _is_compiled(method.name):  # against the compiled plain step
            cc = harness.compare_grads(compiled_ref, got)
            rec.update(grads_equal_compiled_plain=cc.grads_equal,
                       max_abs_grad_diff_compiled_plain=cc.max_abs_grad_diff)
    except Exception as e:  # noqa: BLE001 - record and go on with the other methods
        log.exception("%s failed", method.name)
        rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        rec["applicable"] = False
        method.forward_loss = None
        method.reason = rec["error"]
    finally:
        method.clear_grads()


def run_case(name: str, settings: Settings) -> dict[str, Any]:
    """Benchmark every method on one model; return the JSON-ready result."""
    from benchmarks import compiled_memfit, models, peers, planned

    t_start = time.perf_counter()
    _fresh_compiler()
    case = models.build_case(name)
    log.info("%s: %s", name, case.description)
    methods = peers.build_peers(case, compile_budgets=settings.compile_budgets)
    if settings.compiled_only:
        methods = [m for m in methods if m.name == "none" or m.name.startswith("compile")]
    plain = methods[0]
    records: dict[str, dict[str, Any]] = {m.name: _record(m) for m in methods}
    errors: list[str] = []

    for m in methods:
        if m.applicable and m.name.startswith("compile"):
            log.info("%s: compiling %s", name, m.name)
            peers.warm_compiled(m)
            records[m.name].update(applicable=m.applicable, reason=m.reason,
                                   info={**records[m.name]["info"], **m.info})

    ref = harness.seeded_step_grads(plain.model, plain.step, seed=settings.seed)  # type: ignore[arg-type]
    compiled_plain = next((m for m in methods if m.name == peers.COMPILED_PLAIN and m.applicable), None)
    cref = None if compiled_plain is None else harness.seeded_step_grads(
        compiled_plain.model, compiled_plain.step, seed=settings.seed)  # type: ignore[arg-type]
    for m in methods:
        if m.applicable:
            log.info("%s: checking and metering %s", name, m.name)
            _check_and_measure(m, ref, records[m.name], settings.seed, cref)

    # ---- memfit ----
    peer_peaks = {m.name: records[m.name]["peak_bytes"] for m in methods
                  if m.family is peers.Family.PEER and m.applicable and records[m.name]["peak_bytes"]}
    specs = planned.budget_specs(settings.fractions, peer_peaks if settings.match_peers else {},
                                 include_min=settings.include_min)
    log.info("%s: memfit profile + %d plans", name, len(specs))
    sweep = planned.MemfitSweep() if settings.compiled_only else planned.build_memfit(case, specs)
    sweep = compiled_memfit.extend(sweep, case, peer_peaks, quick=settings.quick,  # compile + memfit
                                   at_peers_only=settings.compiled_only)
    errors.extend(sweep.errors)
    for m in sweep.methods:
        records[m.name] = _record(m)
        if m.applicable:
            log.info("%s: checking and metering %s", name, m.name)
            _check_and_measure(m, ref, records[m.name], settings.seed, cref)
    all_methods = methods + sweep.methods

    # ---- timing, interleaved ----
    timed = {m.name: m for m in all_methods if m.applicable}
    log.info("%s: timing %d methods x (%d warm-up + %d) rounds", name, len(timed), settings.warmup, settings.repeats)
    load_before = harness.load_average()
    cpu: dict[str, list[float]] = {}
    times = harness.time_interleaved({n: m.step for n, m in timed.items()}, warmup=settings.warmup,
                                     repeats=settings.repeats, before=lambda n: timed[n].clear_grads(),
                                     cpu_times=cpu)
    for n, ts in times.items():
        records[n].update(step_s=harness.median(ts), step_times_s=ts, step_min_s=min(ts),
                          cpu_s=harness.median(cpu[n]), cpu_times_s=cpu[n])
    base_s = records["none"]["step_s"]
    base_cpu = records["none"].get("cpu_s")
    for rec in records.values():
        alias = rec["info"].get("same_plan_as")
        if alias:
            src = records[alias]
            for k in ("peak_bytes", "step_s", "step_times_s", "step_min_s", "cpu_s", "cpu_times_s", "grads_equal",
                      "loss_equal", "buffers_equal", "max_abs_grad_diff", "plan",
                      "grads_equal_compiled_plain", "max_abs_grad_diff_compiled_plain"):
                rec[k] = src.get(k, rec.get(k))
        if rec["step_s"] is not None and base_s:
            rec["overhead"] = rec["step_s"] / base_s - 1.0
        if rec.get("cpu_s") is not None and base_cpu:
            rec["cpu_overhead"] = rec["cpu_s"] / base_cpu - 1.0
        first = rec["info"].get("first_call_s")
        if first is not None and rec["step_s"] is not None:
            rec["compile_s"] = max(0.0, first - rec["step_s"])

    method_records = [records[m.name] for m in all_methods]
    return {
        "kind": RESULT_KIND,
        "schema_version": SCHEMA_VERSION,
        "model": name,
        "description": case.description,
        "config": case.config,
        "settings": {**asdict(settings)},
        "memfit": {"profile_s": sweep.profile_s, "plain_predicted_peak_bytes": sweep.plain_predicted_peak_bytes},
        "methods": method_records,
        "comparisons": comparisons(method_records),
        "compiled_comparisons": compiled_memfit.comparisons(method_records),
        "errors": errors,
        "wall_s": time.perf_counter() - t_start,
        # 1-minute load average when timing began and ended; above the core count, other
        # processes shared the cores and absolute times (less so ratios) are inflated
        "load_average": [load_before, harness.load_average()],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def comparisons(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per peer: memfit's plan made for the peer's peak, and memfit's fastest point within it.

    ``time_ratio`` is memfit's step time over the peer's (below 1: memfit faster); a ratio
    counts only where memfit's *measured* peak is at most the peer's (``peak_ok``).
    """
    by_name = {r["name"]: r for r in records}
    memfit = [r for r in records if r["family"] == "memfit" and r["step_s"] and r["peak_bytes"]
              and not r["name"].startswith(("compiled_memfit", "memfit_compile"))]  # compiled: compiled_comparisons
    out = []
    for peer in records:
        if peer["family"] != "peer" or not peer["step_s"] or not peer["peak_bytes"]:
            continue
        row: dict[str, Any] = {"peer": peer["name"], "peer_peak_bytes": peer["peak_bytes"],
                               "peer_step_s": peer["step_s"]}
        matched = by_name.get(f"memfit@{peer['name']}")
        if matched is not None and matched["step_s"] and matched["peak_bytes"]:
            row.update(matched=matched["name"], matched_peak_bytes=matched["peak_bytes"],
                       matched_step_s=matched["step_s"],
                       matched_time_ratio=matched["step_s"] / peer["step_s"],
                       matched_cpu_ratio=_ratio(matched.get("cpu_s"), peer.get("cpu_s")),
                       matched_peak_ok=matched["peak_bytes"] <= peer["peak_bytes"])
        elif matched is not None:
            row.update(matched=matched["name"], matched_reason=matched["reason"] or matched["error"])
        within = [r for r in memfit if r["peak_bytes"] <= peer["peak_bytes"]]
        if within:
            best = min(within, key=lambda r: r["step_s"])
            row.update(best=best["name"], best_peak_bytes=best["peak_bytes"], best_step_s=best["step_s"],
                       best_time_ratio=best["step_s"] / peer["step_s"],
                       best_cpu_ratio=_ratio(best.get("cpu_s"), peer.get("cpu_s")))
        out.append(row)
    return out


def write_outputs(result: dict[str, Any], out_dir: Path, env: dict[str, Any]) -> str:
    """Write ``<model>.json``, ``.md`` and ``.png``; return the markdown."""
    from benchmarks import plot, tables

    out_dir.mkdir(parents=True, exist_ok=True)
    name = result["model"]
    result = {**result, "environment": env}
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    md = tables.markdown(result)
    (out_dir / f"{name}.md").write_text(md)
    try:
        plot.plot_tradeoff(result, out_dir / f"{name}.png")
    except Exception as e:  # noqa: BLE001 - a missing matplotlib must not lose the numbers
        log.warning("plot for %s failed: %s", name, e)
    return md


def main(argv: list[str] | None = None) -> int:
    from benchmarks.models import model_names

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tradeoff", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="all", choices=[*model_names(), "all"])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and budgets (all models < 10 min on 2 cores)")
    parser.add_argument("--out", default="benchmarks/results", type=Path)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peers")
    parser.add_argument("--compiled-only", action="store_true",
                        help="only the plain steps, the torch.compile peers and compiled memfit at their peaks")
    parser.add_argument("--no-reexec", action="store_true", help="do not re-execute with the pinned malloc")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds per method (default 7, 3 with --quick)")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not args.no_reexec:
        harness.ensure_pinned_malloc("benchmarks.tradeoff", argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Compile in this process: inductor's worker pool would otherwise warm up in the
    # background and steal the cores other methods are being timed on.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

    env = harness.collect_environment(args.threads).to_dict()
    settings = Settings.make(quick=args.quick, threads=args.threads, no_compile=args.no_compile,
                             compiled_only=args.compiled_only)
    if args.repeats is not None:
        settings = dataclasses.replace(settings, repeats=args.repeats)
    names = model_names() if args.model == "all" else [args.model]
    failed = []
    for name in names:
        try:
            result = run_case(name, settings)
        except Exception as e:  # noqa: BLE001 - one model failing must not stop the others
            log.exception("%s failed", name)
            failed.append(f"{name}: {type(e).__name__}: {e}")
            continue
        print(write_outputs(result, args.out, env), flush=True)
    for f in failed:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
