"""Saves that only a reader-specific codec may take, and where an op is within its module's call.

What ``memfit.planning.compress_pass`` asks of a profile beyond a storage's own facts: whether
a max pool's save of a relu result reads its geometry alone (NOTE [geometry-only readers] in
``memfit.runtime.compress``), whether a batch norm's saved input can be rebuilt from the
in-place leaky relu after it (NOTE [in-place activated batch norm]) or from its own output
kept beside the relu after it (NOTE [output-activated batch norm]), and the key of an op
within its module's call (a module the forward calls more than once: which call).
"""

from __future__ import annotations

from collections.abc import Sequence

from memfit.planning.compression import (
    ABN_ACTIVATIONS,
    ABN_NORMS,
    OUTPUT_BN_ACTIVATIONS,
    SHAPE_READERS,
)
from memfit.planning.plan import Region
from memfit.profiling.profile import Profile, StorageRecord

__all__ = ["ModuleCalls", "abn_pair", "relu_after_norm", "geometry_saves", "in_regions", "key_in_call",
           "activation_key"]


def in_regions(path: str, regions: Sequence[Region]) -> bool:
    """Whether module ``path`` runs inside one of ``regions``."""
    for r in regions:
        for m in r.modules:
            if m == "" or path == m or path.startswith(m + "."):
                return True
    return False


def _norm_saving(profile: Profile, rec: StorageRecord) -> int | None:
    """The batch norm op that alone saves ``rec`` as its input, if one does."""
    if len(rec.saves) != 1 or rec.saves[0][1] is None:
        return None
    # the save is counted at the op before the batch norm where both run in its module
    # (autograd saves an op's inputs before the op runs: NOTE [saved tensors])
    j = next((k for k in (rec.saves[0][0], rec.saves[0][0] + 1) if k < profile.n_forward
              and profile.ops[k].name in ABN_NORMS), None)
    if j is None or j + 1 >= profile.n_forward:
        return None
    bn = profile.ops[j]
    if not bn.inputs or bn.inputs[0] != rec.id or not bn.outputs:
        return None
    return j


def relu_after_norm(profile: Profile, rec: StorageRecord, regions: Sequence[Region],
                    starts: dict[str, int]) -> tuple[int, int] | None:
    """(batch norm, relu) op indices where ``rec`` is the input of a batch norm that alone
    saves it and the next op is a relu of the norm's whole output, both outside every region:
    in place (the only write to the output in the forward) or out of place (the only reader
    of the output in the forward, which nothing saves) (NOTE [output-activated batch norm]);
    else None."""
    j = _norm_saving(profile, rec)
    if j is None:
        return None
    bn, act = profile.ops[j], profile.ops[j + 1]
    z = bn.outputs[0].storage
    if (act.name not in OUTPUT_BN_ACTIVATIONS or not act.outputs or not act.inputs
            or act.inputs[0] != z or act.outputs[0].shape != bn.outputs[0].shape):
        return None
    if act.inplace:
        if act.outputs[0].storage != z or not _only_writer(profile, z, act.index):
            return None
    elif profile.storage(z).saves or [o.index for o in profile.ops[: profile.n_forward]
                                      if z in o.inputs] != [act.index]:
        return None
    if not _outside(profile, (j, act.index), regions, starts):
        return None
    return j, act.index


def activation_key(profile: Profile, j: int, calls: ModuleCalls, names: Sequence[str]) -> tuple[int, int | None]:
    """As ``key_in_call``, counting the ops of any of ``names`` before op ``j`` in its module's
    call: the runtime counts a module's relu calls, in place or not, as one kind."""
    op = profile.ops[j]
    starts = calls.of(op.module)
    n = sum(1 for s in starts if s <= j) - 1
    k = sum(1 for o in profile.ops[starts[n]: j] if o.name in names)
    return k, (n if len(starts) > 1 else None)


def abn_pair(profile: Profile, rec: StorageRecord, regions: Sequence[Region],
             starts: dict[str, int]) -> tuple[int, int] | None:
    """(batch norm, activation) op indices where ``rec`` is the input of a batch norm that alone
    saves it, whose output the next op, an in-place leaky relu outside every region, writes,
    and nothing else writes in the forward (NOTE [in-place activated batch norm]); else None."""
    j = _norm_saving(profile, rec)
    if j is None:
        return None
    bn, act = profile.ops[j], profile.ops[j + 1]
    z = bn.outputs[0].storage
    if act.name not in ABN_ACTIVATIONS or not act.outputs or act.outputs[0].storage != z:
        return None
    if not _only_writer(profile, z, act.index) or not _outside(profile, (j, act.index), regions, starts):
        return None
    return j, act.index


def _only_writer(profile: Profile, storage: int, i: int) -> bool:
    """Whether op ``i`` is the one forward op that writes ``storage`` in place."""
    return [o.index for o in profile.ops[: profile.n_forward]
            if o.inplace and any(t.storage == storage for t in o.outputs)] == [i]


def _outside(profile: Profile, ops: Sequence[int], regions: Sequence[Region], starts: dict[str, int]) -> bool:
    """Whether ops ``ops`` run outside every region, in modules the forward ran (``starts``)."""
    return all(not in_regions(profile.ops[i].module, regions) and profile.ops[i].module in starts
               for i in ops)


class ModuleCalls:
    """Where each call of a module begins: runs of consecutive forward ops inside the module
    (its children's included), computed per module on first use."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.starts: dict[str, list[int]] = {}

    def of(self, path: str) -> list[int]:
        found = self.starts.get(path)
        if found is None:
            # over the whole forward: a module's record spans its first call only
            inside = [path == "" or o.module == path or o.module.startswith(path + ".")
                      for o in self.profile.ops[: self.profile.n_forward]]
            found = [n for n, ok in enumerate(inside) if ok and (n == 0 or not inside[n - 1])]
            self.starts[path] = found
        return found


def key_in_call(profile: Profile, j: int, calls: ModuleCalls) -> tuple[int, int | None]:
    """Op ``j``'s count among its overload's calls within its module's call, and which call of
    the module that is (None where the forward calls the module once)."""
    op = profile.ops[j]
    starts = calls.of(op.module)
    n = sum(1 for s in starts if s <= j) - 1
    k = sum(1 for o in profile.ops[starts[n]: j] if o.name == op.name)
    return k, (n if len(starts) > 1 else None)


def geometry_saves(profile: Profile, i: int, rec: StorageRecord, regions: Sequence[Region],
                   starts: dict[str, int]) -> list[tuple[str, str, int]]:
    """``(key, module, op)`` of each save of ``rec`` after op ``i``'s by a max pool reading it
    as its input outside every region (NOTE [geometry-only readers]); [] unless every save
    after op ``i``'s is one."""
    found = []
    for j, _, _ in rec.saves:
        if j == i:
            continue
        op = profile.ops[j]
        if (op.name not in SHAPE_READERS or not op.inputs or op.inputs[0] != rec.id
                or in_regions(op.module, regions) or op.module not in starts):
            return []
        k = sum(1 for o in profile.ops[starts[op.module]: j] if o.name == op.name)
        found.append((f"{op.name}#{k}", op.module, j))
    return found
