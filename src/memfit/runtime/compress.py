"""Compress: the tensors autograd saves for backward from named forward ops, kept packed.

NOTE [compression through saved-tensor hooks]
    A plan's ``compressed`` entries name forward ops outside every checkpointed region by a
    step-wide key ``"<overload>#<k>"`` (the k-th call of that overload in the model's
    forward, from 0) and a codec (``memfit.runtime.codecs``). While the model's forward runs:

    1. A dispatch mode counts the calls of the named overloads and tags the output of each
       named call with its codec (by storage, held weakly: a later storage at the same
       address is not tagged).
    2. A ``saved_tensors_hooks`` pack hook encodes a saved tensor whose storage is tagged,
       and keeps every other saved tensor as it is; unpack decodes. A tagged tensor saved by
       several nodes is encoded once and shared. The original storage is then held only by
       whoever else holds it: saved only packed, it is freed at its last use in the forward.
    3. ``sign_bit`` (NOTE [sign-only readers]) tags the output only for the one pack that
       directly follows the op: the op's own node saving its result.
    4. Inside a checkpointed region the checkpoint's own saved-tensor hooks take the saves
       (innermost hooks win), so a region's ops are never compressed here: the planner names
       only ops outside regions.
    The codecs' own ops run with Python dispatch off, so they are neither counted nor traced.

NOTE [sign-only readers]
    ``relu``'s node saves its result and its backward (``threshold_backward(grad, result,
    0)``) reads it only as ``result <= 0``: the 1-bit ``sign_bit`` form gives the same
    gradient bit for bit. Any other node that saves the same tensor (the next convolution's
    input, max-pool's input) reads its values, so only the relu node's own save may be given
    the bits: autograd saves a node's outputs right after the op returns, before any other op
    runs, so that save is the first pack after the op's dispatch, of a tensor whose
    ``grad_fn`` is the op's node. A later save of the same tensor keeps it whole (correct;
    then the bits save nothing, and the planner does not choose them: it compresses only a
    result no other node saves).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from memfit._torch import TorchDispatchMode, no_python_dispatch
from memfit.ops import op_name
from memfit.runtime.codecs import Codec, Exactness, Packed, codec

__all__ = ["Compressor", "SIGN_READERS"]

# Ops whose node saves its result and reads only its sign (NOTE [sign-only readers]), with
# the name prefix of that node's class.
SIGN_READERS = {"aten.relu.default": "ReluBackward", "aten.relu_.default": "ReluBackward"}


class Compressor:
    """Saved-tensor compression for one model's forward (NOTE [compression through saved-tensor
    hooks]); enter it around the forward, as ``apply`` does from module hooks.

    Args:
        decisions: op key (``"aten.relu.default#3"``) -> codec name, or ``(codec name,
            output index)`` for an op of several outputs (max-pool's indices: 1); default 0.

    Attributes:
        raw_bytes: bytes of the saved tensors encoded so far (their storages).
        packed_bytes: bytes of their packed forms.
        kept_whole: tagged saves kept whole (the codec's assumption did not hold, a view).

    Example:
        >>> with Compressor({"aten.relu.default#0": "sign_bit"}):   # doctest: +SKIP
        ...     loss = model(x).sum()
        >>> loss.backward()                                        # doctest: +SKIP
    """

    def __init__(self, decisions: Mapping[str, str | tuple[str, int]]) -> None:
        self.by_name: dict[str, dict[int, tuple[Codec, int]]] = {}
        for key, value in decisions.items():
            name, output = (value, 0) if isinstance(value, str) else value
            overload, sep, k = key.rpartition("#")
            if not sep or not k.isdigit():
                raise ValueError(f"compress key {key!r} is not of the form '<overload>#<k>'")
            c = codec(name)
            if c.exactness is Exactness.SIGN and overload not in SIGN_READERS:
                raise ValueError(f"{key}: the codec {name!r} keeps only the sign, which only the "
                                 f"nodes of {sorted(SIGN_READERS)} read alone")
            self.by_name.setdefault(overload, {})[int(k)] = (c, int(output))
        self.raw_bytes = 0
        self.packed_bytes = 0
        self.kept_whole = 0
        self._mode: _Tagging | None = None
        self._hooks: Any = None
        self._depth = 0

    def __enter__(self) -> Compressor:
        self._depth += 1
        if self._depth == 1:
            self._mode = _Tagging(self)
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._hooks.__enter__()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            mode, hooks = self._mode, self._hooks
            self._mode = self._hooks = None
            if mode is not None:
                mode.__exit__(*exc)
            if hooks is not None:
                hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> Any:
        mode = self._mode
        if mode is None:
            return t
        tag = mode.take(t)
        if tag is None:
            return t
        c, shared = tag
        if shared is not None and (packed := shared()) is not None:
            return packed
        with no_python_dispatch():
            packed = c.encode(t)
        if packed.raw:
            self.kept_whole += 1
            return t
        self.raw_bytes += t.untyped_storage().nbytes()
        self.packed_bytes += packed.nbytes
        mode.share(t, packed)
        return packed


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, Packed):
        with no_python_dispatch():
            return codec(packed.codec).decode(packed)
    return packed


class _Tagging(TorchDispatchMode):
    """Counts the named overloads' calls and tags the outputs of the named ones."""

    def __init__(self, owner: Compressor) -> None:
        super().__init__()
        self.owner = owner
        self.counts: dict[str, int] = {}
        # storage address -> (the storage, weakly; codec; the shared Packed, weakly, or None)
        self.tagged: dict[int, tuple[weakref.ref, Codec, Any]] = {}
        self.sign: tuple[weakref.ref, Codec, str] | None = None  # NOTE [sign-only readers]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.sign = None  # any op in between: the next pack is not the relu node's own
        out = func(*args, **(kwargs or {}))
        planned = self.owner.by_name.get(op_name(func))
        if planned is None:
            return out
        name = op_name(func)
        k = self.counts.get(name, 0)
        self.counts[name] = k + 1
        found = planned.get(k)
        if found is None:
            return out
        c, index = found
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        t = outs[index] if index < len(outs) else None
        if not isinstance(t, torch.Tensor) or not c.accepts(t.dtype):
            return out  # not what was planned: kept whole
        storage = t.untyped_storage()
        if c.exactness is Exactness.SIGN:
            self.sign = (weakref.ref(storage), c, SIGN_READERS[name])
        else:
            self.tagged[storage.data_ptr()] = (weakref.ref(storage), c, None)
        return out

    def take(self, t: torch.Tensor) -> tuple[Codec, Any] | None:
        """The codec for this save of ``t`` (and a Packed to share), or None: keep it whole."""
        storage = t.untyped_storage()
        sign, self.sign = self.sign, None
        if sign is not None and sign[0]() is storage:
            node = type(t.grad_fn).__name__ if t.grad_fn is not None else ""
            return (sign[1], None) if node.startswith(sign[2]) else None
        held = self.tagged.get(storage.data_ptr())
        if held is None or held[0]() is not storage:
            return None
        return held[1], held[2]

    def share(self, t: torch.Tensor, packed: Packed) -> None:
        storage = t.untyped_storage()
        held = self.tagged.get(storage.data_ptr())
        if held is not None and held[0]() is storage:
            self.tagged[storage.data_ptr()] = (held[0], held[1], weakref.ref(packed))
