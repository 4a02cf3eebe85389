"""The prepared GPU check: memfit's own runtime, end to end, on one GPU in under 8 minutes.

    python -m benchmarks.gpu_check                       # CUDA, full sizes
    python -m benchmarks.gpu_check --device cpu --quick  # the same code path on CPU, tiny models

Five cases (``benchmarks.gpu_check_cases``): the zoo GPT (fp32), an HF Llama (bf16, SDPA),
ResNet-50 (fp32, batch sized to the card), the zoo 3D UNet (BatchNorm, bf16 autocast) and
Megatron GPT layers with dropout (bf16). For each, in this order, every part isolated (a part
that fails records its error and the next one runs):

1. ``memfit.fit`` at 70/50/30% of the plain peak and at ``device_memory=`` the card, each plan's
   measured peak against the budget and against the predictions of the real-device profile and
   of a fake-mode profile; loss, gradients, BatchNorm statistics and RNG states against the
   plain step, bitwise under ``torch.use_deterministic_algorithms(True)`` (with
   ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` set before CUDA starts); ``memfit.verify``'s verdict
   (``benchmarks.gpu_check_plans``);
2. step times against the plain step and against every-block and selective checkpointing at
   their measured peaks (memfit planned for each peak), medians of interleaved rounds;
3. the planner's offload plan on the card's host link against recompute only at its measured
   peak (a CPU has no host link: skipped, with the reason recorded);
4. ``memfit.largest_batch(..., device_memory=card)``, three AdamW steps there and at the next
   batch (on a CPU the card is a small synthetic device memory);
5. ``torch.compile``'s ``activation_memory_budget`` against compiled memfit at its peak (by
   default for the GPT and the Llama only: ``--compile``).

A time guard shares ``--time-limit`` among the cases left; a part that starts after its case's
share ran out is skipped (recorded), and timed rounds stop early. Results are written after
each case: ``benchmarks/results/gpu-<date>/gpu_check.{json,md}`` (``--out`` to change), with
torch version, device and commit, and each target of issue 40 as a pass/fail column
(``benchmarks.gpu_check_report``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("benchmarks.gpu_check")

FULL_LIMIT_S = 420.0  # 8 minutes on one H100 less a minute for start-up and the last case's tail


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def check_case(case: Any, device: torch.device, *, target: str, rounds: int, compile_it: bool,
               seconds: float | None) -> dict[str, Any]:
    """Every part for one case; a part that raises records its error and the next one runs."""
    from benchmarks.gpu_check_peers import compiled, largest_batch, offload, speed
    from benchmarks.gpu_check_plans import FRACTIONS, fit_rows, setup
    from benchmarks.gpu_check_report import annotate
    from benchmarks.gpu_check_steps import Deadline, Runner

    deadline = Deadline(seconds)
    t0 = time.perf_counter()
    out: dict[str, Any] = {"case": case.name, "description": case.description, "config": case.config,
                           "time_share_s": seconds, "errors": {}}
    try:
        s = setup(Runner(case, device), target)
        out["card_bytes"], out["card"] = s.card_bytes, s.card_how
        out["plans"], fitted = fit_rows(s, FRACTIONS)
    except Exception as e:  # noqa: BLE001 - the case cannot go on without its profile and plain step
        log.exception("%s: setup failed", case.name)
        out["errors"]["setup"] = _error(e)
        out["seconds"] = time.perf_counter() - t0
        return annotate(out)
    tightest = [r["budget_bytes"] for r in out["plans"][1:len(FRACTIONS) + 1] if r.get("budget_bytes")]
    peaks = {r["plan"]: r["measured_peak_bytes"] for r in out["plans"] if "measured_peak_bytes" in r}
    parts: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("speed", lambda: speed(s, fitted, peaks, rounds=rounds, deadline=deadline)),
        ("offload", lambda: offload(s, min(tightest), rounds=rounds, deadline=deadline)),
        ("largest_batch", lambda: largest_batch(s)),
        ("compile", lambda: compiled(s, rounds=rounds, deadline=deadline) if compile_it else
         {"skipped": "not in --compile (each compile costs minutes on a GPU's budget)"}),
    ]
    for name, part in parts:
        if deadline.expired():
            out[name] = {"skipped": f"time guard: the case's {seconds:.0f} s were spent"}
            continue
        try:
            out[name] = part()
        except Exception as e:  # noqa: BLE001 - recorded; the next part runs
            log.exception("%s: %s failed", case.name, name)
            out["errors"][name] = _error(e)
            out[name] = {"error": _error(e)}
    out["seconds"] = time.perf_counter() - t0
    return annotate(out)


def _target(device: torch.device) -> str:
    """The device preset memfit predicts for: the GPU's by name, else ``cpu``."""
    from benchmarks.gpu_fake_check import PRESETS

    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).upper()
    return next((v for k, v in PRESETS.items() if k in name), "h100")


