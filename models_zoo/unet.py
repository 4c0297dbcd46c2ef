"""U-Net (Ronneberger et al. 2015) with configurable depth and width; padded convolutions so any input
size divisible by 2**depth works. Encoder outputs are concatenated into the decoder (long skips)."""
from __future__ import annotations

import torch
from torch import nn


def _double_conv(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, depth: int = 4, width: int = 64, in_channels: int = 3, num_classes: int = 2) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"U-Net depth must be >= 1, got {depth}")
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([_double_conv(in_channels, widths[0])] +
                                  [_double_conv(widths[i], widths[i + 1]) for i in range(depth)])
        self.pool = nn.MaxPool2d(2)
        self.upsample = nn.ModuleList([nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2)
                                       for i in reversed(range(depth))])
        self.up = nn.ModuleList([_double_conv(2 * widths[i], widths[i]) for i in reversed(range(depth))])
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else self.pool(x))
            skips.append(x)
        skips.pop()
        for upsample, block in zip(self.upsample, self.up):
            x = block(torch.cat([skips.pop(), upsample(x)], dim=1))
        return self.head(x)
