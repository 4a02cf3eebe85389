"""memfit's plans under ``torch.compile``: the planned model compiled (inductor), against
``torch.compile``'s own ``activation_memory_budget`` (the ``compile_budget_<b>`` peers).

Budgets: a few fractions of the plain peak, the smallest feasible one, and each compile peer's
measured peak (``compiled_memfit@compile_budget_<b>``), so that the two ways of trading memory
for time under compilation meet at the same memory. memfit plans from its eager profile; the
compiled graph saves what the plan saves (NOTE [policies under torch.compile] in
``memfit.runtime.checkpoint``), and inductor's fusions change the transients around it, so the
measured peak is what the tables report.

Three plans per budget: ``compiled_memfit*`` from the eager profile's costs,
``compiled_memfit_cc*`` from the compiled costs of ``memfit.Search(compiled=True)`` (NOTE
[compiled costs] in ``memfit.profiling.compiled_costs``: pointwise ops fused for free, no per-op
charges), both compiled the same way, and at the compile peers' peaks ``memfit_compile@*``:
``memfit.compile``, which re-plans on the compiled step's measured peak (NOTE [budgets measured
under compilation] in ``memfit.compiled``).

``extend`` adds the methods to the eager memfit sweep, so that the trade-off run checks,
meters and times them with every other method (interleaved).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from benchmarks.models import Case
from benchmarks.peers import Method, warm_compiled
from benchmarks.planned import MIN_FEASIBLE, BudgetSpec, MemfitSweep, build_memfit

__all__ = ["PREFIX", "CC_PREFIX", "LOOP_PREFIX", "specs", "compile_method", "extend", "comparisons"]

log = logging.getLogger(__name__)

PREFIX = "compiled_memfit"
CC_PREFIX = "compiled_memfit_cc"  # planned with compiled costs
LOOP_PREFIX = "memfit_compile"  # memfit.compile: compiled costs, re-planned on measured peaks
FRACTIONS = (0.6, 0.4)
QUICK_FRACTIONS = (0.4,)


def specs(peer_peaks: Mapping[str, int], *, quick: bool, prefix: str = PREFIX,
          at_peers_only: bool = False) -> list[BudgetSpec]:
    """Fractions, the smallest feasible peak, then each compile peer's measured peak (only
    those with ``at_peers_only``)."""
    out = [] if at_peers_only else [BudgetSpec(f"{prefix}_{f:.2f}", float(f))
                                     for f in (QUICK_FRACTIONS if quick else FRACTIONS)]
    if not at_peers_only:
        out.append(BudgetSpec(f"{prefix}_min", MIN_FEASIBLE))
    out.extend(BudgetSpec(f"{prefix}@{peer}", int(peak), peer=peer)
               for peer, peak in peer_peaks.items() if peer.startswith("compile_budget"))
    return out


def compile_method(method: Method) -> Method:
    """The planned model of an eager memfit method, compiled with inductor's defaults."""
    import torch

    if not method.applicable or method.model is None:
        return method
    model, loss_fn = method.model, method.forward_loss

    def forward_loss(*inputs: Any) -> Any:
        assert loss_fn is not None
        return loss_fn(*inputs)

    label = method.label.replace("memfit", "compile + memfit", 1)
    return Method(method.name, label, method.family, model, torch.compile(forward_loss),
                  method.inputs, info={**method.info, "compiled": "inductor"})


def extend(sweep: MemfitSweep, case: Case, peer_peaks: Mapping[str, int], *,
           quick: bool, at_peers_only: bool = False) -> MemfitSweep:
    """Append compiled memfit methods (compiled and warmed) to ``sweep``; nothing if no
    compile peer ran."""
    wanted = specs(peer_peaks, quick=quick, at_peers_only=at_peers_only)
    if not any(s.peer for s in wanted):
        return sweep
    built = build_memfit(case, wanted, tune=False)  # tuned rows are eager ones: planned.py
    sweep.errors.extend(f"{PREFIX}: {e}" for e in built.errors)
    cc = build_memfit(case, specs(peer_peaks, quick=quick, prefix=CC_PREFIX,
                                  at_peers_only=at_peers_only),
                      prof=_compiled_costs_profile(case), tune=False)
    sweep.errors.extend(f"{CC_PREFIX}: {e}" for e in cc.errors)
    for method in [*built.methods, *cc.methods]:
        compiled = compile_method(method)
        if compiled.applicable:
            log.info("%s: compiling %s", case.name, compiled.name)
            warm_compiled(compiled)
        sweep.methods.append(compiled)
    sweep.methods.extend(loop_method(case, peer, peak) for peer, peak in peer_peaks.items()
                         if peer.startswith("compile_budget"))
    return sweep


