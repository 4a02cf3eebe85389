"""Which op outputs a plan may save, and how ops inside a region are named.

NOTE [saveable ops]
    An op occurrence inside a region may be saved (``OpPolicy.SAVE``) only if
    - it is a forward op that creates at least one new storage, and every tensor it returns
      lives in a storage it created (no views or aliases of earlier storages: caching a view
      would pin its base, and the planner's memory model counts storages, not views);
    - it does not write to an input (``OpRecord.inplace``): torch skips a saved op during
      recomputation, so the in-place write would never happen (dropout's ``div_`` then gives
      wrong gradients, see DESIGN.md);
    - it does not consume the random-number generator (``OpRecord.random``): skipping it during
      recomputation would shift every later random draw of the region. The exception is a
      kept draw (:func:`is_kept_draw`, NOTE [kept draws] in ``memfit.runtime.draws``): the
      runtime keeps what it wrote and the generator's state after it, not its output.
    The planner also never saves an op whose output escapes its region (is read after the
    region's last op, e.g. a block's final residual add), NOTE [escaping outputs]: the
    selective-checkpoint cache then holds that tensor until the region is recomputed, past the
    point where the rest of the step releases it, for the time of one cheap op.
    Nor does it save an op whose output a later forward op writes in place: the runtime
    recomputes such an output anyway (a cached tensor must not change under it).
    ``aten.detach.default`` gets no key at all: torch's selective checkpoint never asks the
    policy about it (checkpointing adds detaches of its own), see ``memfit.runtime.policies``.

NOTE [clobbered inputs]
    A checkpointed region keeps its inputs for the recomputation: torch's non-reentrant
    checkpoint saves the tensors passed to it with ``save_for_backward`` (so with their version
    counters), and a chain segment holds the other tensors passed to its later blocks and checks
    their versions before the replay. A forward op that writes one of those inputs in place once
    the region has started therefore breaks backward ("one of the variables needed for gradient
    computation has been modified by an inplace operation", or ``RecomputeMismatch``), although
    the plain step runs: plain autograd may not have saved that tensor at all (``h +=
    block(h)`` where the block first scales ``h`` by a Python number; a block whose first op is
    ``relu_`` on its input, which is the previous block's output). The recomputation needs the
    value from before the write, which nothing keeps. So a module or segment whose input storage
    (one created before its first op) is written in place by a forward op at or after its first
    op is no candidate region (:func:`clobbered_inputs`); its sub-modules and segments starting
    at a later block still are. Storage granularity: views share their base's version counter.
    An output of a region written in place later is handled by the rules above (such an op is
    never saved, so the selective cache never holds it).

NOTE [collectives in a region]
    A region may hold the collectives its own forward ops issue: tensor parallelism's
    all-reduce after a row-wise layer, a DTensor redistribution, a functional collective in
    the model's code (the ``_c10d_functional`` namespace: :data:`RERUN_NAMESPACES`). Its
    recomputation issues them again:
      1. every rank replays the same ops in the same order, because every rank runs the same
         plan (NOTE [one plan per job] in ``memfit.parallel.distributed``), and torch's checkpoint
         replays a region in backward at the same point of the graph on every rank;
      2. a replayed collective returns the forward's value: the ranks reduce the same inputs
         (replayed bitwise) in gloo's and NCCL's fixed order for a given group and size;
      3. it costs its time again: the profile measured it (``OpRecord.time_s``; a cost-model
         time from the device's link in fake mode, ``memfit.timemodel.devices``), and the
         planner counts it like any op's. torch's early stop ends the replay once backward
         has what it needs, so a row-wise layer's all-reduce that only feeds the residual add
         is not re-run at all (the planner models that stop: NOTE [region memory model]);
      4. its output may be saved instead (Megatron's selective recompute keeps the
         all-reduce's output): an ``OpPolicy.SAVE`` like any other op's (NOTE [saveable
         ops]): the replay then sends nothing for it, and the planner chooses between the
         two by bytes and seconds.
    The rule stays for the collectives that must not run again (``c10d`` and ``fsdp``
    namespaces, :func:`must_not_rerun`): a region holding one is no candidate.
      - FSDP's gathers and copies (``c10d._allgather_base_``, ``fsdp.*``) come from its
        hooks, and FSDP2's hooks do not re-run them: in backward they find the unit already
        gathered and skip the all-gather, so the replay runs other ops and raises
        ``RecomputeMismatch`` (seen on a segment over two ``fully_shard`` blocks and on a
        region over a module holding them).
      - A ``c10d`` call in the model's own forward (``dist.all_reduce(x)``) writes its input
        in place: a side effect of the user's, which a replay would apply twice to a tensor
        the step may have kept, and which no plan may save (NOTE [saveable ops]).
    The storages such ops write count as clobbered inputs (:func:`clobbered_inputs`), so
    every solver skips the region. An FSDP unit itself may be a region: its hooks gather
    before its first op and free after its last, outside its op range (the profile puts
    those ops on the parent), and the runtime's checkpoint runs inside the hooks (NOTE [how
    wrap works] in ``memfit.runtime.wrap``). So in a profile of a sharded model no segment
    spans two units (their gathers run between the blocks, in the parent) and no region
    encloses one. A profile made before sharding has no collectives: plan after
    ``fully_shard`` (docs/distributed.md).

NOTE [buffer writes]
    A region whose forward writes a module buffer in place (BatchNorm statistics,
    spectral_norm's vectors, counters) needs the runtime's buffer watcher (NOTE [buffers
    written in forward] in ``memfit.runtime.buffers``), which costs a Python dispatch per op;
    one that writes none runs without it. :func:`writes_buffers` reads that from the profile:
    a forward op of the region that writes an input (``inplace``: the schema's ``(a!)``, so
    ``out=`` too) reading a buffer storage, or a batch-norm op reading one (it updates the
    running statistics without declaring it). Conservative: an in-place op that reads a
    buffer without writing it counts too.
"""

