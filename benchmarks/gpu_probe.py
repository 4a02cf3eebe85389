"""Fake-mode predictions against a GPU that runs torch alone (no memfit there).

    python -m benchmarks.gpu_probe prepare                 # here: the spec (regions to checkpoint)
    python -m benchmarks.gpu_probe measure --out DIR       # on the GPU: torch only, writes DIR/measured.json
    python -m benchmarks.gpu_probe trace CASE[:cudnn_tf32=0] --out DIR   # on the GPU: per-op allocator peaks
    python -m benchmarks.gpu_probe job CASE... --out DIR   # on the GPU: three AdamW steps, plain and every-block
    python -m benchmarks.gpu_probe report DIR/measured.json   # here: predictions vs measurements
    python -m benchmarks.gpu_probe measure --device cpu --quick --out /tmp/p   # the code path on CPU

Why torch alone: a lent GPU machine runs its own image's torch (2.11 when this was written),
which lacks ``SelectiveCheckpointContext.op_output``, so memfit's runtime refuses to import
there (NOTE [private torch APIs], rule 3). Profiles and plans are data, so memfit predicts
here, in fake mode for the GPU's preset, and the GPU only measures: per case,

1. the plain step's peak (``max_memory_allocated`` above the memory before the step, gradients
   freed first, as a profile counts them) and its median step time;
2. every op's CUDA time (events around each op under a dispatch mode, forward and backward),
   and the forward ops' names (which kernels the device chose: flash attention, fused dropout);
3. every-block checkpointing (``torch.utils.checkpoint``, non-reentrant, on the regions of
   memfit's ``every_block`` plan for the same model): its peak and median step time, stepped in
   turn with the plain step.

``report`` sets these beside memfit's fake-mode profile and plans: peaks measured/predicted,
seconds by op type measured/roofline, the every-block overhead measured against the roofline's
and against the profile with the measured op-type seconds, and, for MONeT's ResNet-50, the
plans at MONeT's four memories re-made on that measured-time profile.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.gpu_probe_cases import (
    Case,
    OpTimes,
    cases,
    checkpoint_regions,
    fake_profile,
    peak_bytes,
    sync,
    train_step,
)

SPEC = Path(__file__).parent / "results" / "gpu-probe-spec.json"


# ---- here: the spec --------------------------------------------------------------------------

def prepare(target: str, quick: bool) -> dict[str, Any]:
    """The regions of memfit's every_block plan per case (all the GPU needs from memfit)."""
    import memfit

    spec: dict[str, Any] = {"target": target, "quick": quick, "cases": {}}
    for case in cases(quick):
        prof = fake_profile(case, target)
        plan = memfit.plan(prof, budget="100%", solver="every_block")
        if any(r.ops for r in plan.regions):
            raise RuntimeError(f"{case.name}: every_block has per-op policies; the GPU side "
                               "checkpoints whole regions only")
        spec["cases"][case.name] = {"regions": [list(r.modules) for r in plan.regions]}
    return spec


