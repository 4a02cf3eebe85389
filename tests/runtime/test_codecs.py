"""memfit.runtime.codecs: round trips, exact packed byte counts, stated error bounds."""

from __future__ import annotations

import pytest
import torch

from memfit.planning.compression import CODEC_SPECS
from memfit.runtime.codecs import _IMPLEMENTATIONS, BLOCK, CODECS, Exactness, codec


def _data(seed: int = 0, n: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 3


def _dropout_mask(n: int = 1001, p: float = 0.3) -> torch.Tensor:
    # what F.dropout saves on CPU: bernoulli_(1 - p) then div_(1 - p)
    g = torch.Generator().manual_seed(1)
    return torch.empty(n).bernoulli_(1 - p, generator=g).div_(1 - p)


def test_two_level_dropout_mask_is_exact_and_32x() -> None:
    mask = _dropout_mask()
    p = codec("two_level").encode(mask)
    assert not p.raw
    assert p.nbytes == 126 + 4  # ceil(1001 / 8) bytes of bits + the value 1/(1-p) as fp32
    assert torch.equal(codec("two_level").decode(p), mask)


@pytest.mark.parametrize("bad", [
    pytest.param(torch.tensor([0.0, 1.0, 2.0]), id="three-values"),
    pytest.param(torch.tensor([-0.0, 1.0, 1.0]), id="negative-zero"),
])
def test_two_level_keeps_other_tensors_whole(bad: torch.Tensor) -> None:
    p = codec("two_level").encode(bad)
    assert p.raw and p.nbytes == 12
    out = codec("two_level").decode(p)
    assert torch.equal(out.view(torch.int32), bad.view(torch.int32))


def test_two_level_all_zero() -> None:
    z = torch.zeros(17)
    p = codec("two_level").encode(z)
    assert not p.raw and p.nbytes == 3 + 4
    assert torch.equal(codec("two_level").decode(p).view(torch.int32), z.view(torch.int32))


def test_bool_bits() -> None:
    b = _data() > 0.5
    p = codec("bool_bits").encode(b)
    assert p.nbytes == 125
    assert torch.equal(codec("bool_bits").decode(p), b)


@pytest.mark.parametrize(("hi", "dtype", "nbytes"), [
    (127, torch.int8, 64), (32767, torch.int16, 128), (2**31 - 1, torch.int32, 256),
])
def test_narrow_int(hi: int, dtype: torch.dtype, nbytes: int) -> None:
    x = torch.randint(0, hi, (64,), generator=torch.Generator().manual_seed(0))
    x[0] = hi
    p = codec("narrow_int").encode(x)
    assert p.data[0].dtype is dtype and p.nbytes == nbytes
    assert torch.equal(codec("narrow_int").decode(p), x)


def test_narrow_int_keeps_wide_values() -> None:
    x = torch.tensor([0, 2**40])
    p = codec("narrow_int").encode(x)
    assert p.raw and torch.equal(codec("narrow_int").decode(p), x)


def test_sign_bit_keeps_exactly_what_relu_backward_reads() -> None:
    r = torch.relu(_data())
    r[3] = float("nan")
    p = codec("sign_bit").encode(r)
    assert p.nbytes == 125
    back = codec("sign_bit").decode(p)
    grad = _data(seed=2)
    ops = torch.ops.aten
    assert torch.equal(ops.threshold_backward(grad, back, 0), ops.threshold_backward(grad, r, 0))


def test_bf16_relative_error() -> None:
    x = _data(n=100_000)
    p = codec("bf16").encode(x)
    assert p.nbytes == 200_000
    err = (codec("bf16").decode(p) - x).abs()
    # round to nearest with 8 significant bits: half an ulp, 2^-8 of |x| at most
    assert bool((err <= 2.0**-8 * x.abs()).all())


def test_fp8_e4m3_error_bound() -> None:
    x = _data(n=100_000)
    p = codec("fp8_e4m3").encode(x)
    assert p.nbytes == 100_000 + 4
    s = x.abs().max() / 448
    err = (codec("fp8_e4m3").decode(p) - x).abs()
    # 4 significant bits (2^-4 of |x|), subnormals spaced 2^-9 s (half: 2^-10 s); 2^-20 |x|
    # for the fp32 rounding of x / s and q * s
    assert bool((err <= (2.0**-4 + 2.0**-20) * x.abs() + 2.0**-10 * s).all())


def test_int8_blockwise_error_bound() -> None:
    x = _data(n=1000)
    x[BLOCK:2 * BLOCK] *= 100  # blocks of other scales
    p = codec("int8_blockwise").encode(x)
    assert p.nbytes == 1000 + 4 * 4
    back = codec("int8_blockwise").decode(p)
    pad = torch.cat([x, x.new_zeros(24)]).view(-1, BLOCK)
    s = (pad.abs().amax(1) / 127).repeat_interleave(BLOCK)[:1000]
    # half a step of the block's scale; 2^-20 |x| for the fp32 rounding of x / s and q * s
    assert bool(((back - x).abs() <= s / 2 + 2.0**-20 * x.abs()).all())


# inplace_abn (REBUILT) packs with the norm's context, in the Compressor: alone it keeps a
# tensor whole (test_inplace_abn_alone_keeps_a_tensor_whole)
@pytest.mark.parametrize("name", sorted(n for n, c in CODECS.items() if c.exactness is not Exactness.REBUILT))
def test_packed_bytes_from_the_shape(name: str) -> None:
    c = codec(name)
    x = {"bool_bits": _data() > 0, "narrow_int": torch.arange(1000) * 2**20,
         "two_level": _dropout_mask(1000)}.get(name, torch.relu(_data()))
    assert c.packed_bytes(tuple(x.shape), x.dtype) == c.encode(x).nbytes
    assert (c.exactness is Exactness.EXACT) == c.lossless


def test_inplace_abn_alone_keeps_a_tensor_whole() -> None:
    x = _data(n=64)
    p = codec("inplace_abn").encode(x)
    assert p.raw and codec("inplace_abn").decode(p) is x


def test_shape_only_keeps_the_geometry_and_no_bytes() -> None:
    x = torch.relu(_data(n=60)).view(3, 4, 5)
    p = codec("shape_only").encode(x)
    assert p.nbytes == 0 and p.shape == (3, 4, 5) and p.dtype == torch.float32
    back = codec("shape_only").decode(p)
    # zeros of the same shape, dtype and device, as a stride-0 view: no storage of its size
    assert back.shape == x.shape and back.dtype == x.dtype and back.device == x.device
    assert back.stride() == (0, 0, 0) and back.untyped_storage().nbytes() == 4
    assert torch.equal(back, torch.zeros(3, 4, 5))
    # a channels-last tensor is kept whole (its zeros would suggest another memory format)
    assert codec("shape_only").encode(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)).raw


