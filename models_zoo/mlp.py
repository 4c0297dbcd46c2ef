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


class BrokenHalves(nn.Module):
    """Two halves of ``layers`` x (Linear(width, width) -> tanh) with ``torch._dynamo.graph_break()``
    between them: under ``torch.compile`` a step of two graphs (scripts/graph_break_budget.py)."""

    def __init__(self, width: int = 256, layers: int = 6) -> None:
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.second = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.first:
            x = torch.tanh(layer(x))
        torch._dynamo.graph_break()
        for layer in self.second:
            x = torch.tanh(layer(x))
        return x
