"""The benchmark models and their adapters: what a step is, and which modules are "blocks".

Peers (``torch.utils.checkpoint`` per block, ``checkpoint_sequential``, selective
checkpointing) need to know where a model's repeated blocks are; memfit does not, but it needs
the same step. A :class:`Case` bundles both, so that every method runs the same model on the
same inputs with the same loss.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Case", "CASES", "build_case", "model_names", "gpt_case", "unet3d_case", "resnet_case", "llama_case"]


@dataclass(frozen=True)
class Case:
    """One benchmark model: its factory, inputs, loss and block structure.

    Attributes:
        name: command-line name (``gpt``, ``gpt-act``, ...).
        description: a line for tables (sizes, batch).
        model: the module (seeded; callers deep-copy it per method).
        inputs: positional inputs of ``model``.
        loss_fn: turns the model's output into a scalar loss.
        blocks: dotted paths of the repeated blocks (what "every block" checkpoints).
        sequential: dotted path of an ``nn.Sequential`` holding the blocks, or ``None`` with the
            reason in ``sequential_reason`` when ``checkpoint_sequential`` cannot be applied.
        hf: the model is a Hugging Face ``PreTrainedModel`` (its own checkpointing switch is
            the "every block" peer).
        config: the sizes, for the JSON record.
    """

    name: str
    description: str
    model: nn.Module
    inputs: tuple[Any, ...]
    loss_fn: Callable[[Any], torch.Tensor]
    blocks: tuple[str, ...]
    sequential: str | None = None
    sequential_reason: str = ""
    hf: bool = False
    config: dict[str, Any] = field(default_factory=dict)


def _gpt_loss(out: torch.Tensor) -> torch.Tensor:
    return out  # the zoo GPT returns the loss itself when given targets


def gpt_case(name: str, *, n_layer: int, d_model: int, n_head: int, seq_len: int, batch: int) -> Case:
    from memfit.zoo import example_inputs, gpt

    cfg: dict[str, Any] = dict(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, vocab_size=512,
               dropout=0.1, seed=0)
    model = gpt(**cfg)
    idx = example_inputs(model, batch=batch, seed=0)
    targets = example_inputs(model, batch=batch, seed=1)
    return Case(
        name=name,
        description=f"zoo GPT {n_layer}x{d_model}, {n_head} heads, seq {seq_len}, batch {batch}, dropout 0.1",
        model=model,
        inputs=(idx, targets),
        loss_fn=_gpt_loss,
        blocks=tuple(f"blocks.{i}" for i in range(n_layer)),
        sequential=None,
        sequential_reason="not applicable: blocks are called from a Python loop over a ModuleList",
        config={**cfg, "batch": batch},
    )


def _labels_loss(labels: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, labels)

    return loss


def unet3d_case(*, base: int, depth: int, side: int, batch: int) -> Case:
    from memfit.zoo import example_inputs, unet3d

    cfg: dict[str, Any] = dict(base=base, depth=depth, in_channels=1, out_channels=2, seed=0)
    model = unet3d(**cfg)
    x = example_inputs(model, batch=batch, size=side, seed=0)
    labels = torch.randint(0, 2, (batch, side, side, side), generator=torch.Generator().manual_seed(1))
    blocks = (*(f"down.{i}" for i in range(depth)), "bottleneck", *(f"up.{i}" for i in range(depth)))
    return Case(
        name="unet3d",
        description=f"zoo UNet3D base {base}, depth {depth}, {side}^3 volume, batch {batch}",
        model=model,
        inputs=(x,),
        loss_fn=_labels_loss(labels),
        blocks=blocks,
        sequential=None,
        sequential_reason="not applicable: skip connections make the UNet a graph, not a sequence",
        config={**cfg, "side": side, "batch": batch},
    )


def resnet_case(*, blocks_per_stage: tuple[int, ...], width: int, side: int, batch: int) -> Case:
    from memfit.zoo import example_inputs, resnet

    cfg: dict[str, Any] = dict(blocks_per_stage=blocks_per_stage, width=width, num_classes=10, seed=0)
    model = resnet(**cfg)
    x = example_inputs(model, batch=batch, size=side, seed=0)
    labels = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(1))
    n = sum(blocks_per_stage)
    return Case(
        name="resnet",
        description=f"zoo ResNet {list(blocks_per_stage)} width {width}, {side}x{side} images, batch {batch}",
        model=model,
        inputs=(x,),
        loss_fn=_labels_loss(labels),
        blocks=tuple(f"layers.{i}" for i in range(n)),
        sequential="layers",
        config={**cfg, "blocks_per_stage": list(blocks_per_stage), "side": side, "batch": batch},
    )


def _llama_loss(out: Any) -> torch.Tensor:
    return out.loss


def llama_case(*, n_layer: int, hidden: int, heads: int, seq_len: int, batch: int) -> Case:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 1024
    cfg: dict[str, Any] = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
               num_hidden_layers=n_layer, num_attention_heads=heads, num_key_value_heads=heads,
               max_position_embeddings=seq_len, attention_dropout=0.1, use_cache=False)
    torch.manual_seed(0)
    config = LlamaConfig(**cfg)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g)

    # A module that takes positional tensors only, so memfit and torch.compile see a plain call.
    return Case(
        name="llama",
        description=f"HF LlamaForCausalLM {n_layer}x{hidden}, {heads} heads, seq {seq_len}, batch {batch}, "
                    "eager attention, attention dropout 0.1",
        model=_LlamaStep(model),
        inputs=(ids,),
        loss_fn=_llama_loss,
        blocks=tuple(f"llama.model.layers.{i}" for i in range(n_layer)),
        sequential=None,
        sequential_reason="not applicable: decoder layers are called from a Python loop over a ModuleList",
        hf=True,
        config={**cfg, "batch": batch, "attn_implementation": "eager"},
    )


class _LlamaStep(nn.Module):
    """``LlamaForCausalLM`` called as ``model(input_ids, labels=input_ids)``."""

    def __init__(self, llama: nn.Module) -> None:
        super().__init__()
        self.llama = llama

    def forward(self, ids: torch.Tensor) -> Any:
        return self.llama(input_ids=ids, labels=ids)


# Sizes: one step takes roughly 0.3-3 s on 2 cores with the malloc pinned (see README).
CASES: dict[str, Callable[[], Case]] = {
    # gradient-heavy: parameter gradients are a large part of the peak
    "gpt": lambda: gpt_case("gpt", n_layer=8, d_model=512, n_head=8, seq_len=256, batch=2),
    # activation-heavy: attention maps and MLP activations dominate
    "gpt-act": lambda: gpt_case("gpt-act", n_layer=8, d_model=256, n_head=4, seq_len=512, batch=4),
    "unet3d": lambda: unet3d_case(base=8, depth=3, side=56, batch=2),
    "resnet": lambda: resnet_case(blocks_per_stage=(2, 2, 2, 2), width=32, side=64, batch=16),
    "llama": lambda: llama_case(n_layer=4, hidden=256, heads=4, seq_len=256, batch=8),
}


def model_names() -> list[str]:
    return list(CASES)


def build_case(name: str) -> Case:
    """Build a benchmark case by name (seeded: two calls give equal models and inputs)."""
    try:
        factory = CASES[name]
    except KeyError:
        raise ValueError(f"unknown benchmark model {name!r}; choose one of {model_names()} or 'all'") from None
    return factory()
