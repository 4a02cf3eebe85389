"""memfit.jax against JAX's own remat policies on CPU: XLA-reported memory, FLOPs, step time.

JAX's policies run twice: compiled as JAX compiles them (on XLA CPU the recompute is merged
into the forward and nothing is saved) and with jax.checkpoint's barriers kept, as memfit
compiles its planned step on the CPU (NOTE [barriers kept on XLA CPU] in memfit.jax.program).

For each model (the Flax GPT and the 3D conv net of ``memfit.jax.models``): the plain step;
JAX's ``nothing_saveable``, ``dots_saveable`` and ``dots_with_no_batch_dims_saveable`` applied
to every block (each top-level child scope, as ``nn.remat`` on each block would); memfit's
plans at each policy's XLA peak and at 70/50/30% of the plain jaxpr-level peak (budgets in bytes, checked
against XLA's report in rounds) and at "min". Per row: memfit's predicted
peak (jaxpr level; for JAX's policies, not predicted), XLA's ``memory_analysis()`` (temp +
output bytes), XLA's ``cost_analysis()`` FLOPs, and the median step seconds of interleaved
rounds. Writes benchmarks/results/jax-policies.json and .md.

    PYTHONPATH=src python -m benchmarks.jax_policies [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import jax

from memfit.errors import InfeasibleBudget
from memfit.jax.fit import PlannedStep, fit, plain_step
from memfit.jax.models import GPTConfig, conv3d, gpt
from memfit.jax.profiler import profile_program
from memfit.jax.program import RegionSpec, trace_program
from memfit.planning.plan import Plan

OUT = Path(__file__).parent / "results"
POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")


def _xla(lowered: Any) -> dict[str, int]:
    c = lowered.compile()
    m = c.memory_analysis()
    ca = c.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    return {"temp_bytes": int(m.temp_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
            "xla_peak_bytes": int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes),
            "xla_flops": int(ca.get("flops", 0))}


def _policy_step(program: Any, prof: Any, name: str, has_aux: bool, keep_barriers: bool) -> PlannedStep:
    """JAX's policy ``name`` on every block: each child scope of the root module (compiled with
    the barriers kept, or as JAX compiles it)."""
    root = next(m for m in prof.modules if m.path and m.parent == "")
    step = PlannedStep(program, Plan((), 0, 0.0, None, name, ""), prof, has_aux=has_aux,
                       keep_barriers=keep_barriers)
    policy = getattr(jax.checkpoint_policies, name)
    specs = []
    for child in root.children:
        ks = [k for k, s in enumerate(program.scopes) if s == child or s.startswith(child + ".")]
        if ks and max(ks) - min(ks) + 1 == len(ks):
            specs.append(RegionSpec(min(ks), max(ks), policy=policy))
    step.regions = specs
    return step


def _memfit_at(loss_fn: Any, params: Any, batch: Any, aux: bool, name: str, target: int,
               plain_peak: int) -> PlannedStep | None:
    """memfit's step for the policy's XLA peak as a budget in bytes: ``fit`` checks it against
    XLA's report in rounds (NOTE [budgets checked against XLA] in memfit.jax.measured)."""
    try:
        return fit(loss_fn, params, batch, budget=target, has_aux=aux, time_limit_s=5.0, model=name, rounds=7)
    except InfeasibleBudget:
        return None


def run_model(name: str, built: tuple[Any, Any, Any, bool], rounds: int) -> list[dict[str, Any]]:
    loss_fn, params, batch, aux = built
    program = trace_program(loss_fn, params, batch)
    prof = profile_program(program, has_aux=aux, model=name)
    rows: list[dict[str, Any]] = []
    steps: dict[str, Any] = {"plain": plain_step(loss_fn, has_aux=aux)}
    for pol in POLICIES:
        steps[pol] = _policy_step(program, prof, pol, aux, keep_barriers=False)
        steps[f"{pol} (barriers kept)"] = _policy_step(program, prof, pol, aux, keep_barriers=True)
    plans: dict[str, Any] = {}
    # memfit at each policy's XLA peak (barriers kept), given as the budget
    for pol in POLICIES:
        target = _xla(steps[f"{pol} (barriers kept)"].lower(params, batch))["xla_peak_bytes"]
        found = _memfit_at(loss_fn, params, batch, aux, name, target, prof.peak_bytes)
        label = f"memfit at {pol}'s peak"
        if found is None:
            rows.append({"model": name, "method": label, "note": f"no plan at XLA peak <= {target} B"})
            continue
        steps[label] = found
        plans[label] = found.plan
    for b in (0.7, 0.5, 0.3, "min"):
        label = f"memfit {b}"
        try:
            st = fit(loss_fn, params, batch, budget=b, has_aux=aux, time_limit_s=5.0, model=name)
        except InfeasibleBudget as e:
            rows.append({"model": name, "method": label, "note": f"infeasible: smallest peak {e.min_feasible_bytes} B"})
            continue
        steps[label] = st
        plans[label] = st.plan
    ref = jax.tree_util.tree_leaves(steps["plain"](params, batch))
    times: dict[str, list[float]] = {k: [] for k in steps}
    for st in steps.values():  # warm-up (compile)
        jax.block_until_ready(st(params, batch))
    for _ in range(rounds):  # interleaved rounds
        for k, st in steps.items():
            t = time.perf_counter()
            jax.block_until_ready(st(params, batch))
            times[k].append(time.perf_counter() - t)
    lower = {k: (st.lower(params, batch) if isinstance(st, PlannedStep) else st.lower(params, batch))
             for k, st in steps.items()}
    plain_s = statistics.median(times["plain"])
    for k, st in steps.items():
        got = jax.tree_util.tree_leaves(st(params, batch))
        p = plans.get(k)
        rows.append({
            "model": name, "method": k, **_xla(lower[k]),
            "predicted_peak_bytes": p.predicted_peak_bytes if p else (prof.peak_bytes if k == "plain" else None),
            "budget_bytes": p.budget_bytes if p else None,
            "predicted_extra_flops": p.extra_flops if p else None,
            "regions": [r.name for r in p.regions] if p else None,
            "median_s": statistics.median(times[k]), "time_ratio": statistics.median(times[k]) / plain_s,
            "bitwise": all(bool((a == b).all()) for a, b in zip(got, ref, strict=True)),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    rows = run_model("gpt", gpt(GPTConfig(n_layer=4, d_model=64, seq_len=64, batch=4)), args.rounds)
    rows += run_model("conv3d", conv3d(batch=2, size=16), args.rounds)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"jax": jax.__version__, "device": "cpu", "machine": platform.machine(), "commit": commit,
            "rounds": args.rounds}
    OUT.mkdir(exist_ok=True)
    (OUT / "jax-policies.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# memfit.jax vs JAX policies (CPU, jax {jax.__version__}, {args.rounds} interleaved rounds)", "",
             "| model | method | predicted peak | XLA temp+out | XLA FLOPs | median s | vs plain | bitwise |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['model']} | {r['method']} | {r['note']} | | | | | |")
            continue
        pp = r["predicted_peak_bytes"]
        lines.append(f"| {r['model']} | {r['method']} | {pp if pp is not None else '-'} | {r['xla_peak_bytes']} | "
                     f"{r['xla_flops']} | {r['median_s']:.4f} | {r['time_ratio']:.2f}x | {r['bitwise']} |")
    (OUT / "jax-policies.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
