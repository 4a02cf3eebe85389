"""The five models of ``benchmarks.gpu_check``, each buildable on any device at any batch.

A case builds its model on the device it is given (``meta`` for memfit's fake-mode prediction
and for ``largest_batch``'s probes, the GPU or CPU for everything measured), seeded, so that two
builds are equal; its inputs likewise, at any batch (``largest_batch`` asks for other batches).
Losses read the output only, so that one loss serves every batch.

Full sizes were chosen from the H200 run of ``benchmarks.gpu_probe`` (2026-12-04), where the
same models' plain steps took 40-160 ms and peaked at 2.6-15.9 GB, so that one case's profiles,
plans, checks and timed rounds take about a minute on one H100.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["GpuCase", "CASE_NAMES", "build_cases", "autocast"]

CASE_NAMES = ("gpt", "llama", "resnet50", "unet3d", "dropout")
# ResNet-50's plain activation peak per 224x224 image in fp32: 15,861,554,176 B at batch 184
# on the H200 (benchmarks/results/gpu-probe-2026-12-04); the batch is sized to a quarter of the
# card, so that the plain step (the reference every plan is checked against) fits with room.
RESNET50_IMAGE_BYTES = 86_204_099
RESNET50_CARD_SHARE = 0.25


@dataclass(frozen=True)
class GpuCase:
    """One model of the check.

    Attributes:
        name: key in the JSON and tables.
        description: a line for the tables (sizes, dtype, batch).
        build: ``device -> model``, seeded; on ``meta`` without weights.
        inputs: ``(device, batch) -> positional inputs``, seeded; on ``meta`` empty.
        loss_fn: output -> scalar loss (reads the output only).
        batch: the batch the checks run at.
        autocast: the dtype of ``torch.autocast`` around forward and loss (backward runs
            outside it, as PyTorch's AMP recipe does), or None.
        hf: a Hugging Face model (its own checkpointing switch is the every-block peer).
        config: the sizes, for the JSON record.
    """

    name: str
    description: str
    build: Callable[[torch.device], nn.Module]
    inputs: Callable[[torch.device, int], tuple[Any, ...]]
    loss_fn: Callable[[Any], torch.Tensor]
    batch: int
    autocast: torch.dtype | None = None
    hf: bool = False
    config: dict[str, Any] = field(default_factory=dict)


def autocast(case: GpuCase, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The case's autocast around forward and loss on ``device`` (nothing if it has none).

    On ``meta`` the autocast of the device the prediction is for is entered: memfit's fake
    mode then makes its fake tensors on that device type (NOTE [fake mode under autocast]).
    """
    if case.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=case.autocast)


def _seeded(device: torch.device, make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return make()


def _randn(device: torch.device, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if device.type == "meta":
        return torch.empty(*shape, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _square_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _sum_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().sum()


def _gpt(quick: bool) -> GpuCase:
    import memfit

    cfg = (dict(n_layer=2, d_model=32, n_head=2, seq_len=32) if quick else
           dict(n_layer=8, d_model=1024, n_head=16, seq_len=1024))
    batch, vocab = (2, 512) if quick else (8, 512)

    def inputs(device: torch.device, n: int) -> tuple[Any, ...]:
        shape = (n, cfg["seq_len"])
        if device.type == "meta":
            return (torch.empty(shape, dtype=torch.long, device=device),) * 2
        g = torch.Generator().manual_seed(0)
        return tuple(torch.randint(0, vocab, shape, generator=g).to(device) for _ in range(2))

    return GpuCase("gpt", "zoo GPT " + ", ".join(f"{k} {v}" for k, v in cfg.items())
                   + f", batch {batch}, fp32, eager attention, dropout 0.1",
                   lambda d: _seeded(d, lambda: memfit.zoo.gpt(**cfg, vocab_size=vocab, dropout=0.1)),
                   inputs, lambda out: out, batch, config={**cfg, "batch": batch})


def _llama(quick: bool) -> GpuCase:
    from benchmarks.gpu_probe_cases import llama_case

    probe = llama_case(quick)
    batch = 2 if quick else 4
    seq = int(probe.inputs(torch.device("meta"))[0].shape[1])
    llama: Any = probe.build(torch.device("meta")).get_submodule("llama")
    vocab = int(llama.config.vocab_size)

    def inputs(device: torch.device, n: int) -> tuple[Any, ...]:
        if device.type == "meta":
            return (torch.empty(n, seq, dtype=torch.long, device=device),)
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, vocab, (n, seq), generator=g).to(device),)

    return GpuCase("llama", probe.description.split(", batch")[0] + f", batch {batch}",
                   probe.build, inputs, probe.loss_fn, batch, hf=True,
                   config={"batch": batch, "seq_len": seq, "vocab": vocab})


def _resnet50(quick: bool, card_bytes: int | None) -> GpuCase:
    from benchmarks.gpu_probe_cases import resnet50 as build

    stages, side, classes = ((1, 1, 1, 1), 64, 10) if quick else ((3, 4, 6, 3), 224, 1000)
    batch = 4 if quick or card_bytes is None else max(
        8, int(card_bytes * RESNET50_CARD_SHARE / RESNET50_IMAGE_BYTES) // 8 * 8)
    return GpuCase("resnet50", f"ResNet-50 (stages {stages}), fp32, {side}x{side}, batch {batch}"
                   + ("" if quick else f" ({RESNET50_CARD_SHARE:.0%} of the card's memory)"),
                   lambda d: build(d, stages, classes),
                   lambda d, n: (_randn(d, n, 3, side, side),), _square_loss, batch,
                   config={"stages": list(stages), "side": side, "batch": batch})


def _unet3d(quick: bool) -> GpuCase:
    import memfit

    base, depth, side, batch = (4, 2, 16, 2) if quick else (16, 4, 128, 2)
    return GpuCase("unet3d", f"zoo UNet3D base {base}, depth {depth}, {side}^3, batch {batch}, "
                   "BatchNorm, bf16 autocast",
                   lambda d: _seeded(d, lambda: memfit.zoo.unet3d(base=base, depth=depth)),
                   lambda d, n: (_randn(d, n, 1, side, side, side),), _square_loss, batch,
                   autocast=torch.bfloat16,
                   config={"base": base, "depth": depth, "side": side, "batch": batch})


def _dropout(quick: bool) -> GpuCase:
    from benchmarks.gpu_fake_check import MegatronLayer

    h, a, s, batch, n = (64, 4, 64, 2, 2) if quick else (2048, 16, 2048, 4, 4)
    return GpuCase("dropout", f"{n} Megatron GPT layers, bf16, eager attention, h={h} a={a} "
                   f"s={s}, batch {batch}, dropout 0.1 on attention probabilities and residuals",
                   lambda d: _seeded(d, lambda: nn.Sequential(
                       *(MegatronLayer(h, a, s, "eager") for _ in range(n))).to(torch.bfloat16)),
                   lambda d, b: (_randn(d, b, s, h, dtype=torch.bfloat16),), _sum_loss, batch,
                   config={"h": h, "a": a, "s": s, "batch": batch, "layers": n})


def build_cases(names: tuple[str, ...], *, quick: bool, card_bytes: int | None) -> list[GpuCase]:
    """The cases named, in that order (``card_bytes`` sizes ResNet-50's batch)."""
    factories: dict[str, Callable[[], GpuCase]] = {
        "gpt": lambda: _gpt(quick), "llama": lambda: _llama(quick),
        "resnet50": lambda: _resnet50(quick, card_bytes), "unet3d": lambda: _unet3d(quick),
        "dropout": lambda: _dropout(quick)}
    return [factories[n]() for n in names]
