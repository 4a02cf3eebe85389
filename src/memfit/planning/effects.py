"""The memory model of checkpointing one region, shared by the simulator and the cost model.

NOTE [region memory model]
    Non-reentrant ``torch.utils.checkpoint`` with a selective policy, per storage. A region
    covers the forward ops ``a..b`` of its modules' first calls (a segment also covers the
    parent's ops between its members). Plain lifetimes are ``[created_by, freed_after]``
    (``freed_after = None``: to the end of the step). ``rp`` (the recompute point) is the
    first backward op that reads a tensor the region's frame saved (``StorageRecord.saves``
    by ops ``a..b``; profiles without them: the smallest ``first_unpack`` of its *dropped*
    storages), for a region that drops something (below); ``L`` (the stop op)
    is the last region op dispatched before autograd saved the region's last tensor
    (``OpRecord.packs``): torch's early stop raises inside the saved-tensor hook once its
    frame has seen as many saved tensors as the forward saved, and autograd saves an op's
    inputs before the op runs. Not the last op that *creates* a saved storage: dropout's
    mask is created by ``empty_like`` and filled in place by ``bernoulli_`` and ``div_``
    before the ``mul`` that saves it; a GPT MLP region saving its two matmuls reran
    ``bernoulli_`` and ``div_`` too (seen under torch's profiler) where the model stopped it
    at ``empty_like`` (predicted 1.8 ms per region, measured 4.6 ms). Nor the creator of a
    region output that a later op saves (a block's output, saved by the next block's norm):
    that save is not the frame's, and the replay stops before the dropout ``mul`` that made
    it (the model ran it to the end of the block: 32 KiB over on a small GPT's replay).
    Profiles without ``packs`` keep the creation rule.

    For a storage ``s`` created by region op ``i``:
    - *escaping* (read in forward after ``b``, or never freed): keeps its plain lifetime; its
      copy made by the replay is a transient. Unless one of the region's ops saved it
      (*held*: the region's output, saved by its last activation): the frame keeps a holder,
      not the tensor, so it is dropped as below, its first lifetime ending where the later
      ops' nodes release their saves of it (``saves``), where Python lets it go at least
      (``StorageRecord.released_after``, NOTE [Python releases] in ``memfit.profiling.profile``;
      the forward's end in profiles without it), and the replay's copy lives from ``rp``
      until the region's own node releases it. Where something else holds it longer (the
      model's output), the first lifetime is the plain one. Its first unpack, by the
      region's node, is where the replay runs (above): an in-place LeakyReLU on
      ``InstanceNorm3d``'s output (a view) saves the block's output, and its backward first
      clones the whole gradient (``CopySlices``); a MONAI ``UnetUpBlock`` region replayed
      with that clone live, 65,408 B over the prediction before (a DynUNet's smallest plan
      9% over).
    - *dropped* (not escaping, ``saved=True``): autograd no longer holds it. It lives
      ``[c, d]`` with ``d = min(freed_after, max(last_forward_use, end))``, ``end`` where
      Python let go of it (``released_after``); and again ``[rp, freed_after]`` once
      recomputed. Profiles without Python releases take ``end`` as the last op of the member
      module that created it (its locals live until that forward returns at most), which
      over-counts what the code drops earlier: ``y = self.bn2(self.conv2(y))`` lets the first
      ReLU's output go at that line, and the zoo ResNet's first block held 262,400 B more than
      its checkpointed step at the block's add (a chain plan predicted 1,048,960 B, measured
      987,648).
    - other (not escaping, not autograd-saved): plain lifetime; the replay makes a transient.
    - a kept draw (NOTE [kept draws] in ``memfit.runtime.draws``; op ``i`` of
      ``memfit.ops.KEPT_DRAW_OPS`` saved) adds ``memfit.planning.rules.draw_bytes`` over
      ``[i, rp - 1]`` and from the replay's first step to step ``i``, where op ``i`` does not
      run again; the tensor it wrote is replayed as any other.
    - if op ``i`` is saved (``Region.save``), torch caches all its outputs and the replay does
      not make them again. One that autograd needs in backward anyway (``freed_after >= rp``)
      keeps its plain lifetime; one the plain step frees in forward (a transient) lives
      ``[c, rp - 1]`` in the cache, and in the replay from its first step until its plain free
      (or the replay's end): the replay takes it out of the cache and drops it after its last
      use (NOTE [cached transients]; measured: saving a 6 MiB transient of a GPT block's
      attention was predicted 1 MiB high before, exact after).
    Storages created before ``a`` and read by region ops or passed to its modules' calls (the
    region's inputs; ``ProfileArrays.inputs_of``) are held by the
    checkpoint's frame, which dies with the region's backward: ``[c, max(freed_after, h)]``,
    ``h`` the last plain free of the region's dropped storages (at least ``rp``), or the last
    backward op of an autograd node of the region's ops that holds saved tensors, if later
    (``ProfileArrays.frame_end``: each such node holds the frame until it is done; a UNet
    block whose first op, a convolution, saves only the block's input and its weight held
    its state through that convolution's backward, 5,056 B over the prediction before, where
    a 45 MB kernel workspace made it the step's peak). Not only until ``rp``: a Llama's 2 MiB causal mask, read by every layer and freed by the plain step
    after the forward, was measured live through layer 0's backward, 2 MiB over the
    prediction. A region that drops something also holds ``Profile.region_state_bytes`` (the
    generator state its call stashes, NOTE [region state bytes] in
    ``memfit.profiling.profile``) over ``[a, h]``, and the copies the runtime makes of the
    module buffers its forward writes (NOTE [buffer copies] in
    ``memfit.planning.buffer_copies``). Its replay forks the generator: the state current
    when the replay starts is saved while the stashed one replays, another
    ``region_state_bytes`` through the replay (the benchmark UNet3D's smallest plan peaks in a
    replay: its unchecked step measured exactly that, 5,056 B, over the prediction before).

    The replay runs just before op ``rp``, one step per op ``a..L`` (saved ops return their
    cached outputs). A replayed storage lives from its step to its plain ``freed_after`` when
    that is within ``a..L``, to the end of the replay otherwise; a dropped storage stays
    (its second lifetime). Memory at replay step ``i`` is the memory just before op ``rp``
    (storages live at both ``rp - 1`` and ``rp``) plus the replayed storages live at ``i``,
    plus op ``i``'s kernel workspace if op ``i`` is not saved (it runs again).
    Recompute time is the forward time of the non-saved ops ``a..L``, scaled per op class by
    the profile's calibration (NOTE [calibration] in ``memfit.timemodel``), plus the
    fixed charges of NOTE [region overhead] and NOTE [dispatch overhead] in ``memfit.timemodel``.

    Kernel workspaces (NOTE [kernel workspaces] in ``memfit.profiling.profile``) add
    ``workspace_bytes[p]`` at op position ``p`` whatever the plan (forward ops run either way),
    never "just before" a position, and at replay step ``i`` as above. In the linear model the
    region's base effect carries the replay workspaces and saving op ``i`` removes op ``i``'s.

    The model is per storage, so the effects of regions that touch disjoint storages add up
    exactly. Two regions touch one storage only when it is an input of both (a tensor read by
    two checkpointed regions, e.g. a UNet skip): the simulator keeps it until the later
    recompute point, the linear model counts both extensions (over-estimates, never under).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memfit.planning.arrays import NEVER, ProfileArrays, dense
from memfit.planning.buffer_copies import buffer_copies
from memfit.profiling.profile import Profile

__all__ = ["ProfileArrays", "RegionSpan", "RegionModel", "Effect", "resolve_span", "dense", "OP_RUNS"]

# Profile.extra: the front end runs any run of the step's ops as a region (memfit.jax): a
# segment's members may be modules of different parents in call order, the code between them
# included (NOTE [segments nested in a block], NOTE [regions nested deeper] in
# memfit.planning.nesting)
OP_RUNS = "regions_are_op_runs"

@dataclass(frozen=True)
class RegionSpan:
    """Where a region sits in the step: its modules and forward op range."""

    modules: tuple[str, ...]
    first_op: int
    last_op: int  # the region's last op; with a tail, the last op before it
    member_last: tuple[int, ...]  # last op of each member module (a segment has several)
    tail_after: str | None = None  # NOTE [region tails] in memfit.planning.tails

    @property
    def name(self) -> str:
        return self.modules[0] if len(self.modules) == 1 else f"{self.modules[0]}..{self.modules[-1]}"


def resolve_span(profile: Profile, modules: tuple[str, ...],
                 _index: dict[str, int] | None = None, tail_after: str | None = None) -> RegionSpan:
    """The op range of a region (one module, or consecutive siblings forming a segment); with
    ``tail_after``, the range ends with that sub-module's last op (NOTE [region tails] in
    ``memfit.planning.tails``).

    Raises:
        ValueError: an unknown module, one that ran no op, or a segment whose members are not
            siblings in call order (in call order, of any parents, on an ``OP_RUNS`` profile);
            a ``tail_after`` that is no sub-module of the region that ran inside it.
    """
    index = _index if _index is not None else {m.path: k for k, m in enumerate(profile.modules)}
    recs = []
    for path in modules:
        k = index.get(path)
        if k is None:
            raise ValueError(f"region names module {path!r}, which the profile does not have; "
                             "is the plan for another model?")
        rec = profile.modules[k]
        if rec.first_op is None or rec.last_op is None:
            raise ValueError(f"module {path!r} ran no op in the profiled step; it cannot be a region")
        recs.append(rec)
    if len(recs) > 1:
        parents = {r.parent for r in recs}
        if len(parents) != 1 and not profile.extra.get(OP_RUNS):
            raise ValueError(f"segment {modules} mixes modules of different parents {sorted(map(str, parents))}; "
                             "a segment is a run of consecutive siblings")
        for r0, r1 in zip(recs, recs[1:], strict=False):
            if r1.first_op <= r0.last_op:  # type: ignore[operator]
                raise ValueError(f"segment members {r0.path!r} and {r1.path!r} are not in call "
                                 "order or overlap; list them in the order they run")
    span = RegionSpan(tuple(modules), int(recs[0].first_op), int(recs[-1].last_op),  # type: ignore[arg-type]
                      tuple(int(r.last_op) for r in recs))  # type: ignore[arg-type]
    if tail_after is None:
        return span
    k = index.get(tail_after)
    tail_rec = profile.modules[k] if k is not None else None
    if (tail_rec is None or len(modules) != 1 or tail_rec.calls != 1 or tail_rec.first_op is None
            or tail_rec.last_op is None
            or not span.first_op <= tail_rec.first_op <= tail_rec.last_op < span.last_op
            or not tail_after.startswith(modules[0] + "." if modules[0] else "")):
        raise ValueError(f"region {modules}: tail_after={tail_after!r} is not a sub-module called "
                         "once inside it that ends before it; is the plan for another model?")
    return RegionSpan(span.modules, span.first_op, int(tail_rec.last_op), span.member_last, tail_after)


@dataclass
class Effect:
    """A signed change of the step's memory: position pieces and (optionally) a replay.

    ``Δlive(p) = Σ v [s <= p <= e]`` over the pieces; ``Δbefore(p)`` counts a piece when it
    covers both ``p - 1`` and ``p``. A replay adds ``Σ rv [rs <= i <= re]`` at its step ``i``
    (``a <= i <= stop``) on top of the total "before ``rp``" memory.
    """

    ps: np.ndarray
    pe: np.ndarray
    pv: np.ndarray
    rs: np.ndarray
    re: np.ndarray
    rv: np.ndarray
    time_s: float = 0.0

    def live(self, lo: int, hi: int) -> np.ndarray:
        return dense(self.ps, self.pe, self.pv, lo, hi)

    def before(self, lo: int, hi: int) -> np.ndarray:
        return dense(self.ps + 1, self.pe, self.pv, lo, hi)

    def before_at(self, p: int) -> int:
        m = (self.ps <= p - 1) & (self.pe >= p)
        return int(self.pv[m].sum())

    def replay(self, a: int, stop: int) -> np.ndarray:
        return dense(self.rs, self.re, self.rv, a, stop)


def _cat(*xs: np.ndarray) -> np.ndarray:
    return np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)


class RegionModel:
    """A region's storages sorted by their role (NOTE [region memory model])."""

    def __init__(self, arrs: ProfileArrays, span: RegionSpan) -> None:
        self.span = span
        a, b = span.first_op, span.last_op
        self.a, self.b = a, b
        ids = arrs.created_in(a, b)
        self.ids = ids
        c = arrs.creator[ids]
        f = arrs.freed[ids]
        self.c, self.f, self.nb = c, f, arrs.nbytes[ids]
        esc = arrs.never_freed[ids] | (arrs.lfu[ids] > b)
        # escaping storages the region's own ops saved: dropped too (NOTE [region memory model])
        rel_in, rel_out = arrs.frame_saves(ids, a, b)
        held = esc & (rel_in >= 0)
        self.held = held
        self.dropped = (~esc & arrs.saved[ids]) | held
        # where the second lifetime (the replay's copy, once unpacked) ends
        self.f2 = np.where(held, np.minimum(f, rel_in), f)
        any_saved = arrs.saved[ids]
        # the first read of any tensor the frame saved replays it (a held storage's own
        # first_unpack may be a later op's read)
        own = self.dropped & ~held
        self.rp: int | None = None
        if self.dropped.any():
            self.rp = min(int(arrs.unpack[ids][own].min(initial=NEVER)), arrs.frame_unpack(a, b))
        if self.rp is not None and self.rp >= NEVER:
            self.rp = None
        # the checkpoint's frame (its inputs, its RNG state) lives until the region's backward
        # ends: the last plain free of its dropped storages, or the end of the last autograd
        # node of its ops holding saved tensors if later (NOTE [region memory model])
        self.hold_end: int = (max(self.rp, int(self.f2[self.dropped].max(initial=self.rp)),
                                  arrs.frame_end(a, b))
                              if self.rp is not None else 0)
        self.copies = buffer_copies(arrs.buffer_writes, arrs.profile.ops, a, b)  # NOTE [buffer copies]: (ids, first ops, kept)
        self.tails = arrs.tails.pieces(arrs.tails.inside(a, b), -1)  # NOTE [autocast's cast cache]
        if arrs.pack_ops.size:  # the replay runs to the last op before a save by a..b
            own = arrs.pack_ops[(arrs.pack_ops >= a) & (arrs.pack_ops <= b)]
            nxt = arrs.next_pack_ops[(arrs.next_pack_ops >= a) & (arrs.next_pack_ops < b)]
            self.stop = max(int(own.max(initial=a)), int(nxt.max(initial=a)))
        else:
            self.stop = int(c[any_saved].max()) if any_saved.any() else a
        member_last = np.array(span.member_last, dtype=np.int64)
        pos = np.searchsorted(member_last, c, side="left")
        end = np.where(pos < len(member_last), member_last[np.minimum(pos, len(member_last) - 1)], b)
        rel = arrs.released[ids]  # where Python let go, where traced (NOTE [Python releases])
        end = np.where(rel >= 0, rel, end)
        self.d = np.minimum(f, np.maximum(arrs.lfu[ids], end))
        # a held storage lives on while a later op's node or Python holds it: its plain free
        # where that is later than the region's own saves, else until Python lets it go (the
        # forward's end where not traced: NOTE [Python releases]) and the later nodes' release
        mine = held & ~arrs.never_freed[ids] & (f <= rel_in)
        py = np.where(rel >= 0, np.maximum(rel, arrs.lfu[ids]), arrs.n_forward - 1)
        self.d = np.where(held, np.where(mine, np.minimum(f, np.maximum(py, rel_out)), f), self.d)
        self.inputs = arrs.inputs_of(a, b, span.modules)
        self.in_c = arrs.creator[self.inputs]
        self.in_f = arrs.freed[self.inputs]
        self.in_nb = arrs.nbytes[self.inputs]
        self.op_time = arrs.rerun_time  # calibrated (NOTE [calibration])
        self.fwd_time = arrs.op_time
        self.op_flops = arrs.op_flops
        self.op_matmul = arrs.op_matmul
        self.calibration = arrs.calibration
        self.workspace = arrs.workspace
        self.state_bytes = arrs.region_state
        self.draw_bytes = arrs.draw_bytes  # NOTE [kept draws] in memfit.runtime.draws
        self.keep_time = arrs.keep_time
        self.all_nbytes = arrs.nbytes
        # replay transient end for non-dropped storages: plain free if within a..stop
        self.rend = np.where(f <= self.stop, f, self.stop)
        self.replayed = c <= self.stop

    @property
    def n_forward_ops(self) -> int:
        """Forward ops of the region (each pays NOTE [dispatch overhead])."""
        return self.b - self.a + 1

    def fixed_s(self, selective: bool) -> float:
        """Seconds a checkpointed call costs beyond the ops it reruns (NOTE [region overhead],
        NOTE [dispatch overhead]); ``selective``: the region saves some op."""
        cal = self.calibration
        per_op = cal.op_s + (cal.selective_op_s if selective else 0.0)
        return cal.region_s + self.n_forward_ops * per_op

    @property
    def useful(self) -> bool:
        """Whether checkpointing the region drops anything (it has a recompute point)."""
        return self.rp is not None

    def saved_mask(self, saved_ops: np.ndarray | set[int] | list[int]) -> np.ndarray:
        """Which of the region's storages come from saved ops."""
        ops = np.fromiter(saved_ops, dtype=np.int64) if not isinstance(saved_ops, np.ndarray) else saved_ops
        return np.isin(self.c, ops) if ops.size else np.zeros(self.c.shape, dtype=bool)

    def time_s(self, saved_ops: set[int]) -> float:
        """Recompute seconds: non-saved ops ``a..stop``, calibrated (NOTE [calibration]), and
        what keeping the saved ones' draws costs (NOTE [kept draws])."""
        rerun = float(self.op_time[self.a: self.stop + 1][self.rerun(saved_ops)].sum())
        draws = self.draws(saved_ops) if saved_ops else ()
        return rerun + sum(float(self.keep_time[i]) for i in draws)

    def flops(self, saved_ops: set[int] | list[int]) -> int:
        """FLOPs the recompute reruns: of the non-saved ops ``a..stop``, the ops ``time_s``
        charges (0 for an op the profile has no FLOP formula for)."""
        return int(self.op_flops[self.a: self.stop + 1][self.rerun(saved_ops)].sum())

    def rerun(self, saved_ops: set[int] | list[int]) -> np.ndarray | slice:
        """Which of ops ``a..stop`` rerun (a slice when all do: one float sum in op order, as
        the cost model's sums)."""
        ops = [i for i in sorted(saved_ops) if self.a <= i <= self.stop]
        if not ops:
            return slice(None)
        keep = np.ones(self.stop - self.a + 1, dtype=bool)
        keep[np.array(ops) - self.a] = False
        return keep

    # -- lifetimes under a save set (used by the simulator) --------------------------------
    def versions(self, sv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per region storage: the end of its first lifetime and whether it has a second."""
        rp = self.rp if self.rp is not None else 0
        drop = self.dropped & ~sv
        end1 = np.where(drop, self.d, np.where(sv, self._saved_end(rp), self.f))
        return end1, drop

    def replay_pieces(self, sv: np.ndarray, saved_ops: set[int] | list[int] | tuple[int, ...] = ()
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Replay pieces under a save set: replayed storages and the rerun ops' workspaces."""
        rep = self.replayed & ~sv
        end = np.where(self.dropped, self.stop, self.rend)
        ws_ops = self._workspace_ops()
        if saved_ops and ws_ops.size:
            ws_ops = ws_ops[~np.isin(ws_ops, np.fromiter(saved_ops, dtype=np.int64))]
        wv = self.workspace[ws_ops]
        cs, ce, cv = self._cached_in_replay(sv)
        bs, be, bv = self.replay_extras()
        ds = self.draws(saved_ops)
        dv = self.draw_bytes[ds]
        return (_cat(self.c[rep], ws_ops, cs, bs, np.full(ds.shape, self.a, dtype=np.int64)),
                _cat(end[rep], ws_ops, ce, be, ds), _cat(self.nb[rep], wv, cv, bv, dv))

    def draws(self, saved_ops: set[int] | list[int] | tuple[int, ...] | np.ndarray) -> np.ndarray:
        """The kept draws among ``saved_ops`` that the replay reaches (NOTE [kept draws])."""
        ops = np.fromiter(saved_ops, dtype=np.int64) if not isinstance(saved_ops, np.ndarray) else saved_ops
        ops = ops[(ops >= self.a) & (ops <= self.stop)]
        return ops[self.draw_bytes[ops] > 0]

    def draw_pieces(self, saved_ops: set[int] | list[int] | tuple[int, ...]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What kept draws hold from their op in forward to just before the replay (NOTE [kept
        draws]); the replay pieces (:meth:`replay_pieces`) carry them to their replay step."""
        ds = self.draws(saved_ops)
        rp = self.rp if self.rp is not None else 0
        return ds, np.full(ds.shape, rp - 1, dtype=np.int64), self.draw_bytes[ds]

    def _saved_end(self, rp: int) -> np.ndarray:
        """End of a saved op's output's first lifetime: through the backward where autograd
        needs it anyway, else until just before the replay (NOTE [cached transients])."""
        return np.where(self.f >= rp, self.f, rp - 1)

    def _cached_in_replay(self, sv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """NOTE [cached transients] A saved op's output that the plain step frees in forward
        stays in the selective-checkpoint cache until the replay; the replay takes it out and
        it is freed after its last use there (its plain free, or the replay's end). As replay
        pieces: from the replay's first step to that free."""
        rp = self.rp if self.rp is not None else 0
        m = sv & (self.f < rp)
        n = int(m.sum())
        return (np.full(n, self.a, dtype=np.int64), np.minimum(self.f[m], self.stop),
                self.nb[m])

    def _workspace_ops(self) -> np.ndarray:
        """Ops ``a..stop`` with a kernel workspace (each uses it again when replayed)."""
        ops = np.arange(self.a, self.stop + 1, dtype=np.int64)
        return ops[self.workspace[ops] > 0]

    # -- linear effects (used by the cost model) -------------------------------------------
    def _version_pieces(self, m: np.ndarray, saved: bool) -> tuple[np.ndarray, ...]:
        """Pieces (+) of the storages selected by ``m`` under recompute or saved, minus plain."""
        rp = self.rp if self.rp is not None else 0
        c, f, nb = self.c[m], self.f[m], self.nb[m]
        if saved:
            e = np.where(f >= rp, f, rp - 1)
            ch = e != f
            return (_cat(c[ch], c[ch]), _cat(e[ch], f[ch]), _cat(nb[ch], -nb[ch]))
        drop = self.dropped[m]
        d = self.d[m]
        cd, fd, nd = c[drop], f[drop], nb[drop]
        return (_cat(cd, np.full(cd.shape, rp, dtype=np.int64), cd),
                _cat(d[drop], self.f2[m][drop], fd),
                _cat(nd, nd, -nd))

    def _recompute_replay(self, m: np.ndarray) -> tuple[np.ndarray, ...]:
        rep = m & self.replayed
        end = np.where(self.dropped, self.stop, self.rend)
        return self.c[rep], end[rep], self.nb[rep]

    def state_pieces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The call's stashed generator state, from ``a`` to the end of the region's backward
        (NOTE [region memory model]), and its forward's buffer copies (NOTE [buffer copies]);
        nothing for a region that drops nothing. Its frame dies with its forward only if its
        ops saved nothing; one whose ops save its inputs or outputs used after it lives on,
        holding what its call was given and this state, and replays at their first unpack:
        not modelled (the planner never proposes such a region; a hand-made one on a test
        model peaked 80,704 B over the prediction)."""
        z = np.zeros(0, dtype=np.int64)
        if self.rp is None:
            return z, z, z
        ids, first, kept = self.copies  # NOTE [buffer copies]
        st = np.array([self.a] if self.state_bytes > 0 else [], dtype=np.int64)
        return (_cat(st, first), _cat(np.full(st.shape, self.hold_end, dtype=np.int64),
                                      np.where(kept, self.hold_end, self.b)),
                _cat(np.full(st.shape, self.state_bytes, dtype=np.int64), self.all_nbytes[ids]))

    def replay_extras(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What the checkpoint holds beside the replayed storages while its replay runs, as a
        replay piece: the generator state it forks (the current one, saved while the stashed
        one replays; NOTE [region memory model]) and the copies of the written buffers it
        reads (NOTE [buffer copies] in ``memfit.planning.buffer_copies``)."""
        ids, _, kept = self.copies
        nbytes = int(self.all_nbytes[ids[kept]].sum()) + self.state_bytes
        if self.rp is None or nbytes <= 0:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z
        return (np.array([self.a], dtype=np.int64), np.array([self.stop], dtype=np.int64),
                np.array([nbytes], dtype=np.int64))

    def base_effect(self) -> Effect:
        """Recompute-all: every region op reruns (up to the stop op)."""
        allm = np.ones(self.c.shape, dtype=bool)
        ps, pe, pv = self._version_pieces(allm, saved=False)
        hold = self.hold_end if self.rp is not None else 0
        ext = self.in_f < hold
        ss, se, sv = self.state_pieces()
        ts, te, tv = self.tails
        ps = _cat(ps, self.in_c[ext], self.in_c[ext], ss, ts)
        pe = _cat(pe, np.full(int(ext.sum()), hold, dtype=np.int64), self.in_f[ext], se, te)
        pv = _cat(pv, self.in_nb[ext], -self.in_nb[ext], sv, tv)
        rs, re_, rv = self._recompute_replay(allm)
        ws_ops = self._workspace_ops()
        bs, be, bv = self.replay_extras()
        rs, re_, rv = _cat(rs, ws_ops, bs), _cat(re_, ws_ops, be), _cat(rv, self.workspace[ws_ops], bv)
        return Effect(ps, pe, pv, rs, re_, rv, time_s=self.time_s(set()))

    def draw_effect(self, op: int) -> Effect:
        """The change from recompute-all when the draw of op ``op`` is kept (NOTE [kept
        draws]): the copy and the generator state held from the op to its replay step, the
        op not rerun."""
        v = np.array([self.draw_bytes[op]], dtype=np.int64)
        at = np.array([op], dtype=np.int64)
        rp = self.rp if self.rp is not None else 0
        rs, re_, rv = np.array([self.a], dtype=np.int64), at, v
        if self.workspace[op] > 0:
            rs, re_, rv = _cat(rs, at), _cat(re_, at), _cat(rv, -self.workspace[at])
        return Effect(at, np.array([rp - 1], dtype=np.int64), v, rs, re_, rv,
                      time_s=float(self.keep_time[op]) - float(self.op_time[op]))

    def op_effect(self, op: int) -> Effect:
        """The change from recompute-all when op ``op`` is saved (its outputs cached), or its
        draw kept (:meth:`draw_effect`)."""
        if self.draw_bytes[op] > 0:
            return self.draw_effect(op)
        m = self.c == op
        s_ps, s_pe, s_pv = self._version_pieces(m, saved=True)
        r_ps, r_pe, r_pv = self._version_pieces(m, saved=False)
        rs, re_, rv = self._recompute_replay(m)
        if self.a <= op <= self.stop and self.workspace[op] > 0:  # a saved op does not rerun
            w = np.array([op], dtype=np.int64)
            rs, re_, rv = _cat(rs, w), _cat(re_, w), _cat(rv, self.workspace[w])
        cs, ce, cv = self._cached_in_replay(m)  # NOTE [cached transients]
        t = float(self.op_time[op]) if op <= self.stop else 0.0
        return Effect(_cat(s_ps, r_ps), _cat(s_pe, r_pe), _cat(s_pv, -r_pv),
                      _cat(rs, cs), _cat(re_, ce), _cat(-rv, cv), time_s=-t)
