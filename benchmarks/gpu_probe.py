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
import dataclasses
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

SPEC = Path(__file__).parent / "results" / "gpu-probe-spec.json"
GB = 10**9


@dataclasses.dataclass
class Case:
    name: str
    description: str
    build: Callable[[torch.device], nn.Module]
    inputs: Callable[[torch.device], tuple[Any, ...]]
    loss_fn: Callable[[Any], torch.Tensor]


def _sum_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().sum()


def _square_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _resnet50(device: torch.device, stages: tuple[int, ...], classes: int) -> nn.Module:
    """``benchmarks.published.resnet50``, on ``device`` and seeded (meta: as built)."""
    from benchmarks.published import resnet50

    model = resnet50(num_classes=classes, stages=stages)
    if device.type == "meta":
        return model
    torch.manual_seed(0)
    model = model.to_empty(device=device)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()  # BatchNorm's resets its running statistics too
    return model


def cases(quick: bool) -> list[Case]:
    """MONeT's ResNet-50 (batch 184, fp32), then ``benchmarks.gpu_fake_check``'s cases."""
    from benchmarks import gpu_fake_check

    stages, batch, side, classes = ((1, 1, 1, 1), 4, 64, 10) if quick else ((3, 4, 6, 3), 184, 224, 1000)
    out = [Case("resnet50", f"ResNet-50 (stages {stages}), fp32, batch {batch}, {side}x{side} (MONeT's setting)",
                lambda dev: _resnet50(dev, stages, classes),
                lambda dev: (torch.randn(batch, 3, side, side, device=dev, generator=None),),
                _square_loss)]
    for c in gpu_fake_check._cases(quick):
        def build(dev: torch.device, c: Any = c) -> nn.Module:
            torch.manual_seed(0)
            with torch.device(dev):
                return c.build()
        out.append(Case(c.name, c.description, build, c.inputs, c.loss_fn))
    out.append(_llama_case(quick))
    return out


def _llama_case(quick: bool, batch: int | None = None) -> Case:
    """An HF Llama fine-tune: bf16, SDPA attention (HF's default), no dropout, GQA."""
    h, layers, heads, kv, seq, default_batch, vocab = ((64, 2, 4, 2, 64, 2, 256) if quick else
                                                       (2048, 8, 16, 4, 2048, 4, 32000))
    batch = batch or default_batch

    def build(dev: torch.device) -> nn.Module:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import LlamaConfig, LlamaForCausalLM

        from benchmarks.models import _LlamaStep

        cfg = LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=int(2.75 * h),
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                          max_position_embeddings=seq, use_cache=False)
        torch.manual_seed(0)
        with torch.device(dev):
            return _LlamaStep(LlamaForCausalLM(cfg).to(torch.bfloat16))

    def inputs(dev: torch.device) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, vocab, (batch, seq), generator=g).to(dev),)

    return Case("hf-llama", f"HF LlamaForCausalLM {layers}x{h}, {heads} heads ({kv} KV), bf16, SDPA, "
                f"seq {seq}, batch {batch}, vocab {vocab}, labels = inputs", build, inputs,
                lambda out: out.loss)


# ---- here: the spec --------------------------------------------------------------------------

def _fake_profile(case: Case, target: str) -> Any:
    import memfit

    model = case.build(torch.device("meta"))
    return memfit.profile(model, case.inputs(torch.device("meta")), loss_fn=case.loss_fn,
                          mode="fake", target=target)


def prepare(target: str, quick: bool) -> dict[str, Any]:
    """The regions of memfit's every_block plan per case (all the GPU needs from memfit)."""
    import memfit

    spec: dict[str, Any] = {"target": target, "quick": quick, "cases": {}}
    for case in cases(quick):
        prof = _fake_profile(case, target)
        plan = memfit.plan(prof, budget="100%", solver="every_block")
        if any(r.ops for r in plan.regions):
            raise RuntimeError(f"{case.name}: every_block has per-op policies; the GPU side "
                               "checkpoints whole regions only")
        spec["cases"][case.name] = {"regions": [list(r.modules) for r in plan.regions]}
    return spec


