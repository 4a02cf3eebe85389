"""Nested regions: checkpointed modules inside a checkpointed block or segment.

NOTE [nested regions]
    A plan may checkpoint a module ``I`` inside a region ``O`` (``blocks.3`` and
    ``blocks.3.attn``); both are recompute-all (no saved ops) and nesting is one level deep.
    What torch's non-reentrant checkpoint then does, per storage (the terms of NOTE [region
    memory model] in ``memfit.planning.effects``):

    - ``I``'s call saves its inputs for its own replay (``_NoopSaveInputs``) under the hooks of
      the enclosing checkpoint: in ``O``'s frame, dropped in forward like ``O``'s other saved
      tensors. Storages created in ``I`` and not escaping it are saved in ``I``'s frame.
    - Backward recomputes ``I`` at ``rp_I``, the first unpack of a storage ``I`` drops. That
      replay needs ``I``'s inputs from ``O``'s frame, so ``O`` is recomputed first if it was
      not yet: ``rp_O = min(first unpack of O's own dropped storages, rp_I)``, which equals the
      recompute point of ``O`` alone.
    - ``O``'s replay (at ``rp_O``) reruns ``I`` as a checkpointed call again: ``I``'s storages
      are transients there, gone when ``I``'s forward returns; they come back at ``rp_I``
      with ``I``'s own replay. So a storage dropped in ``I``'s frame lives ``[c, d]``, then
      ``[rp_I, freed_after]``; one in ``O``'s frame ``[c, d]``, then ``[rp_O, freed_after]``.
    - An output of ``I`` that ``I``'s own ops saved (*held*, NOTE [region memory model]) is
      read by ``O``'s ops after ``I``, whose saves of it go to ``O``'s frame: it is dropped
      and made again as ``O``'s own storage (its copy in ``I``'s replay counted on top).
    - ``I``'s inputs created in ``O`` are held by ``O``'s frame from ``rp_O`` until ``rp_I``
      at least; inputs created before ``O`` (the checkpoint's inputs) until ``rp_O`` and
      every ``rp_I``.
    - That call of ``I`` in ``O``'s replay is a checkpoint call with a frame of its own, which
      stashes the generator state (``region_state_bytes``) and dies with the replay (its
      graph is dropped with the replay's): the stash lives from ``I``'s first step to the end
      of ``O``'s replay (measured: the benchmark's activation-heavy GPT, every block with its
      attention dropout nested, peaked there 5,072 B over the prediction without it).
    - ``O``'s replay runs as far as ``O``'s alone (its stop op). Torch stops it early once
      ``O``'s frame is refilled, which with an inner region at the end of a block can be
      sooner; the profile records where autograd saved tensors (``OpRecord.packs``) but not
      into which frame (an inner region's saves go to its own), so the model keeps the
      later, conservative stop, except where an inner region holds every op from its start
      to that stop: then the replay ends at that inner region's call (NOTE [nested
      segments]).

    The memory this saves: while a block's backward runs the part after ``I`` (in reverse
    order: before it in forward), ``I``'s activations are not held; a GPT block's attention
    maps are absent during its MLP's backward. The price: ``I`` runs twice in backward.
    Modelled time: both replays, both regions' fixed costs (NOTE [region overhead]).

NOTE [nested segments]
    Two-level checkpointing: ``O`` a segment of blocks ``k..j`` of a chain, each block an inner
    region ``I`` of its own (``layers.0..layers.3`` with ``layers.0`` ... ``layers.3``). From
    forward to ``O``'s backward only the segment's input is held, where a region per block
    holds each block's input; ``O``'s replay makes the blocks' inputs again (each block's
    internals are transients of its checkpointed call) and each block's own replay its
    activations. Chen et al.'s recursion, one level deep. The rules above apply, and two more
    (both hold for any nesting; a segment's last block meets the first every time):

    - Torch ends ``O``'s replay once ``O``'s frame is refilled: with every op from ``I``'s
      first to ``O``'s stop inside ``I`` (the last block), ``I``'s call saves only its inputs
      into ``O``'s frame, so the replay stops before ``I``'s first op (the last block runs
      twice in backward, the others three times). The model stops there too.
    - An output of ``I`` that ``I``'s own ops saved (a block ending with a relu) is ``O``'s
      and made again by ``O``'s replay, but that copy serves only the saves of ops outside
      ``I`` (the next block's); ``I``'s saves unpack the copy ``I``'s replay makes. So ``O``'s
      copy ends with the last release of those other saves.

    The chain DP offers it for every segment of single-module blocks (NOTE [chain DP]; not
    with compiled costs, where each block of a segment is its own region: NOTE [segments
    under torch.compile]); the runtime makes the segment first and wraps its blocks inside it
    (``memfit.runtime.apply``). On the MONeT setting (ResNet-50, batch 184, v100 preset) the
    smallest peak fell 5.70 -> 4.39 GB with the stem as a block (NOTE [merged blocks]).
    Measured on the CPU: ``tests/end_to_end/test_nested_segments.py`` (a ResNet-50 of three
    stages at its smallest peak, bitwise, the predicted peak), ``test_predicted_peaks.py``.
NOTE [segments nested in a block]
    The inner region may also be a segment of sibling modules inside the outer module: a
    stage checkpointed with each block of its own chain inside it (``stage_1`` with
    ``stage_1.conv0..stage_1.bn0`` and ``stage_1.conv1..stage_1.bn1``, merged blocks whose
    activation is the stage's own code). Its model is the one above: an inner region is a run
    of ops (``RegionModel`` of a span) whether one module or several make it. ``memfit.jax``
    runs it (a region is a run of primal equations, the inner one a ``jax.checkpoint`` inside
    the outer one's; ``fit`` measures such plans on XLA, NOTE [budgets checked against XLA]).
    The torch runtime does not: it runs a segment from its parent's calls, and inside a
    checkpointed module that parent's replay would have to stop and restart it; ``apply``
    refuses such a plan (``PlanMismatch``), and no solver makes one for a torch profile (the
    chain DP nests modules and blocks of segments, the MILP and greedy nest nothing).
    The chain DP offers a block with its *parts* nested (``PlanningContext.part_partitions``),
    and the block kept with its parts checkpointed alone (each a region of its own: their
    effects add, NOTE [linear model]), where the profile says its front end runs any run of
    ops as a region (``OP_RUNS``, set by ``memfit.jax``): the parts are the blocks of the
    block's own chain, or its sub-modules cut after each that runs a dot or a convolution
    (``parts_after_dots``), a part then spanning its parent's code between two sub-modules
    (a stage's ReLU in ``bn0..conv1``), which a torch segment would not rerun (NOTE
    [chains]). Measured on XLA (jax 0.10.2, CPU, the 3D conv net
    of ``memfit.jax.models``, batch 2, 16^3, widths 8/16/16): every stage checkpointed with
    nothing saved, 4,563,580 B at 1.529 GFLOPs; each stage with its chain's two blocks
    nested, 3,515,388 B at 1.906 GFLOPs (the blocks' convolutions rerun twice); nested at its
    dots, 3,515,580 B at 1.529 GFLOPs; the first stage whole, the second nested at its dots
    and the last one's parts alone, 3,515,196 B at 1.328 GFLOPs. ``memfit.jax.fit`` at half
    the plain peak chose ``nothing_saveable`` on every stage before (4,563,580 B, 1.529
    GFLOPs) and now the chain DP's plan: the first stage whole, the second with its parts at
    its dots nested, the last one's parts alone (4,039,364 B, 1.300 GFLOPs).
NOTE [regions nested deeper]
    Where the profile's front end runs any run of ops as a region (``OP_RUNS``), a region
    nests in every region whose op range contains it, at any depth, and a segment's members
    may be modules of different parents in call order (a run of ops from the first one's
    first op to the last one's last, the code between included): ``memfit.jax`` runs each as
    a ``jax.checkpoint`` inside the one around it. The model is the one above, applied at
    each level: an inner region with regions nested in it is a ``NestedModel`` of its own,
    and the outer one takes from it what its frames do to each storage they drop (both
    lifetimes, from the innermost region that drops it), the inputs its regions hold (until
    their recompute points) and its replays. In an outer replay each inner call runs as a
    checkpointed forward, and a storage that it, or a region nested deeper, drops lives until
    the innermost such call returns (``call_end``; counted to the end of the outermost inner
    call, the conv net's prefixes below were predicted at 7.7 MB). Each region's replay
    reruns its whole op range once, its nested regions' ops included, up to where its last
    inner region starts when that one reaches its stop; so an op ``k`` levels deep reruns up
    to ``k`` times.
    Why deeper: with one level, an outer region's replay holds the inputs of every region
    nested in it until each one's backward, so the step's peak holds one input per part
    beside the backward of the costliest part. The *nested prefixes* (``memfit.jax.measured``:
    parts ``u1..un``, each a region, and each run ``u1..uk`` a region around ``u1..u(k-1)``
    and ``uk``) hold one input at a time, at quadratic rerun. Measured on XLA (jax 0.10.2,
    CPU, the benchmark conv net, its six stage parts): 2,730,196 B, 0.951 of 0.3 of the plain
    peak, where the least one-level plan peaked at 3,515,068 B; 1.819 GFLOPs (the plain step
    1.150), gradients bitwise plain's; predicted 3,333,524 B (1.22x XLA's, as the one-level
    plans' 1.08-1.28x) and 675.9 M extra FLOPs (XLA's 669.0 M: +1.0%). The torch runtime nests
    one level and runs no segment of several parents; ``simulate`` refuses both on a torch
    profile, and ``memfit.apply`` refuses a segment nested in a segment (``PlanMismatch``).

"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from memfit.planning.effects import OP_RUNS, Effect, ProfileArrays, RegionModel, _cat
from memfit.planning.rules import is_matmul
from memfit.profiling.profile import Profile

__all__ = ["NestedModel", "Replay", "OP_RUNS", "parts_after_dots", "unnesting", "nesting_refused"]


# Profile.extra: spans of modules no plan nests a region inside (``unnesting``)
UNNESTED = "unnested_spans"


def unnesting(profile: Profile, spans: Sequence[tuple[int, int]]) -> Profile:
    """``profile`` with the modules of op spans ``spans`` nesting nothing: checkpointed, they
    are checkpointed whole (``memfit.jax.fit``: their nested regions changed the result where
    the module alone did not, NOTE [JAX plans verified on the batch] in ``memfit.jax.verify``)."""
    if not spans:
        return profile
    old = {tuple(s) for s in profile.extra.get(UNNESTED, ())}
    new = tuple(sorted(old | {(int(a), int(b)) for a, b in spans}))
    return dataclasses.replace(profile, extra={**profile.extra, UNNESTED: new})


def nesting_refused(profile: Profile, first_op: int, last_op: int) -> bool:
    """Whether no region may be nested in the region of ops ``first_op..last_op``."""
    return any(a == first_op and b == last_op for a, b in profile.extra.get(UNNESTED, ()))


def parts_after_dots(profile: Profile, path: str) -> list[tuple[str, ...]]:
    """The sub-modules of ``path`` in call order, cut after each one that runs a dot or a
    convolution (NOTE [segments nested in a block]): parts whose backward needs no dot's
    output (a dot's backward reads its inputs), so a part's replay reruns the elementwise ops
    after a dot, not the dot."""
    subs = sorted((m for m in profile.modules if m.parent == path and m.calls == 1 and m.first_op is not None),
                  key=lambda m: int(m.first_op))  # type: ignore[arg-type]
    out: list[tuple[str, ...]] = []
    run: list[str] = []
    for m in subs:
        run.append(m.path)
        if any(is_matmul(profile.ops[i]) for i in range(int(m.first_op), int(m.last_op) + 1)):  # type: ignore[arg-type]
            out.append(tuple(run))
            run = []
    if run:
        out.append(tuple(run))
    return out


@dataclass(frozen=True)
class Replay:
    """One replay of a nested group: before op ``rp``, ops ``a..stop`` rerun.

    ``rs, re, rv``: pieces at replay steps; ``second_bytes``: bytes whose second lifetime starts
    at ``rp`` (they stay after this replay, for a later one at the same point).
    """

    rp: int
    a: int
    stop: int
    rs: np.ndarray
    re: np.ndarray
    rv: np.ndarray
    second_bytes: int
    depth: int


class NestedModel:
    """An outer region with inner regions (NOTE [nested regions]), as storage lifetimes.

    Attributes:
        ids: the outer region's storages (``outer.ids``).
        end1: the end of each one's first lifetime.
        start2: the start of its second lifetime (-1: none).
        end2: the end of its second lifetime.
        input_ids, input_end: storages created before the outer region and the op until which
            the checkpoints hold them.
        replays: the outer replay, then one per useful inner region.
        time_s: recompute seconds of all replays and the regions' fixed costs.
        outer_flops: FLOPs of the outer replay (inner regions' ops included: it reruns them).
        subtrees: per inner region, its own NestedModel where regions nest in it, else None.
        call_end: per storage of the outer region, the op until which it lives when the outer
            region runs as a call inside the replay of a region around it (NOTE [regions
            nested deeper]).
    """

    replays: tuple[Replay, ...]
    call_end: np.ndarray

    def __init__(self, arrs: ProfileArrays, outer: RegionModel,
                 inners: Sequence[RegionModel | NestedModel]) -> None:
        if outer.rp is None:
            raise ValueError(f"nested regions: {outer.span.name} drops nothing")
        self.outer = outer
        # an inner region with regions nested in it (NOTE [regions nested deeper]) is its
        # NestedModel; ``self.inners`` are the regions' own models either way
        self.subtrees: list[NestedModel | None] = [x if isinstance(x, NestedModel) else None for x in inners]
        self.inners = [x.outer if isinstance(x, NestedModel) else x for x in inners]
        out = outer
        pos = {int(s): k for k, s in enumerate(out.ids)}
        owner = np.full(out.ids.shape, -1, dtype=np.int64)
        useful = [q for q, inner in enumerate(self.inners) if inner.rp is not None]
        # per useful inner region: which of its storages are its frames' (``_mine``: an output
        # of I that I's own ops saved is O's, O's ops read it and what they save goes to O's
        # frame, so O's replay makes it again), and where they sit among O's
        where = {q: (m, np.array([pos[int(s)] for s in self.inners[q].ids[m]], dtype=np.int64))
                 for q in useful for m in (self._mine(q),)}
        for q in useful:
            owner[where[q][1]] = q
        rp_o = int(out.rp)  # type: ignore[arg-type]
        rp_i = {q: int(self.inners[q].rp) for q in useful}  # type: ignore[arg-type]
        self.rp = rp_o
        self.inner_rps = tuple(rp_i.get(q) for q in range(len(self.inners)))
        own = out.dropped & (owner < 0)
        self.end1 = np.where(out.dropped, out.d, out.f)
        self.start2 = np.where(own, rp_o, -1)
        self.end2 = out.f2.copy()
        for q in useful:
            inner, sub = self.inners[q], self.subtrees[q]
            mine, ks = where[q]
            if sub is None:
                self.start2[ks] = rp_i[q]
                # Python locals of an inner forward live until it returns, not until O's member's
                self.end1[ks] = inner.d[mine]
            else:  # both lifetimes as the inner region's own nesting has them
                self.start2[ks], self.end1[ks], self.end2[ks] = sub.start2[mine], sub.end1[mine], sub.end2[mine]
        for q in useful:
            # an output I's own ops saved (O's, made again by O's replay): that copy serves
            # the saves of ops outside I; I's saves unpack the copy I's replay makes
            inner = self.inners[q]
            hq = inner.dropped & inner.held
            if hq.any():
                _, rel_out = arrs.frame_saves(inner.ids[hq], inner.a, inner.b)
                ks = np.array([pos[int(s)] for s in inner.ids[hq]], dtype=np.int64)
                self.end2[ks] = np.minimum(self.end2[ks], np.maximum(rel_out, rp_o))
        self.ids = out.ids
        # inputs of each inner region: held by the outer frame until its replay
        # (not their plain free: the region before may drop one, its output, earlier)
        in_ext: dict[int, int] = {int(s): out.hold_end for s in out.inputs}
        held = np.zeros(out.ids.shape, dtype=bool)  # created in out, held by O's frame after rp_O
        for q in useful:
            for s, until, outside in self._inputs(q, rp_i[q]):
                k = pos.get(s)
                if k is None:
                    in_ext[s] = max(in_ext.get(s, -1), outside)
                    continue
                if self.start2[k] < 0 and out.f[k] < rp_o:  # plain transient: held from rp_O
                    self.start2[k] = rp_o
                    self.end2[k] = max(until, int(out.f[k]))
                elif self.start2[k] >= 0:
                    self.end2[k] = max(int(self.end2[k]), until)
                else:  # still live at rp_O
                    self.end1[k] = max(int(self.end1[k]), until)
                held[k] = True
        self.input_ids = np.array(sorted(in_ext), dtype=np.int64)
        self.input_end = np.array([in_ext[s] for s in sorted(in_ext)], dtype=np.int64)
        # the outer replay stops where O's alone does (NOTE [nested regions]), or where torch
        # stops it: an inner region holding every op from its start to that stop saves into
        # O's frame only its inputs, at its call, which refills the frame (NOTE [nested segments])
        self.stop = out.stop
        ending = [q for q in useful if out.a < self.inners[q].a <= out.stop <= self.inners[q].b]
        ends_in = ending[0] if ending else None
        if ends_in is not None:
            self.stop = self.inners[ends_in].a - 1
        # storages of inner frames end with their inner forward's last op, or with that of
        # the region nested deeper that drops them (its call returns first)
        self.call_end = np.minimum(out.f, out.b)
        for q in useful:
            inner, sub = self.inners[q], self.subtrees[q]
            mine, ks = where[q]
            self.call_end[ks] = np.minimum(inner.f, inner.b)[mine] if sub is None else sub.call_end[mine]
        rep = out.c <= self.stop
        end = np.where(own | held, self.stop, np.minimum(out.f, self.stop))
        end = np.where(owner >= 0, self.call_end, end)
        end = np.minimum(end, self.stop)
        ops = np.arange(out.a, self.stop + 1, dtype=np.int64)
        ws = ops[out.workspace[ops] > 0]
        bs, be, bv = out.replay_extras()  # NOTE [region memory model]
        # I's call: its stash (the call that ends the replay stashes too, before it saves)
        stash = [min(i.a, self.stop) for q, i in enumerate(self.inners)
                 if (i.a <= self.stop or q == ends_in) and out.state_bytes > 0]
        bs, be = _cat(bs, np.array(stash, dtype=np.int64)), _cat(be, np.full(len(stash), self.stop, dtype=np.int64))
        bv = _cat(bv, np.full(len(stash), out.state_bytes, dtype=np.int64))
        replays: list[Replay] = [Replay(rp_o, out.a, self.stop, _cat(out.c[rep], ws, bs), _cat(end[rep], ws, be),
                          _cat(out.nb[rep], out.workspace[ws], bv),
                          # what it made and leaves (not what an inner replay makes after it)
                          int(out.nb[(self.start2 == rp_o) & (owner < 0) & (out.c <= self.stop)].sum()), 0)]
        for q in useful:
            inner, sub = self.inners[q], self.subtrees[q]
            if sub is not None:
                replays.extend(dataclasses.replace(r, depth=r.depth + 1) for r in sub.replays)
                continue
            rs, re_, rv = inner.replay_pieces(np.zeros(inner.c.shape, dtype=bool))
            replays.append(Replay(rp_i[q], inner.a, inner.stop, rs, re_, rv,
                                  int(inner.nb[inner.dropped].sum()), 1))
        self.replays = tuple(replays)
        self.outer_time_s = float(out.op_time[out.a: self.stop + 1].sum()) + out.fixed_s(selective=False)
        self.outer_flops = int(out.op_flops[out.a: self.stop + 1].sum())
        useful_s = [c[0] for c, i in zip(self._inner_costs(), self.inners, strict=True) if i.rp is not None]
        self.time_s = (self.outer_time_s + sum(useful_s)
                       + sum(inner.fixed_s(selective=False) for inner in self.inners if inner.rp is None))
        self.arrs = arrs

    def _mine(self, q: int) -> np.ndarray:
        """Which storages of inner region ``q`` its frame (or a frame nested in it) drops and
        its replay makes again: not its outputs that its own ops saved (O's, above)."""
        inner, sub = self.inners[q], self.subtrees[q]
        dropped = inner.dropped if sub is None else sub.start2 >= 0
        return dropped & ~inner.held

    def _inputs(self, q: int, rp_q: int) -> list[tuple[int, int, int]]:
        """Storages inner region ``q`` (and the regions nested in it) hold as inputs: (storage,
        the op until which O's frame holds it when O made it, until which the checkpoints
        hold it when it was made before O)."""
        inner, sub = self.inners[q], self.subtrees[q]
        own = [(int(s), rp_q, inner.hold_end) for s in inner.inputs]
        if sub is None:
            return own
        mine = {s for s, _, _ in own}
        return own + [(int(s), int(e), int(e)) for s, e in zip(sub.input_ids, sub.input_end, strict=True)
                      if int(s) not in mine]

    def _inner_costs(self) -> list[tuple[float, int, int | None]]:
        """Per inner region: the seconds of its replays (its own and those nested in it), its
        outer replay's FLOPs and its recompute point."""
        return [(sub.time_s if sub is not None else inner.time_s(set()) + inner.fixed_s(selective=False),
                 sub.outer_flops if sub is not None else inner.flops(set()), self.inner_rps[q])
                if inner.rp is not None else (inner.fixed_s(selective=False), 0, None)
                for q, (inner, sub) in enumerate(zip(self.inners, self.subtrees, strict=True))]

    def node_costs(self) -> list[tuple[float, int, int | None]]:
        """Per region of this nesting, outer first, then each inner one as nested, depth first:
        its own replay's seconds (fixed charges included), FLOPs and recompute point."""
        out: list[tuple[float, int, int | None]] = [(self.outer_time_s, self.outer_flops, self.rp)]
        for cost, inner, sub in zip(self._inner_costs(), self.inners, self.subtrees, strict=True):
            out.extend(sub.node_costs() if sub is not None and inner.rp is not None else [cost])
        return out

    def state_pieces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The generator states the outer call and each useful inner call stash, each from its
        first op to its recompute point (NOTE [region memory model] in ``effects``)."""
        parts = [self.outer.state_pieces(),
                 *(i.state_pieces() if sub is None else sub.state_pieces()
                   for i, sub in zip(self.inners, self.subtrees, strict=True))]
        return _cat(*(p[0] for p in parts)), _cat(*(p[1] for p in parts)), _cat(*(p[2] for p in parts))

    @property
    def saved_bytes(self) -> int:
        """Bytes held from forward to backward: the outer region's inputs."""
        return int(self.outer.in_nb.sum())

    def effect(self) -> tuple[Effect, tuple[Replay, ...]]:
        """The change from plain as position pieces (``Effect``, without a replay) and the
        replays; the chain DP evaluates both on its local points."""
        out = self.outer
        has2 = self.start2 >= 0
        ps = _cat(out.c, out.c, self.start2[has2])
        pe = _cat(out.f, self.end1, self.end2[has2])
        pv = _cat(-out.nb, out.nb, out.nb[has2])
        f_in = self.arrs.freed[self.input_ids]
        ext = self.input_end > f_in
        ss, se, sv = self.state_pieces()
        ts, te, tv = out.tails  # NOTE [autocast's cast cache] in memfit.planning.cast_cache
        ps = _cat(ps, f_in[ext] + 1, ss, ts)
        pe = _cat(pe, self.input_end[ext], se, te)
        pv = _cat(pv, self.arrs.nbytes[self.input_ids[ext]], sv, tv)
        empty = np.zeros(0, dtype=np.int64)
        return Effect(ps, pe, pv, empty, empty, empty, time_s=self.time_s), self.replays

    @property
    def last_point(self) -> int:
        """The last op position the nesting changes (beyond the outer recompute point)."""
        ends = [int(self.end2[self.start2 >= 0].max(initial=self.rp))]
        ends.extend(r.rp for r in self.replays)
        if self.input_end.size:
            ends.append(int(self.input_end.max()))
        return max(ends)
