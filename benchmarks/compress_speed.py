"""Lossy compression against recompute at the same measured peak (issue #30): zoo GPTs wide
enough that recomputing their matmuls costs more than casting saved activations.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/compress_speed.py [--sizes 256x128:300,384x192:40]

Per size (``d_model x seq_len``; 2 layers, 4 heads, batch 4, vocab 256), plans from one
profile: the lossy plans (every lossy candidate packed, no regions; and the planner's choice
with ``compress="lossy"`` at ``--budget`` of the plain peak), then per lossy plan the
recompute-only plan and memfit's best exact plan (``compress="lossless"``) with the lossy
plan's *measured* peak as budget. The runs train from the same weights, data and dropout
draws in lockstep: step i of every run, the runs' order rotating each step, so each step time
of one run sits beside the others' (the box's 2 cores are shared). Reported: the median step,
its ratio to the exact plans' at the same peak, the final loss and the mean of the last 50
steps' losses against plain (a quarter of the tokens are noise: the loss has a floor). Writes
benchmarks/results/compress-speed.json and compress-speed.md.
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
VOCAB, BATCH = 256, 4


def batch(i: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    # a learnable sequence: token t+1 = (token t + stride) mod vocab, stride and start random;
    # a quarter of the tokens replaced by random ones, so the loss has a floor well above 0
    # (without them it fell to 0.06 in 300 steps, where a relative loss difference says little)
    g = torch.Generator().manual_seed(1000 + i)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    s = (start + stride * torch.arange(seq + 1)) % VOCAB  # (B, T + 1)
    noise = torch.rand(s.shape, generator=g) < 0.25
    s = torch.where(noise, torch.randint(0, VOCAB, s.shape, generator=g), s)
    return s[:, :-1], s[:, 1:]


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)  # (B, T, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def plans(model: torch.nn.Module, seq: int, budget: float, codecs: list[str]) -> dict[str, Any]:
    from memfit.measuring.codec_cost import codec_costs_for
    from memfit.planning.compress_pass import choose, with_compression
    from memfit.planning.plan import Plan

    x0, y0 = batch(0, seq)

    def step_loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y0.reshape(-1))

    prof = memfit.profile(model, x0, loss_fn=step_loss)
    exact_costs = codec_costs_for("lossless")

    def solve(b: Any) -> Plan:
        return memfit.plan(prof, budget=b)

    plain = Plan((), prof.peak_bytes, 0.0, None, "none", prof.signature,
                 plain_peak_bytes=prof.peak_bytes, plain_step_s=prof.step_time_s)
    made: dict[str, Plan | None] = {"plain": None}
    lossy: dict[str, Callable[[], Plan]] = {}
    for codec in codecs:
        costs = codec_costs_for("lossy", codec)
        lossy[f"every lossy candidate ({codec}), no regions"] = (
            lambda c=codec, k=costs: with_compression(prof, plain, mode="lossy", lossy_codec=c, costs=k))
    costs = codec_costs_for("lossy")
    lossy[f"lossy (planner's choice at {budget:.0%}, bf16)"] = lambda: choose(prof, solve, budget, mode="lossy",
                                                                             costs=costs)
    out: dict[str, Any] = {"plain_peak_bytes": prof.peak_bytes, "runs": {}, "pairs": []}

    def same(p: Plan) -> str | None:  # the label of a plan already made with p's decisions
        return next((k for k, q in made.items() if q is not None and q.compressed == p.compressed
                     and q.regions == p.regions), None)

    for label, make in lossy.items():
        p = make()
        if same(p) is not None:
            out.setdefault("notes", []).append(f"{label}: the plan of '{same(p)}'")
            continue
        made[label] = p
        if not p.compressed:
            out.setdefault("notes", []).append(f"{label}: no compression chosen (recompute only)")
            continue
        m = copy.deepcopy(model)
        memfit.apply(m, p)
        peak = memfit.verify(m, x0, loss_fn=step_loss).peak_bytes
        pair: dict[str, Any] = {"lossy": label, "peak_bytes": peak, "exact": []}
        for name, exact in (("recompute-only", lambda b: solve(b)),
                            ("best exact (lossless)", lambda b: choose(prof, solve, b, mode="lossless",
                                                                       costs=exact_costs))):
            elabel = f"{name} at the measured peak of '{label}'"
            try:
                q = exact(peak)
            except memfit.InfeasibleBudget as e:
                out["runs"][elabel] = {"infeasible": str(e), "min_feasible_bytes": e.min_feasible_bytes}
                continue
            if (twin := same(q)) is not None:
                pair["exact"].append(twin)
                out.setdefault("notes", []).append(f"{elabel}: the plan of '{twin}'")
                continue
            made[elabel] = q
            pair["exact"].append(elabel)
        out["pairs"].append(pair)
    for label, p in made.items():
        m = copy.deepcopy(model)
        rec: dict[str, Any] = {"model": m}
        if p is not None:
            memfit.apply(m, p)
            report = memfit.verify(m, x0, loss_fn=step_loss)
            rec.update(predicted_peak_bytes=p.predicted_peak_bytes, measured_peak_bytes=report.peak_bytes,
                       regions=len(p.regions), compressed=len(p.compressed),
                       codecs=sorted({c.codec for c in p.compressed}), predicted_extra_s=p.recompute_s,
                       gradient_rel_error=report.gradient_rel_error, bitwise_step=report.bitwise)
        out["runs"][label] = rec
    return out


def train_lockstep(runs: dict[str, dict[str, Any]], seq: int, steps: int) -> None:
    """Step i of every run, the order rotating by one each step; records losses and times."""
    live = [(label, rec) for label, rec in runs.items() if "model" in rec]
    opts = {label: torch.optim.Adam(rec["model"].parameters(), lr=3e-3) for label, rec in live}
    torch.manual_seed(0)
    rngs = {label: torch.random.get_rng_state() for label, _ in live}  # the same dropout stream
    for rec in runs.values():
        rec.update(losses=[], times=[])
    for i in range(steps):
        x, y = batch(i, seq)
        k = i % len(live)
        for label, rec in live[k:] + live[:k]:
            torch.random.set_rng_state(rngs[label])
            t0 = time.perf_counter()
            opts[label].zero_grad(set_to_none=True)
            loss = loss_fn(rec["model"], x, y)
            loss.backward()
            opts[label].step()
            rec["times"].append(time.perf_counter() - t0)
            rngs[label] = torch.random.get_rng_state()
            rec["losses"].append(float(loss.detach()))
    plain = runs["plain"]
    for _, rec in live:
        rec["median_step_s"] = statistics.median(rec["times"][5:] or rec["times"])
        rec["final_loss"] = rec["losses"][-1]
        rec["final_loss_rel_diff"] = abs(rec["final_loss"] - plain["losses"][-1]) / abs(plain["losses"][-1])
        tail = min(50, steps)  # the mean of the last 50 steps: less noise than one step's loss
        rec["tail_mean_loss"] = statistics.fmean(rec["losses"][-tail:])
        rec["tail_mean_rel_diff"] = abs(rec["tail_mean_loss"] - statistics.fmean(plain["losses"][-tail:])) / abs(
            statistics.fmean(plain["losses"][-tail:]))
        rec["params_bitwise_plain"] = all(
            torch.equal(a, b) for a, b in zip(rec["model"].parameters(), plain["model"].parameters(), strict=True))
    for _, rec in live:
        del rec["model"], rec["times"]


def run_size(d_model: int, seq: int, steps: int, budget: float, codecs: list[str]) -> dict[str, Any]:
    model = zoo.gpt(n_layer=2, d_model=d_model, n_head=4, vocab_size=VOCAB, seq_len=seq, seed=0)
    out = plans(model, seq, budget, codecs)
    for label, rec in out["runs"].items():
        print(f"d{d_model} T{seq}", label, {k: v for k, v in rec.items() if k != "model"}, flush=True)
    t0 = time.perf_counter()
    train_lockstep(out["runs"], seq, steps)
    out.update(d_model=d_model, seq_len=seq, steps=steps, train_s=time.perf_counter() - t0)
    for pair in out["pairs"]:
        lossy = out["runs"][pair["lossy"]]
        pair["step_ratio"] = {e: lossy["median_step_s"] / out["runs"][e]["median_step_s"] for e in pair["exact"]}
    return out


def write(results: list[dict[str, Any]]) -> str:
    RESULTS.mkdir(exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"torch": torch.__version__, "device": "cpu", "commit": commit,
            "threads": torch.get_num_threads()}
    (RESULTS / "compress-speed.json").write_text(json.dumps({**meta, "sizes": results}, indent=1))
    lines = [f"# Lossy compression vs recompute at the same measured peak (issue #30): torch "
             f"{torch.__version__}, CPU, {torch.get_num_threads()} thread(s), commit {commit}", "",
             "Zoo GPT, 2 layers, 4 heads, batch 4, vocab 256; runs stepped in lockstep (order rotating).", "",
             "| size | run | predicted peak | measured peak | regions | compressed | median step | "
             "final loss | vs plain | last-50 mean loss | vs plain | grad rel. error (1 step) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        size = f"d{r['d_model']} T{r['seq_len']} ({r['steps']} steps)"
        for label, rec in r["runs"].items():
            if "infeasible" in rec:
                lines.append(f"| {size} | {label} | infeasible: least peak {rec['min_feasible_bytes']:,} "
                             "| | | | | | | | | |")
                continue
            rel = rec.get("gradient_rel_error")
            pred = rec.get("predicted_peak_bytes", r["plain_peak_bytes"])
            meas = rec.get("measured_peak_bytes")
            comp = f"{rec.get('compressed', 0)} {','.join(rec.get('codecs', []))}".strip()
            lines.append(f"| {size} | {label} | {pred:,} | {'' if meas is None else f'{meas:,}'} | "
                         f"{rec.get('regions', 0)} | {comp} | {rec['median_step_s'] * 1e3:.1f} ms | "
                         f"{rec['final_loss']:.4f} | {rec['final_loss_rel_diff']:.2%} | "
                         f"{rec['tail_mean_loss']:.4f} | {rec['tail_mean_rel_diff']:.2%} | "
                         f"{'' if rel is None else f'{rel:.2e}'} |")
    for r in results:
        lines += [f"- d{r['d_model']} T{r['seq_len']}: {n}" for n in r.get("notes", [])]
    lines += ["", "| size | lossy run | exact run at its measured peak | lossy step / exact step |",
              "|---|---|---|---:|"]
    for r in results:
        for pair in r["pairs"]:
            for e, ratio in pair["step_ratio"].items():
                lines.append(f"| d{r['d_model']} T{r['seq_len']} | {pair['lossy']} | {e} | {ratio:.3f} |")
    text = "\n".join(lines) + "\n"
    (RESULTS / "compress-speed.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256x128:300,384x192:40",
                    help="d_model x seq_len : steps, comma separated")
    ap.add_argument("--codecs", default="bf16,fp8_e4m3", help="lossy codecs of the every-candidate plans")
    ap.add_argument("--budget", type=float, default=0.7, help="the planner's budget, of the plain peak")
    args = ap.parse_args()
    sizes = [(int(s.split("x")[0]), *(int(v) for v in s.split("x")[1].split(":"))) for s in args.sizes.split(",")]
    codecs = args.codecs.split(",")
    print(write([run_size(d, t, steps, args.budget, codecs) for d, t, steps in sizes]))


if __name__ == "__main__":
    main()
