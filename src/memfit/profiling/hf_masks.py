"""Hugging Face's causal-mask skip under fake tensors, as the real step takes it.

NOTE [HF causal mask in fake mode]
    On real tensors, a Hugging Face model given no padding mask and unpacked positions passes
    SDPA ``is_causal=True`` and no mask, so a GPU runs flash or cuDNN attention. Under fake
    tensors two of its checks see a "tracing" tensor and keep a mask:
    ``transformers.masking_utils.find_packed_sequence_indices`` cannot tell the position ids
    are one sequence a row (it would read them) and returns its packed-sequence mask, and
    ``_ignore_causal_mask_sdpa`` refuses a tensor ``q_offset``. The trace then built an
    explicit (batch, 1, s, s) mask and took memory-efficient attention with an expanded bias: an HF Llama (8 x 2048, bf16, 4 x 2048 tokens) profiled 11.7% over the peak
    an H200 measured (10,252,484,744 B against 9,057,117,184; every block checkpointed 13.2%
    over; ``benchmarks/results/gpu-probe-2026-12-04/hf-llama``). While memfit traces in fake
    mode (every tensor of the trace is fake, so "tracing" says nothing), the checks are given
    the answers the real step gets where those read no tensor value: the positions are not
    packed when the example inputs carry no ``position_ids`` (the model then makes them, an
    ``arange`` a row; given ones are left to the check: a packed batch keeps its mask), and
    the mask is skipped with no padding mask, no local attention window reached, and one
    query or as many queries as keys. A padding mask would have to be read (``fast_all``), so
    the mask is kept then, as before (conservative). A wrapper that packs positions itself
    from other inputs is not told apart: pass ``position_ids`` to it by name.
    Only a ``transformers.masking_utils`` already imported is touched (memfit never imports
    transformers for it), and the original function is back when the trace ends.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["hf_causal_mask_skip"]


@contextlib.contextmanager
def hf_causal_mask_skip(*, positions_given: bool) -> Iterator[None]:
    """Inside: Hugging Face's SDPA causal-mask checks decide as on real tensors (NOTE [HF
    causal mask in fake mode]); outside, or without transformers imported, nothing changes.

    Args:
        positions_given: whether the step's example inputs carry ``position_ids`` (then the
            packed-sequence check is left as it is).

    Example:
        >>> with hf_causal_mask_skip(positions_given=False):
        ...     pass
    """
    mu = sys.modules.get("transformers.masking_utils")
    orig = getattr(mu, "_ignore_causal_mask_sdpa", None)
    packed = getattr(mu, "find_packed_sequence_indices", None)
    if orig is None:
        yield
        return
    try:
        sig = inspect.signature(orig)
    except (TypeError, ValueError):
        yield
        return

    def skip(*args: Any, **kwargs: Any) -> bool:
        if orig(*args, **kwargs):
            return True
        try:
            a = sig.bind(*args, **kwargs).arguments
        except TypeError:
            return False
        q = a.get("q_length", a.get("query_length"))
        kv, window = a.get("kv_length"), a.get("local_attention_size")
        if a.get("padding_mask") is not None or not isinstance(q, int) or not isinstance(kv, int):
            return False
        if window is not None and kv >= window:
            return False
        return q == 1 or kv == q

    def unpacked(position_ids: Any) -> None:
        return None  # one sequence a row: the model made the positions (an arange a row)

    mu._ignore_causal_mask_sdpa = skip  # type: ignore[union-attr]
    if packed is not None and not positions_given:
        mu.find_packed_sequence_indices = unpacked  # type: ignore[union-attr]
    try:
        yield
    finally:
        mu._ignore_causal_mask_sdpa = orig  # type: ignore[union-attr]
        if packed is not None:
            mu.find_packed_sequence_indices = packed  # type: ignore[union-attr]
