"""Which saved tensors outside a plan's regions to keep packed, and the peak that gives.

NOTE [compression candidates]
    Read from the profile alone (``StorageRecord.saves``: which forward op's node saved a
    storage). Only forward ops of the model's own forward (the root module's ops, where
    ``memfit.runtime.compress`` counts them) outside every region are named:

    - ``sign_bit`` (SIGN): the result of ``relu`` when relu's own node is the only one that
      saves it by value (NOTE [sign-only readers] in ``memfit.runtime.compress``); saved also
      by another node that reads its values (the next convolution's input) the bits would
      free nothing. A max pool's save of it (its input) reads the geometry alone: that save
      becomes ``shape_only`` (SHAPE, 0 bytes; NOTE [geometry-only readers]), an entry of the
      same candidate (``Candidate.extra``), and the result is then held by no node.
    - ``two_level`` (EXACT): the mask ``div_`` writes right after ``bernoulli_`` on the same
      storage (dropout on CPU): +0 or ``1/(1-p)``.
    - ``narrow_int`` (EXACT): the int64 indices of ``max_pool*_with_indices`` (charged at the
      int32 bound; the runtime packs them narrower where the values allow).
    - ``bool_bits`` (EXACT): any saved bool output.
    - with ``mode="lossy"`` also every other saved fp32 activation an op outside the regions
      created (``lossy_codec``: one of ``LOSSY_CODECS``, default ``bf16``; one codec for all;
      None: none, the batch-norm variants alone), and the batch norms of NOTE [in-place
      activated batch norm] and NOTE [output-activated batch norm] (``memfit.runtime.bn_rebuild``).

NOTE [compressed peak]
    A compressed storage is held whole from its creation to its last use in the forward,
    with its packed form beside it from the save on (counted from creation); after its last
    forward use only the packed form is held, until autograd releases the last save. Each
    unpack in backward decodes a whole copy, held from the op that first reads that save to
    the one after which its node lets it go. The planned timeline (``simulate``) is adjusted
    by those differences, entry by entry; replay entries in backward count the packed form
    while it is held. A candidate that changes other storages' lives too (``bn_from_output``:
    the relu result freed after its last forward reader, the norm's output held until the
    norm's backward, a relu rebuilt per unpack) lists them as ``windows``: bytes added from
    one op to another, each within the forward or within the backward (a backward window
    also over the replays run while it is open).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Literal

from memfit.planning.compress_readers import (
    ModuleCalls,
    abn_pair,
    geometry_saves,
    in_regions,
    key_in_call,
    relu_after_norm,
)
from memfit.planning.compression import (
    BN_FROM_OUTPUT,
    BOOL_BITS,
    DEFAULT_CODEC_COSTS,
    DEFAULT_LOSSY_CODEC,
    NARROW_INT,
    SHAPE_ONLY,
    SIGN_BIT,
    SIGN_READERS,
    TWO_LEVEL,
    CodecCosts,
    Compressed,
    check_lossy_codec,
    codec_packed_bytes,
)
from memfit.planning.norm_variants import (
    Candidate,
    inplace_activated,
    output_activated,
    relaxed_profile,
    release_of,
)
from memfit.planning.plan import Plan, Region
from memfit.profiling.profile import Profile, StorageKind, StorageRecord

if TYPE_CHECKING:
    from memfit.errors import InfeasibleBudget

__all__ = ["Candidate", "candidates", "compressed_peak", "with_compression", "choose", "codec_seconds"]

CompressMode = Literal["lossless", "lossy"]

_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "bool": 1, "uint8": 1, "int8": 1}

def codec_seconds(profile: Profile, chosen: Sequence[Candidate], costs: CodecCosts | None = None) -> float:
    """Predicted seconds ``chosen`` adds to a step: per tensor, per byte, and the tagging mode
    over each named module's ops (NOTE [compression through saved-tensor hooks])."""
    costs = costs or DEFAULT_CODEC_COSTS
    spans = {m.path: m.last_op - m.first_op + 1 for m in profile.modules
             if m.first_op is not None and m.last_op is not None}
    entries = [e for c in chosen for e in c.entries]
    per = sum(costs.per_tensor_s + costs.per_byte_s.get(e.codec, 0.0) * e.raw_bytes for e in entries)
    return per + costs.mode_per_op_s * sum(spans.get(m, 0) for m in {e.module for e in entries})


