"""Where the MONeT and Chen gaps of ``benchmarks.published`` lie: what-if profiles, re-planned.

The profiles are ``benchmarks.published``'s (fake mode, v100 preset). Each what-if edits the
profile's records to model an operator implementation memfit does not have, then re-plans
at the same memory; the difference to memfit's own plan is what that implementation is worth
in the time model. Nothing here changes memfit.

MONeT (ResNet-50, 224x224, batch 184, fp32, SGD; whole job 10.01 / 8.01 / 6.00 / 4.99 GB):

- ``abn``: a batch norm whose output feeds an in-place ReLU differentiates from its output
  (in-place activated batch norm): its input is not saved. Modelled by dropping the saves of
  that BN's input storage by the BN's ops (it then dies after its last forward use); the ReLU
  already saves the output both backwards need.
- ``abn+add``: also the residual add written into the last BN's output (in-place add),
  modelled by counting that BN output 0 B (optimistic by that storage at the BN op itself,
  where an in-place add would still hold it).
- ``tails``: each bottleneck's residual add and the in-place ReLU on its result cost nothing
  to rerun. They save only the block's output, which the next block reads anyway, so a
  region could run them with their saves kept as the plain step keeps them and its replay
  stop before them (torch's early stop). Modelled by setting their seconds to 0 (the step's
  seconds and the overhead's denominator unchanged); their memory is modelled as now (the
  block output still replayed).
- ``mem x f``: the memory-bound ops (everything but convolutions and matmuls) charged at
  ``f`` times their roofline seconds, ``f`` measured on this CPU (``cpu_ratio``).
- per op type: each plan's recompute seconds split by the op type that reruns (the plan
  simulated on a copy of the profile with every other op's seconds set to 0).

Chen (the 998-layer bottleneck ResNet, batch 16, 7/48 of the plain peak): the plan with the
host-side fixed charges (NOTE [host overhead on an async device]) charged in full (as before
its rule 4), at 0 s (device time only) and as ``memfit.plan`` charges them, each with its own
host and device work; and the plain step's host bound against its device time.

Usage (from the repository root)::

    python -m benchmarks.published_gap [--only monet,chen,cpu] [--variants memfit,tails]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import numpy as np
import torch

import memfit
from benchmarks.published import CHEN_RATIO, CHEN_STAGES, GB, MONET, Bottleneck, resnet50
from memfit.errors import InfeasibleBudget
from memfit.planning.hidden_host import device_only, plan_hides
from memfit.planning.hosttime import HOST_OP_S, host_overhead
from memfit.planning.rules import is_matmul
from memfit.profiling.profile import OpRecord, Profile
from memfit.timemodel.calibration import Calibration, CalibrationSource

KINDS = ("conv", "batch norm", "relu", "add", "max pool", "other")


def kind(op: OpRecord) -> str:
    """The op type a recompute second is booked to."""
    n = op.name
    if "convolution" in n:
        return "conv"
    if "batch_norm" in n:
        return "batch norm"
    if "relu" in n or "threshold" in n:
        return "relu"
    if n == "aten.add.Tensor":  # the residual add (BN's counter update is add_)
        return "add"
    if "max_pool" in n:
        return "max pool"
    return "other"


def _plain(profile: Profile) -> Profile:
    """``profile`` with its live-bytes timeline and peak recomputed from its storages."""
    sim = memfit.simulate(profile, memfit.Plan(regions=(), predicted_peak_bytes=0, recompute_s=0.0,
                                                 budget_bytes=None, solver="none",
                                                 profile_signature=profile.signature))
    return dataclasses.replace(profile, live_bytes=sim.live_bytes, peak_bytes=sim.peak_bytes)


def _consumers(profile: Profile) -> dict[int, list[OpRecord]]:
    out: dict[int, list[OpRecord]] = {}
    for op in profile.ops[: profile.n_forward]:
        for s in op.inputs:
            out.setdefault(s, []).append(op)
    return out


def abn(profile: Profile, *, inplace_add: bool = False) -> Profile:
    """The what-if profile of in-place activated batch norm (and, with ``inplace_add``, of
    the residual add written into the BN output it reads)."""
    fwd = profile.ops[: profile.n_forward]
    users = _consumers(profile)
    mod_of = {op.index: op.module for op in fwd}
    storages = {s.id: s for s in profile.storages}
    for op in fwd:
        if "native_batch_norm" not in op.name or not op.outputs:
            continue
        y = op.outputs[0].storage
        nxt = users.get(y, [])
        x = storages[op.inputs[0]]
        if nxt and nxt[0].name.startswith("aten.relu_"):
            keep = tuple(sv for sv in x.saves if mod_of.get(sv[0]) != op.module)
            if len(keep) != len(x.saves):
                last = max([u.index for u in users.get(x.id, [])] + [op.index])
                storages[x.id] = (dataclasses.replace(x, saves=keep) if keep else dataclasses.replace(
                    x, saves=(), saved=False, first_unpack=None, freed_after=last))
        elif inplace_add and nxt and nxt[0].name.startswith("aten.add.Tensor"):
            storages[y] = dataclasses.replace(storages[y], nbytes=0)
    return _plain(dataclasses.replace(profile, storages=tuple(storages[s.id] for s in profile.storages)))


def tails(profile: Profile) -> Profile:
    """The what-if profile of region tails: each residual add (``aten.add.Tensor``) that an
    in-place ReLU on its result follows, and that ReLU, at 0 s; the step's seconds kept."""
    fwd = profile.ops[: profile.n_forward]
    free: set[int] = set()
    for op, nxt in zip(fwd, fwd[1:], strict=False):
        if (op.name == "aten.add.Tensor" and op.outputs and nxt.name.startswith("aten.relu_")
                and nxt.inputs and nxt.inputs[0] == op.outputs[0].storage):
            free |= {op.index, nxt.index}
    ops = tuple(dataclasses.replace(op, time_s=0.0) if op.index in free else op for op in profile.ops)
    return dataclasses.replace(profile, ops=ops)


