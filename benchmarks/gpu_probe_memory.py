"""``benchmarks.gpu_probe``'s memory runs on the GPU (torch only): per-op allocator traces
(``trace``: each op's kernel temporaries) and whole training steps with AdamW (``job``)."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from benchmarks.gpu_probe_cases import Case, OpTimes, checkpoint_regions, peak_bytes, train_step


class _MemTrace:
    """After every aten op of a step: bytes allocated above the step's start, and the most
    allocated while the op ran (its kernels' own temporaries included)."""

    def __init__(self, device: torch.device, base: int) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.rows: list[tuple[str, str, int, int]] = []
        self.phase = "forward"
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                torch.cuda.reset_peak_memory_stats(device)
                out = func(*args, **(kwargs or {}))
                outer.rows.append((str(func), outer.phase, torch.cuda.memory_allocated(device) - base,
                                   torch.cuda.max_memory_allocated(device) - base))
                return out

        self.mode = Mode()


def trace_case(case: Case, device: torch.device, settings: dict[str, bool]) -> dict[str, Any]:
    """One plain step of ``case`` under ``_MemTrace``, with torch backend ``settings``."""
    flags = {"cudnn_tf32": lambda v: setattr(torch.backends.cudnn, "allow_tf32", v),
             "cudnn_sdp": torch.backends.cuda.enable_cudnn_sdp}
    for k, v in settings.items():
        flags[k](v)
    model = case.build(device)
    torch.manual_seed(1)
    inputs = case.inputs(device)
    for _ in range(2):
        train_step(case, model, inputs)
        for p in model.parameters():
            p.grad = None
    gc.collect()
    torch.cuda.synchronize(device)
    peak = peak_bytes(lambda: train_step(case, model, inputs), model, device)
    for p in model.parameters():
        p.grad = None
    gc.collect()
    torch.cuda.synchronize(device)
    tr = _MemTrace(device, torch.cuda.memory_allocated(device))
    with tr.mode:
        loss = case.loss_fn(model(*inputs))
        tr.phase = "backward"
        loss.backward()
    steps = []
    for _ in range(5):
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize(device)
        s = time.perf_counter()
        train_step(case, model, inputs)
        torch.cuda.synchronize(device)
        steps.append(time.perf_counter() - s)
    timer = OpTimes(device)
    for p in model.parameters():
        p.grad = None
    with timer.mode:
        loss = case.loss_fn(model(*inputs))
        timer.phase = "backward"
        loss.backward()
    row = {"case": case.name, "settings": settings, "peak_bytes": peak, "step_s": statistics.median(steps),
           "trace": tr.rows, "ops": timer.seconds()}
    for k in settings:  # back to torch's defaults
        flags[k](True)
    gc.collect()
    torch.cuda.empty_cache()
    return row


def job_case(case: Case, regions: list[list[str]], device: torch.device, steps: int) -> dict[str, Any]:
    """Whole training steps (forward, backward, AdamW step, zero_grad(set_to_none=True)) of
    ``case``, plain and every-block, each in a fresh process state: the allocator's peak with
    the model's weights, gradients and AdamW states in it, the caching allocator's reserved
    peak, and what ``mem_get_info`` shows in use at the end (the CUDA context included)."""
    from benchmarks.gpu_fake_check import _context

    row: dict[str, Any] = {"case": case.name}
    for name in ("plain", "every_block"):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        model = case.build(device)
        if name == "every_block":
            checkpoint_regions(model, regions)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch.manual_seed(1)
        inputs = case.inputs(device)
        for _ in range(steps):
            train_step(case, model, inputs)
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        row[name] = {"allocated_peak_bytes": torch.cuda.max_memory_allocated(device) - start,
                     "reserved_peak_bytes": torch.cuda.max_memory_reserved(device),
                     "context": _context(device), "steps": steps}
        del model, opt, inputs
    gc.collect()
    torch.cuda.empty_cache()
    return row