def candidates(profile: Profile, regions: Sequence[Region] = (), *, mode: CompressMode = "lossless",
               lossy_codec: str | None = DEFAULT_LOSSY_CODEC) -> list[Candidate]:
    """The saved storages outside ``regions`` that ``mode`` may compress (NOTE [compression
    candidates]), in op order.

    Example:
        >>> [c.entry.codec for c in candidates(profile)]   # doctest: +SKIP
        ['two_level', 'sign_bit']
    """
    if mode not in ("lossless", "lossy"):
        raise ValueError(f"compress mode must be 'lossless' or 'lossy', got {mode!r}")
    check_lossy_codec(lossy_codec)
    root = next((m for m in profile.modules if m.path == ""), None)
    if root is None or root.first_op is None or root.last_op is None:
        return []
    found = _scan(profile, root.first_op, root.last_op, regions, "lossless", lossy_codec, set())
    if mode == "lossy":  # after the exact ones: a dropout mask is two_level, not bf16
        # not a region's input: the checkpoint saves its inputs through the same hooks, and a
        # replay from lossy inputs would differ from its forward (the divergence check raises)
        skip = {c.storage for c in found} | _region_inputs(profile, regions)
        found += _scan(profile, root.first_op, root.last_op, regions, "lossy", lossy_codec, skip)
    return sorted(found, key=lambda c: c.created)


def _region_inputs(profile: Profile, regions: Sequence[Region]) -> set[int]:
    """Storages a region's ops read that were made before the region began."""
    spans = {m.path: (m.first_op, m.last_op) for m in profile.modules}
    out: set[int] = set()
    for r in regions:
        bounds = [spans.get(m, (None, None)) for m in r.modules]
        firsts = [b[0] for b in bounds if b[0] is not None]
        lasts = [b[1] for b in bounds if b[1] is not None]
        if not firsts or not lasts:
            continue
        lo, hi = min(firsts), max(lasts)
        for op in profile.ops[lo: hi + 1]:
            for sid in op.inputs:
                made = profile.storage(sid).created_by
                if made is None or made < lo:
                    out.add(sid)
    return out