from __future__ import annotations

import math
import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence

from memfit.ops import KEPT_DRAW_OPS, MATMUL_PACKETS, ignored_op_names
from memfit.ops import is_matmul as _is_matmul_name
from memfit.profiling.profile import ModuleRecord, OpRecord, Profile, StorageKind, is_for_compiler

__all__ = ["unkeyed_ops", "MATMUL_PACKETS", "is_saveable", "is_kept_draw", "draws_into_region", "draw_bytes", "op_keys", "keys_to_ops", "is_matmul",
           "in_place_writes", "clobbered_inputs", "writes_buffers", "buffer_writes", "is_collective",
           "must_not_rerun", "collective_writes", "COLLECTIVE_NAMESPACES", "RERUN_NAMESPACES",
           "CLOSED_REGIONS", "inputs_read_after", "REFUSED_SPANS", "contains_refused_span", "refusing", "span_refused"]

# NOTE [inputs read after a region]
#     A profile whose ``extra[CLOSED_REGIONS]`` is true plans only regions none of whose
#     forward inputs (activations made before the region) a forward op after the region reads.
#     ``memfit.jax`` sets it (NOTE [XLA's costs] in ``memfit.jax.xla_costs``, rule 4): on XLA
#     CPU a ``jax.checkpoint`` over a LayerNorm whose input the residual add after it reads
#     gave gradients 2e-8 to 6e-8 apart from the plain step's (the GPT of
#     ``memfit.jax.models``, each of its 8 LayerNorms alone, each with the attention after
#     it), and the same region with that add inside it gave them bitwise, as did every region
#     with no such input (whole blocks, the attention, the MLP). Torch profiles never set it.
CLOSED_REGIONS = "closed_regions"


def inputs_read_after(profile: Profile, first_op: int, last_op: int) -> bool:
    """Whether the profile asks for closed regions and the forward ops ``first_op..last_op``
    read an activation made before them that a forward op after ``last_op`` reads (NOTE
    [inputs read after a region])."""
    if not profile.extra.get(CLOSED_REGIONS):
        return False
    st = profile.storages
    for op in profile.ops[first_op: last_op + 1]:
        for s in op.inputs:
            made, use = st[s].created_by, st[s].last_forward_use
            if made is not None and made < first_op and use is not None and use > last_op:
                return True
    return False


