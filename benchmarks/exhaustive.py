"""memfit's plan against the best plan of an exhaustive search, at the same peak, in one run.

Usage (from the repository root)::

    python -m benchmarks.exhaustive [--model gpt] [--budget every_block|FRACTION] [--rounds 9]

The searched space is the one hand-tuners use on a transformer: per block, one of four
choices -- keep it, checkpoint it saving its matmul outputs, checkpoint it saving everything
but the attention core (the ops whose outputs are ``T x T`` per head), or checkpoint all of
it -- 4^n plans (65,536 on 8 blocks). Every plan's peak and recompute time are computed on
memfit's linear model (equal to ``simulate`` for disjoint regions) by brute force, without the
solvers. The fastest plans that fit the budget (the predicted every-block peak by default) are
then measured with memfit's plan, every block checkpointed and the plain step, interleaved,
and checked against the plain step bitwise. Output: ``DIR/exhaustive-<model>.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness
from memfit.ops import is_matmul

log = logging.getLogger("benchmarks.exhaustive")

CHOICES = ("keep", "save_matmuls", "save_all_but_core", "recompute_all")


def block_options(ctx: Any, block: str) -> list[tuple[str, tuple[int, ...] | None]]:
    """The four choices of one block as (name, positions in its candidate's ``choices``, all
    SAVE; None = keep)."""
    cand = ctx.candidate((block,))
    prof = ctx.profile
    def square(t: Any) -> bool:
        return len(t.shape) >= 3 and t.shape[-1] == t.shape[-2]

    ops = [(j, ch.op) for j, ch in enumerate(cand.choices)]
    side = max((t.shape[-1] for _, i in ops for t in prof.ops[i].outputs if square(t)), default=0)

    def core(i: int) -> bool:  # an output of T x T per head: attention scores and what follows
        return any(square(t) and t.shape[-1] == side for t in prof.ops[i].outputs)

    matmuls = tuple(j for j, i in ops if is_matmul(prof.ops[i].name))
    all_but_core = tuple(j for j, i in ops if not core(i))
    return [("keep", None), ("save_matmuls", matmuls), ("save_all_but_core", all_but_core),
            ("recompute_all", ())]


def search(prof: Any, blocks: tuple[str, ...], budget: int, top: int = 3) -> dict[str, Any]:
    """Brute force over the 4^n per-block plans on the linear model."""
    from memfit.planning.candidates import PlanningContext
    from memfit.planning.costs import LinearModel

    ctx = PlanningContext(prof)
    cands = [ctx.candidate((b,)) for b in blocks]
    for k, c in enumerate(cands):
        c.index = k  # type: ignore[union-attr]
    lm = LinearModel(ctx, cands)  # type: ignore[arg-type]
    options = [block_options(ctx, b) for b in blocks]
    cols, times = [], []
    for k, opts in enumerate(options):
        kc, kt = [], []
        for _, ops in opts:
            if ops is None:
                kc.append(np.zeros(lm.n_points, dtype=np.int64))
                kt.append(0.0)
            else:
                kc.append(lm.timeline([(k, ops)]) - lm.base)
                kt.append(lm.time_s([(k, ops)]))
        cols.append(np.stack(kc))
        times.append(np.array(kt))
    n = len(blocks)
    half = n // 2

    def sums(ks: range) -> tuple[np.ndarray, np.ndarray, list[tuple[int, ...]]]:
        combos = list(itertools.product(range(len(CHOICES)), repeat=len(ks)))
        mem = np.stack([sum((cols[k][c] for k, c in zip(ks, combo, strict=True)),
                            np.zeros(lm.n_points, dtype=np.int64)) for combo in combos])
        t = np.array([sum(times[k][c] for k, c in zip(ks, combo, strict=True)) for combo in combos])
        return mem, t, combos

    t0 = time.perf_counter()
    m1, t1, c1 = sums(range(half))
    m2, t2, c2 = sums(range(half, n))
    m2b = m2 + lm.base[None, :]
    results = []
    for i in range(len(c1)):
        peaks = (m2b + m1[i][None, :]).max(axis=1)
        for j in np.nonzero(peaks <= budget)[0]:
            results.append((float(t1[i] + t2[j]), int(peaks[j]), c1[i] + c2[j]))
    results.sort()
    best = [{"choices": [CHOICES[c] for c in combo], "predicted_peak_bytes": pk, "recompute_s": t,
             "regions": _regions(options, blocks, combo, ctx)} for t, pk, combo in results[:top]]
    return {"plans_searched": len(c1) * len(c2), "feasible": len(results), "search_s": time.perf_counter() - t0,
            "best": best}


def _regions(options: list, blocks: tuple[str, ...], combo: tuple[int, ...], ctx: Any) -> list[list[Any]]:
    out = []
    for k, c in enumerate(combo):
        _, ops = options[k][c]
        if ops is None:
            continue
        cand = ctx.candidate((blocks[k],))
        out.append([blocks[k], [cand.keys[i] for i in sorted(cand.choices[j].op for j in ops)]])
    return out


def run(name: str, budget_spec: str, rounds: int) -> dict[str, Any]:
    import torch

    import memfit
    from benchmarks.models import build_case
    from benchmarks.peers import every_block, plain
    from memfit.planning.plan import Plan, Region
    from memfit.planning.simulate import simulate
    from memfit.runtime.apply import apply_plan

    torch.set_num_threads(2)
    case = build_case(name)
    prof = memfit.profile(copy.deepcopy(case.model).train(), case.inputs, loss_fn=case.loss_fn)
    every = Plan(tuple(Region((b,)) for b in case.blocks), 0, 0.0, None, "every_block", prof.signature)
    budget = (simulate(prof, every).peak_bytes if budget_spec == "every_block"
              else int(float(budget_spec) * prof.peak_bytes))
    found = search(prof, case.blocks, budget)
    mf = memfit.plan(prof, budget=budget)
    methods = {"none": plain(case), "every_block": every_block(case)}
    plans = {"memfit": mf}
    for q, b in enumerate(found["best"]):
        plans[f"exhaustive_{q + 1}"] = Plan(tuple(Region.saving((m,), keys) for m, keys in b["regions"]),
                                            0, 0.0, budget, "exhaustive", prof.signature)
    models = {}
    for label, p in plans.items():
        model = copy.deepcopy(case.model).train()
        apply_plan(model, p)
        models[label] = model
    def step_of(model: Any) -> Any:
        def step() -> Any:
            loss = case.loss_fn(model(*case.inputs))
            loss.backward()
            return loss.detach()
        return step

    steps = {k: m.step for k, m in methods.items()}
    steps.update({label: step_of(model) for label, model in models.items()})
    ref = harness.seeded_step_grads(methods["none"].model, methods["none"].step, seed=0)
    bitwise = {label: harness.compare_grads(ref, harness.seeded_step_grads(m, steps[label], seed=0)).grads_equal
               for label, m in models.items()}
    all_models = {**{k: m.model for k, m in methods.items()}, **models}

    def clear(label: str) -> None:
        for p in all_models[label].parameters():
            p.grad = None

    cpu: dict[str, list[float]] = {}
    times = harness.time_interleaved(steps, warmup=1, repeats=rounds, before=clear, cpu_times=cpu)
    med = {k: harness.median(v) for k, v in times.items()}
    cmed = {k: harness.median(v) for k, v in cpu.items()}
    rows = []
    for label in steps:
        p = plans.get(label)
        sim = simulate(prof, p) if p is not None else None
        rows.append({"method": label, "step_s": med[label], "overhead": med[label] / med["none"] - 1,
                     "cpu_overhead": cmed[label] / cmed["none"] - 1,
                     "predicted_peak_bytes": sim.peak_bytes if sim else None,
                     "predicted_recompute_s": sim.recompute_s if sim else None,
                     "bitwise": bitwise.get(label), "regions": len(p.regions) if p is not None else None})
    return {"model": name, "description": case.description, "budget_bytes": budget, "budget": budget_spec,
            "rounds": rounds, "search": found, "rows": rows}


def markdown(res: dict[str, Any], env: dict[str, Any]) -> str:
    rows = {r["method"]: r for r in res["rows"]}
    eb = rows["every_block"]["overhead"]
    best = min((r for r in res["rows"] if r["method"].startswith("exhaustive")), key=lambda r: r["step_s"])
    lines = [
        f"### exhaustive search vs memfit: {res['model']} ({res['description']})", "",
        f"torch {env['torch_version']}, {env['threads']} threads, {env['date']}; budget "
        f"{res['budget_bytes'] / 2**20:.1f} MiB ({res['budget']}); {res['search']['plans_searched']} per-block "
        f"plans searched in {res['search']['search_s']:.1f} s, {res['search']['feasible']} fit; "
        f"{res['rounds']} interleaved rounds, medians.", "",
        "| method | predicted MiB | predicted recompute ms | step s | overhead | CPU overhead | "
        "vs every block's overhead | grads bitwise |",
        "|---|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in res["rows"]:
        pk = f"{r['predicted_peak_bytes'] / 2**20:.1f}" if r["predicted_peak_bytes"] else "-"
        rc = f"{r['predicted_recompute_s'] * 1e3:.1f}" if r["predicted_recompute_s"] is not None else "-"
        bw = "-" if r["bitwise"] is None else ("yes" if r["bitwise"] else "NO")
        lines.append(f"| {r['method']} | {pk} | {rc} | {r['step_s']:.3f} | {r['overhead']:+.1%} | "
                     f"{r['cpu_overhead']:+.1%} | {r['overhead'] / eb:.2f} | {bw} |")
    for q, b in enumerate(res["search"]["best"]):
        lines.append(f"\nexhaustive_{q + 1}: {', '.join(b['choices'])}")
    lines.append(f"\nmemfit / best exhaustive step time: {rows['memfit']['step_s'] / best['step_s']:.3f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exhaustive", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--budget", default="every_block", help="'every_block' (its predicted peak) or a fraction")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default="benchmarks/results", type=Path)
    parser.add_argument("--no-reexec", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not args.no_reexec:
        harness.ensure_pinned_malloc("benchmarks.exhaustive", argv)
    env = harness.collect_environment(2).to_dict()
    res = run(args.model, args.budget, args.rounds)
    md = markdown(res, env)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"exhaustive-{args.model}.json").write_text(json.dumps({"env": env, **res}, indent=1))
    (args.out / f"exhaustive-{args.model}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
