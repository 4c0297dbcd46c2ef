"""An ``nn.LSTM`` classifier planned fused and step by step (``optimize(..., unroll_rnns=True)``).

For each sequence length: the smallest feasible budget as a fraction of the store-all step, fused (one
node: nothing to recompute) and unrolled; then, unrolled, a plan at ``--fraction``: planning seconds,
the allocator-measured peak against the prediction and the store-all step, the gradient error against
the fused model (float rounding), and the step time against the fused model's eager step (fastest of
3 each, in turn, same run). Usage: ``python scripts/unrolled_lstm.py [--steps 50 100] [--fraction 0.4]
[--device cuda]`` (on CUDA the fused model runs cuDNN's kernel, and the meter is the caching allocator).
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import recompute_graph as rg
from recompute_graph.units import format_bytes
from recompute_graph.verification import parameter_gradient_error, verify


class Classifier(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(64, 128, num_layers=layers, batch_first=True)
        self.head = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(x)
        return self.head(h[:, -1])


def floor_fraction(model: nn.Module, x: torch.Tensor, compiler: object, **options: object) -> float:
    """The smallest feasible budget over a store-all step's (the fraction of ``InfeasibleBudgetError``)."""
    store_all = rg.optimize(copy.deepcopy(model), 1.0, example_inputs=(x,), compiler=compiler, timing="flops",
                            **options).recompute_plan.budget_bytes
    try:
        rg.optimize(copy.deepcopy(model), 0.01, example_inputs=(x,), compiler=compiler, timing="flops", **options)
    except rg.InfeasibleBudgetError as error:
        return error.min_budget_bytes / store_all
    return 0.01


def step_seconds(module: nn.Module, x: torch.Tensor) -> float:
    def step() -> float:
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        module.zero_grad(set_to_none=True)
        module(x).square().mean().backward()
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        return time.perf_counter() - start
    return min(step() for _ in range(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[50, 100])
    parser.add_argument("--fraction", type=float, default=0.4)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--compiler", choices=["auto", "executor"], default="auto")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    compiler = False if args.compiler == "executor" else "auto"
    print(f"nn.LSTM(64, 128, num_layers={args.layers}) + Linear, batch {args.batch}, path {args.compiler}, "
          f"plan at {args.fraction} of store-all, {args.device}")
    print("| T | floor fused | floor unrolled | planning | measured / predicted / store-all | grad error vs fused"
          " | step vs fused eager |")
    print("|---|---|---|---|---|---|---|")
    for steps in args.steps:
        torch.manual_seed(0)
        model = Classifier(args.layers).to(args.device)
        x = torch.randn(args.batch, steps, 64, device=args.device)
        fused = copy.deepcopy(model)
        fused_floor = floor_fraction(model, x, False)
        unrolled_floor = floor_fraction(model, x, compiler, unroll_rnns=True)
        start = time.perf_counter()
        optimized = rg.optimize(model, args.fraction, example_inputs=(x,), compiler=compiler, unroll_rnns=True)
        planning = time.perf_counter() - start
        report = verify(model, args.fraction, example_inputs=(x,), optimized=optimized,
                        device=x.device if x.is_cuda else None)
        fused.zero_grad()
        fused(x).square().mean().backward()
        model.zero_grad()
        optimized(x).square().mean().backward()
        error = parameter_gradient_error(model, fused)
        ratio = step_seconds(optimized, x) / step_seconds(fused, x)
        print(f"| {steps} | {fused_floor:.2f} | {unrolled_floor:.2f} | {planning:.0f} s | "
              f"{format_bytes(report.measured_peak_bytes)} / {format_bytes(report.predicted_peak_bytes)} / "
              f"{format_bytes(optimized.recompute_plan.store_all_peak_bytes)} | {error:.1e} | x{ratio:.2f} |")


if __name__ == "__main__":
    main()
