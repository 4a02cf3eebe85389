"""Built-in models for demos, tests and benchmarks: seeded, sized by arguments.

``build(name, **options)`` builds one by its command-line name and ``example_inputs(model,
batch=...)`` makes matching inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.zoo.gpt import GPT, GPTConfig, gpt
from memfit.zoo.resnet import ResNet, resnet
from memfit.zoo.unet3d import UNet3D, unet3d

__all__ = ["GPT", "GPTConfig", "ResNet", "UNet3D", "gpt", "resnet", "unet3d", "MODELS", "build", "example_inputs"]

MODELS: dict[str, Callable[..., nn.Module]] = {"gpt": gpt, "unet3d": unet3d, "resnet": resnet}


def build(name: str, **options: Any) -> nn.Module:
    """Build a zoo model by name (``gpt``, ``unet3d``, ``resnet``)."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown zoo model {name!r}; choose one of {sorted(MODELS)}") from None
    return factory(**options)


def example_inputs(model: nn.Module, *, batch: int = 2, size: int | None = None, seed: int = 0) -> torch.Tensor:
    """Seeded inputs that fit ``model``: token ids for GPT, volumes for UNet3D, images for ResNet.

    ``size`` is the sequence length (GPT, default the model's), or the side of the volume
    (UNet3D, default 32) or image (ResNet, default 32).
    """
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, GPT):
        t = size or model.cfg.seq_len
        return torch.randint(0, model.cfg.vocab_size, (batch, t), generator=g)
    if isinstance(model, UNet3D):
        s = size or 32
        return torch.randn(batch, model.in_channels, s, s, s, generator=g)
    if isinstance(model, ResNet):
        s = size or 32
        return torch.randn(batch, 3, s, s, generator=g)
    raise TypeError(f"no example inputs known for {type(model).__name__}; pass your own")
