"""An LSTM unrolled over T steps with one cell reused at every step (the BPTT setting of Gruslys et al.
2016): the traced graph is a chain of T cell calls sharing their weights."""
from __future__ import annotations

import torch
from torch import nn


class UnrolledLSTM(nn.Module):
    def __init__(self, steps: int = 100, input_size: int = 64, hidden_size: int = 256,
                 out_features: int = 10) -> None:
        super().__init__()
        self.steps = steps
        self.hidden_size = hidden_size
        self.cell = nn.LSTMCell(input_size, hidden_size)
        self.head = nn.Linear(hidden_size, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (steps, batch, input_size) -> (batch, out_features) from the last hidden state."""
        h = torch.zeros(x.shape[1], self.hidden_size, dtype=x.dtype, device=x.device)
        c = torch.zeros(x.shape[1], self.hidden_size, dtype=x.dtype, device=x.device)
        for t in range(self.steps):
            h, c = self.cell(x[t], (h, c))
        return self.head(h)
