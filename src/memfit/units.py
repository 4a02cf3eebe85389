"""Parse and format memory quantities and budgets (the API/CLI edge only).

Inside memfit memory is always ``int`` bytes and time ``float`` seconds.
"""

from __future__ import annotations

import math
import numbers
import re

__all__ = ["parse_bytes", "format_bytes", "resolve_budget", "format_seconds", "format_flops"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """Parse a memory size such as ``"6GiB"``, ``"500MB"``, ``"1.5 GB"`` or ``"1024"``.

    Binary (KiB, MiB, GiB, TiB) and decimal (KB, MB, GB, TB) units are both accepted,
    case-insensitively. Returns whole bytes (rounded down).

    Example:
        >>> parse_bytes("1.5 KiB")
        1536
    """
    if not isinstance(text, str):
        raise TypeError(f"expected a string such as '6GiB', got {type(text).__name__}")
    m = _QUANTITY.match(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot parse memory size {text!r}: write a number and a unit, "
            "e.g. '6GiB', '500MB', '1.5 GB' or '1024' (bytes)"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"memory size {text!r} must be positive")
    return int(value)


def resolve_budget(budget: int | float | str, plain_peak_bytes: int) -> int:
    """Turn a user's budget into bytes.

    Args:
        budget: an ``int`` is bytes; a ``float`` in (0, 1] is a fraction of
            ``plain_peak_bytes``; a string is a size (``"6GiB"``), a percentage (``"80%"``) or
            a number written as text. NumPy scalars (``np.int64``, ``np.float32``) and 0-d
            arrays or tensors count as the Python number they hold.
        plain_peak_bytes: the un-checkpointed step's peak activation memory, bytes.

    Raises:
        ValueError: a budget that does not parse, is not positive, or is a fraction above 1
            (a percentage above 100%).
        TypeError: a budget of another type (a bool, a list, an array of several numbers).

    Example:
        >>> resolve_budget(0.5, 1000)
        500
        >>> resolve_budget("80%", 1000)
        800
    """
    value = _plain(budget)
    if isinstance(value, str):
        s = value.strip()
        if s.endswith("%"):
            try:
                pct = float(s[:-1])
            except ValueError:
                raise ValueError(f"cannot parse budget {str(value)!r}: expected e.g. '80%'") from None
            if not math.isfinite(pct) or not 0.0 < pct <= 100.0:
                hint = ("100% already allows the whole un-checkpointed peak; "
                        if pct > 100.0 else "")
                raise ValueError(
                    f"a percentage budget is a share of the un-checkpointed peak and must lie in "
                    f"(0%, 100%], got {s!r}; {hint}give e.g. '60%', or bytes such as '6GiB'"
                )
            return _fraction(pct / 100.0, plain_peak_bytes, repr(s))
        if s.isdigit():
            return resolve_budget(int(s), plain_peak_bytes)
        try:
            fraction = float(s)
        except ValueError:
            try:
                return parse_bytes(s)
            except ValueError as e:
                raise ValueError(f"cannot parse budget {str(value)!r}: {e}") from None
        return _fraction(fraction, plain_peak_bytes, repr(s))
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"budget must be positive bytes, got {value}")
        return value
    if isinstance(value, float):
        return _fraction(value, plain_peak_bytes, repr(value))
    raise TypeError(f"budget must be int bytes, a float fraction or a string, got {type(budget).__name__}")


def _plain(budget: object) -> object:
    """A NumPy scalar, 0-d array or 0-d tensor as the Python int/float it holds; anything else
    unchanged.

    ``bool`` (and NumPy's) is refused: ``True`` would read as 1 byte.
    """
    if isinstance(budget, bool):
        raise TypeError("budget must be bytes (int), a fraction (float) or a string, not bool")
    if isinstance(budget, str):
        return budget
    shape = getattr(budget, "shape", None)
    if shape is not None and hasattr(budget, "item"):  # numpy scalars and arrays, torch tensors
        if tuple(shape) != ():
            raise TypeError(f"budget must be one number, got {type(budget).__name__} of shape "
                            f"{tuple(shape)}")
        return _plain(budget.item())
    if isinstance(budget, numbers.Integral):
        return int(budget)
    if isinstance(budget, numbers.Real):
        return float(budget)
    return budget


def _fraction(fraction: float, plain_peak_bytes: int, written: str) -> int:
    if not math.isfinite(fraction) or not 0.0 < fraction <= 1.0:
        raise ValueError(
            f"a float budget is a fraction of the un-checkpointed peak and must lie in "
            f"(0, 1], got {written}; pass bytes as an int or a string like '6GiB'"
        )
    return max(1, int(fraction * plain_peak_bytes))


def format_bytes(n: int) -> str:
    """Format bytes with a binary unit, e.g. ``format_bytes(1536) == '1.50 KiB'``."""
    sign = "-" if n < 0 else ""
    v = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{sign}{int(v)} B" if unit == "B" else f"{sign}{v:.2f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    """Format seconds for tables: ``'12.3 ms'``, ``'1.25 s'``."""
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1.0:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def format_flops(n: int) -> str:
    """Format a FLOP count with an SI prefix: ``'13.6 MFLOP'``, ``'2.1 TFLOP'``, ``'512 FLOP'``.

    Example:
        >>> format_flops(13_631_488)
        '13.6 MFLOP'
    """
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.3g} {prefix}FLOP" if v < 100 else f"{v:.0f} {prefix}FLOP"
    return f"{n} FLOP"