def main(argv: list[str] | None = None) -> int:
    from benchmarks.gpu_check_cases import CASE_NAMES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny models (the CPU test)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5, quick 2)")
    parser.add_argument("--cases", default=",".join(CASE_NAMES), help=f"comma-separated of {CASE_NAMES}")
    parser.add_argument("--compile", default=None,
                        help="cases that run torch.compile: comma-separated, 'all' or 'none' "
                             "(default gpt,llama; quick: gpt)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help=f"seconds for all cases (default {FULL_LIMIT_S:.0f}; quick: none)")
    parser.add_argument("--out", default=None, help="folder (default benchmarks/results/gpu-<date>)")
    args = parser.parse_args(argv)
    names = tuple(n.strip() for n in args.cases.split(",") if n.strip())
    if not names or any(n not in CASE_NAMES for n in names):
        parser.error(f"--cases takes names from {CASE_NAMES}, got {args.cases!r}")
    compile_arg = args.compile or ("gpt" if args.quick else "gpt,llama")
    compiled = set(CASE_NAMES) if compile_arg == "all" else set() if compile_arg == "none" else \
        {n.strip() for n in compile_arg.split(",")}
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    if device.type == "cuda":
        if torch.cuda.is_initialized() and os.environ.get("CUBLAS_WORKSPACE_CONFIG") is None:
            log.warning("CUDA started before CUBLAS_WORKSPACE_CONFIG was set: cuBLAS may not be deterministic")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
        if not torch.cuda.is_available():
            log.error("no CUDA device here; run with --device cpu --quick to check the code path")
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    limit = args.time_limit if args.time_limit is not None else None if args.quick else FULL_LIMIT_S
    return run(names, device, quick=args.quick, rounds=args.rounds or (2 if args.quick else 5),
               compiled=compiled, limit=limit, out=args.out)


def run(names: tuple[str, ...], device: torch.device, *, quick: bool, rounds: int, compiled: set[str],
        limit: float | None, out: str | None) -> int:
    from benchmarks.gpu_check_cases import build_cases
    from benchmarks.gpu_check_report import markdown
    from benchmarks.harness import collect_environment

    env = collect_environment(torch.get_num_threads())
    date = _dt.date.today().isoformat()
    card = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else None
    target = _target(device)
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "target": target, "torch": torch.__version__, "commit": env.git_commit, "dirty": env.git_dirty,
        "date": date, "quick": quick, "rounds": rounds, "time_limit_s": limit,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "note": ("Peaks: bytes above the step's start (CUDA: max_memory_allocated; CPU: memfit's "
                 "allocator meter). Predicted (profile): the real-device profile's plan; predicted "
                 f"(fake): memfit.simulate on a fake-mode profile for {target}. Bitwise: loss, "
                 "gradients, buffers and RNG states equal to the plain step's under "
                 "torch.use_deterministic_algorithms(True, warn_only=True). Times: medians of "
                 "interleaved rounds."),
        "cases": [],
    }
    folder = Path(out) if out else Path(__file__).parent / "results" / f"gpu-{date}"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cases = build_cases(names, quick=quick, card_bytes=card)
    for i, case in enumerate(cases):
        share = None if limit is None else max(0.0, limit - (time.perf_counter() - t0)) / (len(cases) - i)
        log.info("gpu_check: %s (%s s)", case.description, "no limit" if share is None else f"{share:.0f}")
        try:
            result = check_case(case, device, target=target, rounds=rounds,
                                compile_it=case.name in compiled, seconds=share)
        except Exception as e:  # noqa: BLE001 - one case's failure is recorded; the next runs
            log.exception("%s failed", case.name)
            result = {"case": case.name, "description": case.description, "errors": {"case": _error(e)}}
        record["cases"].append(result)
        record["seconds"] = time.perf_counter() - t0
        # written after each case: a run stopped at its time limit keeps the cases it finished
        (folder / "gpu_check.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        (folder / "gpu_check.md").write_text(markdown(record))
        log.info("gpu_check: %s done in %.0f s; wrote %s", case.name, result.get("seconds", 0),
                 folder / "gpu_check.md")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
