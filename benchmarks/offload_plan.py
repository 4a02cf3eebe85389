"""Offload as a planner choice on a 7B Llama profiled in fake mode: recompute time with and
without offload at one budget (issue #15).

    PYTHONPATH=src python benchmarks/offload_plan.py [--layers 32] [--budget 40GiB]

Prints the recompute-only plan and two offload plans (at the same budget, and with the
recompute-only plan's predicted peak as budget): predicted peak, recompute time, host bytes,
and writes benchmarks/results/offload_plan.json. Pure planning: no GPU; the planning seconds
are this machine's.

Then a bound on what any offload plan can reach at the budget ``M`` under memfit's own model.
An offload plan whose copies total ``D`` bytes becomes a recompute-only plan when its
offloaded outputs are saved instead: its peak rises by at most ``D`` and its time falls by
its link charges, which are at least ``max(0, D - F * L) / L`` (``F``: forward compute
seconds, ``L``: link bytes/s; more than ``F * L`` cannot hide behind the forward, and a copy
still running at backward is a saved tensor). So no offload plan beats
``min_D R(M + D) + max(0, D - F * L) / L``, ``R(b)``: the recompute-only plan's time at
budget ``b``, taken on a grid of ``D``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    import transformers

    from memfit.planning.planner import plan_for_budget
    from memfit.profiling.tracer import trace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--budget", default="40GiB")
    ap.add_argument("--host-budget", default="64GiB")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--out", default="benchmarks/results/offload_plan.json")
    args = ap.parse_args()
    cfg = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=args.layers,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
        max_position_embeddings=args.seq, attn_implementation="eager", tie_word_embeddings=False,
        use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.train()
    ids = torch.zeros(1, args.seq, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    prof = trace(model, {"input_ids": ids, "labels": ids}, mode="fake", target=args.target)
    rows = {"profile_s": time.perf_counter() - t0, "plain_peak_bytes": prof.peak_bytes}
    runs = (("recompute_only", args.budget, False), ("offload", args.budget, True),
            ("offload_at_peak", None, True))  # None: the recompute-only plan's predicted peak
    for key, budget, off in runs:
        if budget is None:
            budget = rows["recompute_only"]["predicted_peak_bytes"]  # type: ignore[index]
        t0 = time.perf_counter()
        p = plan_for_budget(prof, budget=budget, offload=off, host_budget=args.host_budget if off else None)
        rows[key] = {"plan_s": time.perf_counter() - t0, "solver": p.solver, "budget_bytes": p.budget_bytes,
                     "predicted_peak_bytes": p.predicted_peak_bytes, "recompute_s": p.recompute_s,
                     "host_peak_bytes": p.host_peak_bytes, "notes": list(p.notes)}
        print(p)
    rows["bound"] = _bound(prof, args.budget, args.target, plan_for_budget)
    a = rows["recompute_only"]
    for key, what in (("offload", f"same budget {args.budget}"),
                      ("offload_at_peak", "budget = the recompute-only plan's predicted peak")):
        b = rows[key]
        rows[f"{key}_reduction"] = 1 - b["recompute_s"] / a["recompute_s"]  # type: ignore[index]
        print(f"{what}: recompute {a['recompute_s'] * 1e3:.1f} ms -> {b['recompute_s'] * 1e3:.1f} ms "  # type: ignore[index]
              f"({rows[f'{key}_reduction']:.1%} less); peak {a['predicted_peak_bytes']} -> "  # type: ignore[index]
              f"{b['predicted_peak_bytes']} bytes; host {b['host_peak_bytes']} bytes; "  # type: ignore[index]
              f"planned in {b['plan_s']:.1f} s")  # type: ignore[index]
    bd = rows["bound"]
    print(f"bound: any offload plan at {args.budget} reruns at least {bd['recompute_s'] * 1e3:.1f} ms "  # type: ignore[index]
          f"({bd['reduction']:.1%} less than recompute-only), at {bd['copy_bytes'] / 1e9:.2f} GB of copies; "  # type: ignore[index]
          f"the forward hides {bd['hideable_bytes'] / 1e9:.2f} GB")  # type: ignore[index]
    rows.update(torch=torch.__version__, layers=args.layers, seq=args.seq, budget=args.budget,
                target=args.target)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


def _bound(prof: Any, budget: str, target: str, plan: Any) -> dict[str, float]:
    """The least recompute any offload plan can reach at ``budget`` (module docstring)."""
    from memfit.timemodel.devices import preset
    from memfit.units import parse_bytes

    link = preset(target).host_link_bytes_per_s
    hideable = sum(o.time_s for o in prof.ops[: prof.n_forward]) * link
    m = parse_bytes(budget)
    r0 = plan(prof, budget=m).recompute_s
    grid = sorted({*(d * 1e9 for d in range(0, 41, 2)),
                   *(hideable + k * 0.05e9 for k in range(-30, 11)), hideable})
    best = (r0, 0.0)
    for d in grid:
        if d < 0:
            continue
        t = plan(prof, budget=int(m + d)).recompute_s + max(0.0, d - hideable) / link
        if t < best[0]:
            best = (t, d)
    return {"recompute_s": best[0], "copy_bytes": best[1], "hideable_bytes": hideable,
            "link_bytes_per_s": link, "reduction": 1 - best[0] / r0, "grid_points": len(grid)}


if __name__ == "__main__":
    main()
