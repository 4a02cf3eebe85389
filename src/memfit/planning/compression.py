"""What a plan compresses: the codecs' torch-free facts and the plan's ``Compressed`` entries.

The codecs themselves (tensor in, packed form out) are ``memfit.runtime.codecs``; planning
needs only what they are called, whether they are exact, and how many bytes their packed
form takes for a tensor of a given size (the runtime's ``Codec.packed_bytes`` is this).

NOTE [what lossy means]
    A plan is *lossless* when every codec it uses is EXACT (the decoded tensor is bitwise
    the saved one) or SIGN used only for a node that reads the sign alone (relu's): its step
    is then bitwise the plain step, and ``verify`` checks that. A plan with any LOSSY codec
    (bf16, fp8_e4m3, int8_blockwise) changes the gradients: ``verify`` then reports their
    largest relative error over parameters (``gradient_rel_error``) and never claims bitwise
    equality.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["Exactness", "CODEC_EXACTNESS", "codec_packed_bytes", "Compressed", "BLOCK", "CodecCosts",
           "DEFAULT_CODEC_COSTS", "LOSSLESS_CODECS", "LOSSY_CODECS", "check_lossy_codec"]

BLOCK = 256  # elements per int8_blockwise scale


class Exactness(str, enum.Enum):
    EXACT = "exact"  # decode(encode(x)) is bitwise x
    SIGN = "sign"    # only "not x <= 0" survives: exact for a reader that compares with 0 only
    LOSSY = "lossy"  # bounded error (memfit.runtime.codecs states each bound)


CODEC_EXACTNESS: dict[str, Exactness] = {
    "bool_bits": Exactness.EXACT, "two_level": Exactness.EXACT, "narrow_int": Exactness.EXACT,
    "sign_bit": Exactness.SIGN,
    "bf16": Exactness.LOSSY, "fp8_e4m3": Exactness.LOSSY, "int8_blockwise": Exactness.LOSSY,
}


# the codecs a lossless plan may use (SIGN only for a sign-only reader: NOTE [what lossy means])
LOSSLESS_CODECS = tuple(n for n, e in CODEC_EXACTNESS.items() if e is not Exactness.LOSSY)
# the codecs ``compress="lossy"`` may put on the other fp32 activations (``lossy_codec=``)
LOSSY_CODECS = tuple(n for n, e in CODEC_EXACTNESS.items() if e is Exactness.LOSSY)


def check_lossy_codec(name: object) -> str:
    """``name`` if it is one of ``LOSSY_CODECS``, else a ValueError naming them.

    Example:
        >>> check_lossy_codec("fp8_e4m3")
        'fp8_e4m3'
    """
    if not isinstance(name, str) or name not in LOSSY_CODECS:
        raise ValueError(f"lossy_codec must be one of {', '.join(LOSSY_CODECS)}, got {name!r} "
                         "(the exact codecs are chosen by the planner in either compress mode)")
    return name


def codec_packed_bytes(name: str, numel: int, itemsize: int) -> int:
    """Bytes of ``name``'s packed form of a tensor of ``numel`` elements of ``itemsize`` bytes
    (``narrow_int``: the int32 bound; its packed form may be narrower).

    Example:
        >>> codec_packed_bytes("two_level", 1000, 4)
        129
    """
    bits = -(-numel // 8)
    if name in ("bool_bits", "sign_bit"):
        return bits
    if name == "two_level":
        return bits + itemsize
    if name == "narrow_int":
        return 4 * numel
    if name == "bf16":
        return 2 * numel
    if name == "fp8_e4m3":
        return numel + 4
    if name == "int8_blockwise":
        return numel + 4 * -(-numel // BLOCK)
    raise ValueError(f"unknown codec {name!r}; memfit knows {sorted(CODEC_EXACTNESS)}")


@dataclass(frozen=True)
class CodecCosts:
    """What compression costs a step on one machine (``memfit.measuring.codec_cost`` measures
    it): encode + decode seconds per raw byte by codec and per tensor, and the tagging mode's
    seconds per op of a named module (NOTE [compression through saved-tensor hooks])."""

    per_byte_s: dict[str, float]
    per_tensor_s: float
    mode_per_op_s: float


# Measured on this project's 2-core CPU box (torch 2.13) by hand before the measurement ran
# in fit: encode + decode of 32 KiB and 2 MiB tensors (two_level 247 us and 6.4 ms, sign_bit
# 3.3 ms and bf16 0.20 ms at 2 MiB), a no-op Python dispatch mode 15 us per op over small
# matmul/gelu/softmax/view/add ops. fp8_e4m3 and int8_blockwise are estimates. Used when none
# is measured.
DEFAULT_CODEC_COSTS = CodecCosts(
    {"sign_bit": 1.6e-9, "two_level": 3.1e-9, "narrow_int": 0.5e-9, "bool_bits": 1.6e-9,
     "bf16": 0.1e-9, "fp8_e4m3": 1.5e-9, "int8_blockwise": 3.0e-9}, 150e-6, 15e-6)


@dataclass(frozen=True)
class Compressed:
    """One forward op outside every region whose saved outputs the plan keeps packed.

    Attributes:
        key: ``"<overload>#<k>"``, the k-th call (from 0) of that overload within one call
            of ``module`` (its children's ops counted too).
        codec: a name of ``CODEC_EXACTNESS``.
        module: the innermost module running the op (``""``: the root).
        raw_bytes: bytes of the saved storage as autograd would keep it.
        packed_bytes: bytes of its packed form.
        output: which of the op's outputs (max-pool's indices: 1).
    """

    key: str
    codec: str
    module: str = ""
    raw_bytes: int = 0
    packed_bytes: int = 0
    output: int = 0

    def __post_init__(self) -> None:
        if self.codec not in CODEC_EXACTNESS:
            raise ValueError(f"unknown codec {self.codec!r}; memfit knows {sorted(CODEC_EXACTNESS)}")

    @property
    def lossless(self) -> bool:
        return CODEC_EXACTNESS[self.codec] is not Exactness.LOSSY

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "codec": self.codec, "module": self.module,
                "raw_bytes": self.raw_bytes, "packed_bytes": self.packed_bytes, "output": self.output}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Compressed:
        return cls(str(data["key"]), str(data["codec"]), str(data.get("module", "")),
                   int(data.get("raw_bytes", 0)), int(data.get("packed_bytes", 0)),
                   int(data.get("output", 0)))


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
    w = max(len(c.module or "<root>") for c in entries)
    k = max(len(c.key) for c in entries)
    for c in entries:
        out.append(f"    {(c.module or '<root>').ljust(w)}  {c.key.ljust(k)}  {c.codec:<14}  "
                   f"{format_bytes(c.raw_bytes):>10} -> {format_bytes(c.packed_bytes):>10}")
    return out
