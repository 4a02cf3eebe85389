"""Region tails: the last ops of a module region that save only what outlives it.

NOTE [region tails]
    A ResNet bottleneck ends ``out = bn3(conv3(...)); out = out + identity; out = relu_(out)``
    (torchvision's order, the add in place or not): the add saves nothing and the in-place
    ReLU saves its own result, the block's output, which the next block reads and keeps
    anyway. Checkpointed whole, the block's frame packs that result too, so the replay (which
    torch stops once it has made every tensor the frame packed) reruns the add and the ReLU to
    make it again. A *tail* is such a suffix of a module region's ops: every tensor its ops
    save is the region's input or escapes it (read after it, or never freed). memfit runs a
    tail with its saves kept as the plain step keeps them, so the frame packs nothing of it
    and the replay stops before it:
    1. The tail starts after the return of a sub-module called once inside the region (its
       *boundary*, ``Region.tail_after``): the runtime pushes, in that module's forward hook,
       the saved-tensor hooks that were current outside the region (none: saves that keep a
       detached alias, so an output saved by its own op makes no reference cycle), and pops
       them when the region's forward returns; only in the forward, not in a replay
       (``memfit.runtime.wrap``). The longest tail that starts at a boundary is taken, and only
       where its ops save something (otherwise nothing changes).
    2. The planner models the region as the op range up to the boundary's last op: the tail's
       storages keep their plain lifetimes, the tensors the tail reads escape the range, and
       the replay's stop (the last op before the frame's last pack) comes before the tail
       (``RegionSpan.tail_after``; what the range drops is freed where Python lets it go,
       NOTE [Python releases] in ``memfit.profiling.profile``).
    3. Not where a module called once runs in the tail (it could be a region of its own,
       inside this one's call but outside its op range); not for segments, regions nested in
       or around others, front ends that run op ranges
       (``OP_RUNS``), nor compiled costs: under ``torch.compile`` the region is the
       compiler's (NOTE [segments under torch.compile]); nor with ``memfit.Search(tails=False)``
       (``NO_TAILS``), which a double backward (``create_graph=True``) needs: a tail's saved
       aliases keep no history, and the runtime raises when such a backward reads one.
    Measured on a bottleneck with an in-place ReLU (CPU, 2026-12-07): the replay ran 50 ops
    instead of 53 (no add, no ReLU), gradients ``torch.equal`` to plain's.
"""

from __future__ import annotations

import numpy as np

from memfit.planning.effects import OP_RUNS, ProfileArrays, RegionSpan
from memfit.profiling.profile import NO_TAILS, is_for_compiler

__all__ = ["with_tail"]


def with_tail(arrs: ProfileArrays, span: RegionSpan) -> RegionSpan:
    """``span`` ending before its tail (NOTE [region tails]), or ``span`` where it has none."""
    profile = arrs.profile
    if (len(span.modules) != 1 or span.tail_after is not None or profile.extra.get(OP_RUNS)
            or profile.extra.get(NO_TAILS) or is_for_compiler(profile) or arrs.save_op.size == 0):
        return span
    a, b = span.first_op, span.last_op
    in_range = (arrs.save_op >= a) & (arrs.save_op <= b)
    sid, op = arrs.save_sid[in_range], arrs.save_op[in_range]
    if sid.size == 0:
        return span
    outlives = (arrs.creator[sid] < a) | arrs.never_freed[sid] | (arrs.lfu[sid] > b)
    bad = op[~outlives]
    start = int(bad.max()) + 1 if bad.size else a + 1  # the first op of the longest eligible suffix
    path = span.modules[0]
    prefix = path + "." if path else ""
    best: tuple[int, int, str] | None = None
    for m in profile.modules:
        if (m.calls != 1 or m.first_op is None or m.last_op is None or not m.path.startswith(prefix)
                or m.path == path or m.first_op < a or not start - 1 <= m.last_op < b):
            continue
        key = (int(m.last_op), m.path.count("."), m.path)  # the longest tail; the outermost module
        if best is None or key < best:
            best = key
    if best is None:
        return span
    last = best[0]
    # a module that runs in the tail could be a region of its own, outside this one's op range
    # but inside its call: keep such regions apart from tails
    if any(m.calls == 1 and m.first_op is not None and last < m.first_op <= b for m in profile.modules):
        return span
    if not np.any(op > last):  # the tail saves nothing: the replay stops before it anyway
        return span
    return RegionSpan(span.modules, a, last, span.member_last, best[2])
