"""A GPT-style decoder: token + position embeddings, pre-norm blocks, causal attention.

Sized by arguments and seeded, so that tests and benchmarks can rebuild the same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "GPT", "gpt"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 256
    n_layer: int = 8
    n_head: int = 8
    d_model: int = 512
    dropout: float = 0.1  # on: exercises RNG replay in recompute
    bias: bool = True


class CausalSelfAttention(nn.Module):
    mask: torch.Tensor  # (seq_len, seq_len) bool, lower triangle

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of ``x`` (B, T, C), each split into heads (B, nh, T, hs)."""
        B, T, C = x.shape  # batch, time, channels
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        return q, k, v

    def out(self, y: torch.Tensor) -> torch.Tensor:
        """Heads (B, nh, T, hs) merged back and projected: (B, T, C)."""
        B, nh, T, hs = y.shape
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)  # (B, T, C)
        return self.resid_drop(self.proj(y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)  # each (B, nh, T, hs)
        T, hs = q.shape[-2], q.shape[-1]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        return self.out(att @ v)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets=None)`` returns logits, or the loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        if self.cfg.seq_len < T:
            raise ValueError(f"sequence of {T} tokens is longer than the model's seq_len {self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))


def gpt(
    *,
    n_layer: int = 8,
    d_model: int = 512,
    n_head: int = 8,
    seq_len: int = 256,
    vocab_size: int = 512,
    dropout: float = 0.1,
    seed: int = 0,
) -> GPT:
    """Build a seeded GPT decoder.

    Example:
        >>> m = gpt(n_layer=2, d_model=64, n_head=2, seq_len=32)
        >>> m(torch.randint(0, 512, (2, 32))).shape
        torch.Size([2, 32, 512])
    """
    if d_model % n_head:
        raise ValueError(f"d_model {d_model} must be divisible by n_head {n_head}")
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=n_head,
                         d_model=d_model, dropout=dropout))
