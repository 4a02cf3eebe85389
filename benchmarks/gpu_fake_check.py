"""Does a GPU target's fake-mode profile predict the GPU? One command, under 3 minutes on an H200.

    python -m benchmarks.gpu_fake_check              # on a CUDA device (A100, H100 or H200)
    python -m benchmarks.gpu_fake_check --dry-run    # here: every step but the CUDA measurement

For each case (Megatron GPT layers in bf16 with eager attention and with SDPA, the zoo GPT, a
small conv net):
1. memfit's prediction, made without the GPU: the model built on the meta device, profiled in
   fake mode for the GPU's preset (NOTE [CUDA kernels in fake mode] in
   ``memfit.profiling.cuda_kernels``), and ``memfit.plan(profile, budget="50%")``;
2. the GPU: the same model built there, one warm-up step (cuBLAS and cuDNN set up their
   workspaces), then the plain step's peak (``torch.cuda.max_memory_allocated`` minus the
   memory allocated before it, gradients freed first, as the profile counts them) and the
   planned step's (the fake profile's plan applied with ``memfit.apply``, as ``memfit.fit``
   applies its plan);
3. whether the GPU dispatches the forward ops the fake profile recorded (the first difference
   named): the SDPA backend and fused dropout the rules chose are right or they are not;
4. the allocator's reserve on top of the peak (``max_memory_reserved - max_memory_allocated``).
Once per run, the CUDA context: what ``torch.cuda.mem_get_info`` shows in use beyond what the
caching allocator reserved, after CUDA starts and again at the end (kernel modules load
lazily), so that a default reserve for whole-job memory can be documented.

Writes ``benchmarks/results/gpu-check-<date>/gpu_fake_check.{json,md}`` (``--out`` to change).
``--dry-run`` (no CUDA needed) runs the same cases at small sizes on the CPU: fake profiles and
plans for the A100 preset, the plain and planned steps run once each, the forward ops
compared; only the CUDA peaks and the context are not measured (``null``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

log = logging.getLogger("benchmarks.gpu_fake_check")

BUDGET = "50%"
# the ops whose kernel differs by device (NOTE [CUDA kernels in fake mode]), listed per case
_KERNEL_WORDS = ("attention", "dropout", "bernoulli", "batch_norm", "rms_norm")
PRESETS = {"A100": "a100", "H100": "h100", "H200": "h200"}


class MegatronLayer(nn.Module):
    """A pre-LN GPT layer (Korthikanti et al. 2022): dropout on the attention probabilities
    (eager) or inside SDPA, and after the attention and MLP blocks; GELU MLP of 4h."""

    def __init__(self, h: int, a: int, s: int, attention: str, p: float = 0.1) -> None:
        super().__init__()
        self.a, self.attention, self.p = a, attention, p
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.attn_drop, self.drop1, self.drop2 = nn.Dropout(p), nn.Dropout(p), nn.Dropout(p)
        self.register_buffer("future", torch.ones(s, s, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.a
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)                  # (b, s, h) each
        q, k, v = (t.view(b, s, self.a, d).transpose(1, 2) for t in (q, k, v))  # (b, a, s, d)
        if self.attention == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)   # (b, a, s, s)
            probs = torch.softmax(scores.masked_fill(self.future[:s, :s], -math.inf), dim=-1)
            o = torch.matmul(self.attn_drop(probs), v)                     # (b, a, s, d)
        x = x + self.drop1(self.proj(o.transpose(1, 2).reshape(b, s, h)))
        return x + self.drop2(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


@dataclass
class Case:
    name: str
    description: str
    build: Callable[[], nn.Module]                      # called under torch.device(...)
    inputs: Callable[[torch.device], tuple[Any, ...]]
    loss_fn: Callable[[Any], torch.Tensor]


def _sum_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().sum()


def _cases(quick: bool) -> list[Case]:
    import memfit

    h, a, s, b, n = (64, 4, 128, 4, 2) if quick else (2048, 16, 2048, 4, 4)
    g = dict(n_layer=2, d_model=64, n_head=4, seq_len=64, batch=2) if quick else \
        dict(n_layer=8, d_model=1024, n_head=16, seq_len=1024, batch=8)
    r = dict(width=8, side=32, batch=4) if quick else dict(width=64, side=128, batch=64)
    cases = []
    for attention in ("eager", "sdpa"):
        cases.append(Case(
            f"megatron-{attention}", f"{n} Megatron GPT layers, bf16, {attention} attention, "
            f"h={h} a={a} s={s} b={b}, dropout 0.1",
            lambda attention=attention: nn.Sequential(
                *(MegatronLayer(h, a, s, attention) for _ in range(n))).to(torch.bfloat16),
            lambda dev: (torch.zeros(b, s, h, dtype=torch.bfloat16, device=dev),), _sum_loss))
    cases.append(Case(
        "zoo-gpt", "memfit.zoo.gpt, fp32, eager attention, dropout 0.1, " + ", ".join(
            f"{k}={v}" for k, v in g.items()),
        lambda: memfit.zoo.gpt(**{k: v for k, v in g.items() if k != "batch"}),
        lambda dev: (torch.zeros(g["batch"], g["seq_len"], dtype=torch.long, device=dev),),
        _sum_loss))
    cases.append(Case(
        "resnet", f"memfit.zoo.resnet (conv + batch norm), fp32, width {r['width']}, "
                  f"{r['batch']} images of {r['side']}x{r['side']}",
        lambda: memfit.zoo.resnet(width=r["width"]),
        lambda dev: (torch.zeros(r["batch"], 3, r["side"], r["side"], device=dev),), _sum_loss))
    return cases


def _no_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None  # the profile counts the gradients backward allocates


def _cuda_peak(run: Callable[[], None], device: torch.device) -> dict[str, int]:
    """Peak allocated above the memory before ``run``, and the allocator's reserve on top."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return {"peak_bytes": torch.cuda.max_memory_allocated(device) - before,
            "reserve_bytes": torch.cuda.max_memory_reserved(device)
            - torch.cuda.max_memory_allocated(device)}