def loop_method(case: Case, peer: str, peak: int) -> Method:
    """``memfit.compile`` at ``peer``'s measured peak (bytes) on a fresh copy; the loss runs
    eagerly after the compiled model."""
    import copy
    import time

    import memfit
    from benchmarks.peers import Family

    name, label = f"{LOOP_PREFIX}@{peer}", f"memfit.compile @ {peer}"
    model = copy.deepcopy(case.model).train()
    log.info("%s: memfit.compile at %s's peak (%d B)", case.name, peer, peak)
    t0 = time.perf_counter()
    try:
        compiled = memfit.compile(model, case.inputs, budget=int(peak), loss_fn=case.loss_fn)
    except Exception as e:  # noqa: BLE001 - a benchmark records failures and goes on
        return Method(name, label, Family.MEMFIT, reason=f"memfit.compile failed: {type(e).__name__}: {e}")
    plan = model.__dict__["memfit_plan"]
    rounds = model.__dict__["memfit_compiled"]
    loss_fn = case.loss_fn

    def forward_loss(*inputs: Any) -> Any:
        out = compiled(*inputs)
        return loss_fn(out), out

    return Method(name, label, Family.MEMFIT, model, forward_loss, case.inputs, info={
        "budget_spec": "bytes", "matched_peer": peer, "budget_bytes": int(peak),
        "predicted_peak_bytes": int(plan.predicted_peak_bytes), "compile_s": time.perf_counter() - t0,
        "rounds": [r.to_dict() for r in rounds], "plan": plan.to_dict()["regions"]})


def _compiled_costs_profile(case: Case) -> Any:
    """The profile ``fit(search=memfit.Search(compiled=True))`` plans: measured, not fitted
    to eager steps, with compiled costs."""
    import copy

    from memfit.measuring import calibration
    from memfit.profiling.compiled_costs import for_compiler

    model = copy.deepcopy(case.model).train()
    return for_compiler(calibration.profile(model, case.inputs, loss_fn=case.loss_fn,
                                            calibrate_time=False))


def comparisons(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per compile peer: compiled memfit planned at the peer's measured peak."""
    by_name = {r["name"]: r for r in records}
    out = []
    for peer in records:
        if not peer["name"].startswith("compile_budget") or not peer["step_s"] or not peer["peak_bytes"]:
            continue
        for prefix, costs in ((PREFIX, "eager"), (CC_PREFIX, "compiled"),
                              (LOOP_PREFIX, "compiled, re-planned on measured peaks")):
            row: dict[str, Any] = {"peer": peer["name"], "peer_peak_bytes": peer["peak_bytes"],
                                   "peer_step_s": peer["step_s"], "costs": costs}
            mine = by_name.get(f"{prefix}@{peer['name']}")
            if mine is not None and mine["step_s"] and mine["peak_bytes"]:
                row.update(matched=mine["name"], matched_peak_bytes=mine["peak_bytes"],
                           matched_step_s=mine["step_s"],
                           matched_time_ratio=mine["step_s"] / peer["step_s"],
                           matched_peak_ok=mine["peak_bytes"] <= peer["peak_bytes"],
                           matched_grads_equal_compiled_plain=mine.get("grads_equal_compiled_plain"))
            if mine is not None:
                out.append(row)
    return out


def table(result: dict[str, Any]) -> str:
    """Markdown: compile's budget vs compiled memfit's plans (peak, step, ratio)."""
    recs = [r for r in result["methods"]
            if r["name"].startswith(("compile_", PREFIX, LOOP_PREFIX)) or r["name"] == "none"]
    if not any(r["name"].startswith(PREFIX) for r in recs):
        return ""
    mib = 2**20
    base = next((r["step_s"] for r in recs if r["name"] == "none"), None)
    lines = ["torch.compile + memfit (planned from memfit's profile with eager costs, "
             f"``{CC_PREFIX}``: with compiled costs; compiled with inductor) vs torch.compile's "
             "activation_memory_budget:", "",
             "| method | budget | peak MiB | predicted MiB | step s | vs eager none | grads = compiled plain (max diff) | notes |",
             "|---|---|---:|---:|---:|---:|:-:|---|"]
    for r in recs:
        info = r["info"]
        budget = info.get("budget", info.get("budget_spec", "-"))
        if info.get("matched_peer"):
            budget = f"{info['matched_peer']}'s peak"
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / mib:.1f}"
        pred = ("-" if r["predicted_peak_bytes"] is None
                else f"{r['predicted_peak_bytes'] / mib:.1f}")
        step = "-" if r["step_s"] is None else f"{r['step_s']:.3f}"
        vs = "-" if r["step_s"] is None or not base else f"{r['step_s'] / base:.2f}x"
        note = (r.get("reason") or r.get("error") or "").replace("|", "/")[:120]
        if info.get("same_plan_as"):
            note = f"same plan as {info['same_plan_as']}"
        eq = r.get("grads_equal_compiled_plain")
        bitwise = "-" if eq is None else "yes" if eq else f"NO ({r['max_abs_grad_diff_compiled_plain']:.1e})"
        lines.append(f"| {r['name']} | {budget} | {peak} | {pred} | {step} | {vs} | {bitwise} | {note} |")
    for c in result.get("compiled_comparisons", []):
        if "matched_time_ratio" in c:
            lines.append("")
            lines.append(
                f"At {c['peer']}'s measured peak ({c['peer_peak_bytes'] / mib:.1f} MiB): compiled "
                f"memfit ({c.get('costs', 'eager')} costs) {c['matched_peak_bytes'] / mib:.1f} MiB, time ratio "
                f"{c['matched_time_ratio']:.3f} (memfit / compile; below 1: memfit faster), "
                f"peak within: {'yes' if c['matched_peak_ok'] else 'NO'}.")
    return "\n".join(lines)


