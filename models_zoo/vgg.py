"""VGG-19 (Simonyan & Zisserman 2015, configuration E), width scalable by ``width`` (64 = original)."""
from __future__ import annotations

import torch
from torch import nn

CONFIG_E = (1, 1, "M", 2, 2, "M", 4, 4, 4, 4, "M", 8, 8, 8, 8, "M", 8, 8, 8, 8, "M")


class VGG19(nn.Module):
    def __init__(self, width: int = 64, num_classes: int = 1000, image_size: int = 224,
                 hidden: int = 4096) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for item in CONFIG_E:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(channels, width * item, 3, padding=1), nn.ReLU(inplace=True)]
                channels = width * item
        self.features = nn.Sequential(*layers)
        spatial = image_size // 32
        self.classifier = nn.Sequential(
            nn.Linear(channels * spatial * spatial, hidden), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))
