"""Predict the peak memory and recompute time of a plan from a Profile, without running it.

The model of what checkpointing does to each storage is NOTE [region memory model] in
``memfit.planning.effects``. ``simulate(profile, Plan(regions=()))`` reproduces
``profile.live_bytes`` exactly (kernel workspaces included).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memfit.planning.effects import (
    ProfileArrays,
    RegionModel,
    dense,
    resolve_span,
)
from memfit.planning.plan import Plan, Region
from memfit.planning.rules import keys_to_ops
from memfit.profiling.profile import Profile

__all__ = ["Simulation", "simulate"]


@dataclass(frozen=True)
class Simulation:
    """What a plan is predicted to do to one step.

    Attributes:
        peak_bytes: peak activation memory (the maximum of ``live_bytes``).
        recompute_s: seconds of forward ops rerun in backward, plus the fixed cost of each
            checkpointed region (NOTE [region overhead] and NOTE [dispatch overhead] in
            ``memfit.planning.effects``).
        live_bytes: activation memory at each point of the step: one entry per op position
            and, just before a region's recompute point, one entry per replayed op.
        positions: for each entry of ``live_bytes``, the op position it belongs to (a replay
            entry belongs to the recompute point it precedes).
        peak_at: the op position of the peak (for a replay entry, its recompute point).
        region_recompute_s: per region of the plan, its recompute seconds.
        region_saved_bytes: per region, bytes it holds from forward to backward (outputs of
            saved ops plus the region's inputs, held for the replay).
        recompute_points: per region, its recompute point (``None``: nothing to recompute).
    """

    peak_bytes: int
    recompute_s: float
    live_bytes: tuple[int, ...]
    positions: tuple[int, ...]
    peak_at: int
    region_recompute_s: tuple[float, ...] = ()
    region_saved_bytes: tuple[int, ...] = ()
    recompute_points: tuple[int | None, ...] = ()


def region_models(profile: Profile, arrs: ProfileArrays,
                  regions: tuple[Region, ...]) -> list[tuple[RegionModel, list[int]]]:
    """Resolve regions to models and saved op indices; reject nested or overlapping ones."""
    index = {m.path: k for k, m in enumerate(profile.modules)}
    out = []
    for r in regions:
        span = resolve_span(profile, r.modules, index)
        rm = RegionModel(arrs, span)
        saved = keys_to_ops(profile, span.first_op, span.last_op, r.save, r.name)
        out.append((rm, saved))
    spans = sorted(((rm.a, rm.b, rm.span.name) for rm, _ in out))
    for (a0, b0, n0), (a1, b1, n1) in zip(spans, spans[1:], strict=False):
        if a1 <= b0:
            raise ValueError(
                f"regions {n0!r} (ops {a0}..{b0}) and {n1!r} (ops {a1}..{b1}) overlap or nest; "
                "a plan's regions must be disjoint (checkpoint the outer one, or the inner ones)"
            )
    return out


def simulate(profile: Profile, plan: Plan, *, _arrays: ProfileArrays | None = None) -> Simulation:
    """Predict a plan's activation-memory timeline, peak and recompute time.

    Args:
        profile: the step, as profiled.
        plan: the regions to checkpoint (``Plan.regions``; other fields are ignored).

    Returns:
        A :class:`Simulation`.

    Raises:
        ValueError: regions that overlap or nest, unknown modules, or save keys that name no
            op or an op that may not be saved.

    Example:
        >>> sim = simulate(profile, plan)              # doctest: +SKIP
        >>> sim.peak_bytes <= plan.budget_bytes        # doctest: +SKIP
        True
    """
    arrs = _arrays if _arrays is not None else ProfileArrays(profile)
    n = arrs.n_ops
    models = region_models(profile, arrs, plan.regions)
    ids = arrs.by_creator
    end1 = arrs.freed.copy()
    second = np.full(arrs.freed.shape, -1, dtype=np.int64)  # start of a second lifetime
    rec_s: list[float] = []
    saved_b: list[int] = []
    rps: list[int | None] = []
    replays = []
    for rm, saved in models:
        if not rm.useful:
            rec_s.append(rm.fixed_s(selective=False))
            saved_b.append(0)
            rps.append(None)
            continue
        rp = int(rm.rp)  # type: ignore[arg-type]
        sv = rm.saved_mask(saved)
        e1, drop = rm.versions(sv)
        keep = ~drop
        end1[rm.ids[keep]] = np.maximum(end1[rm.ids[keep]], e1[keep])
        end1[rm.ids[drop]] = e1[drop]
        second[rm.ids[drop]] = rp
        end1[rm.inputs] = np.maximum(end1[rm.inputs], rp)
        replays.append((rp, rm, rm.replay_pieces(sv, saved), int(rm.nb[drop].sum())))
        rec_s.append(rm.time_s(set(saved)) + rm.fixed_s(selective=bool(len(saved))))
        saved_b.append(int(rm.nb[sv].sum() + rm.in_nb.sum()))
        rps.append(rp)
    c = arrs.creator[ids]
    e = end1[ids]
    nb = arrs.nbytes[ids]
    s2 = second[ids]
    has2 = s2 >= 0
    f = arrs.freed[ids]
    starts = np.concatenate([c, s2[has2]])
    ends = np.concatenate([e, f[has2]])
    vals = np.concatenate([nb, nb[has2]])
    live = dense(starts, ends, vals, 0, n - 1) + arrs.workspace  # NOTE [region memory model]
    before = dense(starts + 1, ends, vals, 0, n - 1)
    # replays, grouped by recompute point; ones sharing a point run one after another
    bumps: dict[int, list[int]] = {}
    done_at: dict[int, int] = {}
    for rp, rm, (rs, re_, rv), second_bytes in sorted(replays, key=lambda x: (x[0], -x[1].a)):
        extra = done_at.get(rp, 0)
        steps = dense(rs, re_, rv, rm.a, rm.stop) + int(before[rp]) + extra
        bumps.setdefault(rp, []).extend(int(v) for v in steps)
        done_at[rp] = extra + second_bytes
    timeline: list[int] = []
    positions: list[int] = []
    for p in range(n):
        bump = bumps.get(p)
        if bump:
            timeline.extend(bump)
            positions.extend([p] * len(bump))
        timeline.append(int(live[p]))
        positions.append(p)
    if timeline:
        k = int(np.argmax(timeline))
        peak, peak_at = timeline[k], positions[k]
    else:
        peak, peak_at = 0, 0
    return Simulation(
        peak_bytes=int(peak),
        recompute_s=float(sum(rec_s)),
        live_bytes=tuple(timeline),
        positions=tuple(positions),
        peak_at=int(peak_at),
        region_recompute_s=tuple(rec_s),
        region_saved_bytes=tuple(saved_b),
        recompute_points=tuple(rps),
    )
