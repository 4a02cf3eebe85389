"""The model's own memory: its parameters and buffers, as the Profile records them.

NOTE [parameters of a profile]
    ``Profile.parameters`` lists every parameter of the model once (tied weights once, as
    ``named_parameters`` yields them), with the shape, dtype and bytes this process holds: a
    DTensor (an FSDP2 shard) counts its local shard and is marked ``sharded``. Planning reads
    them to count weights, gradients and optimizer states (NOTE [the job's memory] in
    ``memfit.planning.job``); a meta-device model's parameters count as the real ones would.
"""

from __future__ import annotations

import torch

from memfit.profiling.profile import ParameterRecord

__all__ = ["describe_parameters", "buffer_bytes", "dtype_name", "local_part"]


def describe_parameters(model: torch.nn.Module) -> tuple[ParameterRecord, ...]:
    """One record per parameter of ``model`` (NOTE [parameters of a profile]).

    Example:
        >>> describe_parameters(torch.nn.Linear(4, 2))[0]
        ParameterRecord(name='weight', shape=(2, 4), dtype='float32', nbytes=32, trainable=True, sharded=False)
    """
    out = []
    for name, p in model.named_parameters():
        local = local_part(p)
        out.append(ParameterRecord(name, tuple(local.shape), dtype_name(local.dtype),
                                   local.numel() * local.element_size(), bool(p.requires_grad),
                                   local is not p))
    return tuple(out)


def buffer_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's buffers (BatchNorm statistics, rotary tables), each storage once."""
    seen: set[int] = set()
    total = 0
    for b in model.buffers():
        local = local_part(b)
        key = id(local.untyped_storage()) if local.device.type != "meta" else id(local)
        if key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: a DTensor's local shard, else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
