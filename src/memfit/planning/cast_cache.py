"""Autocast's weight-cast cache in the memory model: what it holds beyond a cast's last use.

NOTE [autocast's cast cache]
Under autocast the low-precision copy of a parameter (a cast op's output, ``autocast_cached``
in the profile: NOTE [autocast-cached storages] in ``memfit.profiling.profile``) is kept by
the cache until the cache is cleared, which ``Step.run`` does as the forward and loss end,
where a training loop's autocast block ends (NOTE [a fresh autocast cache per run] in
``memfit.step``). A copy autograd saves (a weight's, for its matmul's backward) lives on
until autograd releases it, cache or not. A copy it does not save (a bias's: ``addmm`` keeps
no input but the two it multiplies) would die after its last use but is held to the end of
the forward: a *tail* ``[last use + 1, plain free]`` of cache-only memory.

A checkpointed region runs without the cache (NOTE [autocast cache] in
``memfit.runtime.checkpoint``), so the tails of its own casts are gone in forward and its
replay's casts are transients like any other. The planner keeps each such storage's
lifetime to its last use (``ProfileArrays.freed``, so every region rule treats it as the
plain transient it is inside a region) and counts the tails apart: in the plain timelines,
less the tails of casts inside the plan's regions (the simulator), or as a negative piece of
the region's effect (the linear model). Measured on a 4-layer GPT under bf16 autocast, every
subset of its blocks checkpointed: predicted to within 32 B of the measured peak (was up to
6,200 B, 0.32%, over with the tails kept; up to 20.8% over when the cache also held the
weights' copies through backward, before ``Step.run`` cleared it with the forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from memfit.profiling.profile import Profile

__all__ = ["CacheTails"]


@dataclass(frozen=True)
class CacheTails:
    """The cache-only tails of a profile's casts (NOTE [autocast's cast cache]).

    Attributes:
        ids: the storages with a tail.
        op: the cast op that made each.
        start: the first op at which only the cache holds it (its last use + 1).
        end: its plain free (``freed_after``).
        nbytes: its size.
    """

    ids: np.ndarray
    op: np.ndarray
    start: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray

    @classmethod
    def of(cls, profile: Profile, counted: np.ndarray) -> CacheTails:
        """The tails of ``profile``'s counted storages (``counted``: a mask over its storages)."""
        rows = []
        for s in profile.storages:
            if (s.autocast_cached and not s.saved and counted[s.id] and s.created_by is not None
                    and s.freed_after is not None):
                last = max(s.created_by, s.last_forward_use if s.last_forward_use is not None else -1)
                if s.freed_after > last:
                    rows.append((s.id, s.created_by, last + 1, s.freed_after, s.nbytes))
        cols = np.array(rows, dtype=np.int64).reshape(-1, 5).T
        return cls(*cols)

    def inside(self, a: int, b: int) -> np.ndarray:
        """Which tails belong to casts among ops ``a..b`` (a region there has none of them)."""
        return (self.op >= a) & (self.op <= b)

    def pieces(self, mask: np.ndarray, sign: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The selected tails as position pieces ``(start, end, bytes * sign)``."""
        return self.start[mask], self.end[mask], sign * self.nbytes[mask]