def _scan(profile: Profile, first: int, last: int, regions: Sequence[Region], mode: CompressMode,
          lossy_codec: str | None, seen: set[int]) -> list[Candidate]:
    starts = {m.path: m.first_op for m in profile.modules if m.first_op is not None}
    calls = ModuleCalls(profile)
    out: list[Candidate] = []
    for op in profile.ops[first: last + 1]:
        if in_regions(op.module, regions) or op.module not in starts:
            continue
        # the key counts within the op's module's call (NOTE [compression through saved-tensor
        # hooks] in memfit.runtime.compress)
        k, call = key_in_call(profile, op.index, calls)
        for index, meta in enumerate(op.outputs):
            rec = profile.storage(meta.storage)
            itemsize = _ITEMSIZE.get(meta.dtype)
            if (not rec.saved or rec.kind is not StorageKind.ACTIVATION or rec.id in seen
                    or itemsize is None):
                continue
            numel = 1
            for d in meta.shape:
                numel *= d
            if numel == 0 or numel * itemsize != rec.nbytes:
                continue  # a view of part of a storage: packing it frees nothing
            relu = relu_after_norm(profile, rec, regions, starts) if mode == "lossy" else None
            if relu is not None:  # NOTE [output-activated batch norm]
                found = output_activated(profile, op.index, rec, relu, calls)
                # not where a region reads the relu result: its checkpoint holds its inputs
                if found is not None and not found[1] & seen:
                    out.append(found[0])
                    seen.update(found[1])
                    continue
            abn = abn_pair(profile, rec, regions, starts) if mode == "lossy" else None
            if abn is not None:  # NOTE [in-place activated batch norm]
                cand = inplace_activated(profile, op.index, rec, abn, calls)
                seen.update((rec.id, profile.ops[abn[0]].outputs[0].storage))
                out.append(cand)
                continue
            geometry = geometry_saves(profile, op.index, rec, regions, starts)
            codec = _codec_for(profile, op.index, op.name, index, meta.dtype, rec, mode, lossy_codec,
                               geometry)
            if codec is None:
                continue
            seen.add(rec.id)
            entry = Compressed(f"{op.name}#{k}", codec, op.module, rec.nbytes,
                               codec_packed_bytes(codec, numel, itemsize), index, call)
            extra: tuple[Compressed, ...] = ()
            if codec == SIGN_BIT.name:
                extra = tuple(Compressed(f"{profile.ops[j].name}#{kj}", SHAPE_ONLY.name, module, call=cj)
                              for module, j, (kj, cj) in ((m, j, key_in_call(profile, j, calls))
                                                          for _, m, j in geometry))
            by_shape = {j for _, _, j in geometry} if extra else set()
            used = rec.last_forward_use if rec.last_forward_use is not None else op.index
            reads = tuple((u, r if r is not None else u) for j, u, r in rec.saves
                          if u is not None and j not in by_shape)
            out.append(Candidate(entry, rec.id, op.index, max(used, op.index),
                                 release_of(profile, rec.id), reads, extra))
    return out


def _codec_for(profile: Profile, i: int, name: str, index: int, dtype: str, rec: StorageRecord,
               mode: CompressMode, lossy_codec: str | None, geometry: Sequence[tuple[str, str, int]] = ()) -> str | None:
    saves, created_by = rec.saves, rec.created_by
    if name in SIGN_READERS:
        # relu's own node alone saves it by value (NOTE [sign-only readers]): its save first,
        # made right after relu ran, and any other by a max pool that reads its geometry
        if saves and saves[0][0] == i and len(saves) == 1 + len(geometry):
            return SIGN_BIT.name
        if mode != "lossy":
            return None  # read by value elsewhere; the lossy pass may still take it
    if name == "aten.div_.Scalar" and i > 0 and profile.ops[i - 1].name.startswith("aten.bernoulli_"):
        prev = profile.ops[i - 1].outputs
        if prev and prev[0].storage == rec.id:
            return TWO_LEVEL.name
    if name.startswith("aten.max_pool") and name.split(".")[1].endswith("with_indices") and index == 1:
        return NARROW_INT.name
    if dtype == "bool":
        return BOOL_BITS.name
    if mode == "lossy" and dtype == "float32" and created_by == i and index == 0:
        return lossy_codec
    return None


def compressed_peak(profile: Profile, live_bytes: Sequence[int], positions: Sequence[int],
                    chosen: Iterable[Candidate]) -> int:
    """The peak of a planned timeline (``Simulation.live_bytes``/``positions``) with
    ``chosen`` compressed (NOTE [compressed peak])."""
    chosen = list(chosen)
    released = [False] * len(chosen)
    n = profile.n_forward
    # backward windows: open from the first backward position at or past their first op
    # to their last op, replays in between included
    opened = [[False] * len(c.windows) for c in chosen]
    closed = [[False] * len(c.windows) for c in chosen]
    backward = False
    peak = 0
    for live, p in zip(live_bytes, positions, strict=True):
        if p >= n:
            backward = True
        delta = 0
        for j, c in enumerate(chosen):
            for w, (a, b, nbytes) in enumerate(c.windows):
                if not backward:
                    delta += nbytes if a <= p <= b < n else 0
                elif a >= n and not closed[j][w]:
                    opened[j][w] = opened[j][w] or p >= a
                    if opened[j][w]:
                        delta += nbytes
                        closed[j][w] = p >= b
        for j, c in enumerate(chosen):
            e = c.entry
            if not backward:
                if c.created <= p <= c.last_forward_use:
                    delta += e.packed_bytes
                elif p > c.last_forward_use:
                    delta -= e.raw_bytes - e.packed_bytes
            else:
                if not released[j]:
                    delta -= e.raw_bytes - e.packed_bytes
                    if c.release is not None and p >= profile.n_forward and p >= c.release:
                        released[j] = True
                # each unpack decodes a copy, held while its node runs
                delta += sum(e.raw_bytes for u, r in c.reads if u <= p <= r)
        peak = max(peak, live + delta)
    return peak


