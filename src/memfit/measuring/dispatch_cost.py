"""The fixed seconds checkpointing costs on this machine, measured on a step made for it.

NOTE [measured dispatch charges]
    Beyond the ops a plan reruns, the time model charges per checkpointed call
    (``region_s``), per forward op of a checkpointed region (``op_s``) and per forward op of a
    region in selective mode (``selective_op_s``; NOTE [calibration] in
    ``memfit.timemodel``). These are host-side work that does not depend on the
    model: torch's checkpoint packs and unpacks every saved tensor through Python hooks, the
    selective mode's two dispatch modes see every op in forward and again in the recompute,
    memfit's policy is asked about every op. They depend on the machine, the interpreter and
    the torch build, so they are measured here, through memfit's own runtime, on a synthetic
    step whose ops cost almost nothing themselves: ``k`` blocks of ``n`` multiplications of
    8-element tensors, each saving one tensor for backward. Each shape runs plain,
    checkpointed (``memfit.checkpoint``, no policy: torch's plain checkpoint) and in selective
    mode (the recompute-all policy), in interleaved rounds; medians decide. With ``d`` the
    extra seconds of a checkpointed step over the plain one and ``f`` the forward seconds of
    one op (which the model already counts as the op's rerun)::

        d_ckpt(k, n) = k * region_s + k * n * (op_s + f)
        d_sel(k, n) - d_ckpt(k, n) = k * n * selective_op_s

    Two shapes with the same ``k * n`` (many short blocks, few long ones) separate
    ``region_s`` from ``op_s``. Measured on the 2-core CPU this project is built on, torch
    2.13: ``op_s`` 14-33 us and ``selective_op_s`` 30-49 us per op (one or two saved tensors
    per op), against the model's 15.3 us constants (``DEFAULT_OP_S``,
    ``DEFAULT_SELECTIVE_OP_S``): the selective charge was under-counted by 2-3x, which made
    selective plans look cheaper than they ran. A value outside ``[0, 16 x default]``
    (timing noise larger than what it measures) keeps the default, and the result says so.
    On a CUDA device the host work overlaps the kernels (NOTE [host overhead on an async
    device] in ``memfit.planning``): nothing is measured there and the defaults stay.
    The same call times what keeping a draw costs per element (``keep_s_per_element``, NOTE
    [kept draws] in ``memfit.runtime.draws``): the copy ``x != 0`` and the write back
    ``x.copy_(kept)`` of a 1M-element float tensor, medians of the same rounds.
"""

from __future__ import annotations

import functools
import gc
import logging
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from memfit.timemodel.calibration import (
    DEFAULT_KEEP_S_PER_ELEMENT,
    DEFAULT_OP_S,
    DEFAULT_REGION_S,
    DEFAULT_SELECTIVE_OP_S,
)

__all__ = ["DispatchCharges", "measure_dispatch_charges", "SHAPES", "ROUNDS"]

log = logging.getLogger(__name__)

SHAPES = ((16, 8), (2, 64))  # (blocks, ops per block): same op count, 8x the calls
_KEEP_ELEMENTS = 1 << 20  # a dropout mask's size (NOTE [kept draws] in memfit.runtime.draws)
ROUNDS = 7
_PLAUSIBLE = 16.0  # a measured charge above this many times its default is noise


@dataclass(frozen=True)
class DispatchCharges:
    """The fixed charges of NOTE [measured dispatch charges], seconds.

    Attributes:
        region_s, op_s, selective_op_s, keep_s_per_element: as ``Calibration`` names them.
        measured: which were measured (the others are the defaults).
        reason: why any was not (empty when all were).
    """

    region_s: float = DEFAULT_REGION_S
    op_s: float = DEFAULT_OP_S
    selective_op_s: float = DEFAULT_SELECTIVE_OP_S
    keep_s_per_element: float = DEFAULT_KEEP_S_PER_ELEMENT
    measured: tuple[str, ...] = ()
    reason: str = ""


