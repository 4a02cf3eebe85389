"""The largest batch that fits a device, by plan: no checkpointing, Chen's sqrt(n), memfit.

The anchor is Checkmate's (Jain et al., MLSys 2020) "largest batch on a 16 GB V100" table:
VGG19 at 224x224 trains at 167 without checkpointing, 197 with Chen et al.'s sqrt(n)
checkpointing and 289 with Checkmate's solver (ratios 1.18x and 1.73x of no checkpointing).
Their figures come from TensorFlow's graph and allocator; here VGG19 (torchvision's layout,
built in code) is profiled in fake mode for a V100 preset and planned for the whole job on
16 GiB (weights, gradients, SGD without momentum, activations; no reserve), so the ratios,
not the absolute batches, are what compares.

Usage (from the repository root)::

    python -m benchmarks.largest_batch [--device-memory 16GiB] [--model vgg19]

Prints one line per method: its largest batch, the profiles the search made, and the ratio
to no checkpointing.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import memfit

# the "v100" preset of memfit.timemodel.devices (NVIDIA V100 SXM2 16GB datasheet)
TARGET = "v100"

VGG19 = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M"]


def vgg19(num_classes: int = 1000) -> nn.Module:
    """VGG19 as torchvision lays it out (features, avgpool, classifier), on the meta device."""
    layers: list[nn.Module] = []
    c = 3
    for v in VGG19:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(c, int(v), 3, padding=1), nn.ReLU(inplace=True)]
            c = int(v)
    with torch.device("meta"):
        return nn.Sequential(nn.Sequential(*layers), nn.AdaptiveAvgPool2d((7, 7)), nn.Flatten(),
                             nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(),
                             nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(),
                             nn.Linear(4096, num_classes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-memory", default="16GiB")
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()
    model = vgg19()

    def make(n: int) -> tuple[nn.Module, torch.Tensor]:
        return model, torch.empty(n, 3, args.size, args.size, device="meta")

    rows = []
    for label, solver in (("no checkpointing", "none"), ("sqrt(n) (Chen et al.)", "sqrt"),
                          ("memfit", "auto")):
        t0 = time.perf_counter()
        found = memfit.largest_batch(make, device_memory=args.device_memory, optimizer="sgd",
                                     target=TARGET, solver=solver, reserve=0)
        rows.append((label, found, time.perf_counter() - t0))
    base = rows[0][1].batch
    print(f"VGG19 {args.size}x{args.size} fp32, SGD, V100 preset, device memory "
          f"{args.device_memory} (Checkmate: 167 / 197 / 289, ratios 1.00 / 1.18 / 1.73)")
    for label, found, secs in rows:
        print(f"  {label:<24} largest batch {found.batch:>5}  ({found.batch / base:.2f}x; "
              f"{len(found.probes)} profiles, {secs:.1f} s; predicted +{found.overhead:.1%} step time)")


if __name__ == "__main__":
    main()