EXHAUSTIVE_UP_TO = 10  # candidates: every subset tried up to this many, greedy above


def with_compression(profile: Profile, plan: Plan, *, mode: CompressMode = "lossless",
                     lossy_codec: str | None = DEFAULT_LOSSY_CODEC, costs: CodecCosts | None = None,
                     budget_bytes: int | None = None) -> Plan:
    """``plan`` with candidates outside its regions compressed: its predicted peak from NOTE
    [compressed peak], its ``recompute_s`` plus the codecs' seconds.

    Args:
        budget_bytes: compress the subset of least codec time whose peak fits it (every
            subset for up to ``EXHAUSTIVE_UP_TO`` candidates, else greedily by bytes freed per
            codec second); none fitting, or None (default): every candidate.

    Example:
        >>> print(with_compression(profile, plan))   # doctest: +SKIP
    """
    from memfit.planning.simulate import simulate

    found = candidates(profile, plan.regions, mode=mode, lossy_codec=lossy_codec)
    if not found:
        return plan
    sim = simulate(profile, plan)
    def cost(cs: Sequence[Candidate]) -> float:
        return codec_seconds(profile, cs, costs)

    def peak(cs: Sequence[Candidate]) -> int:
        return compressed_peak(profile, sim.live_bytes, sim.positions, cs)

    chosen = found
    if budget_bytes is not None and peak(found) <= budget_bytes:
        if len(found) <= EXHAUSTIVE_UP_TO:
            subsets = ([c for j, c in enumerate(found) if mask >> j & 1] for mask in range(1 << len(found)))
            fitting = (s for s in subsets if peak(s) <= budget_bytes)
            chosen = min(fitting, key=lambda s: (cost(s), peak(s)))
        else:
            order = sorted(found, key=lambda c: -(c.entry.raw_bytes - c.entry.packed_bytes) / max(cost([c]), 1e-12))
            chosen = []
            for c in order:
                if sim.peak_bytes <= budget_bytes or (chosen and peak(chosen) <= budget_bytes):
                    break
                chosen.append(c)
        chosen = sorted(chosen, key=lambda c: c.created)
    if not chosen:
        return plan
    codec_s = cost(chosen)
    kind = "lossy" if any(not c.entry.lossless for c in chosen) else "lossless"
    note = (f"{len(chosen)} saved tensor(s) compressed ({kind}), +{codec_s * 1e3:.2f} ms of codecs "
            "counted in the recompute time")
    return dataclasses.replace(plan, compressed=tuple(e for c in chosen for e in c.entries),
                               predicted_peak_bytes=peak(chosen),
                               recompute_s=plan.recompute_s + codec_s, notes=(*plan.notes, note))


FLOOR_LADDER = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4)  # region budgets: fractions of plain - least


def _smallest_compressed(error: InfeasibleBudget, options: Sequence[Plan], kind: str) -> InfeasibleBudget:
    """The error to raise when nothing fits: naming the smallest peak of the floor's
    compressed options (NOTE [the named compressed floor]; each with every candidate outside
    its regions compressed, none having fit) where it is below the recompute-only one, else
    the recompute-only error itself."""
    from memfit.errors import InfeasibleBudget
    from memfit.units import format_bytes

    smallest = min((p.predicted_peak_bytes for p in options), default=error.min_feasible_bytes)
    if smallest >= error.min_feasible_bytes:
        return error
    least = error.min_feasible_bytes
    return InfeasibleBudget(
        f"budget {format_bytes(error.budget_bytes)} ({error.budget_bytes} bytes) is below the "
        f"smallest peak memfit found with {kind} compression: {format_bytes(smallest)} "
        f"({smallest} bytes; recompute alone reaches {format_bytes(least)}, {least} bytes). Give "
        f"a budget of at least {smallest} bytes" + (", or compress='lossy'" if kind == "lossless" else ""),
        budget_bytes=error.budget_bytes, min_feasible_bytes=smallest,
        fits_with=(f"a budget of at least {smallest} bytes",))


