"""A profile's costs as ``torch.compile`` (inductor) runs the step, for a plan that a compiled
model will run (``memfit.Search(compiled=True)``).

NOTE [compiled costs]
    Under ``torch.compile`` memfit's plan decides what the compiled graph saves (NOTE
    [policies under torch.compile] in ``memfit.runtime.checkpoint_compiled``), but the
    seconds a recompute costs are not the eager profile's:

    1. Pointwise ops (``torch.Tag.pointwise``: adds, multiplies, activations, casts, dropout's
       scaling) fuse into the kernels of their producers or consumers, in the forward and in
       the compiled backward's recompute alike; rerunning one costs a re-read of its inputs
       where keeping it costs a read of its output. So they cost 0 s, forward and backward.
       This is also the compiler's own partitioner's view: it recomputes fusible pointwise
       chains for free, and a plan that pays memory to keep them fights it.
    2. No fixed charges: the compiled backward recomputes inside its graph, with no dispatch
       mode, no per-op policy call and no region wrapper at run time, so the charges of NOTE
       [dispatch overhead] (``region_s``, ``op_s``, ``selective_op_s``) are 0.
    3. Everything else keeps its profiled seconds (matmuls and convolutions run the same
       kernels; reductions such as softmax and norms fuse only partly).
    4. The time model is not fitted to timed eager steps (NOTE [calibration]): those time
       eager recompute, whose scales and charges are what (1) and (2) replace.
    5. Elementwise draws (:data:`FUSED_DRAWS`: dropout's ``bernoulli_`` on CPU, its
       ``native_dropout`` on CUDA) are generated inside the fused kernel that uses them, and
       the compiled backward of a region draws them again there from the RNG state it saved
       (the region's policy marks random ops MUST_RECOMPUTE, NOTE [policies under
       torch.compile]): they cost 0 s like (1), and no plan keeps a draw (NOTE [kept draws] in
       ``memfit.runtime.draws``, whose copy and charge a compiled region never makes:
       ``memfit.planning.rules.is_kept_draw`` is False here). Measured (torch 2.13, 2 cores,
       ``y = dropout(x * w, 0.1).sin() * w`` on 8M float32 elements, forward and backward,
       medians of 7): compiled 93.9 ms without a checkpoint, 85.2 ms with the region
       checkpointed and its dropout drawn again in the backward; eager 149.4 and 243.6 ms.
       Before, a compiled-cost plan of the peer harness's GPT (8 x 512, dropout 0.1) at the
       compiler's 0.5-budget peak kept 21 draws and was charged 10.3 ms of its 24.4 ms
       predicted recompute for copies a compiled region never makes.

    Memory stays the eager timeline's. Inductor's fusions only drop transients (a fused
    chain's intermediates are never allocated) and the graph saves what the plan saves, so the
    prediction bounds the compiled step's peak from above; the measured gap is in
    benchmarks/README.md (compiled memfit).

    The step time becomes the eager one less the share of its op seconds that (1) sets to 0:
    an estimate of the compiled step, the base of the plan's overhead.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from memfit.ops import KEPT_DRAW_OPS
from memfit.profiling.profile import COMPILED, OpRecord, Profile, is_for_compiler
from memfit.timemodel.calibration import Calibration, CalibrationSource

__all__ = ["COMPILED", "FUSED_DRAWS", "for_compiler", "is_for_compiler", "is_pointwise", "costs_like"]

log = logging.getLogger(__name__)

# draws inductor generates inside a fused kernel (NOTE [compiled costs], 5)
FUSED_DRAWS: frozenset[str] = frozenset({*KEPT_DRAW_OPS, "aten.native_dropout.default"})


@functools.cache
def is_pointwise(name: str) -> bool:
    """Whether the aten overload ``name`` (``"aten.mul.Tensor"``) is tagged pointwise.

    Example:
        >>> is_pointwise("aten.gelu.default"), is_pointwise("aten.mm.default")
        (True, False)
    """
    parts = name.split(".")
    if len(parts) not in (2, 3):
        return False
    namespace, op, overload = parts if len(parts) == 3 else (*parts, "default")
    try:
        overload_fn = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        return False
    return torch.Tag.pointwise in getattr(overload_fn, "tags", ())


def for_compiler(profile: Profile) -> Profile:
    """``profile`` with the costs of NOTE [compiled costs]; memory and ops unchanged.

    Idempotent: a profile that already carries compiled costs is returned as it is.

    Example:
        >>> import memfit
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
        >>> p = for_compiler(memfit.profile(m, torch.randn(4, 8), calibrate_time=False))
        >>> [op.time_s for op in p.ops if op.name == "aten.gelu.default"]
        [0.0]
    """
    if is_for_compiler(profile):
        return profile
    fused = 0.0
    ops: list[OpRecord] = []
    for op in profile.ops:
        if op.time_s and (is_pointwise(op.name) or op.name in FUSED_DRAWS):
            fused += op.time_s
            op = dataclasses.replace(op, time_s=0.0)
        ops.append(op)
    cal = profile.calibration if profile.calibration is not None else Calibration()
    charges_off = dataclasses.replace(
        cal, region_s=0.0, op_s=0.0, selective_op_s=0.0,
        matmul_scale=1.0, other_scale=1.0, source=CalibrationSource.DEFAULT, fitted=(), measurements=(), charges_measured=(),
        reason="compiled costs (NOTE [compiled costs]): profiled seconds, pointwise ops and "
               "per-op and per-region charges 0 s")
    total = fused + sum(op.time_s for op in ops)
    step_s = profile.step_time_s * (1.0 - fused / total) if total > 0 else profile.step_time_s
    log.info("compiled costs: %.1f ms of pointwise ops fused, step %.1f -> %.1f ms",
             fused * 1e3, profile.step_time_s * 1e3, step_s * 1e3)
    return dataclasses.replace(profile, ops=tuple(ops), calibration=charges_off, step_time_s=step_s,
                               extra={**profile.extra, "costs": COMPILED, "fused_pointwise_s": fused})


def costs_like(profile: Profile, first: Profile) -> Profile:
    """``profile`` (the same step on other inputs) with ``first``'s time model: its
    calibration, and compiled costs where ``first`` has them."""
    if first.calibration is not None:
        profile = dataclasses.replace(profile, calibration=first.calibration)
    return for_compiler(profile) if is_for_compiler(first) else profile
