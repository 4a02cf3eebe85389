"""The copies of module buffers a checkpointed region's runtime makes, for the memory model.

NOTE [buffer copies]
A region whose forward writes a module buffer (NOTE [buffer writes] in
``memfit.planning.rules``) runs under the runtime's buffer watcher (NOTE [buffers written
in forward] in ``memfit.runtime.buffers``), which copies each written buffer just before
the first region op that writes it. A buffer the region's ops touch only by updating it
(batch norm's statistics update; an aten op whose results are only the tensors it writes,
drawing no random numbers, as ``num_batches_tracked.add_(1)``) and read by no other op of
the region is *unread*: its copy is dropped when the region's forward ends (op ``b``) and its
replay skips the updates, copying nothing. Any other written buffer (a counter read after
its increment, spectral norm's vectors) keeps its copy with the frame, to ``h``, and is
copied once more when the replay starts, a copy that lives through the replay (``a..L``).
BatchNorm's three buffers thus cost their bytes only while the region's forward runs.
Measured: a chain of BatchNorm1d(16384) blocks, with or without an EMA buffer read after
its update, peaks to the byte as predicted whichever blocks are checkpointed (batch norm's
kernel workspace, four C-float vectors in forward, measured since: NOTE [workspace
measurement] in ``memfit.profiling.workspace``); the benchmark UNet3D's smallest plan is
predicted to the byte of its step with the generator state its replay forks (NOTE [region
memory model] in ``memfit.planning.effects``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memfit.ops import is_update
from memfit.profiling.profile import OpRecord

__all__ = ["buffer_copies"]


def buffer_copies(writes: Sequence[tuple[int, int, bool]], ops: Sequence[OpRecord], a: int, b: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The buffers the forward ``a..b`` writes (``writes``: ``memfit.planning.rules.buffer_writes``
    of the profile whose ``ops`` these are), the op before which each is copied, and whether its copy
    is held past the forward (read buffers) rather than dropped (unread ones; NOTE [buffer copies])."""
    first: dict[int, int] = {}
    for i, s, _ in writes:
        if a <= i <= b:
            first.setdefault(s, i)
    if not first:  # most regions write no buffer
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty.copy(), np.zeros(0, dtype=bool)
    read: set[int] = set()
    together: list[list[int]] = []  # the buffers one op updates: skipped all together or none
    for i in range(a, b + 1):
        op = ops[i]
        touched = [s for s in op.inputs if s in first]
        if not touched:
            continue
        written = {t.storage for t in op.outputs}
        if "batch_norm" in op.name:  # its statistics update: undeclared, unread by its outputs
            together.append(touched)
        elif op.inplace and written and written <= set(touched) and is_update(op.name):
            together.append(sorted(written))
            read.update(s for s in touched if s not in written)
        else:
            read.update(touched)
    for group in together:
        if read.intersection(group):
            read.update(group)
    ids = np.array(sorted(first), dtype=np.int64)
    kept = np.array([s in read for s in ids.tolist()], dtype=bool)
    return ids, np.array([first[s] for s in ids.tolist()], dtype=np.int64), kept
