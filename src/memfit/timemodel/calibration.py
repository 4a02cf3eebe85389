"""The recompute time model: its parameters, their defaults, and fitting them to timed steps.

Torch-free (numpy; scipy when fitting), read by all three stages: a ``Profile`` carries its
``Calibration``, the planner predicts with it, ``memfit.measuring.calibration`` fits it.

NOTE [calibration]
    A plan's recompute seconds are predicted as a sum over what it reruns (``TimeTerms``)::

        matmul_scale * M + other_scale * O + region_s * R + op_s * N + selective_op_s * S

    ``M`` and ``O``: the profiled forward seconds of the matmul-like ops (matmuls and
    convolutions, ``memfit.planning.rules.is_matmul``) and of the other ops the plan reruns;
    ``R``: checkpointed regions; ``N``: forward ops of those regions; ``S``: forward ops of the
    regions that save some op (selective-checkpoint dispatch modes). The defaults (scales 1,
    the fixed charges of NOTE [region overhead] and NOTE [dispatch overhead], below) are the model as it was before calibration: an op reruns in
    its forward time plus constants measured once on one machine.

    Measured, a rerun op costs more than its forward time (torch's checkpoint and selective
    dispatch modes see every op, caches are cold, the recompute allocates again), and by a
    different factor for a large matmul than for a cheap elementwise op. ``fit_calibration``
    takes the measured extra seconds of a few plans (the step time minus the plain step's)
    and solves for the parameters by non-negative least squares, as multipliers of their
    default contributions. It fits only what the measurements determine: parameters are
    freed in the order of ``FIT_ORDER`` while each adds to the rank of the system, the others
    stay at their defaults (fitted scales absorb what those miss). Two plans (every block
    recomputed; every block saving its matmuls) determine the two scales; when their
    matmul and other columns are not independent (nothing saved, or no matmul) the two
    scales are fitted as one. A fit whose scale leaves ``SCALE_BOUNDS`` (noise larger than the
    recompute it measures) is rejected: the defaults stay, and ``reason`` says why.
    The fixed charges the fit holds are measured on the machine first where they can be
    (NOTE [measured dispatch charges] in ``memfit.measuring.dispatch_cost``; ``charges_measured``
    names them, and a measured charge is never refitted from the plans' steps, whose noise
    is larger than it): on this project's 2-core CPU the selective charge is about 42 us per op, not
    the default 15.3 us.
    Separating the two scales rests on the *difference* of two measured steps, so it is
    only as good as their noise: with one counted step per plan, three benchmark runs of the
    zoo GPT fitted (matmul, other) = (1.74, 0.65), (0.97, 0.97) and (0.89, 1.32) where 5
    interleaved rounds measure about (0.80, 0.97), and plans changed from run to run.
    ``fit_calibration(..., separate_scales=False)`` fits one common scale for all ops (its
    error is that of a sum of both steps, about a fifth of the difference's here);
    ``memfit.measuring.calibration`` separates them only when each plan was timed at least twice and
    every plan's counted steps agree within ``SEPARATE_SPREAD`` of its step.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_REGION_S",
    "DEFAULT_OP_S",
    "DEFAULT_SELECTIVE_OP_S",
    "DEFAULT_KEEP_S_PER_ELEMENT",
    "FIT_ORDER",
    "SCALE_BOUNDS",
    "SEPARATE_SPREAD",
    "CalibrationSource",
    "TimeTerms",
    "TimedPlan",
    "Calibration",
    "fit_calibration",
]

log = logging.getLogger(__name__)

# The fixed charges before calibration: powers of two, so that sums of dyadic test times stay
# exact; the defaults of every profile's calibration, which replaces them when fitted.

# NOTE [region overhead] Each checkpointed call costs time beyond the ops it reruns: torch's
# checkpoint frame, its saved-tensor hooks and memfit's policy and check modes. Measured on
# this project's 2-core CPU machine (2026-11-30, torch 2.13): 250-380 us per region per step
# for 20 wrapped Linear+Tanh blocks. Counting it makes the solvers prefer fewer, larger regions
# where a tiny one (a lone LayerNorm or Dropout) would save almost nothing. 2**-12 s (244 us).
DEFAULT_REGION_S = 2.0**-12

# NOTE [dispatch overhead] Checkpointed regions also pay per op, in Python: the divergence
# check (memfit.runtime.divergence) records every forward op of a region and compares every
# replayed one, and a region that saves ops runs torch's selective-checkpoint dispatch modes,
# which see every op of both passes. Measured on this project's 2-core CPU machine
# (2026-11-30, torch 2.13, a region of 200 tiny ops, per forward op of the region, forward
# plus replay): check +17.8 us, selective modes +21.4 us without the check and +13.9 us on top
# of it. Modelled as 2**-16 s (15.3 us) per forward op for each: DEFAULT_OP_S for every
# region (apply's default check=True), DEFAULT_SELECTIVE_OP_S when the region saves any op.
# The second is a fixed charge, paid once per region whatever the number of saved ops: the
# solvers weigh it against the recompute that saving ops avoids (a block of 60 ops pays
# about 0.9 ms). All three charges are host time: on an async device they may hide behind the
# device's work (NOTE [host overhead on an async device] in memfit.planning.hosttime).
DEFAULT_OP_S = 2.0**-16
DEFAULT_SELECTIVE_OP_S = 2.0**-16
# Seconds per element a kept draw costs (NOTE [kept draws] in memfit.runtime.draws): its copy
# in forward (``tensor != 0``) and the write back in the replay. Measured on this project's
# 2-core CPU (torch 2.13, 1M float elements): 0.56 ms + 0.34 ms, 0.9 ns per element; 2**-30 s.
DEFAULT_KEEP_S_PER_ELEMENT = 2.0**-30

# Parameters in the order a fit frees them (NOTE [calibration]): the op scales carry almost
# all of a real model's recompute; the fixed charges are a few percent of it.
FIT_ORDER = ("matmul_scale", "other_scale", "selective_op_s", "op_s", "region_s")
_TERM_OF = {"matmul_scale": "matmul_s", "other_scale": "other_s", "region_s": "regions",
            "op_s": "ops", "selective_op_s": "selective_ops"}
# A fitted scale outside these is noise, not a measurement (NOTE [calibration]).
SCALE_BOUNDS = (0.5, 4.0)
# counted steps of each plan must agree within this share of its step to separate the scales
SEPARATE_SPREAD = 0.02
_RANK_TOL = 1e-9


class CalibrationSource(str, enum.Enum):
    DEFAULT = "default"  # today's constants (no measurement, or a rejected one)
    FIT = "fit"          # fitted to timed steps of this model


@dataclass(frozen=True)
class TimeTerms:
    """What a plan reruns, in the units of the time model (NOTE [calibration]).

    Attributes:
        matmul_s: profiled forward seconds of the matmul-like ops it reruns.
        other_s: profiled forward seconds of the other ops it reruns.
        regions: checkpointed regions.
        ops: forward ops of those regions.
        selective_ops: forward ops of the regions that save some op.
    """

    matmul_s: float = 0.0
    other_s: float = 0.0
    regions: int = 0
    ops: int = 0
    selective_ops: int = 0

    def vector(self) -> np.ndarray:
        return np.array([float(getattr(self, _TERM_OF[p])) for p in FIT_ORDER], dtype=np.float64)


@dataclass(frozen=True)
class TimedPlan:
    """One measured plan: what it reruns and the seconds it added to the plain step."""

    name: str
    terms: TimeTerms
    extra_s: float
    step_s: float = 0.0


@dataclass(frozen=True)
class Calibration:
    """The recompute time model of one profile (NOTE [calibration]); the defaults are the
    uncalibrated model.

    Example:
        >>> Calibration().recompute_s(TimeTerms(matmul_s=0.5, other_s=0.25))
        0.75
    """

    matmul_scale: float = 1.0
    other_scale: float = 1.0
    region_s: float = DEFAULT_REGION_S
    op_s: float = DEFAULT_OP_S
    selective_op_s: float = DEFAULT_SELECTIVE_OP_S
    keep_s_per_element: float = DEFAULT_KEEP_S_PER_ELEMENT  # not fitted: measured or default
    source: CalibrationSource = CalibrationSource.DEFAULT
    reason: str = ""
    fitted: tuple[str, ...] = ()
    measurements: tuple[TimedPlan, ...] = field(default=(), compare=False)
    charges_measured: tuple[str, ...] = ()  # fixed charges measured on this machine

    def params(self) -> np.ndarray:
        return np.array([float(getattr(self, p)) for p in FIT_ORDER], dtype=np.float64)

    def recompute_s(self, terms: TimeTerms) -> float:
        """Predicted recompute seconds of a plan that reruns ``terms``."""
        return float(terms.vector() @ self.params())

    @classmethod
    def default(cls, reason: str) -> Calibration:
        """The uncalibrated model, saying why (fake mode, too few measurements...)."""
        return cls(reason=reason)

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "matmul_scale": self.matmul_scale, "other_scale": self.other_scale,
            "region_s": self.region_s, "op_s": self.op_s, "selective_op_s": self.selective_op_s,
            "keep_s_per_element": self.keep_s_per_element, "source": self.source.value, "reason": self.reason, "fitted": list(self.fitted),
            "charges_measured": list(self.charges_measured),
            "measurements": [{"name": m.name, "terms": vars(m.terms), "extra_s": m.extra_s,
                              "step_s": m.step_s} for m in self.measurements],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        """Raises KeyError, TypeError or ValueError on a malformed record (the Profile
        reader turns them into ``SchemaError``)."""
        return cls(
            matmul_scale=float(data["matmul_scale"]), other_scale=float(data["other_scale"]),
            region_s=float(data["region_s"]), op_s=float(data["op_s"]),
            selective_op_s=float(data["selective_op_s"]), source=CalibrationSource(data["source"]),
            keep_s_per_element=float(data.get("keep_s_per_element", DEFAULT_KEEP_S_PER_ELEMENT)),
            reason=str(data.get("reason", "")), fitted=tuple(data.get("fitted", ())),
            charges_measured=tuple(data.get("charges_measured", ())),
            measurements=tuple(TimedPlan(m["name"], TimeTerms(**m["terms"]), float(m["extra_s"]),
                                         float(m.get("step_s", 0.0)))
                               for m in data.get("measurements", ())),
        )


def fit_calibration(measurements: Sequence[TimedPlan], *,
                    prior: Calibration | None = None, separate_scales: bool = True,
                    hold: Sequence[str] = ()) -> Calibration:
    """Fit the time model to measured plans (NOTE [calibration]).

    Args:
        measurements: plans with what they rerun and the seconds they added to the plain step.
        prior: the values of the parameters the measurements do not determine (default: the
            uncalibrated model).
        separate_scales: fit the matmul and other scales apart where the measurements
            determine both (default); False: one common scale (NOTE [calibration]).
        hold: parameters kept at ``prior``'s values even where the measurements determine
            them (the fixed charges measured on the machine: NOTE [measured dispatch
            charges] in ``memfit.measuring.dispatch_cost``).

    Returns:
        A fitted :class:`Calibration` (``source`` ``"fit"``, ``fitted`` naming what was fitted),
        or ``prior``'s values with ``source`` ``"default"`` and the reason when the
        measurements determine nothing or the fit is implausible.

    Example:
        >>> eb = TimedPlan("every_block", TimeTerms(matmul_s=0.2, other_s=0.1), extra_s=0.5)
        >>> sm = TimedPlan("save_matmuls", TimeTerms(other_s=0.1), extra_s=0.2)
        >>> c = fit_calibration([eb, sm], prior=Calibration(region_s=0, op_s=0, selective_op_s=0))
        >>> round(c.matmul_scale, 6), round(c.other_scale, 6)
        (1.5, 2.0)
    """
    base = prior if prior is not None else Calibration()
    base = replace(base, source=CalibrationSource.DEFAULT, fitted=(), measurements=tuple(measurements))
    if not measurements:
        return replace(base, reason="no timed plans")
    a = np.stack([m.terms.vector() for m in measurements]) * base.params()  # seconds under prior
    b = np.array([m.extra_s for m in measurements], dtype=np.float64)
    held = tuple(FIT_ORDER.index(h) for h in hold if h in FIT_ORDER)
    groups = [g for g in _free_groups(a, separate_scales, held) if not set(g) & set(held)]
    if not groups:
        return replace(base, reason="the timed plans rerun nothing: no parameter is determined")
    values, bad = _solve(a, b, base.params(), groups)
    if bad and len(groups[0]) == 1:  # two scales out of bounds: one common scale, by least squares
        log.info("calibration: %s out of bounds; fitting one scale for all ops", ", ".join(bad))
        groups = [(0, 1)]
        values, bad = _solve(a, b, base.params(), groups)
    if bad:
        lo, hi = SCALE_BOUNDS
        reason = (f"fit rejected: {', '.join(bad)} outside [{lo}, {hi}] (measured extra seconds "
                  f"{[round(float(v), 6) for v in b]}: timing noise larger than the recompute?)")
        log.info("calibration: %s; keeping the default time model", reason)
        return replace(base, reason=reason)
    mm, other, sel, op, region = (float(v) for v in values)  # FIT_ORDER
    return replace(base, source=CalibrationSource.FIT, reason="", matmul_scale=mm, other_scale=other,
                   selective_op_s=sel, op_s=op, region_s=region,
                   fitted=tuple(FIT_ORDER[i] for g in groups for i in g))


def _solve(a: np.ndarray, b: np.ndarray, prior: np.ndarray, groups: list[tuple[int, ...]]
           ) -> tuple[np.ndarray, list[str]]:
    """NNLS for one multiplier per group (the rest held at the prior): the parameter values,
    and the fitted scales outside ``SCALE_BOUNDS``."""
    from scipy.optimize import nnls

    held = np.ones(a.shape[1], dtype=bool)
    for g in groups:
        held[list(g)] = False
    cols = np.stack([a[:, list(g)].sum(axis=1) for g in groups], axis=1)
    x, _ = nnls(cols, b - a[:, held].sum(axis=1))
    mult = np.ones(a.shape[1])
    for g, v in zip(groups, x, strict=True):
        mult[list(g)] = v
    values = prior * mult
    lo, hi = SCALE_BOUNDS
    free = {i for g in groups for i in g}
    bad = [f"{FIT_ORDER[i]} {values[i]:.3g}" for i in (0, 1) if i in free and not lo <= values[i] <= hi]
    return values, bad


def _free_groups(a: np.ndarray, separate_scales: bool = True, held: Sequence[int] = ()) -> list[tuple[int, ...]]:
    """Parameter groups to fit, one multiplier each, in ``FIT_ORDER`` while each adds rank;
    the two scales as one group when their columns are not independent."""
    norm = np.linalg.norm(a, axis=0)
    unit = np.divide(a, norm, out=np.zeros_like(a), where=norm > 0)

    def rank(groups: list[tuple[int, ...]]) -> int:
        if not groups:
            return 0
        m = np.stack([unit[:, list(g)].sum(axis=1) for g in groups], axis=1)
        return int(np.linalg.matrix_rank(m, tol=_RANK_TOL * max(1.0, float(np.abs(m).max()))))

    scales: list[tuple[int, ...]] = [(0,), (1,)]
    if not separate_scales or rank(scales) < 2:
        scales = [(0, 1)]
    out: list[tuple[int, ...]] = []
    for g in [*scales, *((i,) for i in range(2, a.shape[1]) if i not in held)]:
        if norm[list(g)].max() == 0:
            continue
        if rank([*out, g]) > len(out):
            out.append(g)
    return out
