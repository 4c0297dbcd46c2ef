"""A plain MLP chain: ``depth`` x (Linear(width, width) -> ReLU), then Linear(width, out_features)."""
from __future__ import annotations

import torch
from torch import nn


class MLPChain(nn.Module):
    def __init__(self, depth: int = 8, width: int = 1024, in_features: int | None = None,
                 out_features: int = 10) -> None:
        super().__init__()
        in_features = width if in_features is None else in_features
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(in_features if i == 0 else width, width), nn.ReLU()]
        layers.append(nn.Linear(width if depth else in_features, out_features))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
