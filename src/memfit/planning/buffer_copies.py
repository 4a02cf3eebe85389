"""The copies of module buffers a checkpointed region's runtime makes, for the memory model.

NOTE [buffer copies]
A region whose forward writes a module buffer (NOTE [buffer writes] in
``memfit.planning.rules``) runs under the runtime's buffer watcher (NOTE [buffers written
in forward] in ``memfit.runtime.buffers``), which copies each written buffer just before
the first region op that writes it. A copy of a buffer written only by a batch-norm op's
undeclared statistics update, and read by no later op of the region, is dropped when the
region's forward ends (op ``b``); any other copy (``num_batches_tracked``'s ``add_``, a
counter, spectral norm's vectors) is held with the frame, to ``h``. When the replay
starts, every written buffer is copied once more and that copy lives through the replay
(``a..L``). BatchNorm's statistics thus cost their bytes during the region's forward and
again in its replay, and 8 bytes per BatchNorm from forward to backward. Measured: a
chain of BatchNorm1d(16384) blocks, three checkpointed, peaks to the byte as predicted
(16 B, two held counters, under without the copies); the benchmark UNet3D's smallest plan,
256 B of whose peak are these copies, is predicted to the byte of its unchecked step with
them and the generator state its replay forks (NOTE [region memory model] in
``memfit.planning.effects``). Checkpointing a single BatchNorm1d(16384) block peaks 131,072 B
above the prediction with or without them: BatchNorm's own temporaries, not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memfit.profiling.profile import OpRecord

__all__ = ["buffer_copies"]


def buffer_copies(writes: Sequence[tuple[int, int, bool]], ops: Sequence[OpRecord], a: int, b: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The buffers the forward ``a..b`` writes (``writes``: ``memfit.planning.rules.buffer_writes``
    of the profile whose ``ops`` these are), the op before which each is copied, and whether its copy
    is held past the forward (NOTE [buffer copies])."""
    first: dict[int, int] = {}
    declared: set[int] = set()
    for op, s, decl in writes:
        if a <= op <= b:
            first.setdefault(s, op)
            if decl:
                declared.add(s)
    ids = np.array(sorted(first), dtype=np.int64)
    kept = np.array([s in declared or any(s in ops[i].inputs and "batch_norm" not in ops[i].name
                                           for i in range(first[s] + 1, b + 1))
                     for s in ids.tolist()], dtype=bool)
    return ids, np.array([first[s] for s in ids.tolist()], dtype=np.int64), kept
