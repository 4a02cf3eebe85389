"""What compression costs on this machine: the codecs timed, and the tagging mode.

NOTE [codec cost measurement]
    Each codec encodes and decodes a small (16 KiB) and a large (1 MiB) tensor shaped like
    what it packs (its ``Codec.sample``: a dropout mask for ``two_level``, relu results for
    ``sign_bit``, pool indices for ``narrow_int``); the median of ``repeats`` gives a line ``a + b * bytes``:
    ``b`` per byte for that codec, ``a`` per tensor (the largest over the codecs timed). The
    tagging mode's per-op cost is a no-op ``TorchDispatchMode`` over small matmuls, gelus,
    softmaxes, views and adds, less those ops alone. About 0.1-0.3 s on a CPU; run once per ``fit(compress=...)``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memfit._torch import TorchDispatchMode
from memfit.planning.compression import (
    DEFAULT_CODEC_COSTS,
    DEFAULT_LOSSY_CODEC,
    LOSSLESS_CODECS,
    CodecCosts,
    codec_costs_on,
)

__all__ = ["codec_costs", "codec_costs_for"]

_SMALL, _LARGE = 16 * 1024, 1 << 20  # bytes


def _median_s(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _round_trip(c: Any, x: torch.Tensor) -> Callable[[], object]:
    def run() -> object:
        return c.decode(c.encode(x))
    return run


class _NoOp(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def codec_costs(names: Iterable[str], *, device: torch.device | str = "cpu", repeats: int = 7) -> CodecCosts:
    """Measured :class:`~memfit.planning.compression.CodecCosts` for the codecs ``names``
    (NOTE [codec cost measurement]); codecs not named keep the defaults.

    Args:
        names: codec names (the registry ``memfit.planning.compression.CODEC_SPECS``).
        device: where to time them (default CPU).
        repeats: timed runs per size (the median is used; default 7).

    Example:
        >>> codec_costs(["two_level"]).per_byte_s["two_level"] > 0   # doctest: +SKIP
        True
    """
    from memfit.runtime.codecs import codec

    dev = torch.device(device)
    per_byte = dict(DEFAULT_CODEC_COSTS.per_byte_s)
    fixed = 0.0
    for name in sorted(set(names)):
        c = codec(name)
        timed = []
        for nbytes in (_SMALL, _LARGE):
            x = c.sample(nbytes, torch.Generator(device="cpu").manual_seed(0)).to(dev)
            c.decode(c.encode(x))  # warm-up
            timed.append((x.untyped_storage().nbytes(), _median_s(_round_trip(c, x), repeats, dev)))
        (b0, t0), (b1, t1) = timed
        slope = max(0.0, (t1 - t0) / (b1 - b0))
        per_byte[name] = slope
        fixed = max(fixed, max(0.0, t0 - slope * b0))
    x, w = torch.ones(4, 32, device=dev), torch.ones(32, 32, device=dev)
    n = 40  # ops like a block's: matmul, gelu, softmax, view, add (5 an iteration)

    def adds() -> None:
        for _ in range(n // 5):
            torch.add(torch.softmax(torch.nn.functional.gelu(x @ w), -1).view(-1), 1.0)

    def moded() -> None:
        with _NoOp():
            adds()

    adds()
    moded()
    mode = max(0.0, (_median_s(moded, repeats, dev) - _median_s(adds, repeats, dev)) / n)
    return CodecCosts(per_byte, fixed if names else DEFAULT_CODEC_COSTS.per_tensor_s, mode)


def codec_costs_for(mode: str, lossy_codec: str | None = DEFAULT_LOSSY_CODEC, profile: Any = None) -> CodecCosts:
    """``codec_costs`` of the codecs a ``compress=`` mode uses (``"lossy"``: ``lossy_codec``
    too, default bf16); for a ``profile`` made in fake mode for a GPU preset (its ``device``
    names the preset), the preset's estimate instead (``codec_costs_on``): timing the codecs
    on this machine would price another device."""
    from memfit.timemodel.devices import PRESETS

    target = PRESETS.get(str(getattr(profile, "device", "")).lower())
    if target is not None and target.name != "cpu":
        return codec_costs_on(target.bandwidth_bytes_per_s, target.op_overhead_s)
    return codec_costs(LOSSLESS_CODECS + ((lossy_codec,) if mode == "lossy" and lossy_codec else ()))
