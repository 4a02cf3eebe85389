"""Checkpointing lowers the step's peak activation memory (exact bytes, dispatch tracker).

Uses memfit.profiling.measure (the live-storage tracker meter: every storage an op creates,
counted once, in bytes), so the numbers are exact and deterministic on CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.profiling.measure import measure
from memfit.runtime.segment import checkpoint_segment
from memfit.runtime.wrap import wrap

B, D, H = 512, 64, 256
HIDDEN_BYTES = B * H * 4  # one ReLU output a plain step keeps per block (float32)


def _mlp_stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
                           for _ in range(4)))


def _peak(model: nn.Module, x: torch.Tensor) -> int:
    return measure(lambda: model(x).sum().backward(), model=model, meter="dispatch").peak_bytes


def test_wrapped_and_segmented_peaks_are_lower_by_the_dropped_activations():
    x = torch.randn(B, D, requires_grad=True)
    plain = _peak(_mlp_stack(), x)

    wrapped = _mlp_stack()
    for block in wrapped:
        wrap(block)
    every_block = _peak(wrapped, x)

    segmented = _mlp_stack()
    checkpoint_segment(segmented, [0, 1])
    first_two = _peak(segmented, x)

    assert isinstance(plain, int) and plain > 4 * HIDDEN_BYTES
    # Every block checkpointed: at its peak the plain step holds the ReLU outputs of all 4
    # blocks, the checkpointed one those of the block being recomputed (and, at block
    # boundaries, gradients): at least 2 blocks' worth less (measured: 2.99 blocks' worth).
    assert plain - every_block >= 2 * HIDDEN_BYTES, (plain, every_block)
    # Blocks 0..1 as one segment: their 2 ReLU outputs are dropped, and recomputed only
    # after blocks 2..3's have been freed.
    assert first_two <= plain - HIDDEN_BYTES, (plain, first_two)
    assert every_block < first_two < plain