def scaled(profile: Profile, f: float, which: Callable[[OpRecord], bool]) -> Profile:
    """``profile`` with the seconds of the ops ``which`` picks multiplied by ``f`` (step time too)."""
    ops = tuple(dataclasses.replace(op, time_s=op.time_s * f) if which(op) else op for op in profile.ops)
    return dataclasses.replace(profile, ops=ops, step_time_s=sum(op.time_s for op in ops))


def memory_bound(op: OpRecord) -> bool:
    return not is_matmul(op)


def by_kind(profile: Profile, plan: memfit.Plan) -> dict[str, float]:
    """``plan``'s recompute seconds by op type, and ``"fixed"``: its per-region and per-op charges."""
    out = {}
    zero = dataclasses.replace(profile, calibration=Calibration(region_s=0.0, op_s=0.0, selective_op_s=0.0))
    for k in KINDS:
        only = scaled(zero, 0.0, lambda op, k=k: kind(op) != k)
        out[k] = memfit.simulate(only, plan).recompute_s
    out["fixed"] = plan.recompute_s - sum(out.values())
    return out


def _plan_row(profile: Profile, gb: float, step_s: float) -> tuple[str, memfit.Plan | None]:
    try:
        p = memfit.plan(profile, device_memory=int(gb * GB), optimizer="sgd", reserve=0)
        return f"+{p.recompute_s / step_s:.1%}", p
    except InfeasibleBudget as e:
        return f"none (>= {e.min_feasible_bytes / GB:.2f})", None


