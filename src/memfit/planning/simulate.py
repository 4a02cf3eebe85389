"""Predict the peak memory and recompute time of a plan from a Profile, without running it.

The model of what checkpointing does to each storage is NOTE [region memory model] in
``memfit.planning.effects``. ``simulate(profile, Plan(regions=()))`` reproduces
``profile.live_bytes`` exactly (kernel workspaces included).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from memfit.planning.effects import (
    ProfileArrays,
    RegionModel,
    dense,
    resolve_span,
)
from memfit.planning.nesting import OP_RUNS, NestedModel
from memfit.planning.offload import (
    Copy,
    OffloadSpec,
    link_of,
    offload_copies,
    offload_replay_pieces,
    offload_time_s,
)
from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.planning.rules import keys_to_ops
from memfit.profiling.profile import Profile
from memfit.timemodel.calibration import TimeTerms

__all__ = ["Simulation", "simulate", "time_terms"]


@dataclass(frozen=True)
class Simulation:
    """What a plan is predicted to do to one step.

    Attributes:
        peak_bytes: peak activation memory (the maximum of ``live_bytes``).
        recompute_s: seconds of forward ops rerun in backward, scaled per op class by the
            profile's calibration, plus the fixed cost of each checkpointed region (NOTE
            [calibration] in ``memfit.timemodel``; NOTE [region overhead] and NOTE
            [dispatch overhead] in ``memfit.timemodel``).
        live_bytes: activation memory at each point of the step: one entry per op position
            and, just before a region's recompute point, one entry per replayed op.
        positions: for each entry of ``live_bytes``, the op position it belongs to (a replay
            entry belongs to the recompute point it precedes).
        peak_at: the op position of the peak (for a replay entry, its recompute point).
        region_recompute_s: per region of the plan, its recompute seconds.
        region_saved_bytes: per region, bytes it holds from forward to backward (outputs of
            saved ops plus the region's inputs, held for the replay; 0 for a nested region,
            whose outer region drops them).
        recompute_points: per region, its recompute point (``None``: nothing to recompute).
        offload_s: seconds the plan's host copies add (NOTE [offload time model] in
            ``memfit.planning.offload``: link time no compute hides, per-storage charges);
            included in ``recompute_s``, not in ``region_recompute_s``.
        host_peak_bytes: peak host memory of the offloaded outputs (0 without offload).
        recompute_flops: FLOPs of the forward ops rerun in backward, as ``recompute_s``
            counts them (each replay, an inner region's twice), from ``OpRecord.flops`` (0
            for ops without a FLOP formula; torch's ``flop_counter`` formulas count matmuls,
            convolutions and attention).
        region_recompute_flops: per region of the plan, its recompute FLOPs.
        region_names: per region of the plan, its name (``Region.name``).

    ``print(sim)`` shows them as a table, as ``print(plan)`` does.
    """

    peak_bytes: int
    recompute_s: float
    live_bytes: tuple[int, ...]
    positions: tuple[int, ...]
    peak_at: int
    region_recompute_s: tuple[float, ...] = ()
    region_saved_bytes: tuple[int, ...] = ()
    recompute_points: tuple[int | None, ...] = ()
    offload_s: float = 0.0
    host_peak_bytes: int = 0
    recompute_flops: int = 0
    region_recompute_flops: tuple[int, ...] = ()
    region_names: tuple[str, ...] = ()

    def __str__(self) -> str:
        from memfit.units import format_bytes, format_flops, format_seconds

        lines = [
            f"memfit simulation: peak {format_bytes(self.peak_bytes)} at op {self.peak_at}, "
            f"recompute +{format_seconds(self.recompute_s)}"
            + (f" ({format_flops(self.recompute_flops)})" if self.recompute_flops else "")
            + (f", offload {format_seconds(self.offload_s)} of it" if self.offload_s else "")
            + (f", host {format_bytes(self.host_peak_bytes)}" if self.host_peak_bytes else "")]
        n = len(self.region_recompute_s)
        if not n:
            lines.append("  no checkpointing: every activation is kept")
            return "\n".join(lines)
        names = self.region_names or tuple(f"region {q}" for q in range(n))
        flops = self.region_recompute_flops or (0,) * n
        rows = [(name, format_bytes(saved), format_seconds(s), format_flops(f) if f else "-",
                 "-" if point is None else f"op {point}")
                for name, saved, s, f, point in zip(names, self.region_saved_bytes,
                                                    self.region_recompute_s, flops,
                                                    self.recompute_points, strict=True)]
        head = ("region", "saved", "recompute", "FLOPs", "replayed at")
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
        for row in (head, *rows):
            lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                          for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        return "\n".join(lines)


def region_models(profile: Profile, arrs: ProfileArrays, regions: tuple[Region, ...]
                  ) -> tuple[list[tuple[RegionModel, list[int], list[int]]], list[int]]:
    """Resolve regions to models, saved and offloaded op indices (in plan order), and each one's outer
    region (``nesting``); reject overlapping ones and nesting other than NOTE [nested
    regions] allows."""
    out = []
    for r in regions:
        span = resolve_span(profile, r.modules, arrs.module_index, r.tail_after)
        rm = RegionModel(arrs, span)
        saved = keys_to_ops(profile, span.first_op, span.last_op, r.save, r.name)
        offloaded = keys_to_ops(profile, span.first_op, span.last_op, r.keys_with(OpPolicy.OFFLOAD), r.name)
        out.append((rm, saved, offloaded))
    return out, nesting(regions, [m[0] for m in out], runs=bool(profile.extra.get(OP_RUNS)))


def nesting(regions: tuple[Region, ...], models: list[RegionModel], *, runs: bool = False) -> list[int]:
    """For each region, the index of the region it is nested in (-1: top level).

    Args:
        runs: the profile's front end runs any run of ops as a region (``OP_RUNS``): a region
            nests in any region whose op range contains its own, at any depth (NOTE [regions
            nested deeper] in ``memfit.planning.nesting``).

    Raises:
        ValueError: regions that overlap without nesting, or nesting NOTE [nested regions] does
            not allow (more than one level, saved ops, a segment inside a segment).
    """
    parent = [-1] * len(regions)
    order = sorted(range(len(regions)), key=lambda q: (models[q].a, -models[q].b))
    open_: list[int] = []
    for q in order:
        rm = models[q]
        while open_ and models[open_[-1]].b < rm.a:
            open_.pop()
        if open_:
            o = open_[-1]
            outer, inner = regions[o], regions[q]
            # a module inside the outer one, one block of an outer segment (NOTE [nested
            # segments] in memfit.planning.nesting), or a segment of modules inside an outer
            # module (NOTE [segments nested in a block])
            ok = rm.b <= models[o].b and (runs or (
                any(inner.modules[0].startswith(m + ".") or m == ""
                    or (outer.is_segment and inner.modules[0] == m) for m in outer.modules)
                if not inner.is_segment else
                not outer.is_segment and all(p.startswith(outer.modules[0] + ".") or outer.modules[0] == ""
                                             for p in inner.modules)))
            if not ok:
                raise ValueError(
                    f"regions {outer.name!r} (ops {models[o].a}..{models[o].b}) and {inner.name!r} "
                    f"(ops {rm.a}..{rm.b}) overlap or nest; a plan's regions must be disjoint, or one "
                    "module nested in a region that contains it")
            if parent[o] >= 0 and not runs:
                raise ValueError(f"region {inner.name!r} is nested two levels deep (in {outer.name!r}, "
                                 f"itself in {regions[parent[o]].name!r}); the torch runtime nests one level (memfit.jax "
                                 "nests deeper: NOTE [regions nested deeper] in memfit.planning.nesting)")
            if outer.ops or inner.ops:
                raise ValueError(f"nested regions {outer.name!r} and {inner.name!r} must save no ops "
                                 "(recompute-all); drop the save keys or the nesting")
            parent[q] = o
        open_.append(q)
    return parent


def simulate(profile: Profile, plan: Plan, *, offload: OffloadSpec | None = None,
             _arrays: ProfileArrays | None = None) -> Simulation:
    """Predict a plan's activation-memory timeline, peak and recompute time.

    Args:
        profile: the step, as profiled.
        plan: the regions to checkpoint (``Plan.regions``; other fields are ignored).
        offload: the host link that times OFFLOAD ops (needed only when the plan offloads).

    Returns:
        A :class:`Simulation`.

    Raises:
        ValueError: regions that overlap or nest other than NOTE [nested regions] in
            ``memfit.planning.nesting`` allows, unknown modules, or save keys that name no op
            or an op that may not be saved.

    Example:
        >>> sim = simulate(profile, plan)              # doctest: +SKIP
        >>> sim.peak_bytes <= plan.budget_bytes        # doctest: +SKIP
        True
    """
    arrs = _arrays if _arrays is not None else ProfileArrays(profile)
    models, parent = region_models(profile, arrs, plan.regions)
    for q in range(len(models)):  # inside a region that drops nothing: in the one around it
        while parent[q] >= 0 and not models[parent[q]][0].useful:
            parent[q] = parent[parent[q]]
    acc = _Lifetimes.plain(arrs, len(models))
    for q, (rm, saved, offloaded) in enumerate(models):
        if parent[q] >= 0:
            continue  # modelled with its outer region
        inner_q = [i for i in range(len(models)) if parent[i] == q]
        if not rm.useful:
            acc.rec_s[q] = rm.fixed_s(selective=False)
        elif inner_q:
            acc.add_nested(arrs, q, rm, parent, [m[0] for m in models])
        else:
            acc.add_region(q, rm, saved, offloaded)
    live, before = _live_and_before(arrs, acc, [m[0] for m in models])
    timeline, positions = _timeline(arrs.n_ops, live, before, acc.replays)
    off_s, host_peak = _offload_totals(profile, arrs, acc.copies, offload)
    if timeline:
        k = int(np.argmax(timeline))
        peak, peak_at = timeline[k], positions[k]
    else:
        peak, peak_at = 0, 0
    return Simulation(
        peak_bytes=int(peak),
        recompute_s=float(sum(acc.rec_s)) + off_s,
        live_bytes=tuple(timeline),
        positions=tuple(positions),
        peak_at=int(peak_at),
        region_recompute_s=tuple(acc.rec_s),
        region_saved_bytes=tuple(acc.saved_b),
        recompute_points=tuple(acc.rps),
        offload_s=off_s,
        host_peak_bytes=host_peak,
        recompute_flops=int(sum(acc.rec_flops)),
        region_recompute_flops=tuple(acc.rec_flops),
        region_names=tuple(r.name for r in plan.regions),
    )


# A replay: (recompute point, order key, first op, stop op, (starts, ends, bytes) of the
# storages it makes, bytes that stay after it: the dropped storages' second lifetimes).
_Replay = tuple[int, tuple[int, int], int, int, tuple[np.ndarray, np.ndarray, np.ndarray], int]


@dataclass
class _Lifetimes:
    """What a plan does to the plain step's storages (NOTE [region memory model]), region by
    region: each storage's first lifetime end, its second lifetime (from its recompute point),
    the replays, the extra pieces (region state, kept draws), the host copies; and per region
    its recompute seconds, saved bytes, recompute point and recompute FLOPs."""

    end1: np.ndarray    # per storage: end of its (first) lifetime
    second: np.ndarray  # per storage: start of a second lifetime (-1: none)
    end2: np.ndarray    # per storage: end of the second lifetime
    rec_s: list[float]
    saved_b: list[int]
    rps: list[int | None]
    rec_flops: list[int]
    replays: list[_Replay] = field(default_factory=list)
    states: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)  # NOTE [region state bytes]
    copies: list[Copy] = field(default_factory=list)

    @classmethod
    def plain(cls, arrs: ProfileArrays, n_regions: int) -> _Lifetimes:
        return cls(end1=arrs.freed.copy(), second=np.full(arrs.freed.shape, -1, dtype=np.int64),
                   end2=arrs.freed.copy(), rec_s=[0.0] * n_regions, saved_b=[0] * n_regions,
                   rps=[None] * n_regions, rec_flops=[0] * n_regions)

    def add_nested(self, arrs: ProfileArrays, q: int, rm: RegionModel, parent: list[int],
                   models: list[RegionModel]) -> None:
        """Region ``q`` with the regions nested in it (``parent``: each region's outer one;
        NOTE [nested regions], NOTE [regions nested deeper])."""
        end1, second, end2 = self.end1, self.second, self.end2

        def tree(o: int) -> tuple[NestedModel | RegionModel, list[int]]:
            """Region ``o``'s model (a NestedModel where regions nest in it, a useful one) and
            the regions it covers in ``NestedModel.node_costs`` order."""
            kids = [i for i in range(len(models)) if parent[i] == o]
            if not kids or (o != q and not models[o].useful):
                return models[o], [o]
            subs = [tree(i) for i in kids]
            return NestedModel(arrs, models[o], [m for m, _ in subs]), [o, *(i for _, ix in subs for i in ix)]

        nm, order = tree(q)
        assert isinstance(nm, NestedModel)
        has2 = nm.start2 >= 0
        end1[nm.ids[has2]] = nm.end1[has2]
        end1[nm.ids[~has2]] = np.maximum(end1[nm.ids[~has2]], nm.end1[~has2])
        second[nm.ids[has2]] = nm.start2[has2]
        end2[nm.ids[has2]] = nm.end2[has2]
        end1[nm.input_ids] = np.maximum(end1[nm.input_ids], nm.input_end)
        for r in nm.replays:
            self.replays.append((r.rp, (-rm.a, r.depth), r.a, r.stop, (r.rs, r.re, r.rv), r.second_bytes))
        self.states.append(nm.state_pieces())
        self.saved_b[q] = nm.saved_bytes  # the others 0: their outer region drops their inputs
        for i, (t, flops, rp_i) in zip(order, nm.node_costs(), strict=True):
            self.rec_s[i], self.rec_flops[i], self.rps[i] = t, flops, rp_i

    def add_region(self, q: int, rm: RegionModel, saved: list[int], offloaded: list[int]) -> None:
        """Region ``q``, which drops something, on its own: ``saved`` and ``offloaded`` ops."""
        end1, second, end2 = self.end1, self.second, self.end2
        rp = int(rm.rp)  # type: ignore[arg-type]
        sv = rm.saved_mask(saved)
        e1, drop = rm.versions(sv)
        keep = ~drop
        end1[rm.ids[keep]] = np.maximum(end1[rm.ids[keep]], e1[keep])
        end1[rm.ids[drop]] = e1[drop]
        second[rm.ids[drop]] = rp
        end2[rm.ids[drop]] = rm.f2[drop]
        end1[rm.inputs] = np.maximum(end1[rm.inputs], rm.hold_end)  # NOTE [region memory model]
        pieces = rm.replay_pieces(sv, saved)
        if offloaded:  # NOTE [offload memory model]
            pieces = tuple(np.concatenate(xs) for xs in zip(pieces, offload_replay_pieces(rm, offloaded),
                                                            strict=True))  # type: ignore[assignment]
            self.copies.extend(offload_copies(rm, i) for i in offloaded)
        self.replays.append((rp, (-rm.a, 0), rm.a, rm.stop, pieces, int(rm.nb[drop].sum())))
        self.states.append(rm.state_pieces())
        self.states.append(rm.draw_pieces(saved))  # NOTE [kept draws] in memfit.runtime.draws
        self.rec_flops[q] = rm.flops(set(saved) | set(offloaded))
        self.rec_s[q] = (rm.time_s(set(saved) | set(offloaded))
                         + rm.fixed_s(selective=bool(len(saved) + len(offloaded))))
        self.saved_b[q] = int(rm.nb[sv].sum() + rm.in_nb.sum() + rm.draw_bytes[rm.draws(saved)].sum())
        self.rps[q] = rp


def _live_and_before(arrs: ProfileArrays, acc: _Lifetimes, models: list[RegionModel]
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Bytes live at each op position under the plan (kernel workspaces included), and live
    just before it (NOTE [region memory model])."""
    ids = arrs.by_creator
    c = arrs.creator[ids]
    e = acc.end1[ids]
    nb = arrs.nbytes[ids]
    s2 = acc.second[ids]
    has2 = s2 >= 0
    f = acc.end2[ids]
    tails = arrs.tails  # NOTE [autocast's cast cache]: none for casts inside a region
    outside = ~np.any([tails.inside(m.a, m.b) for m in models], axis=0) if models else \
        np.ones(tails.ids.shape, dtype=bool)
    states = [*acc.states, tails.pieces(outside)]
    starts = np.concatenate([c, s2[has2], *(x[0] for x in states)])
    ends = np.concatenate([e, f[has2], *(x[1] for x in states)])
    vals = np.concatenate([nb, nb[has2], *(x[2] for x in states)])
    n = arrs.n_ops
    live = dense(starts, ends, vals, 0, n - 1) + arrs.workspace  # NOTE [region memory model]
    before = dense(starts + 1, ends, vals, 0, n - 1)
    return live, before