# NOTE [refused spans]
#     ``extra[REFUSED_SPANS]`` lists forward op spans ``(first, last)`` that no planned region
#     may contain whole: a front end that ran a plan and found one of its regions changes the
#     step's result (NOTE [JAX plans verified on the batch] in ``memfit.jax.verify``) plans
#     again without it, and without any region around it (a segment over the same block
#     reruns it the same way); regions inside it remain candidates, to be checked in turn.
REFUSED_SPANS = "refused_spans"


def contains_refused_span(profile: Profile, first_op: int, last_op: int) -> bool:
    """Whether forward ops ``first_op..last_op`` contain a span the profile refuses (NOTE
    [refused spans])."""
    return any(first_op <= a and b <= last_op for a, b in profile.extra.get(REFUSED_SPANS, ()))


def refusing(profile: Profile, spans: Sequence[tuple[int, int]]) -> Profile:
    """``profile`` with ``spans`` added to the spans it refuses (NOTE [refused spans])."""
    import dataclasses

    old = tuple(tuple(s) for s in profile.extra.get(REFUSED_SPANS, ()))
    new = tuple(sorted({*old, *((int(a), int(b)) for a, b in spans)}))
    return dataclasses.replace(profile, extra={**profile.extra, REFUSED_SPANS: new})


def span_refused(profile: Profile, first_op: int, last_op: int) -> bool:
    """Whether no region may cover forward ops ``first_op..last_op``: an input read after it
    (NOTE [inputs read after a region]) or a refused span inside it (NOTE [refused spans])."""
    return inputs_read_after(profile, first_op, last_op) or contains_refused_span(profile, first_op, last_op)


def unkeyed_ops() -> frozenset[str]:
    """Ops the selective-checkpoint policy is never consulted for (NOTE [saveable ops]), by
    name: the runtime skips the same ones (NOTE [ignored ops] in memfit.ops); torch's, read on
    first use (NOTE [torch-free facts] there)."""
    return ignored_op_names()


def is_saveable(profile: Profile, op: OpRecord) -> bool:
    """Whether ``op``'s outputs may be saved by a plan (NOTE [saveable ops]).

    Example:
        >>> is_saveable(profile, profile.ops[3])   # doctest: +SKIP
        True
    """
    if op.index >= profile.n_forward or op.inplace or op.random or op.name in unkeyed_ops():
        return False
    if not op.saveable:  # the front end cannot name its outputs (memfit.jax)
        return False
    if not op.outputs:
        return False
    return all(profile.storages[t.storage].created_by == op.index for t in op.outputs)


def is_kept_draw(profile: Profile, op: OpRecord) -> bool:
    """Whether a plan may keep ``op``'s draw (NOTE [kept draws] in ``memfit.runtime.draws``): a
    forward op of :data:`memfit.ops.KEPT_DRAW_OPS` writing one tensor that an earlier forward
    op created (dropout's mask, made by ``empty_like``), in a profile with eager costs (a
    compiled backward draws again: NOTE [compiled costs] in
    ``memfit.profiling.compiled_costs``). The planner offers it only where that creator is in
    the same region (``memfit.planning.candidates``), so the replay makes the tensor again.

    Example:
        >>> is_kept_draw(profile, profile.ops[227])   # doctest: +SKIP
        True
    """
    if op.index >= profile.n_forward or op.name not in KEPT_DRAW_OPS or len(op.outputs) != 1:
        return False
    if is_for_compiler(profile):  # the compiled backward draws again (NOTE [compiled costs], 5)
        return False
    created = profile.storages[op.outputs[0].storage].created_by
    return created is not None and 0 <= created < op.index


def draws_into_region(profile: Profile, op: OpRecord, first_op: int) -> bool:
    """Whether the tensor kept draw ``op`` writes was made by the region starting at
    ``first_op``, so that its replay makes it again (NOTE [kept draws])."""
    created = profile.storages[op.outputs[0].storage].created_by
    return created is not None and created >= first_op


def draw_bytes(profile: Profile, op: OpRecord) -> int:
    """Bytes keeping ``op``'s draw holds: one per element written, and the generator's state
    (``Profile.region_state_bytes``: 0 where it is host memory). NOTE [kept draws]."""
    return math.prod(op.outputs[0].shape) + int(profile.region_state_bytes)


