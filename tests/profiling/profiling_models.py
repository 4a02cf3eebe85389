"""Small seeded models whose activations can be counted by hand (the profiling tests' models;
imported by name, as ``runtime_helpers`` and ``profile_builders`` are: ``from conftest import``
found another directory's conftest when pytest was given several directories)."""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> nn.Module:
    """Linear(64, 128) -> ReLU -> Linear(128, 10), fp32 (see test_tracer for its bytes)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


class Block(nn.Module):
    """A pre-norm transformer block with hand-written attention (no sdpa: same kernels on
    every device, so fake mode and measure mode run the same ops)."""

    def __init__(self, d: int, heads: int, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)                  # (b, t, d) each
        q = q.view(b, t, self.heads, -1).transpose(1, 2)                   # (b, h, t, hs)
        k = k.view(b, t, self.heads, -1).transpose(1, 2)
        v = v.view(b, t, self.heads, -1).transpose(1, 2)
        # no 1/sqrt(hs) scale: `tensor * python_float` makes autograd save an 8-byte wrapped
        # scalar that no dispatch mode sees (test_measure.py::test_wrapped_scalar_gap)
        att = q @ k.transpose(-2, -1)                                      # (b, h, t, t)
        att = self.drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)                     # (b, t, d)
        x = x + self.proj(y)
        return x + self.drop(self.out(self.act(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, n_layer: int = 2, d: int = 32, heads: int = 2, vocab: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)                                              # (b, t, vocab)
        return nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())


def gpt_inputs(batch: int = 2, seq: int = 16, vocab: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, seq), generator=g)
