"""What a plan compresses: the one registry of codecs (torch-free) and the plan's ``Compressed``.

``CODEC_SPECS`` is the registry: per codec its name, :class:`Exactness`, packed-bytes rule,
default encode + decode cost and what it keeps (its error bound). Planning reads it as is;
the codecs themselves (tensor in, packed form out) are ``memfit.runtime.codecs``, one
implementation per registry entry, whose ``Codec.packed_bytes`` is the entry's rule.

NOTE [adding a codec]
    A codec's name is written once, in its :class:`CodecSpec` below. To add one:

    1. Here: a ``CodecSpec`` (name, exactness, packed bytes from ``(numel, itemsize)``,
       default seconds per raw byte, what it keeps and its bound), listed in ``CODEC_SPECS``.
       ``LOSSLESS_CODECS``, ``LOSSY_CODECS``, ``DEFAULT_CODEC_COSTS``, the error for an
       unknown name, ``fit``'s ``lossy_codec=`` check and the CLI's ``--lossy-codec``
       choices all follow from the registry.
    2. In ``memfit.runtime.codecs``: a ``Codec`` subclass with ``spec = <the CodecSpec>``
       (encode, decode, ``accepts``, ``sample``), listed in ``_IMPLEMENTATIONS``
       (tests/runtime/test_codecs.py fails while the registry and the implementations differ).
    3. Only for an exact codec the planner should pick by itself: its rule in
       ``memfit.planning.compress_pass._codec_for`` (a LOSSY codec is chosen by
       ``lossy_codec=``, as it is). Every other module refers to ``CodecSpec.name``;
       tests/planning/test_compression.py fails on a codec name spelled in another module.

NOTE [what lossy means]
    A plan is *lossless* when every codec it uses is EXACT (the decoded tensor is bitwise
    the saved one), SIGN used only for a node that reads the sign alone (relu's) or SHAPE
    only for a node that reads the geometry alone (max pool's saved input): its step
    is then bitwise the plain step, and ``verify`` checks that. A plan with any LOSSY codec
    (bf16, fp8_e4m3, int8_blockwise) changes the gradients: ``verify`` then reports their
    largest relative error over parameters (``gradient_rel_error``) and never claims bitwise
    equality. A REBUILT codec (``inplace_abn``, ``bn_from_output``) is lossy in the same sense: the gradients differ
    by the roundings its ``keeps`` states; it is used only with ``compress="lossy"``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Exactness", "CodecSpec", "CODEC_SPECS", "codec_spec", "codec_packed_bytes", "Compressed",
           "BLOCK", "CodecCosts", "codec_costs_on", "DEFAULT_CODEC_COSTS", "DEFAULT_LOSSY_CODEC", "LOSSLESS_CODECS",
           "LOSSY_CODECS", "SIGN_READERS", "SHAPE_READERS", "SHAPE_ONLY", "INPLACE_ABN", "ABN_NORMS",
           "ABN_ACTIVATIONS", "BN_FROM_OUTPUT", "OUTPUT_BN_ACTIVATIONS", "check_lossy_codec", "BOOL_BITS",
           "TWO_LEVEL",
           "NARROW_INT", "SIGN_BIT", "BF16", "FP8_E4M3", "INT8_BLOCKWISE"]

BLOCK = 256  # elements per int8_blockwise scale


class Exactness(str, enum.Enum):
    EXACT = "exact"  # decode(encode(x)) is bitwise x
    SIGN = "sign"    # only "not x <= 0" survives: exact for a reader that compares with 0 only
    SHAPE = "shape"  # only the shape, dtype and device survive: exact for a reader of those only
    REBUILT = "rebuilt"  # rebuilt in backward from another saved tensor: a few roundings off
    LOSSY = "lossy"  # bounded error (each CodecSpec.keeps states its bound)


@dataclass(frozen=True)
class CodecSpec:
    """One codec's torch-free facts (NOTE [adding a codec]).

    Attributes:
        name: the codec's name, as plans (``Compressed.codec``) and users write it.
        exactness: EXACT, SIGN or LOSSY (NOTE [what lossy means]).
        packed_bytes: ``(numel, itemsize) -> bytes`` of the packed form of a tensor of
            ``numel`` elements of ``itemsize`` bytes (value-dependent codecs: the bound).
        per_byte_s: encode + decode seconds per raw byte used when none is measured
            (``DEFAULT_CODEC_COSTS``).
        keeps: what the packed form keeps: the codec's error bound.
        passes: bytes its encode + decode move per raw byte, and ops: the kernels they run
            per tensor; counted from ``memfit.runtime.codecs``' ops, for a device that is
            not this machine (``codec_costs_on``; not measured there).
    """

    name: str
    exactness: Exactness
    packed_bytes: Callable[[int, int], int]
    per_byte_s: float
    keeps: str
    passes: float = 0.0
    ops: int = 0


def _bits(numel: int, itemsize: int) -> int:
    return -(-numel // 8)


def _bits_and_value(numel: int, itemsize: int) -> int:
    return -(-numel // 8) + itemsize


def _nothing(numel: int, itemsize: int) -> int:
    return 0


def _int32(numel: int, itemsize: int) -> int:
    return 4 * numel


def _two_bytes(numel: int, itemsize: int) -> int:
    return 2 * numel


def _byte_and_scale(numel: int, itemsize: int) -> int:
    return numel + 4


def _byte_and_block_scales(numel: int, itemsize: int) -> int:
    return numel + 4 * -(-numel // BLOCK)


# per_byte_s: measured on this project's 2-core CPU box (torch 2.13) by hand before the
# measurement ran in fit: encode + decode of 32 KiB and 2 MiB tensors (two_level 247 us and
# 6.4 ms, sign_bit 3.3 ms and bf16 0.20 ms at 2 MiB). fp8_e4m3 and int8_blockwise are estimates.
BOOL_BITS = CodecSpec("bool_bits", Exactness.EXACT, _bits, 1.6e-9,
                      "a bool tensor, 1 bit per element (8x)", passes=10.3, ops=7)
TWO_LEVEL = CodecSpec("two_level", Exactness.EXACT, _bits_and_value, 3.1e-9,
                      "a float tensor whose elements are +0 or one value c (dropout's scaled "
                      "mask): 1 bit per element + c (32x on fp32)", passes=7.0, ops=12)
NARROW_INT = CodecSpec("narrow_int", Exactness.EXACT, _int32, 0.5e-9,
                       "an int64 tensor (max-pool indices) in the narrowest of int8, int16, int32 "
                       "that holds its values (charged at the int32 bound)", passes=4.5, ops=4)
SIGN_BIT = CodecSpec("sign_bit", Exactness.SIGN, _bits, 1.6e-9,
                     "only `not x <= 0`, 1 bit per element; decodes to 1.0 / 0.0. Exact for a "
                     "reader that only compares with 0 (SIGN_READERS), wrong for any other",
                     passes=5.5, ops=9)
SHAPE_ONLY = CodecSpec("shape_only", Exactness.SHAPE, _nothing, 0.0,
                       "nothing but the shape, dtype and device; decodes to zeros (a stride-0 view "
                       "of one element). Exact for a node that reads its saved input's geometry "
                       "alone (SHAPE_READERS: max pool's backward scatters by its indices), wrong "
                       "for any other", passes=0.0, ops=1)
# inplace_abn's per_byte_s: measured by `benchmarks/abn.py --act leaky` (six norms of a 3D
# conv net, 5.5 MB of inputs let go, on this 2-core CPU, 15 rounds: +1.4 to +4.7 ms a step in
# three runs, 0.25e-9 to 0.85e-9 s per byte, the largest taken; +5.9 and +6.5 ms, 1.1e-9 s
# per byte, in the same session before the statistics came from the kernel, NOTE [the
# kernel's statistics]). passes: the inverse leaky relu in place (2) and one addcmul (2)
INPLACE_ABN = CodecSpec("inplace_abn", Exactness.REBUILT, _nothing, 0.8e-9,
                        "batch norm's input, kept as nothing: rebuilt in backward from the "
                        "output of the in-place leaky relu after it (y = z, or z / slope where "
                        "z < 0; x = y a + b, a = 1 / (weight invstd), b = mean - bias a): fp32 roundings of x, "
                        "|x' - x| <= 2^-20 (|x| + |mean| + |bias / weight| / invstd) (NOTE "
                        "[in-place activated batch norm])", passes=4.0, ops=8)
# bn_from_output's per_byte_s: measured by `benchmarks/abn.py --act relu` (five norms of a 3D
# conv net, 5.4 MB of inputs let go, on this 2-core CPU, 15 rounds: +3.6 and +3.7 ms a step,
# 0.68e-9 s per byte; +7.3 and +7.6 ms, 1.4e-9 s per byte, in the same session when a var_mean
# pass in forward computed the statistics again, NOTE [the kernel's statistics]): the input
# rebuilt from the output (one addcmul pass) and relu(y) for the next convolution's save.
# passes: 2 + 2 (the relu run out of place moves the bytes the in-place one did)
BN_FROM_OUTPUT = CodecSpec("bn_from_output", Exactness.REBUILT, _nothing, 0.7e-9,
                           "batch norm's input, kept as nothing: rebuilt in backward from the norm's "
                           "own output y, kept whole because the relu after it then runs out of "
                           "place (x = y a + b, a = 1 / (weight invstd), b = mean - bias a); the relu "
                           "result's saves are rebuilt as relu(y), bitwise. fp32 roundings of x: |x' - x| <= 2^-20 "
                           "(|x| + |mean| + |bias / weight| / invstd) (NOTE [output-activated batch "
                           "norm])", passes=4.0, ops=8)
BF16 = CodecSpec("bf16", Exactness.LOSSY, _two_bytes, 0.1e-9,
                 "bfloat16: |x' - x| <= 2^-8 |x| for normal fp32 x", passes=3.0, ops=2)
FP8_E4M3 = CodecSpec("fp8_e4m3", Exactness.LOSSY, _byte_and_scale, 1.5e-9,
                     "float8_e4m3fn with one fp32 scale s = amax / 448: "
                     "|x' - x| <= 2^-4 |x| + 2^-10 s (+ fp32 rounding)", passes=9.5, ops=8)
INT8_BLOCKWISE = CodecSpec("int8_blockwise", Exactness.LOSSY, _byte_and_block_scales, 3.0e-9,
                           f"int8 with one fp32 scale per block of {BLOCK}: |x' - x| <= s_b / 2 "
                           "(+ fp32 rounding), s_b = amax(block) / 127", passes=12.0, ops=12)

# the registry: every codec memfit knows, by name (NOTE [adding a codec])
CODEC_SPECS: dict[str, CodecSpec] = {c.name: c for c in (
    BOOL_BITS, TWO_LEVEL, NARROW_INT, SIGN_BIT, SHAPE_ONLY, INPLACE_ABN, BN_FROM_OUTPUT, BF16, FP8_E4M3,
    INT8_BLOCKWISE)}

# the codecs a lossless plan may use (SIGN, SHAPE only for their readers: NOTE [what lossy means])
LOSSLESS_CODECS = tuple(n for n, c in CODEC_SPECS.items()
                        if c.exactness not in (Exactness.LOSSY, Exactness.REBUILT))
# the codecs ``compress="lossy"`` may put on the other fp32 activations (``lossy_codec=``)
LOSSY_CODECS = tuple(n for n, c in CODEC_SPECS.items() if c.exactness is Exactness.LOSSY)
DEFAULT_LOSSY_CODEC = BF16.name

# Ops whose node saves its result and reads only its sign (NOTE [sign-only readers] in
# memfit.runtime.compress), with the name prefix of that node's class: where SIGN_BIT is exact.
SIGN_READERS = {"aten.relu.default": "ReluBackward", "aten.relu_.default": "ReluBackward"}

# Ops whose node saves their input 0 and reads only its geometry (NOTE [geometry-only readers]
# in memfit.runtime.compress), with the name of the ``torch.nn.functional`` call that runs
# them: where SHAPE_ONLY is exact (max pool's backward writes the gradient where the indices
# point; it reads the input for its sizes and memory format only).
SHAPE_READERS = {"aten.max_pool2d_with_indices.default": "max_pool2d",
                 "aten.max_pool3d_with_indices.default": "max_pool3d"}

# Batch norms whose saved input INPLACE_ABN rebuilds, and the in-place activation after them
# it inverts, with the torch.nn.functional calls that run them (NOTE [in-place activated
# batch norm] in memfit.runtime.compress)
ABN_NORMS = {"aten.native_batch_norm.default": "batch_norm", "aten.cudnn_batch_norm.default": "batch_norm",
             "aten._native_batch_norm_legit.default": "batch_norm"}
ABN_ACTIVATIONS = {"aten.leaky_relu_.default": "leaky_relu"}
# The relus after a batch norm (in place or not) that BN_FROM_OUTPUT runs out of place,
# with the torch calls that run them (NOTE [output-activated batch norm] in memfit.runtime.bn_rebuild)
OUTPUT_BN_ACTIVATIONS = {"aten.relu_.default": "relu", "aten.relu.default": "relu"}


def codec_costs_on(bandwidth_bytes_per_s: float, op_overhead_s: float) -> CodecCosts:
    """What the codecs would cost on a device that is not this machine (a fake-mode
    ``target``): each codec's ``passes`` over memory at ``bandwidth_bytes_per_s`` per raw byte,
    its ``ops`` launches of ``op_overhead_s`` per tensor (the most of any codec), and the
    tagging mode's host cost per op as on this machine (``DEFAULT_CODEC_COSTS``): estimates
    from the implementations' passes, not measured on that device.

    Example:
        >>> c = codec_costs_on(900e9, 5e-6); round(c.per_byte_s["sign_bit"] * 900e9, 1)
        5.5
    """
    return CodecCosts({c.name: c.passes / bandwidth_bytes_per_s for c in CODEC_SPECS.values()},
                      max(c.ops for c in CODEC_SPECS.values()) * op_overhead_s,
                      DEFAULT_CODEC_COSTS.mode_per_op_s)


def codec_spec(name: object) -> CodecSpec:
    """The registry's entry for ``name``, else a ValueError naming every codec memfit knows.

    Example:
        >>> codec_spec("bf16").exactness
        <Exactness.LOSSY: 'lossy'>
    """
    spec = CODEC_SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown codec {name!r}; memfit knows {sorted(CODEC_SPECS)}")
    return spec


def check_lossy_codec(name: object) -> str | None:
    """``name`` if it is one of ``LOSSY_CODECS`` or None (no codec on the other activations:
    ``compress="lossy"`` then adds the REBUILT batch-norm variants alone), else a ValueError
    naming them.

    Example:
        >>> check_lossy_codec("fp8_e4m3")
        'fp8_e4m3'
    """
    if name is None:
        return None
    if not isinstance(name, str) or name not in LOSSY_CODECS:
        raise ValueError(f"lossy_codec must be one of {', '.join(LOSSY_CODECS)} or None (the "
                         f"batch-norm variants alone), got {name!r} "
                         "(the exact codecs are chosen by the planner in either compress mode)")
    return name


def codec_packed_bytes(name: str, numel: int, itemsize: int) -> int:
    """Bytes of ``name``'s packed form of a tensor of ``numel`` elements of ``itemsize`` bytes
    (``narrow_int``: the int32 bound; its packed form may be narrower).

    Example:
        >>> codec_packed_bytes("two_level", 1000, 4)
        129
    """
    return codec_spec(name).packed_bytes(numel, itemsize)


@dataclass(frozen=True)
class CodecCosts:
    """What compression costs a step on one machine (``memfit.measuring.codec_cost`` measures
    it): encode + decode seconds per raw byte by codec and per tensor, and the tagging mode's
    seconds per op of a named module (NOTE [compression through saved-tensor hooks])."""

    per_byte_s: dict[str, float]
    per_tensor_s: float
    mode_per_op_s: float


# Used when none is measured: each codec's CodecSpec.per_byte_s; per tensor and a no-op Python
# dispatch mode's 15 us per op over small matmul/gelu/softmax/view/add ops measured as above.
DEFAULT_CODEC_COSTS = CodecCosts({c.name: c.per_byte_s for c in CODEC_SPECS.values()}, 150e-6, 15e-6)


@dataclass(frozen=True)
class Compressed:
    """One forward op outside every region whose saved outputs the plan keeps packed.

    Attributes:
        key: ``"<overload>#<k>"``, the k-th call (from 0) of that overload within one call
            of ``module`` (its children's ops counted too).
        codec: a name of ``CODEC_SPECS``.
        module: the innermost module running the op (``""``: the root).
        raw_bytes: bytes of the saved storage as autograd would keep it.
        packed_bytes: bytes of its packed form.
        output: which of the op's outputs (max-pool's indices: 1).
        call: which call of ``module`` in the forward (from 0), for a module the forward
            calls more than once (a block's one ``relu`` module used after each norm); None:
            every call.
    """

    key: str
    codec: str
    module: str = ""
    raw_bytes: int = 0
    packed_bytes: int = 0
    output: int = 0
    call: int | None = None

    def __post_init__(self) -> None:
        codec_spec(self.codec)

    @property
    def lossless(self) -> bool:
        return CODEC_SPECS[self.codec].exactness not in (Exactness.LOSSY, Exactness.REBUILT)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "codec": self.codec, "module": self.module,
                               "raw_bytes": self.raw_bytes, "packed_bytes": self.packed_bytes,
                               "output": self.output}
        if self.call is not None:  # written only where set: older plans' JSON is unchanged
            out["call"] = self.call
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Compressed:
        return cls(str(data["key"]), str(data["codec"]), str(data.get("module", "")),
                   int(data.get("raw_bytes", 0)), int(data.get("packed_bytes", 0)),
                   int(data.get("output", 0)),
                   None if data.get("call") is None else int(data["call"]))


def compressed_lines(entries: tuple[Compressed, ...]) -> list[str]:
    """``print(plan)``'s lines for the compressed tensors."""
    from memfit.units import format_bytes

    if not entries:
        return []
    lossy = [c for c in entries if not c.lossless]
    saved = sum(c.raw_bytes - c.packed_bytes for c in entries)
    out = [f"  compressed: {len(entries)} saved tensor(s), {format_bytes(saved)} less kept; "
           + ("LOSSY: gradients differ from the plain step's (verify reports their relative error)"
              if lossy else "lossless: the step stays bitwise equal to the plain one")]
    w = max(len(c.module or "<root>") + (0 if c.call is None else len(f" (call {c.call})"))
            for c in entries)
    k = max(len(c.key) for c in entries)
    for c in entries:
        where = (c.module or "<root>") + ("" if c.call is None else f" (call {c.call})")
        out.append(f"    {where.ljust(w)}  {c.key.ljust(k)}  {c.codec:<14}  "
                   f"{format_bytes(c.raw_bytes):>10} -> {format_bytes(c.packed_bytes):>10}")
    return out
