"""What a byte budget means for a model that torch.compile splits at a graph break.

    python scripts/graph_break_budget.py [--fraction 0.6] [--batch 4096]

Two halves of six 256-wide linear+tanh layers, with ``torch._dynamo.graph_break()`` between them. One
eager step (``pow(2).sum()`` loss) is measured with the allocator (``measure.allocator_peak_memory``),
then ``torch.compile(model, backend=rg.backend(budget), dynamic=False)`` at ``--fraction`` of that peak
in bytes: each graph is planned within the whole budget alone (the backend warns with a
``GraphBreakWarning``), and the script prints each graph's predicted step peak and the allocator's
peak of the compiled step against the budget.
"""
from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn

import recompute_graph as rg
from recompute_graph.measure import allocator_peak_memory


class Halves(nn.Module):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=0.6)
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, x = Halves(), torch.randn(args.batch, 256)

    def step(module: nn.Module) -> None:
        module.zero_grad(set_to_none=True)
        module(x).pow(2).sum().backward()
    eager_bytes = allocator_peak_memory(lambda: step(model))
    budget = int(args.fraction * eager_bytes)
    predicted: list[int] = []
    compiled = torch.compile(model, dynamic=False, backend=rg.backend(
        budget, on_lowered=lambda lowered: predicted.append(lowered.plan.predicted_step_peak_bytes)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(compiled)  # compiles and plans both graphs
    measured = allocator_peak_memory(lambda: step(compiled))
    print(f"eager step: {eager_bytes:,} B; budget ({args.fraction:g} of it): {budget:,} B")
    print(f"graphs planned: {len(predicted)}, predicted step peaks {', '.join(f'{p:,} B' for p in predicted)}")
    print(f"compiled step measured: {measured:,} B, {measured / budget:.3f} of the budget")
    print(f"GraphBreakWarning raised: {any(issubclass(w.category, rg.GraphBreakWarning) for w in caught)}")


if __name__ == "__main__":
    main()
