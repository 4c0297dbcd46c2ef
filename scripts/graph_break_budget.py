"""What a byte budget means for a model that torch.compile splits at a graph break.

    python scripts/graph_break_budget.py [--fraction 0.6] [--batch 4096] [--model halves|CONFORMANCE_NAME]
                                         [--on-infeasible raise|floor]

``--model halves`` (the default): two halves of six 256-wide linear+tanh layers, with
``torch._dynamo.graph_break()`` between them, trained with a ``pow(2).sum()`` loss given to the backend
as ``loss_fn``. A conformance model (``models_zoo.third_party``, e.g. ``hf_gpt2``, which breaks at its
loss function) trains on its own loss (``output.loss``), or on its first output's ``float().square()
.mean()``. One eager step is measured with the allocator (``measure.allocator_peak_memory``), then
``torch.compile(model, backend=rg.backend(budget), dynamic=False)`` at ``--fraction`` of that peak in
bytes (the backend warns with a ``GraphBreakWarning``). The first step compiles the graphs, each at its
smallest-memory plan; the second begins by planning them together within the budget
(``compile_backend``, ``step_graphs``) and compiling them again. The script prints the allocator's
peak of the second and third steps against the step plan's prediction and the budget, and the
gradients' error against eager's (relative to the largest gradient). The outputs are dropped before
the backward, as a training loop does.

Before session 34 each graph was planned within the whole budget alone: the halves at 0.6 measured
46,137,352 B, 1.222 of the budget.
"""
from __future__ import annotations

import argparse
import copy
import warnings
from typing import Any, Callable

import torch
from torch import nn

import recompute_graph as rg
from recompute_graph.joint_lowering import InfeasibleBudgetWarning
from recompute_graph.measure import allocator_peak_memory
from recompute_graph.verification import parameter_gradient_error


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


def _model_and_step(name: str, batch: int) -> tuple[nn.Module, Callable[[nn.Module], None], Any]:
    """The model, one training step of a module like it, and the backend's ``loss_fn`` (None: the
    model's own loss, or the default)."""
    torch.manual_seed(0)
    if name == "halves":
        model, x = Halves(), torch.randn(batch, 256)

        def loss_fn(out: torch.Tensor) -> torch.Tensor:
            return out.pow(2).sum()

        def step(module: nn.Module) -> None:
            module.zero_grad(set_to_none=True)
            loss_fn(module(x)).backward()
        return model, step, loss_fn
    from models_zoo import third_party
    model, call = third_party.build(name)

    def loss_of(out: Any) -> torch.Tensor:
        if getattr(out, "loss", None) is not None:
            return out.loss
        first = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)
        return first.float().square().mean()

    def model_step(module: nn.Module) -> None:
        module.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the same dropout masks in every step
        loss = loss_of(module(**call) if isinstance(call, dict) else module(*call))
        loss.backward()
    return model, model_step, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=0.6)
    parser.add_argument("--batch", type=int, default=4096, help="the halves' batch")
    parser.add_argument("--model", default="halves")
    parser.add_argument("--on-infeasible", default="raise", choices=("raise", "floor"))
    args = parser.parse_args()
    model, step, loss_fn = _model_and_step(args.model, args.batch)
    reference = copy.deepcopy(model)
    eager_bytes = allocator_peak_memory(lambda: step(reference))
    budget = int(args.fraction * eager_bytes)
    step(reference)
    backend = rg.backend(budget, loss_fn=loss_fn, on_infeasible=args.on_infeasible)
    compiled = torch.compile(model, dynamic=False, backend=backend)
    print(f"{args.model}: eager step {eager_bytes:,} B; budget ({args.fraction:g} of it): {budget:,} B")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(compiled)  # step 1 compiles and prices the graphs and runs each at its floor; not measured:
        # the pricing measures allocations with the profiler too, and nested under another it sees none
        for number in (2, 3):
            measured = allocator_peak_memory(lambda: step(compiled))
            predicted = backend.step_plan.predicted_step_peak_bytes
            print(f"compiled step {number}: predicted {predicted:,} B, measured {measured:,} B "
                  f"({measured / predicted:.3f} of the prediction, {measured / budget:.3f} of the budget)")
    print(backend.step_plan)
    print(f"gradient error of the last step (of the largest gradient): "
          f"{parameter_gradient_error(model, reference):.1e}")
    for warning in caught:
        if issubclass(warning.category, (rg.GraphBreakWarning, InfeasibleBudgetWarning)):
            print(f"{warning.category.__name__}: {str(warning.message)[:160]}...")


if __name__ == "__main__":
    main()
