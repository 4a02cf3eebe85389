"""The batch-norm variants (compress="lossy") against recompute, on a 3D conv net whose blocks
are conv -> BatchNorm3d -> activation (in place), on the CPU: ``--act leaky`` (LeakyReLU,
``inplace_abn``) or ``--act relu`` (ReLU, ``bn_from_output``).

    PYTHONPATH=src python -m benchmarks.abn [--act leaky|relu] [--rounds 7] [--size 32]

Rows, from one profile and the same weights and input: the plain step; torch's checkpoint on
every stage and a selective checkpoint on every stage that saves the convolutions' outputs
and recomputes the norms and activations (the peers); every norm's input rebuilt (no
regions); memfit recompute-only at that plan's predicted peak; memfit's own choice with
compress="lossy" (``lossy_codec=None``: the variants alone) at that peak. Per row: the
predicted peak, the peak ``memfit.verify`` measured (CPU allocator; the peers' by the
allocator meter), the median step seconds of interleaved rounds and its ratio to the plain
step in the same run, and the largest gradient difference from the plain step. Prints the
variant's seconds per byte of norm input let go. Writes benchmarks/results/abn.json and
abn.md (``--act leaky``) or abn-relu.json and abn-relu.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import memfit
from memfit.planning.compress_pass import candidates, compressed_peak
from memfit.planning.compression import CODEC_SPECS
from memfit.planning.plan import Plan
from memfit.planning.simulate import simulate

RESULTS = Path(__file__).resolve().parent / "results"


CODEC = {"leaky": "inplace_abn", "relu": "bn_from_output"}


def _act(kind: str) -> nn.Module:
    return nn.LeakyReLU(0.01, inplace=True) if kind == "leaky" else nn.ReLU(inplace=True)


class Stage(nn.Module):
    def __init__(self, c_in: int, c: int, stride: int, act: str) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv3d(c_in, c, 3, stride, 1, bias=False), nn.BatchNorm3d(c), _act(act),
            nn.Conv3d(c, c, 3, 1, 1, bias=False), nn.BatchNorm3d(c), _act(act))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _save_convolutions(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    conv = op is torch.ops.aten.convolution.default
    return CheckpointPolicy.MUST_SAVE if conv else CheckpointPolicy.PREFER_RECOMPUTE


def _selective() -> Any:
    return create_selective_checkpoint_contexts(_save_convolutions)


class Net(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (8, 16, 32), checkpointed: str = "", act: str = "leaky") -> None:
        super().__init__()
        stages, c = [], 1
        for i, w in enumerate(widths):
            stages.append(Stage(c, w, 1 if i == 0 else 2, act))
            c = w
        self.stages = nn.ModuleList(stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(c, 2))
        self.checkpointed = checkpointed  # "": none, "all": torch's checkpoint, "convs": selective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.stages:
            if self.checkpointed == "all":
                x = checkpoint(s, x, use_reentrant=False)
            elif self.checkpointed == "convs":
                x = checkpoint(s, x, use_reentrant=False, context_fn=_selective)
            else:
                x = s(x)
        return self.head(x)


def _every_abn(p: memfit.Profile, codec: str) -> Plan:
    chosen = [c for c in candidates(p, mode="lossy") if c.entry.codec == codec]
    plain = Plan((), p.peak_bytes, 0.0, None, "none", p.signature, plain_peak_bytes=p.peak_bytes)
    sim = simulate(p, plain)
    return Plan((), compressed_peak(p, sim.live_bytes, sim.positions, chosen), 0.0, None, "every_abn",
                p.signature, plain_peak_bytes=p.peak_bytes, model="abn-net",
                compressed=tuple(e for c in chosen for e in c.entries))


def _grads(m: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    for q in m.parameters():
        q.grad = None
    m(x).square().mean().backward()
    return [q.grad.clone() for q in m.parameters()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--act", choices=sorted(CODEC), default="leaky")
    args = ap.parse_args()
    codec = CODEC[args.act]
    torch.manual_seed(0)
    base = Net(act=args.act)
    x = torch.randn(2, 1, args.size, args.size, args.size)
    loss = lambda out: out.square().mean()  # noqa: E731
    prof = memfit.profile(base, x, loss_fn=loss)
    every = _every_abn(prof, codec)
    cap = every.predicted_peak_bytes
    rows: dict[str, tuple[nn.Module, Plan | None]] = {"plain": (copy.deepcopy(base), None)}
    for how, label in (("all", "checkpoint every stage (torch)"),
                       ("convs", "selective checkpoint every stage, convolutions saved (torch)")):
        ck = Net(checkpointed=how, act=args.act)
        ck.load_state_dict(base.state_dict())
        rows[label] = (ck, None)
    rows[f"every norm rebuilt ({codec})"] = (memfit.apply(copy.deepcopy(base), every), every)
    notes: list[str] = []
    try:
        rec = memfit.plan(prof, budget=cap)
        rows["memfit recompute-only at that peak"] = (memfit.apply(copy.deepcopy(base), rec), rec)
    except memfit.InfeasibleBudget as e:
        notes.append(f"memfit recompute-only at that peak ({cap} B): infeasible, its least peak is "
                     f"{e.min_feasible_bytes} B")
    least = memfit.plan(prof, budget="min")
    rows["memfit recompute-only, least peak"] = (memfit.apply(copy.deepcopy(base), least), least)
    lossy = memfit.fit(copy.deepcopy(base), x, budget=cap, loss_fn=loss, search=memfit.Search(compress="lossy", lossy_codec=None))
    rows["memfit compress='lossy' at that peak"] = (lossy, lossy.memfit_plan)
    ref = _grads(copy.deepcopy(base), x)
    out: list[dict[str, Any]] = []
    times: dict[str, list[float]] = {k: [] for k in rows}
    for m, _ in rows.values():  # warm-up
        _grads(m, x)
    for _ in range(args.rounds):
        for k, (m, _) in rows.items():
            t0 = time.perf_counter()
            _grads(m, x)
            times[k].append(time.perf_counter() - t0)
    plain_s = statistics.median(times["plain"])
    for k, (m, p) in rows.items():
        got = _grads(m, x)
        diff = max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=True))
        peak = memfit.verify(m, x, loss_fn=loss, plan=p).peak_bytes if p is not None else None
        if peak is None:  # no plan: the step's measured peak alone
            from memfit.profiling.measure import measure
            peak = measure(lambda m=m: _grads(m, x), model=m).peak_bytes
        abn = [c for c in (p.compressed if p else ()) if c.codec == codec and c.raw_bytes]
        out.append({"method": k, "predicted_peak_bytes": p.predicted_peak_bytes if p else prof.peak_bytes if k == "plain" else None,
                    "measured_peak_bytes": peak, "median_s": statistics.median(times[k]),
                    "vs_plain": statistics.median(times[k]) / plain_s, "max_grad_diff": diff,
                    "regions": len(p.regions) if p else None, "norms_rebuilt": len(abn)})
    let_go = sum(c.raw_bytes for c in every.compressed)
    extra_s = statistics.median(times[f"every norm rebuilt ({codec})"]) - plain_s
    per_byte = extra_s / let_go if let_go else float("nan")
    notes.append(f"every norm rebuilt: +{extra_s * 1e3:.2f} ms a step for {let_go} B of norm inputs "
                 f"let go, {per_byte:.2e} s per byte ({codec}'s default per_byte_s: "
                 f"{CODEC_SPECS[codec].per_byte_s:.1e})")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"notes": notes, "torch": torch.__version__, "input": list(x.shape), "rounds": args.rounds, "commit": commit, "act": args.act,
            "largest_gradient": max(float(g.abs().max()) for g in ref)}
    RESULTS.mkdir(exist_ok=True)
    name = "abn" if args.act == "leaky" else f"abn-{args.act}"
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": out}, indent=1))
    title = "In-place activated batch norm" if args.act == "leaky" else "Batch norm from its output (ReLU)"
    lines = [f"# {title} vs recompute (CPU, torch {torch.__version__}, input "
             f"{tuple(x.shape)}, {args.rounds} interleaved rounds, commit {commit})", "",
             "| method | predicted peak | measured peak | median s | vs plain | max grad diff | regions | norms rebuilt |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in out:
        pp = r["predicted_peak_bytes"]
        lines.append(f"| {r['method']} | {pp if pp is not None else '-'} | {r['measured_peak_bytes']} | "
                     f"{r['median_s']:.4f} | {r['vs_plain']:.2f}x | {r['max_grad_diff']:.2e} | "
                     f"{r['regions'] if r['regions'] is not None else '-'} | {r['norms_rebuilt']} |")
    lines.append("")
    lines += [f"{n}." for n in notes]
    lines.append(f"Largest plain gradient: {meta['largest_gradient']:.3e}.")
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
