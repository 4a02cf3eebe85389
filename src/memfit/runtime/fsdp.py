"""FSDP units, told apart by their class: what ``apply`` refuses to put inside a region.

Duck-typed on class names: ``torch.distributed.fsdp`` is never imported, and nothing here
knows a process group.
"""

from __future__ import annotations

__all__ = ["is_fsdp_unit_class"]


def is_fsdp_unit_class(cls: type) -> bool:
    """Whether ``cls`` is a class ``fully_shard`` made (``FSDP<Class>``, an ``FSDPModule``),
    or FSDP1's ``FullyShardedDataParallel`` wrapper: modules whose hooks gather and free
    parameters (NOTE [collectives in a region] in ``memfit.planning.rules``).

    Example:
        >>> is_fsdp_unit_class(torch.nn.Linear)   # doctest: +SKIP
        False
    """
    names = {c.__name__ for c in cls.__mro__}
    return (cls.__name__.startswith("FSDP") and "FSDPModule" in names
            or "FullyShardedDataParallel" in names)
