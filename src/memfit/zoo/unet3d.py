"""A 3D UNet with skip connections and BatchNorm, as used for volumetric medical images."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["UNet3D", "unet3d"]


class ConvBlock(nn.Module):
    """(Conv3d -> BatchNorm3d -> ReLU) x 2."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(c_in, c_out, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm3d(c_out)
        self.conv2 = nn.Conv3d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm3d(c_out)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.bn1(self.conv1(x)))  # (N, c_out, D, H, W)
        return self.act(self.bn2(self.conv2(x)))


class UNet3D(nn.Module):
    """Encoder of ``depth`` ConvBlocks with 2x max-pooling, a bottleneck, and a decoder with
    transposed-conv upsampling and concatenated skip connections."""

    def __init__(self, in_channels: int = 1, out_channels: int = 2, base: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.in_channels = in_channels
        chans = [base * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        c = in_channels
        for ch in chans[:-1]:
            self.down.append(ConvBlock(c, ch))
            c = ch
        self.pool = nn.MaxPool3d(2)
        self.bottleneck = ConvBlock(chans[-2], chans[-1])
        self.upconv = nn.ModuleList()
        self.up = nn.ModuleList()
        for ch_hi, ch_lo in zip(reversed(chans[1:]), reversed(chans[:-1]), strict=True):
            self.upconv.append(nn.ConvTranspose3d(ch_hi, ch_lo, 2, stride=2))
            self.up.append(ConvBlock(2 * ch_lo, ch_lo))
        self.head = nn.Conv3d(chans[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)  # kept until the decoder level that concatenates it
            x = self.pool(x)
        x = self.bottleneck(x)
        for upconv, block in zip(self.upconv, self.up, strict=True):
            x = upconv(x)
            x = block(torch.cat([x, skips.pop()], dim=1))
        return self.head(x)  # (N, out_channels, D, H, W)


def unet3d(*, in_channels: int = 1, out_channels: int = 2, base: int = 8, depth: int = 3, seed: int = 0) -> UNet3D:
    """Build a seeded 3D UNet. Input sides must be divisible by ``2**depth``.

    Example:
        >>> m = unet3d(base=4, depth=2)
        >>> m(torch.randn(1, 1, 16, 16, 16)).shape
        torch.Size([1, 2, 16, 16, 16])
    """
    torch.manual_seed(seed)
    return UNet3D(in_channels, out_channels, base, depth)
