"""The step's peak under DeepSpeed's gradient handling, from the plan's timeline (bytes, per
rank).

NOTE [DeepSpeed's gradients in the timeline]
    The plan's timeline (``memfit.planning.simulate``) holds, at each op of backward, the
    live activations and every parameter gradient made by then. DeepSpeed 0.19 moves those
    gradients (``contiguous_gradients`` on, as by default; ``overlap_comm`` off), so the
    step's memory is the timeline with the gradients replaced by the engine's buffers:
    1. ZeRO-1: each gradient stays where autograd made it until backward ends. The
       ``reduce_bucket_size`` bucket is allocated at the first gradient's hook
       (``setup_buckets``). After backward, ``reduce_gradients`` copies the gradients into
       the bucket (freeing each) and, at the first reduction, allocates the rank's partition
       of gradients (``grads_in_partition``: the whole numel of every parameter that
       overlaps the rank's slice of the flat, 2-element-aligned group). So: ``live + bucket``
       from the first gradient on, and at the end ``live_end - min(gradients, bucket) +
       bucket + partition``.
    2. ZeRO-2: each gradient is copied into the bucket in its hook and freed; the first
       reduction (when a gradient does not fit the bucket's rest) allocates the partition.
       So ``live - gradients made before the op + bucket (+ partition once the gradients
       made exceed the bucket)``, and at the end ``live_end - gradients + bucket +
       partition``.
    3. ZeRO-3: the bucket and the gradient partitions are allocated at ``initialize``
       (before the step); each gradient is copied into the bucket and freed. So ``live -
       gradients made before the op``, plus the gathered parameters in flight (NOTE
       [planning under a DeepSpeed engine], rule 9), a constant.
    The gradient made at an op is counted at that op (it lives until its hook copies it).
    ``None`` when the profile does not reproduce the plan's peak (a plan tuned or compressed
    on another profile): the caller keeps the upper bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["partition_elements", "step_peak"]


def partition_elements(numels: Sequence[int], world_size: int, rank: int, *, align: int = 2) -> int:
    """Elements of ZeRO-1/2's ``grads_in_partition`` on ``rank``: the whole numel of each
    parameter (in the group's order) that overlaps the rank's slice of the flat group padded
    to ``align * world_size`` (NOTE [DeepSpeed's gradients in the timeline], rule 1).

    Example:
        >>> partition_elements([6, 4, 2], 2, 0)   # slices [0, 6) and [6, 12)
        6
        >>> partition_elements([5, 4, 3], 2, 1)   # [6, 12): the 4 and the 3
        7
    """
    total = sum(numels)
    quantum = align * world_size
    size = -(-total // quantum) * quantum // world_size
    start, end = rank * size, (rank + 1) * size
    out = at = 0
    for n in numels:
        if at < end and at + n > start and n > 0:
            out += n
        at += n
    return out


def step_peak(profile: Any, plan: Any, *, stage: int, bucket_bytes: int, partition_bytes: int,
              gathered_bytes: int = 0) -> int | None:
    """The step's forward + backward peak on one rank under ZeRO ``stage`` (NOTE [DeepSpeed's
    gradients in the timeline]): the plan's timeline with the parameter gradients replaced by
    the engine's buffers; bytes. ``None`` when ``simulate(profile, plan)`` does not give the
    plan's predicted peak."""
    from memfit.planning.simulate import simulate
    from memfit.profiling.profile import StorageKind

    sim = simulate(profile, plan)
    if sim.peak_bytes != plan.predicted_peak_bytes or not sim.live_bytes:
        return None
    n = len(profile.ops)
    made = np.zeros(n + 1, dtype=np.int64)  # parameter gradients' bytes made at each op
    for s in profile.storages:
        if s.kind == StorageKind.GRADIENT and s.freed_after is None and s.created_by is not None:
            made[min(s.created_by, n)] += s.nbytes
    through = np.cumsum(made)  # made at or before the op
    before = through - made
    total = int(through[-1])
    first = int(np.argmax(made > 0)) if total else n + 1
    live = np.asarray(sim.live_bytes, dtype=np.int64)
    pos = np.asarray(sim.positions, dtype=np.int64)
    started = pos >= first
    if stage == 1:
        during = live + np.where(started, bucket_bytes, 0)
        end = int(live[-1]) - min(total, bucket_bytes) + bucket_bytes + partition_bytes
    elif stage == 2:
        reduced = through[pos] > bucket_bytes
        during = (live - before[pos] + np.where(started, bucket_bytes, 0)
                  + np.where(reduced, partition_bytes, 0))
        end = int(live[-1]) - total + bucket_bytes + partition_bytes
    elif stage == 3:
        during = live - before[pos]
        end = int(live[-1]) - total
    else:
        return int(live.max())
    return max(int(during.max()), end) + gathered_bytes
