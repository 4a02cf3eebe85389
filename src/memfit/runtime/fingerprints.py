"""Fingerprints of op outputs: the exact, allocation-free value summaries the divergence
check compares (NOTE [value check] in ``memfit.runtime.divergence``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from memfit._torch import no_python_dispatch, op_schema

__all__ = ["SAMPLE", "fingerprint"]

# Elements of an op output a fingerprint reads at most (NOTE [value check], rule 1).
SAMPLE = 64


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _sample(t: torch.Tensor) -> torch.Tensor:
    """A strided view of at most SAMPLE elements of ``t``, spread over every dimension."""
    n = t.numel()
    if n <= SAMPLE:
        return t
    if t.is_contiguous():
        step = (n // SAMPLE) | 1
        count = (n - 1) // step + 1
        return t.as_strided((count,), (step,), t.storage_offset())
    dims = [(size, stride) for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1]
    per_dim = max(2, math.ceil(SAMPLE ** (1 / len(dims))))
    sizes, strides = [], []
    for size, stride in dims:
        step = max(1, size // per_dim) | 1 if size > per_dim else 1
        sizes.append((size - 1) // step + 1)
        strides.append(stride * step)
    return t.as_strided(sizes, strides, t.storage_offset())


def fingerprint(t: Any) -> int | torch.Tensor | None:
    """The exact fingerprint of one op output (NOTE [value check]); None if not taken.

    A Python int for a CPU tensor, a 0-dim int64 tensor on the tensor's device otherwise.
    Call it below the dispatch modes (``no_python_dispatch``) when modes are active.
    """
    if type(t) not in _PLAIN or t.layout != torch.strided or t.is_meta:
        return None
    as_int = _INT_OF_SIZE.get(t.element_size())
    if as_int is None or t.numel() == 0:
        return None
    sample = _sample(t).view(as_int)
    if sample.device.type == "cpu":
        return _total(sample.tolist())  # allocates no tensor (NOTE [value check], rule 4)
    return sample.sum(dtype=torch.int64)


def _total(values: Any) -> int:
    """The sum of a nested list of ints (``Tensor.tolist()`` of any rank)."""
    if isinstance(values, list):
        return sum(_total(v) for v in values) if values and isinstance(values[0], list) \
            else sum(values)
    return int(values)


_UNWRITTEN: dict[Any, bool] = {}

# Outputs that are a kernel's workspace, by op and output index (NOTE [value check], rule 5).
_SCRATCH_OUTPUTS: dict[str, frozenset[int]] = {
    "aten.mkldnn_rnn_layer.default": frozenset({3}),
    "aten._cudnn_rnn.default": frozenset({3}),
    "aten.miopen_rnn.default": frozenset({3}),
    "aten.cudnn_batch_norm.default": frozenset({3}),
}
_SCRATCH: dict[Any, frozenset[int]] = {}
_NONE: frozenset[int] = frozenset()


def _scratch(func: Any) -> frozenset[int]:
    """The output indices of ``func`` that hold its kernel's workspace."""
    found = _SCRATCH.get(func)
    if found is None:
        found = _SCRATCH[func] = _SCRATCH_OUTPUTS.get(str(func), _NONE)
    return found


def _unwritten(func: Any) -> bool:
    """True for ops whose outputs hold uninitialized memory (``aten.empty_like``...)."""
    found = _UNWRITTEN.get(func)
    if found is None:
        schema = op_schema(func)
        found = _UNWRITTEN[func] = schema is not None and "empty" in schema.name
    return found


def _take_prints(func: Any, out: Any, op_index: int, prints: list, where: list) -> None:
    if _unwritten(func):
        return
    if isinstance(out, torch.Tensor):
        outs: tuple = (out,)
    elif isinstance(out, (tuple, list)):
        outs = tuple(out)
    else:
        return
    scratch = _scratch(func)
    with no_python_dispatch():
        for k, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and k not in scratch:
                fp = fingerprint(o)
                if fp is not None:
                    prints.append(fp)
                    where.append((op_index, k))


def _as_ints(prints: list) -> list[int]:
    """Fingerprints as ints: device tensors read back with one copy per device."""
    if all(isinstance(p, int) for p in prints):
        return prints
    tensors = [p for p in prints if not isinstance(p, int)]
    with no_python_dispatch():
        try:
            values = iter(torch.stack(tensors).tolist())
        except RuntimeError:  # several devices
            values = iter([int(p) for p in tensors])
        return [p if isinstance(p, int) else next(values) for p in prints]