def _context(device: torch.device) -> dict[str, int]:
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return {"total_bytes": total, "in_use_bytes": total - free, "reserved_bytes": reserved,
            "context_bytes": total - free - reserved}


def _first_difference(fake: list[tuple[str, str]], real: list[tuple[str, str]]) -> str | None:
    for i, (f, r) in enumerate(zip(fake, real, strict=False)):
        if f != r:
            return f"forward op {i}: fake {f[0]} in {f[1]!r}, device {r[0]} in {r[1]!r}"
    if len(fake) != len(real):
        return f"fake mode recorded {len(fake)} forward ops, the device ran {len(real)}"
    return None


def check_case(case: Case, device: torch.device, target: str, measure: bool) -> dict[str, Any]:
    import memfit
    from memfit.errors import InfeasibleBudget
    from memfit.profiling.tracer import ProfileMode, _forward_ops

    t0 = time.perf_counter()
    with torch.device("meta"):
        meta_model = case.build()
    prof = memfit.profile(meta_model, case.inputs(torch.device("meta")), loss_fn=case.loss_fn,
                          mode="fake", target=target)
    try:
        plan = memfit.plan(prof, budget=BUDGET)
    except InfeasibleBudget as e:  # tiny dry-run models are mostly weights
        plan = memfit.plan(prof, budget=int(e.min_feasible_bytes))
    row: dict[str, Any] = {
        "case": case.name, "description": case.description, "target": target,
        "fake": {"peak_bytes": prof.peak_bytes, "saved_bytes": prof.saved_bytes,
                 "planned_peak_bytes": plan.predicted_peak_bytes,
                 "budget_bytes": plan.budget_bytes, "regions": len(plan.regions),
                 "cuda_kernels": prof.extra.get("cuda_kernels", {})}}
    torch.manual_seed(0)
    with torch.device(device):
        model = case.build()
    inputs = case.inputs(device)
    real = [(o.name, o.module) for o in _forward_ops(model, inputs, case.loss_fn, ProfileMode.MEASURE)]
    difference = _first_difference([(o.name, o.module) for o in prof.forward_ops], real)
    row["forward_ops_match"] = difference is None
    row["first_difference"] = difference
    row["device_kernel_ops"] = sorted({n for n, _ in real if any(k in n for k in _KERNEL_WORDS)})

    def step() -> None:
        case.loss_fn(model(*inputs)).backward()

    measured: dict[str, Any] = {}
    for name in ("plain", "planned"):
        if name == "planned":
            memfit.apply(model, plan)  # as fit applies its plan
        step()  # warm-up: cuBLAS/cuDNN handles and workspaces, lazily loaded kernels
        _no_grads(model)
        measured[name] = _cuda_peak(step, device) if measure else step()
        _no_grads(model)
    memfit.unapply(model)
    row["measured"] = measured
    if measure:
        row["plain_measured_over_predicted"] = measured["plain"]["peak_bytes"] / prof.peak_bytes
        row["planned_measured_over_predicted"] = (measured["planned"]["peak_bytes"]
                                                  / plan.predicted_peak_bytes)
    row["seconds"] = time.perf_counter() - t0
    return row


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.3f}"