def _with_variants(profile: Profile, solve_on: Callable[[Profile, int], Plan], cap: int,
                   compress: Callable[[Plan], Plan]) -> list[Plan]:
    """The options of NOTE [variants planned with the regions]: the solver's plans of the
    relaxed profile, re-simulated on ``profile`` and compressed outside their regions."""
    from memfit.errors import InfeasibleBudget
    from memfit.planning.simulate import simulate

    taken = [c for c in candidates(profile, mode="lossy", lossy_codec=None)
             if c.entry.codec == BN_FROM_OUTPUT.name]
    if not taken:
        return []
    relaxed = relaxed_profile(profile, taken)
    out: list[Plan] = []
    budgets = [int(f * cap) for f in (1.0, 0.95, 0.9, 0.8)]
    tried: set[int] = set()
    while budgets:
        budget = budgets.pop(0)
        if budget in tried:
            continue
        tried.add(budget)
        try:
            p = solve_on(relaxed, budget)
        except InfeasibleBudget:
            break
        sim = simulate(profile, p)
        # the same ops and times: only the memory differs from the relaxed profile's
        real = dataclasses.replace(p, predicted_peak_bytes=sim.peak_bytes, plain_peak_bytes=profile.peak_bytes)
        out.append(compress(real))
        over = out[-1].predicted_peak_bytes - cap
        if over > 0 and budget == cap:
            budgets.insert(0, cap - over)  # what the relaxation left out, taken off the budget
    return out


