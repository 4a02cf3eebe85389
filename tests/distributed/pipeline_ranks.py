"""One pipeline stage per rank: the zoo GPT split by blocks, GPipe or 1F1B, plain then planned.

Run by ``torch.distributed.run`` (never collected by pytest: no ``test_`` prefix), from
``test_pipeline.py`` (2 stages) and ``benchmarks/pipeline_stages.py`` (4 stages)::

    pipeline_ranks.py SCHEDULE N_MICROBATCHES [--layers L --d-model C --seq T --mb B]

Each rank: counts the micro-batches its stage holds (hooks on the stage module, during a plain
step) beside ``memfit.parallel.pipeline.in_flight``; profiles one micro-batch of its stage; gives every
stage the same device memory ``M`` (static bytes + activation budget); plans its stage for its
own in-flight count (per-stage) and for the largest count of any stage (uniform: one recipe
for every stage, sized for the worst); measures each plan's peak over a schedule step
(the CPU allocator's events, the reference; and the tensors' peak of the dispatch meter,
which misses the masks of the dropouts a plan keeps, made with Python dispatch off: NOTE
[kept draws]) and its compute seconds
(forward_one_chunk + backward_one_chunk, median of REPEATS, interleaved); compares every
parameter gradient with ``torch.equal`` to the plain schedule's. Writes
``$MEMFIT_DIST_OUT/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

import memfit
from memfit.parallel.pipeline import (
    format_stages,
    gather_stages,
    in_flight,
    in_flight_of,
    kept_by_sends,
    stage_report,
)
from memfit.planning.stages import plan_stage, stage_candidates, stage_peak
from memfit.profiling.meters import AllocatorMeter, DispatchMeter
from memfit.zoo.gpt import gpt
from memfit.zoo.gpt_stages import gpt_stage, lm_loss

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
REPEATS = 3
MEMORY_BETWEEN = 0.3  # M: this far from the tightest feasible memory towards the plain one


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("schedule", choices=[*sorted(SCHEDULES), "interleaved"])
    ap.add_argument("n_microbatches", type=int)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mb", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, p, n = dist.get_rank(), dist.get_world_size(), args.n_microbatches
    if args.schedule == "interleaved":
        _write(rank, _interleaved_counts(rank, p, n))
    model = gpt(n_layer=args.layers, d_model=args.d_model, n_head=2, seq_len=args.seq,
                vocab_size=args.vocab, seed=0)
    mod = gpt_stage(model, rank, p)
    stage = PipelineStage(mod, rank, p, torch.device("cpu"))
    schedule = SCHEDULES[args.schedule](stage, n, loss_fn=lm_loss)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (n * args.mb, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (n * args.mb, args.seq), generator=g)
    spent = [0.0]
    for name in ("forward_one_chunk", "backward_one_chunk"):
        _time_calls(stage, name, spent)

    def run_schedule() -> None:
        if rank == 0:
            schedule.step(x, return_outputs=False)
        elif rank == p - 1:
            schedule.step(target=y, losses=[], return_outputs=False)
        else:
            schedule.step(return_outputs=False)

    def step() -> None:
        torch.manual_seed(0)  # the same dropout masks in every step
        for q in mod.parameters():
            assert q.grad is not None
            q.grad.zero_()  # static: the grads exist before the step (NOTE [pipeline stage memory model])
        stage.clear_runtime_states()  # the last step's outputs and input grads, before metering
        run_schedule()

    def metered() -> tuple[int, int, dict[str, torch.Tensor]]:
        step()  # warm (the plan's first step)
        with AllocatorMeter() as alloc, DispatchMeter() as tensors:
            step()
        grads = {k: q.grad.clone() for k, q in mod.named_parameters() if q.grad is not None}
        return tensors.peak_bytes, alloc.peak_bytes, grads

    # the plain schedule: its first step builds the stage's buffers and the grads (and
    # may run the stage once more for its shapes), so the count is of the second step
    torch.manual_seed(0)
    run_schedule()
    counted = _count_in_flight(mod)
    step()
    k_counted = counted()
    plain_peak, plain_alloc, plain_grads = metered()

    k = in_flight(schedule, rank)
    ks = [in_flight(schedule, s) for s in range(p)]
    mb_x = x[: args.mb] if rank == 0 else torch.randn(args.mb, args.seq, args.d_model, requires_grad=True)
    loss_fn = (lambda out: lm_loss(out, y[: args.mb])) if rank == p - 1 else None
    prof = memfit.profile(mod, (mb_x,), loss_fn=loss_fn)
    candidates = stage_candidates(prof)
    boundary = args.mb * args.seq * args.d_model * 4  # one micro-batch's hidden state, float32
    kept = kept_by_sends(schedule, rank, p, output_bytes=boundary, input_grad_bytes=boundary,
                         n_microbatches=n)
    static = 2 * sum(q.numel() * q.element_size() for q in mod.parameters())  # weights + grads
    plain_pred = stage_peak(prof, candidates[0], k, extra_bytes=kept).peak_bytes
    tight = min(stage_peak(prof, c, max(ks), extra_bytes=kept).peak_bytes for c in candidates)
    every = _gather((static, plain_pred, tight))
    lo = max(s + t for s, _, t in every)
    hi = max(s + q for s, q, _ in every)
    memory = lo + int(MEMORY_BETWEEN * max(0, hi - lo))  # the same device memory on every stage
    budget = memory - static
    per = plan_stage(prof, budget=budget, in_flight=k, candidates=candidates, extra_bytes=kept)
    uni = plan_stage(prof, budget=budget, in_flight=max(ks), candidates=candidates,
                     extra_bytes=kept)
    uni_here = stage_peak(prof, uni, k, extra_bytes=kept)
    # the same through memfit.fit on a copy: every rank plans its own stage (no PlansDiffer)
    twin = copy.deepcopy(mod)
    memfit.fit(twin, (mb_x,), loss_fn=loss_fn, budget=budget, parallel=memfit.Parallel(in_flight=k, kept_bytes=kept))
    fitted = twin.memfit_plan.extra["pipeline"]

    results: dict[str, Any] = {}
    for name, plan in (("per_stage", per), ("uniform", uni)):
        memfit.apply(mod, plan, check_ranks=False)
        peak, alloc, grads = metered()
        memfit.unapply(mod)
        results[name] = {"measured_peak_bytes": alloc, "tensors_peak_bytes": peak,
                         "regions": [list(r.modules) for r in plan.regions],
                         "recompute_s": plan.recompute_s,
                         "unequal": sorted(kk for kk in plain_grads
                                           if not torch.equal(plain_grads[kk], grads[kk]))}
    results["uniform"]["predicted_peak_bytes"] = uni_here.peak_bytes
    results["per_stage"]["predicted_peak_bytes"] = per.extra["pipeline"]["stage_peak_bytes"]
    times: dict[str, list[float]] = {"per_stage": [], "uniform": []}
    for _ in range(REPEATS):
        for name, plan in (("per_stage", per), ("uniform", uni)):
            memfit.apply(mod, plan, check_ranks=False)
            step()
            spent[0] = 0.0
            step()
            times[name].append(spent[0])
            memfit.unapply(mod)
    for name in times:
        results[name]["measured_s"] = statistics.median(times[name])
    reports = {}
    for name, plan in (("per_stage", per), ("uniform", uni)):
        r = stage_report(plan, stage=rank, n_microbatches=n, static_bytes=static,
                         measured_peak_bytes=results[name]["measured_peak_bytes"],
                         measured_s=results[name]["measured_s"])
        if name == "uniform":  # planned for max(ks), run holding k: its peak here
            import dataclasses

            r = dataclasses.replace(r, in_flight=k, predicted_peak_bytes=uni_here.peak_bytes,
                                    budget_bytes=budget)
        reports[name] = gather_stages(r)
    out = {"rank": rank, "stages": p, "schedule": args.schedule, "n_microbatches": n,
           "in_flight": k, "in_flight_counted": k_counted,
           "in_flight_formula": in_flight_of(args.schedule, rank, p, n),
           "in_flight_all": ks, "kept_bytes": kept, "fit": fitted, "device_memory_bytes": memory, "static_bytes": static,
           "budget_bytes": budget, "plain_predicted_bytes": plain_pred,
           "plain_measured_bytes": plain_alloc, "plain_tensors_bytes": plain_peak,
           "n_grads": len(plain_grads), **results,
           "reports": {kk: [r.to_dict() for r in v] for kk, v in reports.items()},
           "tables": {kk: format_stages(v) for kk, v in reports.items()},
           "torch": torch.__version__}
    _write(rank, out)


def _write(rank: int, out: dict[str, Any]) -> None:
    Path(os.environ["MEMFIT_DIST_OUT"], f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as rank_common.write: gloo's threads have aborted a clean teardown


def _interleaved_counts(rank: int, p: int, n: int) -> dict[str, Any]:
    """``ScheduleInterleaved1F1B`` with 2 stages per rank (tiny linear stages): each stage's
    in-flight count from the action order and as counted by hooks during one step."""
    width = 8
    stages = []
    for v in range(2):
        index = rank + v * p  # the looped placement: rank r holds stages r and r + p
        torch.manual_seed(index)
        mod = torch.nn.Linear(width, width)
        stages.append(PipelineStage(mod, index, 2 * p, torch.device("cpu")))
    schedule = ScheduleInterleaved1F1B(stages, n, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    x = torch.randn(n, width)
    for i in range(2):  # the first step also runs stage 0 for shapes: count the second
        if i == 1:
            counters = [(st.stage_index, _count_in_flight(st.submod)) for st in stages]
        if rank == 0:
            schedule.step(x)
        elif rank == p - 1:
            schedule.step(target=x, losses=[])
        else:
            schedule.step()
    counted = {index: finish() for index, finish in counters}
    return {"rank": rank, "schedule": "interleaved", "n_microbatches": n,
            "in_flight": {i: in_flight(schedule, i) for i in counted}, "in_flight_counted": counted}


def _time_calls(stage: PipelineStage, name: str, spent: list[float]) -> None:
    """Add the seconds of each call of ``stage.<name>`` to ``spent[0]``."""
    original = getattr(stage, name)

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    setattr(stage, name, timed)


def _count_in_flight(mod: torch.nn.Module) -> Any:
    """Hooks counting the micro-batches forwarded and not yet backwarded (the gradient of
    the stage's output arriving ends one); returns a function that removes them and gives
    the most held at once."""
    live, most = [0], [0]

    def done(grad: torch.Tensor) -> None:
        live[0] -= 1

    def forward_hook(_m: Any, _inputs: Any, output: torch.Tensor) -> None:
        live[0] += 1
        most[0] = max(most[0], live[0])
        output.register_hook(done)

    handle = mod.register_forward_hook(forward_hook)

    def finish() -> int:
        handle.remove()
        return most[0]

    return finish


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


if __name__ == "__main__":
    main()
