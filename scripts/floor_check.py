"""Plan a zoo model at a budget near its floor and run one step through the executor: measured peak
against the prediction and against the measured store-all step, exact gradients and buffers.

    python scripts/floor_check.py [--model resnet50] [--preset paper] [--batch 8] [--budget 0.33]

Prices with FLOP-based times (``timing="flops"``); memory is what is checked. Peaks are measured with
the allocator (``measure.peak_memory``: torch.profiler memory events on CPU) on the same inputs.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import models_zoo
import recompute_graph as rg
from recompute_graph.verification import parameter_gradient_error
from recompute_graph.measure import default_loss, peak_memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.33)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, inputs = models_zoo.get_model(args.model, args.preset, batch=args.batch)
    reference = copy.deepcopy(model)
    start = time.perf_counter()
    optimized = rg.optimize(model, args.budget, example_inputs=inputs, timing="flops")
    plan = optimized.recompute_plan
    print(f"{plan.one_line()}  (planned in {time.perf_counter() - start:.1f} s; {plan.description})")

    def step(module: torch.nn.Module):
        def run() -> None:
            module.zero_grad(set_to_none=True)
            default_loss(module(*inputs)).backward()
        return run
    measured = peak_memory(step(optimized))
    store_all = peak_memory(step(reference))
    gradient_error = parameter_gradient_error(model, reference)
    buffers_equal = all(torch.equal(a, b) for a, b in zip(model.buffers(), reference.buffers()))
    print(f"measured {rg.format_bytes(measured)} (predicted {rg.format_bytes(plan.predicted_peak_bytes)}, "
          f"budget {rg.format_bytes(plan.budget_bytes)}); store-all measured {rg.format_bytes(store_all)}, "
          f"ratio {measured / store_all:.3f}; largest relative gradient difference {gradient_error:.1e}; "
          f"buffers equal: {buffers_equal}")


if __name__ == "__main__":
    main()