def choose(profile: Profile, solve: Callable[[int | float | str | None], Plan],
           budget: int | float | str | None, *, mode: str = "lossless",
           lossy_codec: str | None = DEFAULT_LOSSY_CODEC, costs: CodecCosts | None = None,
           solve_on: Callable[[Profile, int], Plan] | None = None) -> Plan:
    """The fastest plan under ``budget`` among recompute-only and compressed ones.

    NOTE [compress or recompute]
        Compression frees bytes outside the regions at a codec's cost; recompute frees bytes
        inside them at the ops' cost. The choice: the recompute-only plan at the budget; the
        plain step with every candidate compressed; and, for looser region budgets (the
        budget plus 100/75/50/25% of what compression frees on the plain step), the solver's
        plan there with the candidates outside its regions compressed, kept if its peak fits
        the budget; where none fits and no recompute-only plan does, the floor below. The
        least predicted time wins (recompute + codec seconds; ties: the lower peak).
        ``solve`` is the solver (budget -> Plan); it raises ``InfeasibleBudget``.

    NOTE [the named compressed floor]
        Under the least recompute-only peak (``low``) the options above depend on the budget,
        and so would the least peak an error names: a budget that one search called
        infeasible, naming a peak whose own search found nothing (a zoo GPT: 476,713 B named,
        nothing under 481,304 B found there). So where no option fits, the floor's options
        are tried, in this order, none depending on the budget: the least-peak plan, then the
        solver's plans at ``low`` + 1/16, 1/8, 1/4, 1/2 and 3/4 of (plain peak - ``low``),
        each with its outside candidates compressed, the first that fits taken. Where none
        fits, the error names their least peak (each then has every candidate compressed): at
        that budget the same plan fits again, with the cheapest subset of its candidates
        that does. The fractions near ``low`` are there for plans that leave the compressible
        tensors outside their regions (that GPT's lossy floor: 476,716 B from region budgets
        ``low`` + 7-12%, none of 1/4, 1/2 and 3/4 reached it).

    NOTE [variants planned with the regions]
        A batch-norm variant frees a norm's input for a few passes over memory, far less than
        recomputing the convolution before it; but planned after the regions, the solver has
        already spent its recompute where the variants would have freed the bytes (ResNet-50,
        v100, 10.01 GB: every looser budget's plan holds the stage-1 norms in its regions). So
        with ``compress="lossy"`` and a ``solve_on`` (profile, budget in bytes -> Plan), the
        solver also plans a relaxed profile (``norm_variants.relaxed_profile``: every
        ``bn_from_output`` candidate of the plain step taken) at the budget and below; each plan's
        regions are then priced and its peak computed on the real profile with its outside
        candidates compressed, as any other option. What the relaxation leaves out (the
        decoded relu results; a norm inside a region replays whole) can only make an option
        not fit, never a wrong prediction. The relaxed budgets: the budget less the first
        plan's overshoot, and 95, 90 and 80% of the budget (the fastest that fits is not
        always the loosest: ResNet-50 at 10.01 GB, +8.5% at 95%, +8.2% at 90%).

    Raises:
        InfeasibleBudget: no option fits (the recompute-only plan's error).
        ValueError: a mode other than ``"lossless"`` and ``"lossy"``; a ``lossy_codec`` not
            in ``LOSSY_CODECS``.
    """
    from memfit.errors import InfeasibleBudget

    if mode not in ("lossless", "lossy"):
        raise ValueError(f"compress must be None, 'lossless' or 'lossy', got {mode!r}")
    check_lossy_codec(lossy_codec)
    kind: CompressMode = "lossy" if mode == "lossy" else "lossless"

    def compress(p: Plan) -> Plan:
        return with_compression(profile, p, mode=kind, lossy_codec=lossy_codec,
                                costs=costs, budget_bytes=cap)

    error: InfeasibleBudget | None = None
    cap: int | None = None
    options: list[Plan] = []
    base: Plan | None = None
    try:
        base = solve(budget)
        cap = base.budget_bytes
        options += [base, compress(base)]
    except InfeasibleBudget as e:
        error, cap = e, e.budget_bytes
    if cap is None:
        return options[0]
    plain = Plan((), profile.peak_bytes, 0.0, cap, "compress", profile.signature,
                 plain_peak_bytes=profile.peak_bytes, plain_step_s=profile.step_time_s,
                 model=profile.model, input_signature=profile.input_signature,
                 profile_device=base.profile_device if base is not None else profile.device)
    whole = compress(plain)
    options.append(whole)
    freed = profile.peak_bytes - whole.predicted_peak_bytes
    for f in (1.0, 0.75, 0.5, 0.25):
        looser = cap + int(f * freed)
        if freed <= 0 or looser >= profile.peak_bytes:
            continue
        try:
            options.append(compress(solve(looser)))
        except InfeasibleBudget:
            continue
    if kind == "lossy" and solve_on is not None:
        options += _with_variants(profile, solve_on, cap, compress)
    fits = [p for p in options if p.predicted_peak_bytes <= cap]
    if not fits and error is not None:
        # NOTE [the named compressed floor]: under every recompute-only plan's peak, the
        # options below do not depend on the budget; the error names their least peak
        floor = [whole]
        low = error.min_feasible_bytes
        region_budgets: list[int | str] = ["min", *(low + int(f * (profile.peak_bytes - low)) for f in FLOOR_LADDER)]
        for region_budget in region_budgets:
            try:
                floor.append(compress(solve(region_budget)))
            except InfeasibleBudget:
                continue
            if floor[-1].predicted_peak_bytes <= cap:
                break
        options += floor[1:]
        fits = [p for p in options if p.predicted_peak_bytes <= cap]
        if not fits:
            raise _smallest_compressed(error, floor, kind)
    if not fits:
        return options[0]
    best = min(fits, key=lambda p: (p.recompute_s, p.predicted_peak_bytes))
    return dataclasses.replace(best, budget_bytes=cap)