def cpu_ratio(batch: int = 8, repeats: int = 7) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """Measured and roofline seconds of ResNet-50's bottleneck ops on this CPU (real tensors):
    (measured memory-bound / conv ratio, the CPU preset's roofline ratio, per kind (measured s,
    roofline s))."""
    torch.manual_seed(0)
    blocks = [(Bottleneck(256, 64, 1), 56), (Bottleneck(512, 128, 1), 28), (Bottleneck(1024, 256, 1), 14)]
    meas: dict[str, list[float]] = {}
    roof: dict[str, list[float]] = {}
    for blk, hw in blocks:
        x = torch.randn(batch, blk.conv1.in_channels, hw, hw)
        fake = memfit.profile(blk, x, mode="fake", target="cpu")
        runs = [memfit.profile(blk, x) for _ in range(repeats)]
        for k in range(fake.n_forward):
            kd = kind(fake.ops[k])
            times = sorted(r.ops[k].time_s for r in runs if r.ops[k].name == fake.ops[k].name)
            if not times:
                continue
            meas.setdefault(kd, []).append(times[len(times) // 2])
            roof.setdefault(kd, []).append(fake.ops[k].time_s)
    per = {k: (sum(meas[k]), sum(roof[k])) for k in meas}
    mem_m = sum(v[0] for k, v in per.items() if k != "conv")
    mem_r = sum(v[1] for k, v in per.items() if k != "conv")
    return mem_m / per["conv"][0], mem_r / per["conv"][1], per


def monet(f_mem: float | None, names: set[str] | None = None) -> None:
    base = memfit.profile(resnet50(), torch.empty(184, 3, 224, 224, device="meta"), mode="fake", target="v100")
    step = base.step_time_s
    variants: list[tuple[str, Profile]] = [("memfit", base), ("abn", abn(base)),
                                           ("abn+add", abn(base, inplace_add=True)), ("tails", tails(base))]
    if f_mem is not None:
        variants.append((f"mem x {f_mem:.2f}", scaled(base, f_mem, memory_bound)))
    if names is not None:
        variants = [v for v in variants if v[0] in names or (v[0].startswith("mem x") and "mem" in names)]
    print(f"MONeT what-ifs: ResNet-50 224x224 batch 184 fp32 SGD, v100 preset; overhead over the plain "
          f"step of each profile (memfit's {step * 1e3:.0f} ms)")
    for name, prof in variants:
        print(f"  {name:<12} plain activation peak {prof.peak_bytes / GB:.2f} GB, step {prof.step_time_s * 1e3:.0f} ms")
    print(f"  {'memory':>8}  {'MONeT':>7}  " + "  ".join(f"{n:>16}" for n, _ in variants))
    plans: dict[tuple[str, float], memfit.Plan | None] = {}
    for gb, theirs in MONET:
        cells = []
        for name, prof in variants:
            cell, p = _plan_row(prof, gb, prof.step_time_s)
            plans[(name, gb)] = p
            cells.append(f"{cell:>16}")
        print(f"  {gb:>6.2f}GB  {f'+{theirs:.1%}':>7}  " + "  ".join(cells), flush=True)
    print("  recompute by op type, ms (memfit's own plans; % of the step in brackets)")
    print(f"  {'memory':>8}  " + "  ".join(f"{k:>12}" for k in (*KINDS, "fixed")) + f"  {'total':>12}")
    for gb, _ in MONET:
        p = plans[("memfit", gb)]
        if p is None:
            print(f"  {gb:>6.2f}GB  no plan")
            continue
        parts = by_kind(base, p)
        print(f"  {gb:>6.2f}GB  " + "  ".join(f"{v * 1e3:>5.1f} ({v / step:>4.1%})" for v in parts.values())
              + f"  {p.recompute_s * 1e3:>5.1f} ({p.recompute_s / step:>4.1%})")


def chen() -> None:
    prof = memfit.profile(resnet50(stages=CHEN_STAGES), torch.empty(16, 3, 224, 224, device="meta"),
                          mode="fake", target="v100")
    cal = prof.calibration or Calibration()
    ho = host_overhead(prof, cal, np.array([op.time_s for op in prof.ops]))
    n, nf = len(prof.ops), prof.n_forward
    print(f"Chen: {3 * sum(CHEN_STAGES) + 2} layers, batch 16, v100 preset: {n} ops ({nf} forward), "
          f"plain step {prof.step_time_s * 1e3:.0f} ms device, its forward "
          f"{sum(op.time_s for op in prof.ops[:nf]) * 1e3:.0f} ms "
          f"({sum(op.time_s for op in prof.ops[:nf]) / prof.step_time_s:.1%})")
    print(f"  host bound H {ho.host_bound_s * 1e3:.0f} ms vs device D {ho.device_s * 1e3:.0f} ms: "
          f"{'hidden' if ho.hidden else 'not hidden'}; the plain step's own host work "
          f"{n * HOST_OP_S * 1e3:.0f} ms ({n * HOST_OP_S / prof.step_time_s:.0%} of D)")
    budget = int(prof.peak_bytes * CHEN_RATIO)
    # a fitted source is taken as given: the default charges in full, as before rule 4
    full = dataclasses.replace(prof, calibration=dataclasses.replace(cal, source=CalibrationSource.FIT))
    off = device_only(prof)
    for label, pr in (("charges in full", full), ("device only", off), ("memfit (rule 4)", prof)):
        t0 = time.process_time()
        p = memfit.plan(pr, budget=budget)
        secs = time.process_time() - t0
        rerun = memfit.simulate(off, p).recompute_s
        hides, host_s, device_s = plan_hides(prof, p, rerun)
        print(f"  {label:<16} +{p.recompute_s / prof.step_time_s:.1%} ({p.solver}, {len(p.regions)} regions, "
              f"peak {p.predicted_peak_bytes / prof.peak_bytes:.1%}, {secs:.0f} CPU s): reruns "
              f"{rerun * 1e3:.0f} ms (+{rerun / prof.step_time_s:.1%}), charges "
              f"{(memfit.simulate(full, p).recompute_s - rerun) * 1e3:.0f} ms; its host work "
              f"{host_s * 1e3:.0f} ms {'<=' if hides else '>'} its device work {device_s * 1e3:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="cpu,monet,chen", help="sections: cpu, monet, chen")
    ap.add_argument("--variants", default=None,
                    help="MONeT's columns, comma-separated (memfit, abn, abn+add, tails, mem); default all")
    ap.add_argument("--mem-factor", type=float, default=None,
                    help="the memory-bound factor for MONeT's 'mem x f' column without the cpu section")
    args = ap.parse_args()
    only = {s.strip() for s in args.only.split(",")}
    f_mem = args.mem_factor
    if "cpu" in only:
        m, r, per = cpu_ratio()
        f_mem = m / r
        print("CPU (this machine, real tensors, batch 8, three bottleneck shapes): forward seconds by op type")
        for k, (ms, rs) in per.items():
            print(f"  {k:<10} measured {ms * 1e3:8.2f} ms  roofline (cpu preset) {rs * 1e3:8.2f} ms  "
                  f"measured/roofline {ms / rs:5.2f}")
        print(f"  memory-bound / conv: measured {m:.3f}, roofline {r:.3f}: the roofline "
              f"{'under' if m > r else 'over'}-charges memory-bound ops by {f_mem:.2f}x relative to conv")
    if "monet" in only:
        monet(f_mem, None if args.variants is None else {v.strip() for v in args.variants.split(",")})
    if "chen" in only:
        chen()


if __name__ == "__main__":
    main()
