"""What a rerun costs in a compiled XLA step: which equations XLA fuses, and the time model.

NOTE [XLA's costs]
    memfit's recompute time model was made for torch's eager checkpoint (NOTE [calibration]
    in ``memfit.timemodel``): an op reruns at its own kernel's time, plus fixed charges for
    the Python work of each region and each op. A jitted JAX step has neither:
    1. no host work per region or per op: the calibration's fixed charges (``region_s``,
       ``op_s``, ``selective_op_s``) are 0 s;
    2. XLA fuses elementwise chains, reductions and data movement into the kernels of their
       readers, so a rerun elementwise equation costs its arithmetic only (its FLOPs at the
       device's peak: no bytes of its own are read or written), while the equations XLA
       does not fuse (``UNFUSED``: dots, convolutions, windowed reductions, gathers and
       scatters, sorts, scans) cost their roofline time, as in the eager model;
    3. only an unfused equation's outputs may be saved inside a region (``saveable``):
       saving a fused value makes XLA write it out of its fusion in the forward and read it
       back in the backward, which costs more than rerunning it. Measured on the GPT of
       ``memfit.jax.models`` (2026-12-06, CPU): with every value saveable and elementwise
       reruns priced as fused, the plans saved elementwise values and ran at 1.07x the step
       of ``dots_saveable`` for 402 M against 401 M FLOPs. JAX's own ``dots_saveable`` is
       this rule with no choice of which dots.
    4. regions are closed (NOTE [inputs read after a region] in ``memfit.planning.rules``):
       XLA rounds a rerun LayerNorm apart from its forward where the region's input is read
       after the region, and gradients must be bitwise.
    Before this model (the eager charges), the solver priced ``dots_saveable`` on every
    block at +23 ms of recompute on a 7.7 ms step and reran matmuls instead (+64 M FLOPs
    where the policy reran +8 M, at the same XLA peak).
"""

from __future__ import annotations

from memfit.timemodel.calibration import Calibration
from memfit.timemodel.devices import DevicePreset, op_time_s

__all__ = ["UNFUSED", "CALIBRATION", "rerun_time_s", "saveable", "unbatched_dot"]

UNFUSED = frozenset({
    "dot_general", "conv_general_dilated",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
    "select_and_scatter_add", "select_and_gather_add",
    "gather", "scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter-min", "scatter-max",
    "sort", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
    "scan", "while", "cond", "custom_call",
})

# rule 1: no fixed charges in a compiled step
CALIBRATION = Calibration(region_s=0.0, op_s=0.0, selective_op_s=0.0)


def rerun_time_s(primitive: str, flops: int, bytes_moved: int, dtype: str, device: DevicePreset) -> float:
    """Seconds one equation costs when rerun (rule 2): its roofline time if XLA does not fuse
    it, else its FLOPs at the device's peak.

    Example:
        >>> from memfit.timemodel.devices import preset
        >>> rerun_time_s("add", 1000, 12000, "float32", preset("cpu")) == 1000 / preset("cpu").fp32_flops_per_s
        True
    """
    if primitive in UNFUSED:
        return op_time_s(flops, bytes_moved, dtype, device)
    return flops / device.peak_for(dtype)


def saveable(primitive: str) -> bool:
    """Whether a region may save this equation's outputs (rule 3)."""
    return primitive in UNFUSED


def unbatched_dot(primitive: str, params: dict) -> bool:
    """Whether the equation is a ``dot_general`` without batch dimensions: what JAX's
    ``dots_with_no_batch_dims_saveable`` saves."""
    if primitive != "dot_general":
        return False
    _, (lhs_batch, rhs_batch) = params["dimension_numbers"]
    return not lhs_batch and not rhs_batch
