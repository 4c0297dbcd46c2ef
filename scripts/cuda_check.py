"""End-to-end check on a GPU: exact gradients, allocator peak vs prediction, step-time ratios.

    python scripts/cuda_check.py [--device cuda] [--models resnet50 unet gpt2] [--budget 0.5] [--dtype float64]

For each model (small presets, moved to the device): the original model's gradients and its step, then
``optimize(..., budget)`` on its default path (the compiler path where the model is captured whole;
the solver column says which path ran), or the smallest feasible budget where ``budget`` is below it,
with costs measured on the device: the largest gradient difference over the largest gradient (both
computed with deterministic float32 kernels, :func:`exact_kernels`),
``torch.cuda.max_memory_allocated`` peak above what was live before the step (``measure.peak_memory``
with ``device=``) against the plan's predicted peak, and median step times. Runs on CPU too
(``--device cpu``, the profiler's allocator events) to check the script itself.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
from typing import Iterator

import torch

import models_zoo
from recompute_graph import CompiledRecomputedModule, InfeasibleBudgetError, format_bytes, optimize
from recompute_graph.measure import default_loss, make_training_step, peak_memory, time_step


@contextlib.contextmanager
def exact_kernels() -> Iterator[None]:
    """Deterministic float32 kernels (no TF32, no cuDNN autotuning) while gradients are compared: the
    defaults let cuDNN run TF32 convolutions and pick algorithms whose sums round differently from run to
    run, which BatchNorm's backward amplifies in gradients that nearly cancel."""
    backends = torch.backends
    saved = (backends.cudnn.deterministic, backends.cudnn.benchmark, backends.cudnn.allow_tf32,
             backends.cuda.matmul.allow_tf32)
    backends.cudnn.deterministic, backends.cudnn.benchmark = True, False
    backends.cudnn.allow_tf32 = backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        (backends.cudnn.deterministic, backends.cudnn.benchmark, backends.cudnn.allow_tf32,
         backends.cuda.matmul.allow_tf32) = saved


def gradients(model: torch.nn.Module, inputs: tuple) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with exact_kernels():
        default_loss(model(*inputs)).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def gradient_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """Largest absolute gradient difference over the model's largest gradient (some exact gradients are
    0, so each parameter's own scale would divide rounding noise by nothing)."""
    scale = max(g.abs().max().item() for g in expected.values())
    return max((actual[k] - expected[k]).abs().max().item() for k in expected) / max(scale, 1e-30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", nargs="+", default=["resnet50", "unet", "gpt2"])
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                        help="float64: the gradient comparison without float32's rounding, which BatchNorm's "
                             "backward amplifies where a gradient nearly cancels")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    meter_device = device if device.type == "cuda" else None
    print("| model | solver | predicted peak | measured peak | measured / predicted | max grad error / largest grad | "
          "time / original |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        model, inputs = models_zoo.get_model(name, "small")
        model = model.to(device=device, dtype=dtype)
        inputs = tuple(t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device) for t in inputs)
        twin = copy.deepcopy(model)
        expected = gradients(model, inputs)
        original = make_training_step(model, inputs)
        original_peak = peak_memory(original, device=meter_device)
        original_time = time_step(original, repeats=5, warmup=2, device=meter_device).median_seconds
        budget = args.budget
        try:
            optimized = optimize(twin, budget, example_inputs=inputs)
        except InfeasibleBudgetError as error:  # e.g. GPT-2 small, whose parameters take half the step
            budget = error.min_budget_bytes
            optimized = optimize(twin, budget, example_inputs=inputs)
        plan = optimized.recompute_plan
        step = make_training_step(optimized, inputs)
        peak = peak_memory(step, device=meter_device)
        seconds = time_step(step, repeats=5, warmup=2, device=meter_device).median_seconds
        # last: the first CUDA step is checked against the budget, and the plan was priced with the default
        # kernels; deterministic cuDNN algorithms take other workspaces (a ResNet-50 step: 109 MiB
        # allocated against a budget of 87.6 MiB). Training-mode gradients do not depend on the running
        # statistics these steps moved.
        actual = gradients(optimized, inputs)
        error = gradient_error(actual, expected)
        solver = plan.solver if budget == args.budget else f"{plan.solver} (smallest budget, {format_bytes(budget)})"
        solver += " (compiler)" if isinstance(optimized, CompiledRecomputedModule) else " (executor)"
        print(f"| {name} | {solver} | {format_bytes(plan.predicted_peak_bytes)} | {format_bytes(peak)} "
              f"(original {format_bytes(original_peak)}) | {peak / plan.predicted_peak_bytes:.3f} | {error:.1e} | "
              f"{seconds / original_time:.2f} |", flush=True)


if __name__ == "__main__":
    main()
