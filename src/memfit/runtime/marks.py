"""What memfit marks on a module it checkpoints, and how to ask.

``wrap`` keeps its state as the instance attribute ``_memfit_wrap``, a chain segment its
handle as ``_memfit_segment`` on each of its blocks. Both wrap and segment refuse a module the
other already checkpoints; asking here, rather than in each other's module, keeps the runtime
free of import cycles.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["WRAP_ATTR", "SEGMENT_ATTR", "is_wrapped", "segment_mark"]

WRAP_ATTR = "_memfit_wrap"
SEGMENT_ATTR = "_memfit_segment"


def is_wrapped(module: nn.Module) -> bool:
    """True if ``wrap`` checkpointed this module."""
    return WRAP_ATTR in module.__dict__


def segment_mark(module: nn.Module) -> Any:
    """The segment handle a module belongs to, if any (None otherwise); typed as such by
    ``memfit.runtime.segment.segment_of``."""
    return module.__dict__.get(SEGMENT_ATTR)
