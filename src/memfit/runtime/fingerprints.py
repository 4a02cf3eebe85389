"""Fingerprints of op outputs: the exact, allocation-free value summaries the divergence
check compares (NOTE [value check] in ``memfit.runtime.divergence``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from memfit._torch import no_python_dispatch, op_schema
from memfit.ops import is_view

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


def _storage_key(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (0 for an empty one: never tracked)."""
    with no_python_dispatch():
        return t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else 0


def _collective(func: Any) -> bool:
    """True for collectives (``c10d``, ``_c10d_functional``): a collective may write its
    outputs after it returns (an async work, gloo's included), so what they hold at dispatch
    is not yet their value. ``wait_tensor`` returns the finished value: it is compared."""
    found = _COLLECTIVE.get(func)
    if found is None:
        name = str(func)
        found = _COLLECTIVE[func] = (name.startswith(("c10d.", "_c10d_functional."))
                                     and not name.startswith("_c10d_functional.wait_tensor"))
    return found


_COLLECTIVE: dict[Any, bool] = {}


def _take_prints(func: Any, out: Any, op_index: int, prints: list, where: list,
                 blank: set[int] | None = None) -> None:
    """Fingerprint ``func``'s outputs into ``prints`` / ``where`` (NOTE [value check]).

    ``blank`` holds the storages, of this region's tensors, that an op allocated without
    writing (rule 5) or a collective owns: a view of one is not fingerprinted (it would read
    whatever the allocator or an in-flight collective left there); the op that fills the
    storage, or reads it once filled, is. Any other op writing into such a storage (an
    ``out=`` or in-place op, the result shares its storage) takes it off the set.
    """
    if isinstance(out, torch.Tensor):
        outs: tuple = (out,)
    elif isinstance(out, (tuple, list)):
        outs = tuple(out)
    else:
        return
    if _unwritten(func) or _collective(func):
        if blank is not None:
            blank.update(k for o in outs if isinstance(o, torch.Tensor)
                         and type(o) in _PLAIN and (k := _storage_key(o)))
        return
    view = blank and is_view(func)
    scratch = _scratch(func)
    with no_python_dispatch():
        for k, o in enumerate(outs):
            if not isinstance(o, torch.Tensor) or k in scratch:
                continue
            if blank and type(o) in _PLAIN:
                key = _storage_key(o)
                if key in blank:
                    if view:
                        continue
                    blank.discard(key)
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