class _Mul(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.w = torch.full((8,), 1.0001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        for _ in range(self.n):
            x = x * w  # saves w for backward: one packed tensor per op
        return x


def measure_dispatch_charges(device: torch.device | str = "cpu", *, rounds: int = ROUNDS) -> DispatchCharges:
    """Measure the fixed charges on ``device`` (NOTE [measured dispatch charges]), once per
    process and device (they are the machine's, not a model's).

    Takes about 1.3 s on a 2-core CPU. Autograd state, RNG and the caller's tensors are not
    touched; nothing of the synthetic step outlives the call.

    Example:
        >>> c = measure_dispatch_charges()
        >>> c.op_s > 0
        True
    """
    return _measured(torch.device(device).type, rounds)


@functools.lru_cache(maxsize=4)
def _measured(device_type: str, rounds: int) -> DispatchCharges:
    from memfit.runtime.checkpoint import run_region
    from memfit.runtime.policies import recompute_all

    if device_type != "cpu":
        return DispatchCharges(reason=f"not measured on {device_type}: host work overlaps the device's")
    dev = torch.device(device_type)
    sel_policy = recompute_all()

    def step(blocks: list[_Mul], x: torch.Tensor, mode: str) -> float:
        t0 = time.perf_counter()
        h = x
        for b in blocks:
            if mode == "plain":
                h = b(h)
            else:
                h = run_region(b, (h,), {}, policy=sel_policy if mode == "selective" else None,
                               check=None, name="dispatch-cost", modules=(b,), watch_buffers=False)
        h.sum().backward()
        return time.perf_counter() - t0

    def forward_per_op(blocks: list[_Mul], x: torch.Tensor) -> float:
        t0 = time.perf_counter()
        h = x
        for b in blocks:
            h = b(h)
        dt = time.perf_counter() - t0
        del h
        return dt

    modes = ("plain", "checkpoint", "selective")
    setups = []
    for k, n in SHAPES:
        blocks = [_Mul(n) for _ in range(k)]
        x = torch.ones(8, device=dev, requires_grad=True)
        setups.append((k, n, blocks, x))
    times: dict[tuple[int, str], list[float]] = {(i, m): [] for i in range(len(setups)) for m in modes}
    fwd: list[float] = []
    drawn = torch.ones(_KEEP_ELEMENTS, device=dev)
    keep: list[float] = []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds + 1):  # round 0 warms up and is not counted
            for i, (k, n, blocks, x) in enumerate(setups):
                for j in range(len(modes)):
                    mode = modes[(r + j) % len(modes)]
                    t = step(blocks, x, mode)
                    if r:
                        times[(i, mode)].append(t)
                if r:
                    fwd.append(forward_per_op(blocks, x) / (k * n))
            t0 = time.perf_counter()
            drawn.copy_(torch.ne(drawn, 0))  # NOTE [kept draws]: the copy and its write back
            if r:
                keep.append((time.perf_counter() - t0) / _KEEP_ELEMENTS)
    finally:
        if was_enabled:
            gc.enable()
    med = {key: statistics.median(v) for key, v in times.items()}
    f = statistics.median(fwd)
    (k1, n1, *_), (k2, n2, *_) = setups
    d1 = med[(0, "checkpoint")] - med[(0, "plain")]
    d2 = med[(1, "checkpoint")] - med[(1, "plain")]
    region = (d1 - d2) / (k1 - k2)
    op = (d1 - k1 * region) / (k1 * n1) - f
    sel = statistics.mean([(med[(i, "selective")] - med[(i, "checkpoint")]) / (k * n)
                           for i, (k, n, *_) in enumerate(setups)])
    return _checked(region, op, sel, statistics.median(keep))


def _checked(region: float, op: float, sel: float, keep: float | None = None) -> DispatchCharges:
    """Keep each measured charge that is plausible; the default otherwise, saying why
    (``keep``: None when not measured)."""
    got: dict[str, float] = {}
    bad = []
    charges = [("region_s", region, DEFAULT_REGION_S), ("op_s", op, DEFAULT_OP_S),
               ("selective_op_s", sel, DEFAULT_SELECTIVE_OP_S)]
    if keep is not None:
        charges.append(("keep_s_per_element", keep, DEFAULT_KEEP_S_PER_ELEMENT))
    for name, value, default in charges:
        if 0.0 <= value <= _PLAUSIBLE * default:
            got[name] = value
        else:
            bad.append(f"{name} {value * 1e6:.1f} us")
    reason = f"implausible (timing noise?), defaults kept: {', '.join(bad)}" if bad else ""
    if bad:
        log.info("dispatch charges: %s", reason)
    return DispatchCharges(measured=tuple(got), reason=reason, **got)
