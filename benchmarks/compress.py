"""Activation compression in training (issue #30): a zoo GPT and a small 3D UNet trained on
synthetic data, plain and under memfit plans at one activation budget.

    PYTHONPATH=src python benchmarks/compress.py [--steps 300] [--budget 0.8]

Per model, runs from the same weights, data and dropout draws, plans made from one profile:
plain; recompute-only at the budget; the planner's choice with ``compress="lossless"`` and
``"lossy"`` at the budget (NOTE [compress or recompute]: it may choose no compression); the
recompute-only plan with every lossless candidate compressed (the least lossless peak); every
lossy candidate compressed with no regions, and the recompute-only plan at that plan's peak
(the same memory). Each run: the plan's predicted peak, the peak ``memfit.verify`` measured
on one step (CPU allocator), the median step seconds of the training loop, the loss of every
step. Writes
benchmarks/results/compress.json, compress.md and compress.png. The runs go one after the
other (not interleaved): step times are indicative, this box's 2 cores being shared.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import memfit
from memfit import zoo

RESULTS = Path(__file__).resolve().parent / "results"


def gpt_case(steps: int) -> tuple[torch.nn.Module, Callable[[int], tuple], Callable]:
    model = zoo.gpt(n_layer=2, d_model=64, n_head=4, vocab_size=64, seq_len=32, seed=0)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # a learnable sequence: token t+1 = (token t + stride) mod vocab, stride and start random
        g = torch.Generator().manual_seed(1000 + i)
        start = torch.randint(0, 64, (4, 1), generator=g)
        stride = torch.randint(1, 4, (4, 1), generator=g)
        seq = (start + stride * torch.arange(33)) % 64  # (B, T + 1)
        return seq[:, :-1], seq[:, 1:]

    def loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)  # (B, T, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return model, batch, loss


def unet_case(steps: int) -> tuple[torch.nn.Module, Callable[[int], tuple], Callable]:
    model = zoo.unet3d(base=4, depth=2, seed=0)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # a noisy volume; the label is whether its smoothed value is positive
        g = torch.Generator().manual_seed(2000 + i)
        clean = F.avg_pool3d(torch.randn(1, 1, 16, 16, 16, generator=g), 5, 1, 2)
        x = clean + 0.1 * torch.randn(1, 1, 16, 16, 16, generator=g)
        return x, (clean[:, 0] > 0).long()  # (1, 16, 16, 16)

    def loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    return model, batch, loss


def train(model: torch.nn.Module, batch: Callable, loss_fn: Callable, steps: int) -> dict[str, Any]:
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses, times = [], []
    torch.manual_seed(0)  # the dropout draws: the same stream in every run
    for i in range(steps):
        x, y = batch(i)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return {"losses": losses, "median_step_s": statistics.median(times[5:] or times),
            "params": [p.detach().clone() for p in model.parameters()]}


def run_model(name: str, case: Callable, steps: int, budget: float) -> dict[str, Any]:
    from memfit.measuring.codec_cost import codec_costs_for
    from memfit.planning.compress_pass import choose, with_compression
    from memfit.planning.plan import Plan

    model, batch, loss_fn = case(steps)
    x0, y0 = batch(0)

    def step_loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]) if name == "gpt" else out,
                               y0.reshape(-1) if name == "gpt" else y0)

    out: dict[str, Any] = {"model": name, "budget_fraction": budget, "runs": {}}
    prof = memfit.profile(model, x0, loss_fn=step_loss)
    out["plain_peak_bytes"] = prof.peak_bytes

    def solve(b: Any) -> Plan:
        return memfit.plan(prof, budget=b)

    costs = codec_costs_for("lossy")  # NOTE [codec cost measurement]
    out["codec_costs"] = {"per_byte_s": costs.per_byte_s, "per_tensor_s": costs.per_tensor_s,
                          "mode_per_op_s": costs.mode_per_op_s}
    plain_plan = Plan((), prof.peak_bytes, 0.0, None, "none", prof.signature,
                      plain_peak_bytes=prof.peak_bytes, plain_step_s=prof.step_time_s)
    plans: dict[str, Callable[[], Plan | None]] = {
        "plain": lambda: None,
        "recompute-only": lambda: solve(budget),
        "lossless (planner's choice)": lambda: choose(prof, solve, budget, mode="lossless", costs=costs),
        "lossy (planner's choice)": lambda: choose(prof, solve, budget, mode="lossy", costs=costs),
        "recompute-only + every lossless candidate": lambda: with_compression(prof, solve(budget), costs=costs),
        "every lossy candidate, no regions": lambda: with_compression(prof, plain_plan, mode="lossy",
                                                                      costs=costs),
    }
    made: dict[str, Plan | None] = {}
    for label, make in plans.items():
        try:
            made[label] = make()
        except memfit.InfeasibleBudget as e:
            out["runs"][label] = {"infeasible": str(e), "min_feasible_bytes": e.min_feasible_bytes}
    lossy_all = made.get("every lossy candidate, no regions")
    if lossy_all is not None:  # the recompute-only plan at the same memory as the lossy one
        label = "recompute-only at the lossy plan's peak"
        try:
            made[label] = solve(lossy_all.predicted_peak_bytes)
        except memfit.InfeasibleBudget as e:
            out["runs"][label] = {"infeasible": str(e), "min_feasible_bytes": e.min_feasible_bytes}
    for label, plan in made.items():
        m = copy.deepcopy(model)
        rec: dict[str, Any] = {}
        if plan is not None:
            memfit.apply(m, plan)
            report = memfit.verify(m, x0, loss_fn=step_loss)
            rec.update(predicted_peak_bytes=plan.predicted_peak_bytes, measured_peak_bytes=report.peak_bytes,
                       budget_bytes=plan.budget_bytes, regions=len(plan.regions),
                       compressed=[c.to_dict() for c in plan.compressed], bitwise_step=report.bitwise,
                       gradient_rel_error=report.gradient_rel_error, verify_ok=report.ok,
                       predicted_extra_s=plan.recompute_s)
        result = train(m, batch, loss_fn, steps)
        rec.update(losses=result["losses"], median_step_s=result["median_step_s"], final_loss=result["losses"][-1])
        rec["_params"] = result["params"]
        out["runs"][label] = rec
    plain = out["runs"]["plain"]
    trained = [rec for rec in out["runs"].values() if "losses" in rec]
    for rec in trained:
        rec["final_loss_rel_diff"] = abs(rec["final_loss"] - plain["final_loss"]) / abs(plain["final_loss"])
        rec["params_bitwise_plain"] = all(torch.equal(a, b) for a, b in zip(rec["_params"], plain["_params"], strict=True))
    for rec in trained:
        del rec["_params"]
    return out


def write(results: list[dict[str, Any]], steps: int) -> None:
    RESULTS.mkdir(exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"torch": torch.__version__, "device": "cpu", "commit": commit, "steps": steps}
    (RESULTS / "compress.json").write_text(json.dumps({**meta, "models": results}, indent=1))
    lines = [f"# Activation compression (issue #30): {steps} training steps, torch {torch.__version__}, "
             f"CPU, commit {commit}", "",
             "| model | run | predicted peak | measured peak | regions | compressed | predicted extra | "
             "median step | final loss | vs plain | params bitwise plain | grad rel. error (1 step) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        for label, rec in r["runs"].items():
            if "infeasible" in rec:
                lines.append(f"| {r['model']} | {label} | infeasible: least peak {rec['min_feasible_bytes']:,} "
                             "| | | | | | | | | |")
                continue
            pred = rec.get("predicted_peak_bytes", r["plain_peak_bytes"])
            meas = rec.get("measured_peak_bytes", "")
            rel = rec.get("gradient_rel_error")
            extra = rec.get("predicted_extra_s", 0.0)
            lines.append(f"| {r['model']} | {label} | {pred:,} | {meas:,} | {rec.get('regions', 0)} | "
                         f"{len(rec.get('compressed', []))} | {extra * 1e3:.1f} ms | {rec['median_step_s'] * 1e3:.1f} ms | "
                         f"{rec['final_loss']:.4f} | {rec['final_loss_rel_diff']:.2%} | "
                         f"{rec['params_bitwise_plain']} | {'' if rel is None else f'{rel:.2e}'} |"
                         if meas != "" else
                         f"| {r['model']} | {label} | {pred:,} | | 0 | 0 | | {rec['median_step_s'] * 1e3:.1f} ms | "
                         f"{rec['final_loss']:.4f} | - | - | |")
    (RESULTS / "compress.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4))
    for ax, r in zip(axes if len(results) > 1 else [axes], results, strict=True):
        for label, rec in r["runs"].items():
            if "losses" not in rec:
                continue
            ax.plot(rec["losses"], label=label, linestyle="--" if "lossless" in label else "-", linewidth=1)
        ax.set_title(f"{r['model']}: budget {r['budget_fraction']:.0%} of the plain peak")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "compress.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    # the UNet's recompute-only plans reach 93% of its plain peak at best (its activations are
    # skips and pooling inputs kept across the network): 0.8 is infeasible for them
    ap.add_argument("--budgets", default="gpt=0.8,unet=0.95", help="model=fraction of the plain peak, ...")
    args = ap.parse_args()
    cases = {"gpt": gpt_case, "unet": unet_case}
    budgets = {k: float(v) for k, v in (kv.split("=") for kv in args.budgets.split(","))}
    results = [run_model(n, cases[n], args.steps, b) for n, b in budgets.items()]
    write(results, args.steps)
    print((RESULTS / "compress.md").read_text())


if __name__ == "__main__":
    main()
