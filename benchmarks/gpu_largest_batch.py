"""memfit's largest batch for a whole job on an H200, against the largest that runs there.

    python -m benchmarks.gpu_largest_batch predict          # here: fake mode, h200 preset
    python -m benchmarks.gpu_largest_batch measure --out DIR   # on the GPU: torch only

The HF Llama of ``benchmarks.gpu_probe`` (8 x 2048, bf16, 2048 tokens a row), fully fine-tuned
with AdamW. ``predict`` asks ``memfit.largest_batch`` for the card's whole memory (what
``mem_get_info`` reported there: 150,109,880,320 B) with memfit's default reserve, for the plain
step (``solver="none"``) and every block checkpointed (``"every_block"``: the two plans the GPU
can apply with torch alone), and writes them to ``results/gpu-largest-batch-spec.json``.
``measure`` runs two AdamW steps at the predicted batch and then at larger ones (+1, +2, +4,
... until one runs out of memory), or, if the predicted batch runs out, at smaller ones (-1,
-2, -4, ... until one runs), and records each with its peaks.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

SPEC = Path(__file__).parent / "results" / "gpu-largest-batch-spec.json"
CARD_BYTES = 150_109_880_320  # torch.cuda.mem_get_info()[1] on the lent H200 (2026-12-04)
SOLVERS = ("none", "every_block")


def predict() -> dict[str, Any]:
    import memfit
    from benchmarks.gpu_probe_cases import llama_case
    from memfit.planning.job import expandable_segments

    out: dict[str, Any] = {"device_memory_bytes": CARD_BYTES, "target": "h200",
                           "expandable_segments": expandable_segments()}
    for solver in SOLVERS:
        def make(n: int) -> tuple[Any, ...]:
            case = llama_case(False, batch=n)
            return (case.build(torch.device("meta")), case.inputs(torch.device("meta")), case.loss_fn)

        t0 = time.perf_counter()
        fit = memfit.largest_batch(make, device_memory=CARD_BYTES, optimizer="adamw", target="h200",
                                   solver=solver, limit=4096)
        m = fit.plan.memory
        out[solver] = {"batch": fit.batch, "total_bytes": m.total_bytes, "reserve_bytes": m.reserve_bytes,
                       "activations_bytes": m.activations_bytes, "seconds": time.perf_counter() - t0}
        print(f"{solver}: batch {fit.batch}, job {m.total_bytes:,} B of {CARD_BYTES:,} "
              f"(reserve {m.reserve_bytes:,})", flush=True)
    return out


def _run(batch: int, solver: str, device: torch.device) -> dict[str, Any]:
    from benchmarks.gpu_probe_cases import checkpoint_regions, llama_case, train_step

    case = llama_case(False, batch=batch)
    row: dict[str, Any] = {"batch": batch}
    model = opt = inputs = None
    try:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        model = case.build(device)
        if solver == "every_block":
            checkpoint_regions(model, [[f"llama.model.layers.{i}"] for i in range(8)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        inputs = case.inputs(device)
        for _ in range(2):
            train_step(case, model, inputs)
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        row.update(ran=True, allocated_peak_bytes=torch.cuda.max_memory_allocated(device),
                   reserved_peak_bytes=torch.cuda.max_memory_reserved(device))
    except torch.OutOfMemoryError as e:
        row.update(ran=False, error=str(e).splitlines()[0][:200])
    finally:
        del model, opt, inputs
        gc.collect()
        torch.cuda.empty_cache()
    return row


def measure(spec: dict[str, Any], device: torch.device, out: Path) -> dict[str, Any]:
    rec: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                           "mem_get_info_total": torch.cuda.mem_get_info(device)[1]}
    for solver in SOLVERS:
        b = spec[solver]["batch"]
        rows = [_run(b, solver, device)]
        step, sign = 1, 1 if rows[0]["ran"] else -1  # up until one fails, or down until one runs
        while rows[-1]["ran"] == (sign > 0) and step <= 64 and b + sign * step > 0:
            rows.append(_run(b + sign * step, solver, device))
            step *= 2
        rec[solver] = rows
        print(f"{solver}: " + ", ".join(f"{r['batch']}:{'ran' if r['ran'] else 'OOM'}" for r in rows), flush=True)
        (out / "largest_batch.json").write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cmd", choices=("predict", "measure"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.cmd == "predict":
        SPEC.write_text(json.dumps(predict(), indent=1) + "\n")
        return 0
    out = Path(args.out or ".")
    out.mkdir(parents=True, exist_ok=True)
    measure(json.loads(SPEC.read_text()), torch.device("cuda"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
