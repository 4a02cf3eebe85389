"""A compression candidate, and the two batch-norm variants whose candidates change several storages.

``Candidate`` is what ``memfit.planning.compress_pass`` chooses among: one saved storage's
plan entries and where it lives in the step. The batch-norm variants (NOTE [in-place
activated batch norm], NOTE [output-activated batch norm] in ``memfit.runtime.bn_rebuild``)
let a norm's saved input go in forward and rebuild it in backward; their candidates say how
that moves the other storages the pair touches (NOTE [compressed peak]).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.planning.compress_readers import ModuleCalls, activation_key, key_in_call
from memfit.planning.compression import (
    ABN_NORMS,
    BN_FROM_OUTPUT,
    INPLACE_ABN,
    OUTPUT_BN_ACTIVATIONS,
    Compressed,
)
from memfit.profiling.profile import Profile, StorageRecord

__all__ = ["Candidate", "release_of", "inplace_activated", "output_activated", "relaxed_profile"]


@dataclass(frozen=True)
class Candidate:
    """A compressible saved storage: the plan entry and where it lives in the step."""

    entry: Compressed
    storage: int
    created: int
    last_forward_use: int
    release: int | None  # the backward op after which autograd let its last save go
    reads: tuple[tuple[int, int], ...] = ()  # per save decoded whole: (first unpack, release)
    extra: tuple[Compressed, ...] = ()  # the other nodes' saves of it (shape_only), 0 bytes
    # other storages' changes: (first, last, bytes) in forward or in backward (NOTE [compressed peak])
    windows: tuple[tuple[int, int, int], ...] = ()

    @property
    def entries(self) -> tuple[Compressed, ...]:
        """The plan's entries for this storage: its codec's, then the ``extra`` ones."""
        return (self.entry, *self.extra)


def release_of(profile: Profile, sid: int) -> int | None:
    rec = profile.storage(sid)
    ends = [s[2] for s in rec.saves]
    if not ends or any(e is None for e in ends):
        return rec.freed_after
    return max(e for e in ends if e is not None)



def inplace_activated(profile: Profile, i: int, rec: StorageRecord, pair: tuple[int, int],
                      calls: ModuleCalls) -> Candidate:
    """The ``inplace_abn`` candidate of batch norm input ``rec`` (made by op ``i``): the norm's
    output is held whole until the norm's backward, so no codec goes on it (NOTE [in-place
    activated batch norm])."""
    (bn_key, bn_call), (act_key, act_call) = (key_in_call(profile, j, calls) for j in pair)
    bn, act = (profile.ops[j] for j in pair)
    # its packed form: nothing; the rebuild reads the mean and invstd the norm's node saves
    # (NOTE [the kernel's statistics] in memfit.runtime.bn_rebuild)
    entry = Compressed(f"{bn.name}#{bn_key}", INPLACE_ABN.name, bn.module, rec.nbytes, 0, 0, bn_call)
    extra = (Compressed(f"{act.name}#{act_key}", INPLACE_ABN.name, act.module, call=act_call),)
    used = rec.last_forward_use if rec.last_forward_use is not None else i
    # rebuilt in place in the norm's output, which is then held until the norm's backward
    # lets its input go: an input-sized tensor from the output's release to then (a read
    # window of that size)
    out_release = profile.storage(bn.outputs[0].storage).freed_after
    release = release_of(profile, rec.id)
    held: tuple[tuple[int, int], ...] = (
        ((out_release + 1, release),) if out_release is not None and release is not None
        and out_release < release else ())
    return Candidate(entry, rec.id, i, max(used, i), release, held, extra)


def output_activated(profile: Profile, i: int, rec: StorageRecord, pair: tuple[int, int],
                      calls: ModuleCalls) -> tuple[Candidate, set[int]] | None:
    """The ``bn_from_output`` candidate of batch norm input ``rec`` (made by op ``i``) and the
    storages it takes (NOTE [output-activated batch norm] in ``memfit.runtime.bn_rebuild``)."""
    bn, act = (profile.ops[j] for j in pair)
    z = profile.storage(bn.outputs[0].storage)
    r = profile.storage(act.outputs[0].storage)
    release = release_of(profile, rec.id)
    n = profile.n_forward
    if release is None or z.freed_after is None or r.last_forward_use is None:
        return None
    (bn_key, bn_call), (act_key, act_call) = (key_in_call(profile, pair[0], calls),
                                              activation_key(profile, pair[1], calls, tuple(OUTPUT_BN_ACTIVATIONS)))
    # its packed form: nothing; the rebuild reads the mean and invstd the norm's node saves
    # (NOTE [the kernel's statistics] in memfit.runtime.bn_rebuild)
    entry = Compressed(f"{bn.name}#{bn_key}", BN_FROM_OUTPUT.name, bn.module, rec.nbytes, 0, 0, bn_call)
    extra = (Compressed(f"{act.name}#{act_key}", BN_FROM_OUTPUT.name, act.module, call=act_call),)
    used = rec.last_forward_use if rec.last_forward_use is not None else i
    # each save of the relu result decodes relu(y), a whole copy while its node runs; the
    # relu's own is given y itself
    windows = [(u, e if e is not None else u, r.nbytes) for j, u, e in r.saves
               if u is not None and j != act.index]
    if act.inplace:
        # the relu result is a new storage until its last forward reader; the norm's output
        # (the storage the relu wrote in place) held from its plain release to the norm's backward
        windows.append((act.index, max(act.index, r.last_forward_use), r.nbytes))
        if z.freed_after < release:
            windows.append((max(z.freed_after + 1, n), release, z.nbytes))
    else:
        # the relu result held by no node after its last forward reader; the norm's output
        # held from its plain release (the relu) to the norm's backward
        r_release = release_of(profile, r.id)
        if r_release is None:
            return None
        windows += [(r.last_forward_use + 1, n - 1, -r.nbytes), (n, r_release, -r.nbytes),
                    (z.freed_after + 1, n - 1, z.nbytes), (n, release, z.nbytes)]
    windows = [w for w in windows if w[0] <= w[1]]
    cand = Candidate(entry, rec.id, i, max(used, i), release, (), extra, tuple(windows))
    return cand, {rec.id, z.id, r.id}


def relaxed_profile(profile: Profile, chosen: list[Candidate]) -> Profile:
    """``profile`` as the solver should see it with the ``bn_from_output`` candidates
    ``chosen`` taken (NOTE [variants planned with the regions] in ``memfit.planning.compress_pass``):
    each norm's input held until its last forward use and saved by nothing, its relu's
    result likewise where the relu ran out of place, the norm's output held until the
    norm's backward. The relu results decoded in backward are left out (a relaxation: the
    plan's true peak is computed on ``profile``)."""
    import dataclasses

    from memfit.planning.simulate import simulate

    storages = {s.id: s for s in profile.storages}

    def let_go(sid: int) -> None:
        s = storages[sid]
        last = s.last_forward_use if s.last_forward_use is not None else s.created_by
        storages[sid] = dataclasses.replace(s, saves=(), saved=False, first_unpack=None, freed_after=last)

    for c in chosen:
        if c.entry.codec != BN_FROM_OUTPUT.name or c.release is None:
            continue
        bn = next(o for o in profile.ops[: profile.n_forward]
                  if o.inputs and o.inputs[0] == c.storage and o.name in ABN_NORMS)
        act = profile.ops[bn.index + 1]
        z, r = bn.outputs[0].storage, act.outputs[0].storage
        let_go(c.storage)
        if r != z:
            let_go(r)
        zs = storages[z]
        if zs.freed_after is not None and zs.freed_after < c.release:
            storages[z] = dataclasses.replace(zs, freed_after=c.release)
    edited = dataclasses.replace(profile, storages=tuple(storages[s.id] for s in profile.storages))
    from memfit.planning.plan import Plan

    sim = simulate(edited, Plan((), 0, 0.0, None, "none", profile.signature))
    return dataclasses.replace(edited, live_bytes=tuple(sim.live_bytes), peak_bytes=sim.peak_bytes)