# ---- several runs' table: python -m benchmarks.compiled_memfit RUN_DIR... ----------------------
MODELS = ("gpt", "gpt-act", "unet3d", "resnet", "llama")
_VARIANTS = ((PREFIX, "eager costs"), (CC_PREFIX, "compiled costs"), (LOOP_PREFIX, "memfit.compile"))
_COSTS = {PREFIX: "eager", CC_PREFIX: "compiled", LOOP_PREFIX: "compiled, re-planned on measured peaks"}


def runs_table(runs: list[dict[str, dict[str, Any]]]) -> str:
    """Markdown: per model and compile budget, each variant's measured peak and time ratio to
    the compile peer at its peak, one value per run (``runs``: model name -> result JSON)."""
    mib = 2**20
    head = "| model | budget | compile peer: peak MiB, step s |" + "".join(
        f" {label}: peak MiB, ratio |" for _, label in _VARIANTS)
    lines = [head, "|---|---|---|" + "---|" * len(_VARIANTS)]
    for model in MODELS:
        results = [r[model] for r in runs if model in r]
        if not results:
            continue
        for peer in sorted({c["peer"] for res in results for c in res.get("compiled_comparisons", [])},
                           reverse=True):
            rows = [{(c["peer"], c["costs"]): c for c in res["compiled_comparisons"]} for res in results]
            peer_cell = " / ".join(f"{row[(peer, 'eager')]['peer_peak_bytes'] / mib:.1f}, "
                                   f"{row[(peer, 'eager')]['peer_step_s']:.3f}"
                                   for row in rows if (peer, "eager") in row)
            cells = []
            for prefix, _ in _VARIANTS:
                got = [row.get((peer, _COSTS[prefix])) for row in rows]
                cells.append(" / ".join(
                    "-" if c is None or "matched_time_ratio" not in c else
                    f"{c['matched_peak_bytes'] / mib:.1f}{'' if c['matched_peak_ok'] else ' (over)'}, "
                    f"{c['matched_time_ratio']:.3f}" for c in got))
            budget = peer.removeprefix("compile_budget_")
            lines.append(f"| {model} | {budget} | {peer_cell} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description="compiled memfit vs torch.compile's budget, several "
                                                 "runs of `benchmarks.tradeoff --compiled-only`")
    parser.add_argument("runs", nargs="+", type=Path, help="each run's --out folder")
    args = parser.parse_args(argv)
    runs = [{m: json.loads((d / f"{m}.json").read_text()) for m in MODELS if (d / f"{m}.json").exists()}
            for d in args.runs]
    print(runs_table(runs))


if __name__ == "__main__":
    main()