def _timeline(n: int, live: np.ndarray, before: np.ndarray, replays: list[_Replay]
              ) -> tuple[list[int], list[int]]:
    """The step's memory timeline with each replay's steps inserted just before its recompute
    point, and the op position of each entry. Replays sharing a point run one after another
    (later regions first, as backward reaches them; an outer region before its inner ones)."""
    bumps: dict[int, list[int]] = {}
    done_at: dict[int, int] = {}
    for rp, _, a, stop, (rs, re_, rv), second_bytes in sorted(replays, key=lambda x: (x[0], x[1])):
        extra = done_at.get(rp, 0)
        steps = dense(rs, re_, rv, a, stop) + int(before[rp]) + extra
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
    return timeline, positions


def _offload_totals(profile: Profile, arrs: ProfileArrays, copies: list[Copy],
                    spec: OffloadSpec | None) -> tuple[float, int]:
    """Seconds (link time no compute hides, per-storage charges) and peak host bytes of the
    offloaded copies (NOTE [offload time model] in ``memfit.planning.offload``)."""
    if not copies:
        return 0.0, 0
    if spec is None:
        spec = OffloadSpec(link_of(profile)[0])
    if spec.link_bytes_per_s <= 0:
        raise ValueError(f"the plan offloads {len(copies)} op(s), but the profile's device "
                         f"{profile.device!r} has no host link to time the copies with; pass "
                         "offload=OffloadSpec(link_bytes_per_s=...) to simulate")
    host = dense(np.array([c.op for c in copies]), np.array([c.rp for c in copies]),
                 np.array([c.nbytes for c in copies]), 0, arrs.n_ops - 1)
    return offload_time_s(arrs, copies, spec), int(host.max(initial=0))
