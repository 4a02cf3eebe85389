"""Tiny Hugging Face models built from code (no downloads), with their default configs:
``use_cache=True``, dropout on. Activations dominate at these sizes, so half the plain peak
is a feasible budget."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB = 4, 64, 128


def llama(max_positions: int = SEQ, layers: int = 6) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        attention_dropout=0.1)  # Llama's default dropout is 0: turn it on to test RNG replay
    return transformers.LlamaForCausalLM(cfg).train()


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=6,
                                  n_head=4, bos_token_id=0, eos_token_id=0)  # dropouts 0.1 by default
    return transformers.GPT2LMHeadModel(cfg).train()


MODELS = {"llama": llama, "gpt2": gpt2}


def batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)  # (batch, time)
    return {"input_ids": ids, "labels": ids}


def train(model: torch.nn.Module, steps: int = 3, seed: int = 0) -> torch.nn.Module:
    """``steps`` AdamW steps on fresh batches, from a fixed RNG seed (dropout masks)."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        loss = model(**batch(seed=100 + i)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    unequal = [n for n in pa if not torch.equal(pa[n], pb[n])]
    assert not unequal, f"{len(unequal)} parameters differ, first {unequal[0]}"