def in_place_writes(profile: Profile) -> dict[int, int]:
    """Storage id -> index of the last forward op that writes it in place.

    The storages an in-place op writes are those of the tensors it returns (the written
    argument); one that returns no tensor is taken to write all its inputs.

    Example:
        >>> in_place_writes(profile)   # doctest: +SKIP
        {12: 40, 31: 77}
    """
    last: dict[int, int] = {}
    for op in profile.forward_ops:
        if op.inplace:
            for sid in [t.storage for t in op.outputs] or op.inputs:
                last[sid] = op.index
    return last


def clobbered_inputs(profile: Profile, modules: Sequence[ModuleRecord],
                     writes: Mapping[int, int] | None = None) -> tuple[int, ...]:
    """Input storages of the region ``modules`` (one module, or a segment's blocks in call
    order) that a forward op writes in place once the region has started (NOTE [clobbered
    inputs]), and storages a collective that must not re-run writes inside it (NOTE
    [collectives in a region]);
    empty if the region may be checkpointed.

    Args:
        profile: the profile the modules come from.
        modules: the region's module records.
        writes: ``in_place_writes(profile)``, if already computed.

    Example:
        >>> clobbered_inputs(profile, [profile.module("layers.0")])   # doctest: +SKIP
        (12,)
    """
    first = modules[0].first_op
    if first is None:
        return ()
    writes = in_place_writes(profile) if writes is None else writes
    out: list[int] = list(collective_writes(profile, first, max(int(m.last_op) for m in modules
                                                                if m.last_op is not None)))
    for m in modules:
        for sid in m.inputs:
            created = profile.storages[sid].created_by
            if created is not None and created >= first:
                continue  # made inside the region: an earlier block's output, replayed
            written = writes.get(sid)
            if written is not None and written >= first and sid not in out:
                out.append(sid)
    return tuple(out)


COLLECTIVE_NAMESPACES = ("c10d.", "_c10d_functional.", "fsdp.")
# Collectives a region's replay may issue again (NOTE [collectives in a region]).
RERUN_NAMESPACES = ("_c10d_functional.",)


def is_collective(op: OpRecord | str) -> bool:
    """Whether ``op`` (or an op name) is a collective or FSDP's gather/copy op (NOTE
    [collectives in a region])."""
    return (op if isinstance(op, str) else op.name).startswith(COLLECTIVE_NAMESPACES)


def must_not_rerun(op: OpRecord | str) -> bool:
    """Whether ``op`` is a collective no region may hold: FSDP's, or a ``c10d`` call in the
    model's forward (NOTE [collectives in a region]); a functional collective may re-run.

    Example:
        >>> must_not_rerun("_c10d_functional.all_reduce.default")
        False
    """
    name = op if isinstance(op, str) else op.name
    return is_collective(name) and not name.startswith(RERUN_NAMESPACES)


def collective_writes(profile: Profile, first_op: int, last_op: int) -> tuple[int, ...]:
    """Storages written by the collective ops no region may hold (:func:`must_not_rerun`)
    among forward ops ``first_op..last_op``: the tensors they return, else their inputs
    (NOTE [collectives in a region]).

    Example:
        >>> collective_writes(profile, 0, profile.n_forward - 1)   # doctest: +SKIP
        (150, 160)
    """
    found = _collective_ops(profile)
    out: list[int] = []
    for i in found[bisect_left(found, first_op): bisect_right(found, min(last_op, profile.n_forward - 1))]:
        op = profile.ops[i]
        for sid in [t.storage for t in op.outputs] or list(op.inputs):
            if sid not in out:
                out.append(sid)
    return tuple(out)


# Per profile (by identity, while it lives): the indices of its forward ops that must not
# re-run (:func:`must_not_rerun`), so that asking about each of thousands of candidate
# regions costs a bisection, not a scan.
_COLLECTIVES: dict[int, tuple[weakref.ref[Profile], tuple[int, ...]]] = {}


def _collective_ops(profile: Profile) -> tuple[int, ...]:
    hit = _COLLECTIVES.get(id(profile))
    if hit is not None and hit[0]() is profile:
        return hit[1]
    found = tuple(op.index for op in profile.ops[: profile.n_forward] if must_not_rerun(op))
    key = id(profile)
    _COLLECTIVES[key] = (weakref.ref(profile, lambda _: _COLLECTIVES.pop(key, None)), found)
    return found


