"""A Profile as numpy arrays: the plain step's storages, ops and timelines, built once per
planning call and shared by the region memory model (``memfit.planning.effects``), the
simulator and the solvers."""

from __future__ import annotations

import numpy as np

from memfit.planning.cast_cache import CacheTails
from memfit.planning.hosttime import host_overhead
from memfit.planning.rules import buffer_writes, draw_bytes, is_kept_draw, is_matmul, is_saveable
from memfit.profiling.profile import PYTHON_RELEASES, Profile, StorageKind
from memfit.timemodel.calibration import Calibration

__all__ = ["ProfileArrays", "dense", "NEVER"]

_COUNTED_KINDS = (StorageKind.ACTIVATION, StorageKind.GRADIENT)
NEVER = np.iinfo(np.int64).max // 4


class ProfileArrays:
    """A Profile's storages and ops as numpy arrays (built once per planning call)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        n = len(profile.ops)
        self.n_ops = n
        self.n_forward = profile.n_forward
        st = profile.storages
        m = len(st)
        self.creator = np.full(m, -1, dtype=np.int64)
        self.freed = np.full(m, n - 1, dtype=np.int64)
        self.never_freed = np.zeros(m, dtype=bool)
        self.lfu = np.full(m, -1, dtype=np.int64)
        self.nbytes = np.zeros(m, dtype=np.int64)
        self.saved = np.zeros(m, dtype=bool)
        self.unpack = np.full(m, NEVER, dtype=np.int64)
        self.counted = np.zeros(m, dtype=bool)
        # NOTE [Python releases] in memfit.profiling.profile: -1 where not traced (or an
        # autocast-cached cast, NOTE [autocast's cast cache]), NEVER where held at the forward's end
        traced = bool(profile.extra.get(PYTHON_RELEASES))
        self.released = np.full(m, NEVER if traced else -1, dtype=np.int64)
        # forward ops after which autograd saved something (NOTE [region memory model]): for
        # the op's own module, and for the next op, which runs in another one
        fwd = profile.ops[: self.n_forward]
        self.pack_ops = np.array([o.index for o in fwd if o.packs > 0], dtype=np.int64)
        self.next_pack_ops = np.array([o.index for o in fwd if o.next_packs > 0], dtype=np.int64)
        for k, s in enumerate(st):
            if s.id != k:
                raise ValueError(f"profile storage table is not dense: position {k} holds id {s.id}")
            self.nbytes[k] = s.nbytes
            self.saved[k] = s.saved
            if s.created_by is not None:
                self.creator[k] = s.created_by
                self.counted[k] = s.kind in _COUNTED_KINDS
            if s.freed_after is None:
                self.never_freed[k] = True
            else:
                self.freed[k] = s.freed_after
            if s.last_forward_use is not None:
                self.lfu[k] = s.last_forward_use
            if s.first_unpack is not None:
                self.unpack[k] = s.first_unpack
            if s.autocast_cached:  # a region runs its cast without the cache: the older rule
                self.released[k] = -1
            elif traced and s.released_after is not None:
                self.released[k] = s.released_after
        # NOTE [saved tensors] in memfit.profiling.profile: each forward pack, by storage
        # (then by saving op) and by saving op
        packs = sorted((k, op, NEVER if u is None else u, NEVER if r is None else r)
                       for k, s in enumerate(st) for op, u, r in s.saves)
        pk = np.array(packs, dtype=np.int64).reshape(-1, 4)
        self.save_sid, self.save_op, self.save_unpack, self.save_release = pk.T.copy()
        self.save_ptr = np.searchsorted(self.save_sid, np.arange(m + 1), side="left")
        by_op = np.argsort(self.save_op, kind="stable")
        self.save_op_sorted = self.save_op[by_op]
        self.save_unpack_by_op = self.save_unpack[by_op]
        self.tails = CacheTails.of(profile, self.counted)  # NOTE [autocast's cast cache]
        self.freed[self.tails.ids] = self.tails.start - 1
        # counted storages in creation order, for slicing by op range
        ids = np.nonzero(self.counted)[0]
        order = np.argsort(self.creator[ids], kind="stable")
        self.by_creator = ids[order]
        self.by_creator_op = self.creator[self.by_creator]
        self.op_time = np.array([op.time_s for op in profile.ops], dtype=np.float64)
        self.op_flops = np.array([op.flops for op in profile.ops], dtype=np.int64)  # 0: no formula
        # NOTE [calibration]: the seconds an op costs when a region reruns it; its fixed
        # charges count 0 s where NOTE [host overhead on an async device] (in
        # memfit.planning.hosttime) finds them hidden: the one place the rule applies
        self.host = host_overhead(profile, profile.calibration if profile.calibration is not None
                                  else Calibration(), self.op_time)
        self.calibration = self.host.calibration
        cal = self.calibration
        self.op_matmul = np.array([is_matmul(op) for op in profile.ops], dtype=bool)
        self.rerun_time = self.op_time * np.where(self.op_matmul, cal.matmul_scale, cal.other_scale)
        self.workspace = np.array([op.workspace_bytes for op in profile.ops], dtype=np.int64)
        self.region_state = int(profile.region_state_bytes)  # NOTE [region state bytes]
        self.buffer_writes = buffer_writes(profile)  # NOTE [buffer writes] in .rules
        self.op_cumtime = np.concatenate([[0.0], np.cumsum(self.op_time)])
        self.op_saveable = np.array([is_saveable(profile, op) for op in profile.ops], dtype=bool)
        # NOTE [kept draws] in memfit.runtime.draws: bytes a kept draw holds, 0 for other ops
        self.draw_bytes = np.array([draw_bytes(profile, op) if is_kept_draw(profile, op) else 0
                                    for op in profile.ops], dtype=np.int64)
        # ... and the seconds keeping it costs: its copy in forward, its write back in the replay
        self.keep_time = np.where(self.draw_bytes > 0, self.draw_bytes - self.region_state, 0
                                  ) * cal.keep_s_per_element
        ptr = [0]
        flat: list[int] = []
        for op in profile.ops[: profile.n_forward]:
            flat.extend(op.inputs)
            ptr.append(len(flat))
        self.in_ptr = np.array(ptr, dtype=np.int64)
        self.module_index = {m.path: k for k, m in enumerate(profile.modules)}
        self.node_ends = _node_ends(profile, self.saved)
        self.in_ids = np.array(flat, dtype=np.int64)
        # plain timelines: live at op p, and "just before op p" (live at both p-1 and p)
        c = self.creator[ids]
        f = self.freed[ids]
        nb = self.nbytes[ids]
        ts, te, tv = self.tails.pieces(np.ones(self.tails.ids.shape, dtype=bool))
        c, f, nb = np.concatenate([c, ts]), np.concatenate([f, te]), np.concatenate([nb, tv])
        self.base_live = dense(c, f, nb, 0, n - 1) + self.workspace  # workspace at its op only
        self.base_before = dense(c + 1, f, nb, 0, n - 1)
        self._floor: int | None = None  # NOTE [peak floor]

    def floor_peak(self) -> int:
        """NOTE [peak floor] A peak no plan goes below. Checkpointing and offload drop
        forward storages autograd saved, and nothing else; every op of the plain step runs in
        every plan. So every plan keeps, where the plain step has them: gradients and all else
        created in backward, forward storages autograd did not save, and saved ones something
        besides autograd keeps to the end of the step (never freed, or freed at the end though
        autograd released them before: the step's outputs, a cache's keys); and at the last op
        everything live there (a saved tensor the last op reads is live, as itself or as its
        replay's copy). The floor is the larger of those two timelines' peaks, each with the
        ops' workspaces. When it equals the plain peak, no plan peaks lower than the plain step
        (the gradients set the peak): the smallest feasible budget is known without a search."""
        if self._floor is None:
            n = self.n_ops
            released = np.full(self.nbytes.size, -1, dtype=np.int64)  # last release of a pack
            np.maximum.at(released, self.save_sid, self.save_release)
            kept_to_end = self.never_freed | ((self.freed >= n - 1) & (released < n - 1))
            droppable = ((self.creator >= 0) & (self.creator < self.n_forward) & self.saved
                         & ~kept_to_end)
            ids = np.nonzero(self.counted & ~droppable)[0]
            live = dense(self.creator[ids], self.freed[ids], self.nbytes[ids], 0, n - 1) + self.workspace
            self._floor = max(int(live.max(initial=0)), int(self.base_live[n - 1]) if n else 0)
        return self._floor

    def created_in(self, a: int, b: int) -> np.ndarray:
        """Ids of counted storages created by ops ``a..b``."""
        lo = np.searchsorted(self.by_creator_op, a, side="left")
        hi = np.searchsorted(self.by_creator_op, b, side="right")
        return self.by_creator[lo:hi]

    def frame_end(self, a: int, b: int) -> int:
        """The last backward op of the autograd nodes of forward ops ``a..b`` that read a
        saved tensor, -1 if none: a checkpoint of ``a..b`` keeps its frame (its inputs, its
        generator state) until the last such node is done (NOTE [region memory model] in
        ``memfit.planning.effects``)."""
        return int(self.node_ends[a: b + 1].max(initial=-1))

    def frame_unpack(self, a: int, b: int) -> int:
        """The first backward op that reads a tensor autograd saved for forward ops ``a..b``
        (``NEVER``: none, or a profile without ``saves``): where a checkpoint of ``a..b``
        replays (NOTE [region memory model] in ``memfit.planning.effects``)."""
        lo = np.searchsorted(self.save_op_sorted, a, side="left")
        hi = np.searchsorted(self.save_op_sorted, b, side="right")
        return int(self.save_unpack_by_op[lo:hi].min(initial=NEVER))

    def frame_saves(self, ids: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Per storage of ``ids`` (created by ops ``a..b``): the last release of its packs by
        ops ``a..b`` (-1: none) and of its packs by later ops (-1: none; ``NEVER``: one never
        released)."""
        lo, hi = self.save_ptr[ids], self.save_ptr[ids + 1]
        counts = hi - lo
        rel_in = np.full(ids.shape, -1, dtype=np.int64)
        rel_out = np.full(ids.shape, -1, dtype=np.int64)
        total = int(counts.sum())
        if total:
            owner = np.repeat(np.arange(ids.size), counts)
            idx = np.repeat(lo, counts) + np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
            inside = self.save_op[idx] <= b
            np.maximum.at(rel_in, owner[inside], self.save_release[idx[inside]])
            np.maximum.at(rel_out, owner[~inside], self.save_release[idx[~inside]])
        return rel_in, rel_out

    def inputs_of(self, a: int, b: int, modules: tuple[str, ...] = ()) -> np.ndarray:
        """Ids of counted storages created before ``a`` and read by forward ops ``a..b`` or
        passed to the (first) call of one of ``modules``: a checkpoint's frame holds every
        tensor its call was given, read or not (a Hugging Face Llama layer is passed
        ``cache_position``/``position_ids``, one 2 KiB storage its ops never read, held
        through the layer's backward: every benchmark Llama plan peaked 2,048 B over its
        prediction before it was counted)."""
        passed = [s for m in modules for s in self.profile.modules[self.module_index[m]].inputs]
        ids = np.unique(np.concatenate([self.in_ids[self.in_ptr[a]: self.in_ptr[b + 1]],
                                        np.array(passed, dtype=np.int64)]))
        if ids.size == 0:
            return ids
        keep = self.counted[ids] & (self.creator[ids] >= 0) & (self.creator[ids] < a)
        return ids[keep]


def _node_ends(profile: Profile, saved: np.ndarray) -> np.ndarray:
    """Per forward op: the last backward op of its autograd node if one of the node's ops
    reads a saved storage (the node holds saved tensors), else -1."""
    n_fwd = profile.n_forward
    last = np.full(n_fwd, -1, dtype=np.int64)
    holds = np.zeros(n_fwd, dtype=bool)
    for op in profile.ops[n_fwd:]:
        j = op.forward_op
        if j is None or not 0 <= j < n_fwd:
            continue
        last[j] = op.index
        if not holds[j] and any(0 <= s < saved.size and saved[s] for s in op.inputs):
            holds[j] = True
    return np.where(holds, last, -1)


def dense(start: np.ndarray, end: np.ndarray, val: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Sum of ``val`` over intervals ``[start, end]`` at each point ``lo..hi`` (int64)."""
    out = np.zeros(hi - lo + 2, dtype=np.int64)
    if hi < lo:
        return out[:0]
    s = np.maximum(start, lo)
    e = np.minimum(end, hi)
    ok = s <= e
    if ok.any():
        np.add.at(out, s[ok] - lo, val[ok])
        np.add.at(out, e[ok] - lo + 1, -val[ok])
    return np.cumsum(out[:-1])
