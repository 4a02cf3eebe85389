"""``benchmarks.gpu_check``'s second part for one case: memfit against its peers at their
measured peaks, the planner's offload plan against recompute only, the largest batch, and
``torch.compile``.

- speed: every-block checkpointing and selective checkpointing (matmul outputs saved;
  ``benchmarks.peers``) are measured; memfit plans for each one's measured peak
  (``memfit.profile``/``plan``/``apply``); all of them, the plain step and the ``fit`` plans are
  timed in interleaved rounds.
- offload: ``memfit.plan(..., offload=True)`` for the device's preset host link at the
  tightest budget, against the recompute-only plan for the offload plan's measured peak.
- largest batch: ``memfit.largest_batch(..., device_memory=card)`` on fake-mode profiles (the
  plain step of a batch that needs checkpointing does not fit the device, so it cannot be
  profiled there), then three AdamW steps at that batch with its plan and at the next batch
  with its smallest plan.
- compile: ``torch.compile`` with ``activation_memory_budget`` 0.5 against memfit's plan for
  its measured peak, compiled.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

import memfit
from benchmarks.gpu_check_plans import Setup, check_method, plan_at
from benchmarks.gpu_check_report import PEAK_RTOL
from benchmarks.gpu_check_steps import Deadline, time_rounds
from benchmarks.peers import Method
from memfit.errors import InfeasibleBudget
from memfit.runtime.apply import host_pool

__all__ = ["speed", "offload", "largest_batch", "compiled", "COMPILE_BUDGET"]

COMPILE_BUDGET = 0.5


def _peer_case(s: Setup) -> Any:
    """The case as ``benchmarks.peers`` takes it, its blocks the single-module regions of
    memfit's every-block plan (torch's checkpoint wraps modules: a merged block such as a
    ResNet stem with its in-place ReLU, NOTE [merged blocks], is not one of them)."""
    from benchmarks.models import Case

    r = s.runner
    blocks = tuple(reg.modules[0] for reg in memfit.plan(s.prof, budget="100%", solver="every_block").regions
                   if len(reg.modules) == 1)
    return Case(r.case.name, r.case.description, r.base, r.inputs, r.case.loss_fn, blocks, hf=r.case.hf)


def _planned(s: Setup, name: str, budget: int, prof: Any = None) -> tuple[Method, dict[str, Any]]:
    """memfit's plan for ``budget`` bytes (of ``prof``, default the case's profile) applied to a
    fresh copy, and what it was."""
    plan, note = plan_at(s.prof if prof is None else prof, budget)
    model = memfit.apply(s.runner.fresh(), plan)
    return s.runner.method(name, model), {"budget_bytes": budget, "planned_at_bytes": plan.budget_bytes,
                                          "predicted_peak_bytes": plan.predicted_peak_bytes,
                                          "solver": plan.solver, "note": note}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _versus(peers: list[str], ours: str, peaks: dict[str, int], med: dict[str, float],
            plans: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"peer": p, "memfit": ours.format(p), "peer_peak_bytes": peaks[p],
             "memfit_peak_bytes": peaks.get(ours.format(p)), "peer_s": med.get(p),
             "memfit_s": med.get(ours.format(p)), "plan": plans.get(ours.format(p)),
             "memfit_over_peer": _ratio(med.get(ours.format(p)), med.get(p))} for p in peers]


def speed(s: Setup, fitted: dict[str, Method], fitted_peaks: dict[str, int], *, rounds: int,
          deadline: Deadline) -> dict[str, Any]:
    from benchmarks import peers

    pc = _peer_case(s)
    methods = {"every_block": peers.every_block(pc), "selective": peers.selective(pc)}
    peaks = {**fitted_peaks, **{n: s.runner.peak(m) for n, m in methods.items()}}
    plans: dict[str, Any] = {}
    for peer in list(methods):
        name = f"memfit@{peer}"
        methods[name], plans[name] = _planned(s, name, peaks[peer])
        peaks[name] = s.runner.peak(methods[name])
    timed = time_rounds(s.runner, {"plain": s.plain, **fitted, **methods}, rounds=rounds, deadline=deadline)
    med = timed["median_s"]
    return {**timed, "peaks": peaks, "over_plain": {n: _ratio(t, med["plain"]) for n, t in med.items()},
            "comparisons": _versus(["every_block", "selective"], "memfit@{}", peaks, med, plans)}


def offload(s: Setup, budget: int, *, rounds: int, deadline: Deadline) -> dict[str, Any]:
    """The planner's offload plan for ``budget`` bytes against recompute only at its peak."""
    if s.runner.device.type != "cuda":
        return {"skipped": "on a CPU: no host link (the planner makes offload a no-op there); "
                           "runs on a GPU only"}
    plan = memfit.plan(s.prof, budget=budget, offload=True, target=s.target)
    n_off = sum(p is memfit.OpPolicy.OFFLOAD for r in plan.regions for _, p in r.ops)
    model = memfit.apply(s.runner.fresh(), plan)
    off = s.runner.method("offload", model)
    row: dict[str, Any] = {"budget_bytes": budget, "target": s.target, "offloaded_ops": n_off,
                           "predicted_peak_bytes": plan.predicted_peak_bytes, "solver": plan.solver,
                           "offload": check_method(s, off)}
    rec, row["recompute"] = _planned(s, "recompute", row["offload"]["measured_peak_bytes"])
    row["recompute"]["measured_peak_bytes"] = s.runner.peak(rec)
    timed = time_rounds(s.runner, {"offload": off, "recompute": rec}, rounds=rounds, deadline=deadline)
    pool = host_pool(model)
    row.update(timed, host_peak_bytes=pool.peak_bytes if pool is not None else 0,
               offload_over_recompute=_ratio(timed["median_s"]["offload"], timed["median_s"]["recompute"]))
    return row