def writes_buffers(profile: Profile, modules: Sequence[str]) -> bool:
    """Whether the forward of the region over ``modules`` wrote a buffer (NOTE [buffer writes])."""
    recs = [m for m in profile.modules if m.path in modules and m.first_op is not None]
    if not recs:
        return True  # nothing known: let the runtime watch
    first = min(int(m.first_op) for m in recs)  # type: ignore[arg-type]
    last = max(int(m.last_op) for m in recs)    # type: ignore[arg-type]
    return any(first <= op <= last for op, _, _ in buffer_writes(profile))


def buffer_writes(profile: Profile) -> list[tuple[int, int, bool]]:
    """``(op, buffer storage, declared)`` for each forward op that writes a module buffer
    (NOTE [buffer writes]): an in-place op reading it (declared), a batch-norm op reading it
    (its statistics update: undeclared)."""
    st = profile.storages
    return [(op.index, s, op.inplace) for op in profile.ops[: profile.n_forward]
            if op.inplace or "batch_norm" in op.name
            for s in op.inputs if st[s].kind is StorageKind.BUFFER]


def is_matmul(op: OpRecord) -> bool:
    """Whether ``op`` is one of the matmul/convolution overloads in :data:`MATMUL_PACKETS`."""
    return _is_matmul_name(op.name)


def op_keys(profile: Profile, first_op: int, last_op: int) -> dict[int, str]:
    """Keys (NOTE [op keys] in ``memfit.planning.plan``) of the forward ops ``first_op..last_op``.

    Returns ``{op index: "<overload>#<k>"}``; ops torch's policy never sees (detach) have no
    key.

    Example:
        >>> op_keys(profile, 4, 6)   # doctest: +SKIP
        {4: 'aten.mm.default#0', 5: 'aten.gelu.default#0', 6: 'aten.mm.default#1'}
    """
    counts: dict[str, int] = {}
    out: dict[int, str] = {}
    unkeyed = unkeyed_ops()
    for i in range(first_op, last_op + 1):
        name = profile.ops[i].name
        if name in unkeyed:
            continue
        k = counts.get(name, 0)
        counts[name] = k + 1
        out[i] = f"{name}#{k}"
    return out


def keys_to_ops(profile: Profile, first_op: int, last_op: int, keys: Sequence[str],
                region_name: str) -> list[int]:
    """Map a region's ``save`` keys to op indices, checking each one may be saved.

    Raises:
        ValueError: a key names no op of the region, or an op that may not be saved.
    """
    by_key = {k: i for i, k in op_keys(profile, first_op, last_op).items()}
    out = []
    for key in keys:
        i = by_key.get(key)
        if i is None:
            known = sorted(by_key)[:8]
            raise ValueError(
                f"region {region_name!r} saves {key!r}, but its forward ops "
                f"{first_op}..{last_op} have no such occurrence (keys look like {known}); "
                "make the plan again from a profile of this model"
            )
        op = profile.ops[i]
        if is_kept_draw(profile, op):
            if not draws_into_region(profile, op, first_op):
                raise ValueError(
                    f"region {region_name!r} keeps the draw {key!r}, but the tensor it draws "
                    "into was made before the region started, so the replay cannot make it "
                    "again (NOTE [kept draws] in memfit.runtime.draws); drop it from Region.ops "
                    "or start the region before that tensor is made"
                )
            out.append(i)
            continue
        if op.name in KEPT_DRAW_OPS and is_for_compiler(profile):
            raise ValueError(
                f"region {region_name!r} keeps the draw {key!r}, but the profile has compiled "
                "costs, and a compiled region draws again in its backward: nothing is kept "
                "(NOTE [compiled costs] in memfit.profiling.compiled_costs); drop it from "
                "Region.ops, or plan from a profile with eager costs for an eager model"
            )
        if not is_saveable(profile, op):
            why = ("writes to an input" if op.inplace else "consumes the RNG" if op.random
                   else "has outputs the front end cannot name" if not op.saveable
                   else "returns a view or alias of an earlier storage")
            raise ValueError(
                f"region {region_name!r} saves {key!r}, but that op {why}; such outputs are "
                "always recomputed (see memfit.planning.rules); drop it from Region.ops"
            )
        out.append(i)
    return out