def test_views_are_kept_whole() -> None:
    x = _data(n=64).view(8, 8).t()
    for c in CODECS.values():
        if c.accepts(x.dtype):
            assert c.encode(x).raw


def test_unknown_codec() -> None:
    with pytest.raises(ValueError, match="unknown codec 'zip'; memfit knows \\['bf16', 'bn_from_output', 'bool_bits'"):
        codec("zip")


def test_the_implementations_cover_exactly_the_registry() -> None:
    # one implementation per registry entry, no other (NOTE [adding a codec])
    specs = [c.spec for c in _IMPLEMENTATIONS]
    assert len(specs) == len(set(map(id, specs))) == len(CODEC_SPECS)
    assert all(s is CODEC_SPECS[s.name] for s in specs)
    assert list(CODECS) == list(CODEC_SPECS)
    for name, c in CODECS.items():
        assert c.name == name and c.spec is CODEC_SPECS[name] and c.exactness is CODEC_SPECS[name].exactness


# inplace_abn is not timed alone (its default cost is used: codec_costs_for times the
# lossless codecs and the lossy_codec): see test_inplace_abn_alone_keeps_a_tensor_whole
@pytest.mark.parametrize("name", sorted(n for n, c in CODEC_SPECS.items() if c.exactness is not Exactness.REBUILT))
def test_each_sample_is_what_its_codec_packs(name: str) -> None:
    # what memfit.measuring.codec_cost times: packed (not kept whole), about the bytes asked
    c = codec(name)
    x = c.sample(4096, torch.Generator().manual_seed(0))
    assert x.untyped_storage().nbytes() == 4096 and c.accepts(x.dtype)
    p = c.encode(x)
    # narrow_int is charged at its int32 bound; the sample's indices (< 100) pack to int8
    packed = x.numel() if name == "narrow_int" else c.packed_bytes(tuple(x.shape), x.dtype)
    assert not p.raw and p.nbytes == packed