def _markdown(record: dict[str, Any]) -> str:
    lines = [f"# Fake-mode predictions vs {record['device']} (target {record['target']})", "",
             f"torch {record['torch']}, commit {record['commit']}, {record['date']}"
             f"{' (dry run: nothing measured)' if record['dry_run'] else ''}. Peaks in GiB "
             "above the memory before the step.", "",
             "| case | fake peak | measured | ratio | planned (50%) fake | measured | ratio | "
             "reserve | forward ops match |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for c in record["cases"]:
        plain, planned = c["measured"]["plain"], c["measured"]["planned"]
        ratio = c.get("plain_measured_over_predicted")
        pratio = c.get("planned_measured_over_predicted")
        lines.append(
            f"| {c['case']} | {_gib(c['fake']['peak_bytes'])} | "
            f"{_gib(plain and plain['peak_bytes'])} | {'-' if ratio is None else f'{ratio:.3f}'} | "
            f"{_gib(c['fake']['planned_peak_bytes'])} | {_gib(planned and planned['peak_bytes'])} | "
            f"{'-' if pratio is None else f'{pratio:.3f}'} | {_gib(plain and plain['reserve_bytes'])} | "
            f"{'yes' if c['forward_ops_match'] else 'no: ' + str(c['first_difference'])} |")
    lines += ["", "Cases:", *(f"- {c['case']}: {c['description']}; fake mode's CUDA kernels "
                              f"{c['fake']['cuda_kernels']}; the device ran "
                              f"{', '.join(c['device_kernel_ops']) or 'none of those'}"
                              for c in record["cases"])]
    ctx = record.get("context")
    if ctx:
        lines += ["", "CUDA context (in use per `mem_get_info` beyond the allocator's reserved "
                  f"bytes): {_gib(ctx['start']['context_bytes'])} GiB after start, "
                  f"{_gib(ctx['end']['context_bytes'])} GiB at the end, of "
                  f"{_gib(ctx['start']['total_bytes'])} GiB."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU at small sizes, for the A100 preset: no CUDA measurement")
    parser.add_argument("--target", default=None, choices=sorted(PRESETS.values()),
                        help="the preset (default: from the device's name; a100 on a dry run)")
    parser.add_argument("--out", default=None, help="folder (default benchmarks/results/gpu-check-<date>)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from benchmarks.harness import collect_environment

    if args.dry_run:
        device, name, target = torch.device("cpu"), "cpu (dry run)", args.target or "a100"
    else:
        if not torch.cuda.is_available():
            log.error("no CUDA device here; --dry-run checks every step but the measurement")
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
        target = args.target or next((v for k, v in PRESETS.items() if k in name.upper()), "")
        if not target:
            log.error("no preset for %s: pass --target a100, h100 or h200", name)
            return 2
        torch.zeros(1, device=device)  # start CUDA: the context
    env = collect_environment(torch.get_num_threads())
    date = _dt.date.today().isoformat()
    record: dict[str, Any] = {"device": name, "target": target, "torch": torch.__version__,
                              "commit": env.git_commit, "date": date, "dry_run": args.dry_run,
                              "cases": []}
    if device.type == "cuda":
        record["context"] = {"start": _context(device)}
    t0 = time.perf_counter()
    for case in _cases(quick=args.dry_run):
        log.info("gpu_fake_check: %s", case.description)
        record["cases"].append(check_case(case, device, target, measure=device.type == "cuda"))
        gc.collect()  # the case's model is gone: its memory back to the device
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda":
        record["context"]["end"] = _context(device)
    record["seconds"] = time.perf_counter() - t0
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"gpu-check-{date}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_fake_check.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "gpu_fake_check.md").write_text(_markdown(record))
    log.info("gpu_fake_check: wrote %s (%.1f s)", out / "gpu_fake_check.md", record["seconds"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
