"""What a byte budget means for a model that torch.compile splits at a graph break.

    python scripts/graph_break_budget.py [--fraction 0.6] [--batch 4096]

Two halves of six 256-wide linear+tanh layers, with ``torch._dynamo.graph_break()`` between them. One
eager step (``pow(2).sum()`` loss, given to the backend as ``loss_fn``) is measured with the allocator
(``measure.allocator_peak_memory``), then ``torch.compile(model, backend=rg.backend(budget), dynamic=False)`` at ``--fraction`` of that peak
in bytes (the backend warns with a ``GraphBreakWarning``). The first step compiles both graphs, each at
its smallest-memory plan; the second begins by planning them together within the budget
(``compile_backend``, ``step_graphs``) and compiling them again. The script prints the allocator's
peak of the second and third steps against the step plan's prediction and the budget, and the
gradients' error against eager's (relative to the largest gradient).

Before session 34 each graph was planned within the whole budget alone: 46,137,352 B measured, 1.222
of the budget.
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

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).sum()

    def step(module: nn.Module) -> None:
        module.zero_grad(set_to_none=True)
        loss_fn(module(x)).backward()
    eager_bytes = allocator_peak_memory(lambda: step(model))
    budget = int(args.fraction * eager_bytes)
    step(model)
    reference = [p.grad.clone() for p in model.parameters()]
    backend = rg.backend(budget, loss_fn=loss_fn)  # the loop's own loss, priced on the outputs
    compiled = torch.compile(model, dynamic=False, backend=backend)
    print(f"eager step: {eager_bytes:,} B; budget ({args.fraction:g} of it): {budget:,} B")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(compiled)  # step 1 compiles and prices both graphs and runs each at its floor; not measured:
        # the pricing measures allocations with the profiler too, and nested under another it sees none
        for number in (2, 3):
            measured = allocator_peak_memory(lambda: step(compiled))
            predicted = backend.step_plan.predicted_step_peak_bytes
            print(f"compiled step {number}: predicted {predicted:,} B, measured {measured:,} B "
                  f"({measured / predicted:.3f} of the prediction, {measured / budget:.3f} of the budget)")
    largest = max(r.abs().max().item() for r in reference)
    error = max((p.grad - r).abs().max().item() for p, r in zip(model.parameters(), reference)) / largest
    print(backend.step_plan)
    print(f"gradient error of the last step (of the largest gradient): {error:.1e}")
    print(f"GraphBreakWarning raised: {any(issubclass(w.category, rg.GraphBreakWarning) for w in caught)}")


if __name__ == "__main__":
    main()