# ---- on the GPU: torch only ------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _OpTimes:
    """Every aten op of a step with its time: CUDA events around it (CPU: wall clock)."""

    def __init__(self, device: torch.device) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.device, self.rows, self.phase = device, [], "forward"
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if outer.device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    out = func(*args, **(kwargs or {}))
                    end.record()
                    outer.rows.append([str(func), outer.phase, (start, end)])
                else:
                    t0 = time.perf_counter()
                    out = func(*args, **(kwargs or {}))
                    outer.rows.append([str(func), outer.phase, time.perf_counter() - t0])
                return out

        self.mode = Mode()

    def seconds(self) -> list[tuple[str, str, float]]:
        _sync(self.device)
        return [(n, ph, t[0].elapsed_time(t[1]) / 1e3 if isinstance(t, tuple) else t)
                for n, ph, t in self.rows]


class _Checkpointed(nn.Module):
    """Runs ``modules`` (consecutive siblings) in order under one non-reentrant checkpoint."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.inner = nn.ModuleList(modules)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        x = self.inner[0](*args, **kwargs)  # keyword arguments: a lone module's (HF layers')
        for m in self.inner[1:]:
            x = m(x)
        return x

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self._run, *args, use_reentrant=False, **kwargs)


def checkpoint_regions(model: nn.Module, regions: list[list[str]]) -> nn.Module:
    """``model`` with each region (module paths: one, or consecutive siblings) checkpointed."""
    for paths in regions:
        parent_path, _, first = paths[0].rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        names = [p.rpartition(".")[2] for p in paths]
        wrapped = _Checkpointed([parent.get_submodule(n) for n in names])
        if len(names) == 1:
            setattr(parent, first, wrapped)
            continue
        if not isinstance(parent, nn.Sequential):
            raise TypeError(f"a run of siblings under {parent_path!r} ({type(parent).__name__}) "
                            "needs an nn.Sequential parent here")
        kept = [(n, m) for n, m in parent.named_children() if n not in names[1:]]
        for n, _ in list(parent.named_children()):
            delattr(parent, n)
        for n, m in kept:
            parent.add_module(n, wrapped if n == first else m)
    return model


def _step(case: Case, model: nn.Module, inputs: tuple[Any, ...]) -> None:
    """Forward, loss, backward, the output referenced through backward as in a usual training
    loop (``out = model(x); loss_fn(out).backward()``) and as memfit's profile counts it."""
    out = model(*inputs)
    case.loss_fn(out).backward()
    del out


def _peak(step: Callable[[], None], model: nn.Module, device: torch.device) -> int | None:
    for p in model.parameters():
        p.grad = None  # the profile counts the gradients backward allocates
    gc.collect()
    if device.type != "cuda":
        step()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def measure_case(case: Case, regions: list[list[str]], device: torch.device, repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    models = {"plain": case.build(device), "every_block": case.build(device)}
    checkpoint_regions(models["every_block"], regions)
    torch.manual_seed(1)
    inputs = case.inputs(device)

    def step_of(m: nn.Module) -> Callable[[], None]:
        def step() -> None:
            _step(case, m, inputs)
        return step

    def clear(m: nn.Module) -> None:
        for p in m.parameters():
            p.grad = None

    row: dict[str, Any] = {"case": case.name, "description": case.description}
    for name, m in models.items():
        for _ in range(2):  # warm-up: cuBLAS/cuDNN handles and workspaces, lazy kernels
            step_of(m)()
            clear(m)
        row[f"{name}_peak_bytes"] = _peak(step_of(m), m, device)
        clear(m)
    times: dict[str, list[float]] = {n: [] for n in models}
    for r in range(repeats):  # in turn, the order alternating
        for name in (list(models) if r % 2 == 0 else list(reversed(models))):
            m = models[name]
            clear(m)
            _sync(device)
            s = time.perf_counter()
            step_of(m)()
            _sync(device)
            times[name].append(time.perf_counter() - s)
    for name, ts in times.items():
        row[f"{name}_step_s"] = statistics.median(ts)
        row[f"{name}_steps_s"] = ts
    timer = _OpTimes(device)
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
