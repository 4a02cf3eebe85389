"""Codecs for saved activations: a tensor in, a smaller packed form out, and back.

Each codec is a small object with ``encode(tensor) -> Packed``, ``decode(packed) -> tensor``,
``packed_bytes(shape, dtype)`` (the bytes its packed form takes, from the shape alone: what
the planner charges) and ``sample(nbytes, generator)`` (a tensor like those it packs, for
timing), implementing one entry of the registry ``memfit.planning.compression.CODEC_SPECS``
(``Codec.spec``): its name, exactness, packed-bytes rule and error bound (``CodecSpec.keeps``)
are written there, once (NOTE [adding a codec]). ``CODECS`` holds one implementation per
registry entry, in the registry's order.

NOTE [exact codecs check what they assume]
    An EXACT codec never trusts the caller: ``two_level`` verifies (on the bit patterns) that
    every element is +0.0 or one and the same value, ``narrow_int`` reads the min and max.
    A tensor that breaks the assumption is kept whole (a ``Packed`` of ``raw`` form), so an
    EXACT codec is exact on every input; only its saving depends on the values. Non-contiguous
    tensors, views into a larger storage and tensors off the strided layout are kept whole
    too: packing them would not free their storage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from memfit.planning.compression import (
    BF16,
    BLOCK,
    BN_FROM_OUTPUT,
    BOOL_BITS,
    CODEC_SPECS,
    FP8_E4M3,
    INPLACE_ABN,
    INT8_BLOCKWISE,
    NARROW_INT,
    SHAPE_ONLY,
    SIGN_BIT,
    TWO_LEVEL,
    CodecSpec,
    Exactness,
    codec_spec,
)

__all__ = ["Exactness", "Packed", "Codec", "CODECS", "codec", "BLOCK"]

_FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class Packed:
    """A packed tensor: the codec's tensors and what is needed to rebuild the original."""

    codec: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    data: tuple[torch.Tensor, ...]
    meta: tuple[Any, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of the packed tensors' storages (exactly what the packed form holds)."""
        return sum(t.untyped_storage().nbytes() for t in self.data)

    @property
    def raw(self) -> bool:
        return self.codec == "raw"


def _packable(t: torch.Tensor) -> bool:
    """Whether packing frees ``t``'s storage: a dense tensor that is its whole storage."""
    return (t.layout is torch.strided and t.is_contiguous() and t.storage_offset() == 0
            and t.numel() > 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _raw(t: torch.Tensor) -> Packed:
    return Packed("raw", tuple(t.shape), t.dtype, (t,))


_SHIFTS: dict[torch.device, torch.Tensor] = {}  # tensor([0..7]) of uint8, per device


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return s


def prepare_bits(devices: Iterable[torch.device]) -> None:
    """Make the bit packers' constant on ``devices`` now, outside any step: made in the first
    step that packs, it stays allocated, and that step measured 8 bytes above its predicted
    peak (only in the first such step of a process: an order-dependent test failure)."""
    for device in devices:
        _shifts(torch.device(device))


def pack_bits(b: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8, 8 elements a byte (element i is bit i % 8 of byte i // 8)."""
    flat = b.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8).to(torch.uint8) << _shifts(b.device)).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The bool tensor (flat, ``numel`` elements) that :func:`pack_bits` packed."""
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    return bits.view(-1)[:numel].bool()


_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


class Codec:
    """Base class: the implementation of the registry entry ``spec`` (its name, exactness,
    packed bytes and bound: ``memfit.planning.compression.CodecSpec``)."""

    spec: ClassVar[CodecSpec]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def exactness(self) -> Exactness:
        return self.spec.exactness

    @property
    def lossless(self) -> bool:
        return self.exactness is Exactness.EXACT

    def accepts(self, dtype: torch.dtype) -> bool:
        raise NotImplementedError

    def encode(self, t: torch.Tensor) -> Packed:
        raise NotImplementedError

    def decode(self, p: Packed) -> torch.Tensor:
        raise NotImplementedError

    def sample(self, nbytes: int, generator: torch.Generator) -> torch.Tensor:
        """A tensor of ``nbytes`` like those this codec packs, on the CPU (what
        ``memfit.measuring.codec_cost`` times): by default fp32 activations in [0, 1)."""
        return torch.rand(nbytes // 4, generator=generator)

    def packed_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes of the packed form of a tensor of ``shape`` and ``dtype`` (for value-dependent
        codecs, ``narrow_int``, the bound from the shape: int32)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.spec.packed_bytes(math.prod(shape), itemsize)

    def __repr__(self) -> str:
        return f"codec({self.name!r})"


def _decode_raw(p: Packed) -> torch.Tensor | None:
    return p.data[0] if p.raw else None


class _BoolBits(Codec):
    spec = BOOL_BITS

    def accepts(self, dtype):
        return dtype is torch.bool

    def encode(self, t):
        if t.dtype is not torch.bool or not _packable(t):
            return _raw(t)
        return Packed(self.name, tuple(t.shape), t.dtype, (pack_bits(t),))

    def decode(self, p):
        raw = _decode_raw(p)
        return raw if raw is not None else unpack_bits(p.data[0], math.prod(p.shape)).view(p.shape)

    def sample(self, nbytes, generator):
        return torch.rand(nbytes, generator=generator) > 0.5


class _TwoLevel(Codec):
    spec = TWO_LEVEL

    def accepts(self, dtype):
        return dtype in _INT_VIEW

    def encode(self, t):
        if t.dtype not in _INT_VIEW or not _packable(t):
            return _raw(t)
        iv = t.view(_INT_VIEW[t.dtype]).reshape(-1)  # bit patterns: +0.0 is 0; -0.0, NaN are not
        nonzero = iv != 0
        at = nonzero.to(torch.uint8).argmax()  # the first nonzero element (0 if none)
        if not bool(((iv == iv[at]) | ~nonzero).all()):
            return _raw(t)  # three or more values: kept whole (NOTE [exact codecs check ...])
        value = t.reshape(-1)[at].reshape(1).clone()  # +0.0 itself when all are +0.0
        return Packed(self.name, tuple(t.shape), t.dtype, (pack_bits(nonzero), value))

    def decode(self, p):
        raw = _decode_raw(p)
        if raw is not None:
            return raw
        bits, value = p.data
        mask = unpack_bits(bits, math.prod(p.shape)).view(p.shape)
        return torch.zeros(p.shape, dtype=p.dtype, device=bits.device).masked_fill_(mask, value[0])

    def sample(self, nbytes, generator):
        return (super().sample(nbytes, generator) > 0.1).float().div_(0.9)  # a dropout mask


class _NarrowInt(Codec):
    spec = NARROW_INT
    _WIDTHS = (torch.int8, torch.int16, torch.int32)

    def accepts(self, dtype):
        return dtype is torch.int64

    def encode(self, t):
        if t.dtype is not torch.int64 or not _packable(t):
            return _raw(t)
        lo, hi = int(t.min()), int(t.max())
        for dtype in self._WIDTHS:
            info = torch.iinfo(dtype)
            if info.min <= lo and hi <= info.max:
                return Packed(self.name, tuple(t.shape), t.dtype, (t.to(dtype),))
        return _raw(t)

    def decode(self, p):
        raw = _decode_raw(p)
        return raw if raw is not None else p.data[0].to(torch.int64)

    def sample(self, nbytes, generator):
        return torch.randint(0, 100, (nbytes // 8,), generator=generator)  # pool indices


class _SignBit(Codec):
    spec = SIGN_BIT

    def accepts(self, dtype):
        return dtype.is_floating_point

    def encode(self, t):
        if not t.dtype.is_floating_point or not _packable(t):
            return _raw(t)
        # threshold_backward passes the gradient where not x <= 0: NaN counts as positive
        return Packed(self.name, tuple(t.shape), t.dtype, (pack_bits(~(t <= 0)),))

    def decode(self, p):
        raw = _decode_raw(p)
        if raw is not None:
            return raw
        return unpack_bits(p.data[0], math.prod(p.shape)).view(p.shape).to(p.dtype)

    def sample(self, nbytes, generator):
        return torch.relu(super().sample(nbytes, generator) - 0.5)  # relu results


class _ShapeOnly(Codec):
    spec = SHAPE_ONLY

    def accepts(self, dtype):
        return True

    def encode(self, t):
        # a contiguous tensor only: its zeros decode as a stride-0 view, whose suggested
        # memory format is the contiguous one, as the saved tensor's was (NOTE
        # [geometry-only readers] in memfit.runtime.compress)
        if not _packable(t):
            return _raw(t)
        return Packed(self.name, tuple(t.shape), t.dtype, (), (t.device,))

    def decode(self, p):
        raw = _decode_raw(p)
        if raw is not None:
            return raw
        return torch.zeros((), dtype=p.dtype, device=p.meta[0]).expand(p.shape)


class _InplaceAbn(Codec):
    """Rebuilds need the norm's output and statistics, which a tensor alone does not carry: the
    Compressor does it (NOTE [in-place activated batch norm] in memfit.runtime.compress); on
    its own this codec keeps a tensor whole."""

    spec = INPLACE_ABN

    def accepts(self, dtype):
        return dtype.is_floating_point

    def encode(self, t):
        return _raw(t)

    def decode(self, p):
        return p.data[0]


class _BnFromOutput(_InplaceAbn):
    """As ``inplace_abn``: the Compressor rebuilds (NOTE [output-activated batch norm] in
    memfit.runtime.bn_rebuild); on its own this codec keeps a tensor whole."""

    spec = BN_FROM_OUTPUT


class _Bf16(Codec):
    spec = BF16

    def accepts(self, dtype):
        return dtype in (torch.float32, torch.float64)

    def encode(self, t):
        if not self.accepts(t.dtype) or not _packable(t):
            return _raw(t)
        return Packed(self.name, tuple(t.shape), t.dtype, (t.to(torch.bfloat16),))

    def decode(self, p):
        raw = _decode_raw(p)
        return raw if raw is not None else p.data[0].to(p.dtype)



class _Fp8E4m3(Codec):
    spec = FP8_E4M3

    def accepts(self, dtype):
        return dtype in (torch.float32, torch.bfloat16, torch.float16)

    def encode(self, t):
        if not self.accepts(t.dtype) or not _packable(t):
            return _raw(t)
        x = t.float()
        amax = x.abs().amax()
        scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax)).reshape(1)
        return Packed(self.name, tuple(t.shape), t.dtype, ((x / scale).to(torch.float8_e4m3fn), scale))

    def decode(self, p):
        raw = _decode_raw(p)
        if raw is not None:
            return raw
        q, scale = p.data
        return (q.float() * scale).to(p.dtype)



class _Int8Blockwise(Codec):
    spec = INT8_BLOCKWISE

    def accepts(self, dtype):
        return dtype in (torch.float32, torch.bfloat16, torch.float16)

    def encode(self, t):
        if not self.accepts(t.dtype) or not _packable(t):
            return _raw(t)
        flat = t.float().reshape(-1)
        n = flat.numel()
        pad = (-n) % BLOCK
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        blocks = flat.view(-1, BLOCK)                              # (blocks, BLOCK)
        amax = blocks.abs().amax(dim=1, keepdim=True)              # (blocks, 1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.round(blocks / scale).clamp_(-127, 127).to(torch.int8)
        return Packed(self.name, tuple(t.shape), t.dtype, (q.view(-1)[:n].clone(), scale.view(-1)))

    def decode(self, p):
        raw = _decode_raw(p)
        if raw is not None:
            return raw
        q, scale = p.data
        n = q.numel()
        pad = (-n) % BLOCK
        qf = q.float()
        if pad:
            qf = torch.cat([qf, qf.new_zeros(pad)])
        return (qf.view(-1, BLOCK) * scale.view(-1, 1)).view(-1)[:n].view(p.shape).to(p.dtype)



# one implementation per entry of the registry (NOTE [adding a codec]; tests/runtime/
# test_codecs.py checks that these and CODEC_SPECS name the same codecs)
_IMPLEMENTATIONS: tuple[Codec, ...] = (
    _BoolBits(), _TwoLevel(), _NarrowInt(), _SignBit(), _ShapeOnly(), _InplaceAbn(), _BnFromOutput(), _Bf16(),
    _Fp8E4m3(), _Int8Blockwise())
CODECS: dict[str, Codec] = {name: c for name in CODEC_SPECS for c in _IMPLEMENTATIONS
                            if c.spec is CODEC_SPECS[name]}


def codec(name: str) -> Codec:
    """The implementation of the registry's codec ``name`` (one of ``CODEC_SPECS``).

    Raises:
        ValueError: an unknown name (the message lists the registry's names).

    Example:
        >>> p = codec("bf16").encode(torch.ones(4)); p.nbytes
        8
    """
    spec = codec_spec(name)
    found = CODECS.get(spec.name)
    if found is None:
        raise NotImplementedError(f"the codec {name!r} is in the registry but has no runtime "
                                  "implementation in memfit.runtime.codecs (NOTE [adding a codec])")
    return found
