"""The zoo GPT split by blocks into pipeline stages (``torch.distributed.pipelining``).

Stage 0 holds the embeddings, the last stage the final norm and the head; every stage a run of
consecutive blocks (the first stages get one more when they do not divide evenly). Each stage
is a deep copy of its part of the model, so the stages of one ``GPT`` start from its weights.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from memfit.zoo.gpt import GPT

__all__ = ["GPTStage", "gpt_stage", "lm_loss"]


class GPTStage(nn.Module):
    """Blocks ``[start, stop)`` of a GPT, with the embeddings if first, the head if last.

    ``forward`` takes token ids (B, T) on the first stage, hidden states (B, T, C) on the
    others; returns hidden states (B, T, C), or logits (B, T, vocab) on the last.
    """

    def __init__(self, model: GPT, start: int, stop: int) -> None:
        super().__init__()
        n = len(model.blocks)
        self.first, self.last = start == 0, stop == n
        self.tok = copy.deepcopy(model.tok) if self.first else None
        self.pos = copy.deepcopy(model.pos) if self.first else None
        self.drop = copy.deepcopy(model.drop) if self.first else None
        self.blocks = nn.ModuleList(copy.deepcopy(model.blocks[i]) for i in range(start, stop))
        self.ln_f = copy.deepcopy(model.ln_f) if self.last else None
        self.head = copy.deepcopy(model.head) if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None and self.pos is not None and self.drop is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok(x) + self.pos(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None and self.head is not None:
            x = self.head(self.ln_f(x))  # (B, T, vocab)
        return x


def gpt_stage(model: GPT, stage: int, n_stages: int) -> GPTStage:
    """Stage ``stage`` of ``n_stages`` of ``model``, split by blocks.

    Example:
        >>> m = memfit.zoo.gpt(n_layer=4, d_model=64, n_head=2, seq_len=32)   # doctest: +SKIP
        >>> [len(gpt_stage(m, s, 2).blocks) for s in range(2)]                # doctest: +SKIP
        [2, 2]
    """
    n = len(model.blocks)
    if not 0 <= stage < n_stages <= n:
        raise ValueError(f"stage {stage} of {n_stages} stages of a GPT of {n} blocks: need "
                         f"0 <= stage < n_stages <= {n}")
    per, more = divmod(n, n_stages)
    start = stage * per + min(stage, more)
    return GPTStage(model, start, start + per + (stage < more))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of logits (B, T, vocab) against targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