def time_terms(profile: Profile, plan: Plan) -> TimeTerms:
    """What ``plan`` reruns, in the time model's units (NOTE [calibration] in
    ``memfit.timemodel``): ``ProfileArrays(profile).calibration.recompute_s(
    time_terms(profile, plan))`` equals ``simulate(profile, plan).recompute_s`` up to float
    rounding (that calibration is ``profile.calibration`` unless NOTE [host overhead on an
    async device] in ``memfit.planning.hosttime`` zeroed its fixed charges).

    Raises:
        ValueError: as ``simulate``; also nested regions (calibration times flat plans only).

    Example:
        >>> time_terms(profile, every_block_plan).regions     # doctest: +SKIP
        8
    """
    arrs = ProfileArrays(profile)
    models, parent = region_models(profile, arrs, plan.regions)
    if any(p >= 0 for p in parent):
        raise ValueError("time_terms models flat plans only; this plan nests regions")
    parts = [_region_terms(rm, saved + offloaded) for rm, saved, offloaded in models]  # neither reruns
    return TimeTerms(
        matmul_s=float(sum(t.matmul_s for t in parts)), other_s=float(sum(t.other_s for t in parts)),
        regions=sum(t.regions for t in parts), ops=sum(t.ops for t in parts),
        selective_ops=sum(t.selective_ops for t in parts))


def _region_terms(rm: RegionModel, saved_ops: list[int]) -> TimeTerms:
    """What one region reruns: its non-saved ops ``a..stop`` if it drops anything (as
    ``RegionModel.time_s``), and its fixed charges (as ``RegionModel.fixed_s``)."""
    if rm.useful:
        sel = rm.rerun(saved_ops)
        fwd = rm.fwd_time[rm.a: rm.stop + 1][sel]
        mm = rm.op_matmul[rm.a: rm.stop + 1][sel]
    else:
        fwd, mm = rm.fwd_time[:0], rm.op_matmul[:0]
    n = rm.n_forward_ops
    return TimeTerms(matmul_s=float(fwd[mm].sum()), other_s=float(fwd[~mm].sum()), regions=1, ops=n,
                     selective_ops=n if saved_ops and rm.useful else 0)