def measure_case(case: Case, regions: list[list[str]], device: torch.device, repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    models = {"plain": case.build(device), "every_block": case.build(device)}
    checkpoint_regions(models["every_block"], regions)
    torch.manual_seed(1)
    inputs = case.inputs(device)

    def step_of(m: nn.Module) -> Callable[[], None]:
        def step() -> None:
            train_step(case, m, inputs)
        return step

    def clear(m: nn.Module) -> None:
        for p in m.parameters():
            p.grad = None

    row: dict[str, Any] = {"case": case.name, "description": case.description}
    for name, m in models.items():
        for _ in range(2):  # warm-up: cuBLAS/cuDNN handles and workspaces, lazy kernels
            step_of(m)()
            clear(m)
        row[f"{name}_peak_bytes"] = peak_bytes(step_of(m), m, device)
        clear(m)
    times: dict[str, list[float]] = {n: [] for n in models}
    for r in range(repeats):  # in turn, the order alternating
        for name in (list(models) if r % 2 == 0 else list(reversed(models))):
            m = models[name]
            clear(m)
            sync(device)
            s = time.perf_counter()
            step_of(m)()
            sync(device)
            times[name].append(time.perf_counter() - s)
    for name, ts in times.items():
        row[f"{name}_step_s"] = statistics.median(ts)
        row[f"{name}_steps_s"] = ts
    timer = OpTimes(device)
    m = models["plain"]
    clear(m)
    with timer.mode:
        loss = case.loss_fn(m(*inputs))
        timer.phase = "backward"
        loss.backward()
    clear(m)
    row["ops"] = timer.seconds()
    row["seconds"] = time.perf_counter() - t0
    del models
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def measure(device: torch.device, quick: bool, repeats: int, spec: dict[str, Any],
            out: Path, only: list[str] | None) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "quick": quick, "repeats": repeats,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32, "cases": []}
    if device.type == "cuda":
        from benchmarks.gpu_fake_check import _context

        torch.zeros(1, device=device)  # start CUDA: the context
        rec["context_start"] = _context(device)
    for case in cases(quick):
        if only and case.name not in only:
            continue
        print(f"gpu_probe: {case.description}", flush=True)
        try:
            rec["cases"].append(measure_case(case, spec["cases"][case.name]["regions"], device, repeats))
        except Exception as e:  # noqa: BLE001  (the other cases still run; the error is recorded)
            rec["cases"].append({"case": case.name, "error": f"{type(e).__name__}: {e}"})
        print(f"gpu_probe: {case.name} done", flush=True)
        if device.type == "cuda":
            rec["context_end"] = _context(device)  # kernel modules load lazily
        (out / "measured.json").write_text(json.dumps(rec) + "\n")  # after each case
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--target", default="h200")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--spec", default=str(SPEC))
    m = sub.add_parser("measure")
    m.add_argument("--device", default="cuda")
    m.add_argument("--quick", action="store_true")
    m.add_argument("--repeats", type=int, default=7)
    m.add_argument("--spec", default=str(SPEC))
    m.add_argument("--only", default="", help="comma-separated case names (default: all)")
    m.add_argument("--out", required=True)
    t = sub.add_parser("trace", help="per-op memory traces of chosen cases under backend settings")
    t.add_argument("runs", nargs="+", help="CASE or CASE:flag=0,flag=1 (flags: cudnn_tf32, cudnn_sdp)")
    t.add_argument("--out", required=True)
    j = sub.add_parser("job", help="whole AdamW training steps, plain and every-block (CUDA)")
    j.add_argument("names", nargs="+")
    j.add_argument("--steps", type=int, default=3)
    j.add_argument("--spec", default=str(SPEC))
    j.add_argument("--out", required=True)
    r = sub.add_parser("report")
    r.add_argument("measured")
    r.add_argument("--target", default=None)
    r.add_argument("--out", default=None, help="markdown file (default: print)")
    args = parser.parse_args(argv)
    if args.cmd == "prepare":
        Path(args.spec).write_text(json.dumps(prepare(args.target, args.quick), indent=1) + "\n")
        print(f"gpu_probe: wrote {args.spec}")
    elif args.cmd == "measure":
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            print("gpu_probe: no CUDA device here (--device cpu --quick checks the code path)", file=sys.stderr)
            return 2
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        spec = json.loads(Path(args.spec).read_text())
        if spec["quick"] != args.quick:
            print(f"gpu_probe: the spec was prepared with quick={spec['quick']}", file=sys.stderr)
            return 2
        measure(device, args.quick, args.repeats, spec, out, [s for s in args.only.split(",") if s] or None)
    elif args.cmd == "job":
        from benchmarks.gpu_probe_memory import job_case

        device = torch.device("cuda")
        by_name = {c.name: c for c in cases(False)}
        spec = json.loads(Path(args.spec).read_text())
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        jobs = []
        for name in args.names:
            print(f"gpu_probe job: {name}", flush=True)
            try:
                jobs.append(job_case(by_name[name], spec["cases"][name]["regions"], device, args.steps))
            except Exception as e:  # noqa: BLE001  (the other cases still run; the error is recorded)
                jobs.append({"case": name, "error": f"{type(e).__name__}: {e}"})
            (out / "jobs.json").write_text(json.dumps(jobs) + "\n")
    elif args.cmd == "trace":
        from benchmarks.gpu_probe_memory import trace_case

        device = torch.device("cuda")
        by_name = {c.name: c for c in cases(False)}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows = []
        for run in args.runs:
            name, _, opts = run.partition(":")
            settings = {k: v == "1" for k, v in (o.split("=") for o in opts.split(",") if o)}
            print(f"gpu_probe trace: {name} {settings}", flush=True)
            try:
                rows.append(trace_case(by_name[name], device, settings))
            except Exception as e:  # noqa: BLE001  (the other runs still go; the error is recorded)
                rows.append({"case": name, "settings": settings, "error": f"{type(e).__name__}: {e}"})
            (out / "traces.json").write_text(json.dumps(rows) + "\n")
    else:
        from benchmarks.gpu_probe_report import report

        text = report(Path(args.measured), args.target)
        if args.out:
            Path(args.out).write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