def _trainer(s: Setup, model: torch.nn.Module, inputs: tuple[Any, ...], steps: int) -> Callable[[], None]:
    """``steps`` AdamW steps of ``model`` on ``inputs`` (the output held through backward, as
    memfit's step holds it)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    loss_fn = s.runner.case.loss_fn

    def train() -> None:
        for _ in range(steps):
            with s.runner.autocast():
                out = model(*inputs)
                loss = loss_fn(out)
            loss.backward()
            del out
            opt.step()
            opt.zero_grad(set_to_none=True)
    return train


def _train(s: Setup, n: int, plan: Any, memory: Any, steps: int = 3) -> dict[str, Any]:
    """``steps`` AdamW steps at batch ``n`` with ``plan``: ran or ran out of memory, and the
    job's measured peak (CUDA: allocated, absolute; CPU: weights plus the meter's peak)."""
    case, device = s.runner.case, s.runner.device
    row: dict[str, Any] = {"batch": n, "solver": plan.solver,
                           "predicted_total_bytes": memory.total_bytes if memory else None,
                           "reserve_bytes": memory.reserve_bytes if memory else None}
    model: torch.nn.Module | None = None
    train: Callable[[], None] | None = None
    try:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        model = memfit.apply(case.build(device), plan)
        train = _trainer(s, model, case.inputs(device, n), steps)
        if device.type == "cuda":
            train()
            torch.cuda.synchronize(device)
            row.update(ran=True, job_peak_bytes=torch.cuda.max_memory_allocated(device),
                       reserved_peak_bytes=torch.cuda.max_memory_reserved(device))
        else:
            weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
            peak = memfit.measure(train, device=device, model=model).peak_bytes
            row.update(ran=True, job_peak_bytes=weights + peak)
        # the tolerance of every peak check (on a CPU, where nothing runs out of memory, this
        # is the check; on a GPU running at all is)
        row["within_device"] = row["job_peak_bytes"] <= s.card_bytes * (1 + PEAK_RTOL)
    except torch.OutOfMemoryError as e:
        row.update(ran=False, error=str(e).splitlines()[0][:200])
    finally:
        del model, train
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _fake_plan(s: Setup, n: int) -> tuple[Any, Any]:
    """The smallest plan for batch ``n`` from a fake-mode profile, and the job's breakdown with
    it on the device (for the batch over the top, which memfit says does not fit)."""
    case, meta = s.runner.case, torch.device("meta")
    with s.runner.autocast():
        prof = memfit.profile(case.build(meta), case.inputs(meta, n), loss_fn=case.loss_fn,
                              mode="fake", target=s.target)
    try:
        memory = memfit.plan(prof, device_memory=s.card_bytes, optimizer="adamw", budget="min").memory
    except InfeasibleBudget as e:
        memory = e.memory
    return memfit.plan(prof, budget="min"), memory


def largest_batch(s: Setup) -> dict[str, Any]:
    """``memfit.largest_batch`` for the device's memory with AdamW (fake-mode probes), then
    three AdamW steps at that batch with its plan, and at the next batch with its smallest
    plan (which memfit predicts does not fit)."""
    case, meta = s.runner.case, torch.device("meta")

    def make(n: int) -> tuple[Any, ...]:
        return case.build(meta), case.inputs(meta, n), case.loss_fn

    with s.runner.autocast():
        found = memfit.largest_batch(make, device_memory=s.card_bytes, optimizer="adamw",
                                     target=s.target)
    return {"device_memory_bytes": s.card_bytes, "batch": found.batch,
            "predicted_overhead": found.overhead, "probes": len(found.probes),
            "found": _train(s, found.batch, found.plan, found.plan.memory),
            "next": _train(s, found.batch + 1, *_fake_plan(s, found.batch + 1))}


def compiled(s: Setup, *, rounds: int, deadline: Deadline) -> dict[str, Any]:
    """``torch.compile``'s activation memory budget against memfit's plan for its measured
    peak, compiled (``benchmarks.compiled_memfit``), timed with the plain step."""
    from benchmarks import peers
    from benchmarks.compiled_memfit import compile_method
    from memfit.profiling.compiled_costs import for_compiler

    peer = peers.compiled(_peer_case(s), COMPILE_BUDGET)
    with s.runner.autocast():
        peers.warm_compiled(peer)
    if not peer.applicable:
        return {"error": peer.reason}
    peaks = {peer.name: s.runner.peak(peer)}
    # eager costs, and compiled costs (memfit.Search(compiled=True): NOTE [compiled costs])
    ours: dict[str, Method] = {}
    plans: dict[str, Any] = {}
    for prefix, prof in (("compiled_memfit", s.prof), ("compiled_memfit_cc", for_compiler(s.prof))):
        name = f"{prefix}@{peer.name}"
        eager, plans[name] = _planned(s, name, peaks[peer.name], prof)
        ours[name] = compile_method(eager)
        with s.runner.autocast():
            peers.warm_compiled(ours[name])
        if not ours[name].applicable:
            return {"peaks": peaks, "plans": plans, "error": ours[name].reason}
        peaks[name] = s.runner.peak(ours[name])
    timed = time_rounds(s.runner, {"plain": s.plain, peer.name: peer, **ours}, rounds=rounds,
                        deadline=deadline)
    return {**timed, "peaks": peaks,
            "compile_s": {n: m.info.get("first_call_s") for n, m in {peer.name: peer, **ours}.items()},
            "comparisons": [*_versus([peer.name], "compiled_memfit@{}", peaks, timed["median_s"], plans),
                            *_versus([peer.name], "compiled_memfit_cc@{}", peaks, timed["median_s"],
                                     plans)]}
