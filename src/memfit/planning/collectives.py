"""The collectives a plan's recomputation issues again: count, bytes and seconds per step.

NOTE [collectives in a region] in ``memfit.planning.rules`` says which collectives a region
may hold and why re-running them is safe. This module prices what it costs: for each region,
the collective ops its replay runs again (the non-saved ops up to the replay's stop op, as
``RegionModel.time_s`` counts them), with the bytes each one returns and the seconds the
profile gave it (measured, or the link's time in fake mode: ``memfit.timemodel.devices``).
A collective whose output the plan saves (Megatron's selective recompute keeps the
all-reduce's output) is not re-run, and one after the replay's stop (a row-wise layer's
all-reduce that only feeds the residual add) is not either. ``wait_tensor`` and the
autograd wrap are not counted as collectives: they move nothing, but their seconds (waiting
for the transfer) are counted in ``seconds``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from memfit.planning.arrays import ProfileArrays
from memfit.planning.plan import Region
from memfit.planning.rules import is_collective
from memfit.planning.simulate import region_models
from memfit.profiling.profile import OpRecord, Profile

__all__ = ["ReplayedCollectives", "replayed_collectives", "moves_data", "collective_bytes",
           "REPLAYED_SCHEMA_VERSION"]

REPLAYED_SCHEMA_VERSION = 1
# Ops of the collective namespaces that move no data themselves (NOTE above).
_NO_TRANSFER = ("_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd")


@dataclass(frozen=True)
class ReplayedCollectives:
    """The collectives one step's recomputation issues again, over every region of a plan.

    Attributes:
        count: collective calls re-run per step.
        nbytes: bytes those calls return on this rank (an all-reduce's output, an
            all-gather's gathered tensor), summed.
        seconds: their profiled seconds, with the waits for them (``wait_tensor``).
        by_region: region name -> ``(count, nbytes)``, for the regions that re-run any.
        saved: collective calls inside regions whose output the plan keeps instead (Megatron's
            selective recompute): no communication in the replay.
    """

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    by_region: dict[str, tuple[int, int]] = field(default_factory=dict)
    saved: int = 0
    schema_version: int = REPLAYED_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["by_region"] = {k: list(v) for k, v in self.by_region.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplayedCollectives:
        if int(data.get("schema_version", 1)) > REPLAYED_SCHEMA_VERSION:
            raise ValueError(f"replayed collectives of schema {data['schema_version']} are newer "
                             f"than this memfit reads ({REPLAYED_SCHEMA_VERSION}); upgrade memfit")
        return cls(count=int(data["count"]), nbytes=int(data["nbytes"]), seconds=float(data["seconds"]),
                   by_region={k: (int(v[0]), int(v[1])) for k, v in data["by_region"].items()},
                   saved=int(data.get("saved", 0)))


def moves_data(op: OpRecord | str) -> bool:
    """Whether ``op`` is a collective that sends data (not ``wait_tensor`` or the autograd
    wrap of a functional collective's output).

    Example:
        >>> moves_data("_c10d_functional.all_reduce.default")
        True
    """
    name = op if isinstance(op, str) else op.name
    return is_collective(name) and not name.startswith(_NO_TRANSFER)


def collective_bytes(profile: Profile, op: OpRecord) -> int:
    """Bytes of the storages ``op``'s outputs live in, on this rank."""
    return sum(profile.storages[sid].nbytes for sid in {t.storage for t in op.outputs})


def replayed_collectives(profile: Profile, regions: tuple[Region, ...]) -> ReplayedCollectives:
    """What the recomputation of ``regions`` (a plan's) sends again per step.

    Args:
        profile: the profile the regions were planned on.
        regions: the plan's regions (``plan.regions``).

    Returns:
        A :class:`ReplayedCollectives`; all zero for a profile without collectives.

    Example:
        >>> replayed_collectives(profile, plan.regions).count   # doctest: +SKIP
        4
    """
    if not any(is_collective(op) for op in profile.ops[: profile.n_forward]):
        return ReplayedCollectives()
    arrs = ProfileArrays(profile)
    models, _ = region_models(profile, arrs, regions)
    count = nbytes = saved_calls = 0
    seconds = 0.0
    by_region: dict[str, tuple[int, int]] = {}
    for r, (rm, saved, offloaded) in zip(regions, models, strict=True):
        if not rm.useful:
            continue
        kept = set(saved) | set(offloaded)
        n = b = 0
        for i in range(rm.a, rm.b + 1):
            op = profile.ops[i]
            if not is_collective(op):
                continue
            if i in kept:
                saved_calls += int(moves_data(op))
                continue
            if i > rm.stop:
                continue
            seconds += op.time_s
            if moves_data(op):
                n += 1
                b += collective_bytes(profile, op)
        if n:
            by_region[r.name] = (n, b)
            count += n
            nbytes += b
    return ReplayedCollectives(count=count, nbytes=nbytes, seconds=seconds, by_region=by_region,
                               saved=saved_calls)

