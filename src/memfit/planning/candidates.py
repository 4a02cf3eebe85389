"""The plan space: candidate regions (modules, chain segments) and chains of blocks.

NOTE [chains]
    A chain is a run of children of an ``nn.ModuleList`` / ``nn.Sequential`` that each ran
    once, one after another, where what block ``k`` (and the parent's code after it) creates
    is read in forward by nothing after block ``k + 1``: each block feeds the next and no skip
    connection jumps over a block. Every block must be a useful region (it drops something).
    On a chain, the memory effect of each block lives in its own forward, its own backward,
    and as a constant in between, which is what makes ``solvers.chain`` exact.

NOTE [merged blocks] (``memfit.planning.merged_blocks``): a chain block may be a run of
    consecutive children.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from itertools import pairwise

import numpy as np

from memfit.planning.effects import (
    Effect,
    ProfileArrays,
    RegionModel,
    RegionSpan,
    resolve_span,
)
from memfit.planning.merged_blocks import merged_runs
from memfit.planning.nesting import OP_RUNS, parts_after_dots
from memfit.planning.offload import Copy, OffloadSpec, offload_copies, offload_effect
from memfit.planning.plan import OpPolicy, Region
from memfit.planning.rules import (
    clobbered_inputs,
    draws_into_region,
    in_place_writes,
    op_keys,
    span_refused,
    unkeyed_ops,
)
from memfit.planning.tails import with_tail
from memfit.profiling.profile import ModuleRecord, Profile

__all__ = ["Candidate", "OpChoice", "Chain", "PlanningContext", "CONTAINER_TYPES", "segment_cap", "indexed",
           "overlap_groups"]

CONTAINER_TYPES = ("ModuleList", "Sequential")
INNER_LIMIT = 6  # sub-modules per block tried as nested regions (most bytes dropped first)


def segment_cap(n: int) -> int:
    """Longest multi-block segment considered on a chain of ``n`` blocks: all of them on short
    chains, about ``2 sqrt(n)`` on long ones (the sqrt(n) regime needs segments of ~sqrt(n)),
    ``sqrt(n) + 3`` past 64 blocks: there the segments' candidates cost more than the rest of
    the plan (126 Llama 3 405B-shaped layers: 5.1 of 11.8 s at 2 sqrt(n); no plan of 40%, 70%
    or "min" chose a segment; benchmarks/published.py)."""
    if n <= 12:
        return n
    return max(4, 2 * math.isqrt(n - 1) + 2) if n <= 64 else math.isqrt(n - 1) + 3


@dataclass(frozen=True)
class OpChoice:
    """One way a candidate region may treat one of its ops instead of recomputing it.

    A solver picks, per candidate, a set of choices with at most one per op (each op has SAVE;
    a context planned with offload adds OFFLOAD). ``effect`` is the change from recompute-all
    (NOTE [region memory model] in ``memfit.planning.effects``); for OFFLOAD, ``copy`` is what
    goes to the host (NOTE [offload memory model] in ``memfit.planning.offload``), whose link
    time is not in ``effect.time_s`` (it depends on the other copies).
    """

    op: int
    policy: OpPolicy
    effect: Effect
    copy: Copy | None = None


@dataclass
class Candidate:
    """A region the solvers may choose, with its linear effects (NOTE [region memory model])."""

    index: int
    model: RegionModel
    base: Effect
    choices: tuple[OpChoice, ...]       # alternatives to recomputing an op: saves, then offloads, each in op order
    keys: dict[int, str] = field(repr=False)

    @property
    def modules(self) -> tuple[str, ...]:
        return self.model.span.modules

    @property
    def a(self) -> int:
        return self.model.a

    @property
    def b(self) -> int:
        return self.model.b

    @property
    def rp(self) -> int:
        return int(self.model.rp)  # type: ignore[arg-type]

    @property
    def stop(self) -> int:
        return self.model.stop

    @property
    def time_s(self) -> float:
        """Recompute-all seconds, plus the fixed cost of one more checkpointed region (NOTE
        [region overhead] and NOTE [dispatch overhead] in ``memfit.timemodel``)."""
        return self.base.time_s + self.model.fixed_s(selective=False)

    @property
    def selective_s(self) -> float:
        """Extra seconds when the region saves at least one op (NOTE [dispatch overhead])."""
        return self.model.fixed_s(selective=True) - self.model.fixed_s(selective=False)

    def region(self, chosen: tuple[int, ...] | list[int] = ()) -> Region:
        """The region with the choices at positions ``chosen`` (indices into ``choices``)."""
        picked = sorted((self.choices[j] for j in chosen), key=lambda c: c.op)
        return Region(self.modules, tuple((self.keys[c.op], c.policy) for c in picked),
                      tail_after=self.model.span.tail_after)


@dataclass(frozen=True)
class Chain:
    """Blocks of a chain (NOTE [chains]) and their forward op ranges; a block is one child of
    the parent or a run of consecutive children (NOTE [merged blocks])."""

    parent: str
    blocks: tuple[tuple[str, ...], ...]
    first_ops: tuple[int, ...]
    last_ops: tuple[int, ...]

    def modules(self, k: int, j: int | None = None) -> tuple[str, ...]:
        """The modules of blocks ``k..j`` (``j`` defaults to ``k``), in call order."""
        return tuple(m for blk in self.blocks[k: (k if j is None else j) + 1] for m in blk)

    def name(self, k: int) -> str:
        blk = self.blocks[k]
        return blk[0] if len(blk) == 1 else f"{blk[0]}..{blk[-1]}"


class PlanningContext:
    """Everything the solvers share about one profile, computed lazily and once."""

    def __init__(self, profile: Profile, offload: OffloadSpec | None = None) -> None:
        self.profile = profile
        self.offload = offload  # None: plans never offload
        self.arrays = ProfileArrays(profile)
        self._index = self.arrays.module_index
        self._cands: dict[tuple[str, ...], Candidate | None] = {}
        self._inner: dict[str, list[RegionModel]] = {}
        self.memo: dict[str, dict] = {}  # solvers' per-context caches, by solver

    def candidate(self, modules: tuple[str, ...], *, with_ops: bool = True,
                  tail: bool = True) -> Candidate | None:
        """The candidate for a module or segment, or ``None`` if checkpointing it drops nothing;
        a module's ends before its tail (NOTE [region tails] in ``memfit.planning.tails``)
        unless ``tail`` is False (a region nested in or around others)."""
        key = (modules, with_ops, tail)
        hit = self._cands.get(key)  # type: ignore[arg-type]
        if hit is not None or key in self._cands:
            return hit
        if len({self.profile.modules[self._index[m]].parent for m in modules if m in self._index}) > 1:
            self._cands[key] = None  # type: ignore[index]
            return None  # no segment across a join (NOTE [joined chains] in planning.chain_joins)
        span = resolve_span(self.profile, modules, self._index)
        # A segment's replay reruns its blocks only, so no segment spans parent code between
        # two blocks (a UNet's pooling): the runtime would cut it there (NOTE [chains]).
        recs = [self.profile.modules[self._index[m]] for m in modules]
        if any(self.parent_ops_between(a.last_op, b.first_op)  # type: ignore[arg-type]
               for a, b in pairwise(recs)):
            self._cands[key] = None  # type: ignore[index]
            return None
        # NOTE [clobbered inputs], [inputs read after a region], [refused spans] in planning.rules
        if self.clobbered(recs) or span_refused(self.profile, span.first_op, span.last_op):
            self._cands[key] = None  # type: ignore[index]
            return None
        if tail:
            span = with_tail(self.arrays, span)
        cand = self._build(span, with_ops)
        self._cands[key] = cand  # type: ignore[index]
        return cand

    def _build(self, span: RegionSpan, with_ops: bool) -> Candidate | None:
        rm = RegionModel(self.arrays, span)
        if not rm.useful:
            return None
        keys = op_keys(self.profile, rm.a, rm.b) if with_ops else {}
        arrs = self.arrays
        saveable: tuple[int, ...] = ()
        if with_ops:
            saveable = tuple(i for i in range(rm.a, rm.stop + 1)
                             if arrs.op_saveable[i] and arrs.op_time[i] > 0 and i in keys
                             and not self._escapes(i, rm.b)
                             and not self._written_later(i))
        draws: tuple[int, ...] = ()
        if with_ops:  # NOTE [kept draws] in memfit.runtime.draws
            draws = tuple(i for i in range(rm.a, rm.stop + 1)
                          if arrs.draw_bytes[i] > 0 and arrs.op_time[i] > 0 and i in keys
                          and draws_into_region(self.profile, self.profile.ops[i], rm.a))
        choices = tuple(OpChoice(i, OpPolicy.SAVE, rm.op_effect(i)) for i in sorted(saveable + draws))
        if self.offload is not None:  # an op that may be saved may be offloaded
            offl = (OpChoice(i, OpPolicy.OFFLOAD, offload_effect(rm, i, self.offload), offload_copies(rm, i))
                    for i in saveable)
            choices += tuple(c for c in offl if c.copy is not None and c.copy.nbytes > 0)
        return Candidate(index=-1, model=rm, base=rm.base_effect(), choices=choices, keys=keys)

    def parent_ops_between(self, prev_last: int, next_first: int) -> bool:
        """Whether an op other than torch's ignored ones ran between two sibling blocks."""
        unkeyed = unkeyed_ops()
        return any(self.profile.ops[i].name not in unkeyed for i in range(prev_last + 1, next_first))

    @cached_property
    def _writes(self) -> dict[int, int]:
        return in_place_writes(self.profile)

    def clobbered(self, recs: list[ModuleRecord]) -> bool:
        """Whether the region's inputs are written in place once it has started."""
        return bool(clobbered_inputs(self.profile, recs, self._writes))

    @cached_property
    def _written_in_place(self) -> frozenset[int]:
        """Storages a forward in-place op read (and perhaps wrote): every input, to be safe."""
        return frozenset(sid for op in self.profile.forward_ops if op.inplace for sid in op.inputs)

    def _written_later(self, op: int) -> bool:
        """Whether an output of ``op`` is later written in place: the runtime then recomputes it
        anyway (a cached tensor must not change), so offering it would count memory twice."""
        return any(t.storage in self._written_in_place for t in self.profile.ops[op].outputs)

    def _escapes(self, op: int, last_op: int) -> bool:
        """Whether an output of ``op`` is read after the region's last op (NOTE [escaping
        outputs] in ``memfit.planning.rules``)."""
        for t in self.profile.ops[op].outputs:
            use = self.profile.storages[t.storage].last_forward_use
            if use is None or use > last_op:
                return True
        return False

    # -- module candidates ---------------------------------------------------------------------
    @cached_property
    def module_candidates(self) -> list[Candidate]:
        """Every module (not the root) called once whose checkpointing drops something; of
        modules with the same op range only the outermost."""
        return self._module_candidates()

    def module_candidates_outside(self, lo: int, hi: int) -> list[Candidate]:
        """``module_candidates`` but those whose ops all lie in ``lo..hi`` (without building
        them): a module inside a chain's span drops only what the chain's region drops (a
        storage that escapes it escapes the chain or is saved by the chain's ops)."""
        if "module_candidates" in self.__dict__:
            return [c for c in self.module_candidates if not (lo <= c.a and c.b <= hi)]
        return self._module_candidates(skip=(lo, hi))

    def _module_candidates(self, skip: tuple[int, int] | None = None) -> list[Candidate]:
        out = []
        seen: set[tuple[int, int]] = set()
        for m in self.profile.modules:
            if not m.path or m.calls != 1 or m.first_op is None or m.last_op is None:
                continue
            if (m.first_op, m.last_op) in seen:
                continue
            seen.add((m.first_op, m.last_op))
            if skip is not None and skip[0] <= m.first_op and m.last_op <= skip[1]:
                continue
            c = self.candidate((m.path,))
            if c is not None:
                out.append(c)
        return out

    # -- chains --------------------------------------------------------------------------------
    @cached_property
    def chains(self) -> list[Chain]:
        """Chains (NOTE [chains], NOTE [merged blocks]), the one whose cut points can part the
        most saved bytes first (``chain_order_bytes``)."""
        prof = self.profile
        found: list[list[list[ModuleRecord]]] = []
        for m in prof.modules:
            if m.type not in CONTAINER_TYPES or len(m.children) < 2:
                continue
            kids = [prof.modules[self._index[c]] for c in m.children if c in self._index]
            kids = [k for k in kids if k.calls == 1 and k.first_op is not None]
            kids.sort(key=lambda k: k.first_op)  # type: ignore[arg-type, return-value]
            found.extend(merged_runs(self, kids))
        chains = []
        for run in found:
            if len(run) < 2:
                continue
            # the last block's output may be read anywhere later; earlier blocks checked above
            chains.append(Chain(run[0][0].parent or "", tuple(tuple(k.path for k in blk) for blk in run),
                                tuple(int(blk[0].first_op) for blk in run),  # type: ignore[arg-type]
                                tuple(int(blk[-1].last_op) for blk in run)))  # type: ignore[arg-type]
        chains.sort(key=self.chain_order_bytes, reverse=True)
        return chains

    def chain_order_bytes(self, chain: Chain) -> int:
        """Saved bytes of the chain outside its largest block: what its cut points can part.
        A model ``nn.Sequential(features, head)`` is a chain of two blocks saving nearly all
        bytes, one of which holds them all; ``features``' own chain of 21 blocks comes first."""
        arrs = self.arrays
        per_block = [int(arrs.nbytes[ids][arrs.saved[ids]].sum())
                     for ids in (arrs.created_in(a, b) for a, b in zip(chain.first_ops, chain.last_ops, strict=True))]
        return self.chain_saved_bytes(chain) - max(per_block)

    def chain_saved_bytes(self, chain: Chain) -> int:
        """Autograd-saved activation bytes created by the chain's ops."""
        arrs = self.arrays
        ids = arrs.created_in(chain.first_ops[0], chain.last_ops[-1])
        return int(arrs.nbytes[ids][arrs.saved[ids]].sum())

    def _dropped_ids(self, modules: tuple[str, ...]) -> set[int]:
        span = resolve_span(self.profile, modules, self._index)
        rm = RegionModel(self.arrays, span)
        return set(rm.ids[rm.dropped].tolist())

    def chain_droppable_share(self, chain: Chain) -> float:
        """Share of the bytes any candidate region could drop that the chain's regions drop."""
        memo = self.memo.setdefault("chain_share", {})
        if chain not in memo:
            memo[chain] = self._chain_droppable_share(chain)
        return memo[chain]  # type: ignore[no-any-return]

    def _chain_droppable_share(self, chain: Chain) -> float:
        mods = chain.modules(0, len(chain.blocks) - 1)
        parent = {m: self.profile.modules[self._index[m]].parent for m in mods}
        in_chain = set().union(*(self._dropped_ids(tuple(m for m in mods if parent[m] == p))
                                 for p in dict.fromkeys(parent.values())))  # NOTE [joined chains]
        every = set(in_chain)
        lo, hi = chain.first_ops[0], chain.last_ops[-1]
        for c in self.module_candidates_outside(lo, hi):
            every |= set(c.model.ids[c.model.dropped].tolist())
        total = int(self.arrays.nbytes[list(every)].sum()) if every else 0
        mine = int(self.arrays.nbytes[list(in_chain)].sum()) if in_chain else 0
        return mine / total if total else 0.0

    @cached_property
    def saved_activation_bytes(self) -> int:
        arrs = self.arrays
        fwd = (arrs.creator >= 0) & (arrs.creator < arrs.n_forward) & arrs.counted
        return int(arrs.nbytes[fwd & arrs.saved].sum())

    def segment_candidates(self, chain: Chain, cap: int | None = None) -> list[Candidate]:
        """Recompute-all segments of 2..cap consecutive blocks of a chain."""
        n = len(chain.blocks)
        cap = segment_cap(n) if cap is None else cap
        out = []
        for k in range(n):
            for j in range(k + 1, min(n, k + cap)):
                c = self.candidate(chain.modules(k, j), with_ops=False)
                if c is not None:
                    out.append(c)
        return out

    def inner_candidates(self, path: str) -> list[RegionModel]:
        """Sub-modules of ``path`` worth checkpointing inside it (NOTE [nested regions] in
        ``memfit.planning.nesting``): each ran once, drops something, and is among the
        ``INNER_LIMIT`` that drop the most bytes."""
        hit = self._inner.get(path)
        if hit is not None:
            return hit
        prefix = path + "." if path else ""
        found = []
        for m in self.profile.modules:
            if not m.path.startswith(prefix) or m.path == path or m.calls != 1 or m.first_op is None:
                continue
            span = resolve_span(self.profile, (m.path,), self._index)
            if self.clobbered([m]) or span_refused(self.profile, span.first_op, span.last_op):
                continue
            rm = RegionModel(self.arrays, span)
            if rm.useful:
                found.append((int(rm.nb[rm.dropped].sum()), rm.a, rm))
        found.sort(key=lambda x: (-x[0], x[1]))
        out = [rm for _, _, rm in found[:INNER_LIMIT]]
        self._inner[path] = out
        return out

    def part_partitions(self, path: str) -> list[list[RegionModel]]:
        """Ways to cut ``path`` into parts checkpointed inside it (NOTE [segments nested in a
        block] in ``memfit.planning.nesting``): its chain's blocks, and its sub-modules cut
        after each dot; only where the profile's front end runs any run of ops as a region
        (``OP_RUNS``). Parts that drop nothing, are refused or have clobbered inputs are left
        out; a partition keeps at least two."""
        memo = self.memo.setdefault("part_partitions", {})
        if path in memo:
            return memo[path]  # type: ignore[no-any-return]
        out: list[list[RegionModel]] = []
        if self.profile.extra.get(OP_RUNS):
            chain = next((c for c in self.chains if c.parent == path), None)
            seen = set()
            for parts in (chain.blocks if chain else (), parts_after_dots(self.profile, path)):
                models = [rm for rm in map(self._part, parts) if rm is not None]
                key = tuple(rm.span.modules for rm in models)
                if len(models) >= 2 and key not in seen:
                    seen.add(key)
                    out.append(models)
        memo[path] = out
        return out

    def _part(self, modules: tuple[str, ...]) -> RegionModel | None:
        recs = [self.profile.modules[self._index[m]] for m in modules]
        span = resolve_span(self.profile, modules, self._index)
        if self.clobbered(recs) or span_refused(self.profile, span.first_op, span.last_op):
            return None
        rm = RegionModel(self.arrays, span)
        return rm if rm.useful else None

    def region_candidates(self, *, segments: bool = True) -> list[Candidate]:
        """Module candidates plus chain segments, indexed 0..R-1 (the MILP/brute plan space)."""
        cands = list(self.module_candidates)
        if segments:
            seen = {(c.a, c.b) for c in cands}
            for ch in self.chains:
                if all(len(blk) == 1 for blk in ch.blocks):
                    cands.extend(self.segment_candidates(ch))
                    continue
                # merged blocks (NOTE [merged blocks]) are regions too; a segment with the op
                # range of a module already offered (a container's whole run) is that module
                for c in [self.candidate(blk) for blk in ch.blocks if len(blk) > 1] + self.segment_candidates(ch):
                    if c is not None and (c.a, c.b) not in seen:
                        seen.add((c.a, c.b))
                        cands.append(c)
        return indexed(cands)


def indexed(cands: list[Candidate]) -> list[Candidate]:
    """Copies of ``cands`` with ``index`` = position in the list (what LinearModel expects)."""
    return [Candidate(k, c.model, c.base, c.choices, c.keys) for k, c in enumerate(cands)]


def overlap_groups(cands: list[Candidate], n_forward: int) -> list[list[int]]:
    """Maximal sets of candidates sharing a forward op (at most one of each may be chosen)."""
    cover: dict[int, list[int]] = {}
    events = np.zeros(n_forward + 1, dtype=np.int64)
    for c in cands:
        events[c.a] += 1
        events[c.b + 1] -= 1
    depth = np.cumsum(events)[:-1]
    groups: set[tuple[int, ...]] = set()
    for q in np.nonzero(depth >= 2)[0]:
        cover.setdefault(int(q), [])
    if not cover:
        return []
    for c in cands:
        for p in range(c.a, c.b + 1):
            if p in cover:
                cover[p].append(c.index)
    for g in cover.values():
        groups.add(tuple(sorted(g)))
    out = sorted(groups)
    # drop groups contained in another
    sets = [set(g) for g in out]
    return [list(g) for g, s in zip(out, sets, strict=True)
            if not any(s < t for t in sets)]
