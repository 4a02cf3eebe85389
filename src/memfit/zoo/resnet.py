"""A ResNet-style CNN: a stem, stages of residual basic blocks with BatchNorm, a linear head."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ResNet", "resnet"]


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.act = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn1(self.conv1(x)))  # (N, c_out, H', W')
        y = self.bn2(self.conv2(y))
        return self.act(y + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, blocks_per_stage: tuple[int, ...] = (2, 2, 2, 2), width: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers: list[nn.Module] = []
        c = width
        for i, n in enumerate(blocks_per_stage):
            c_out = width * 2**i
            for j in range(n):
                layers.append(BasicBlock(c, c_out, stride=2 if (j == 0 and i > 0) else 1))
                c = c_out
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))  # (N, C, H', W')
        return self.fc(torch.flatten(self.pool(x), 1))  # (N, num_classes)


def resnet(*, blocks_per_stage: tuple[int, ...] = (2, 2, 2, 2), width: int = 32, num_classes: int = 10, seed: int = 0) -> ResNet:
    """Build a seeded ResNet-style CNN (ResNet-18 layout at width 32 by default).

    Example:
        >>> m = resnet(blocks_per_stage=(1, 1), width=8)
        >>> m(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    torch.manual_seed(seed)
    return ResNet(tuple(blocks_per_stage), width, num_classes)
