"""The main job: plan a zoo model at a memory budget, train a few steps with it, and show what it buys.

    python scripts/demo.py [--model gpt2] [--preset tiny|small|paper] [--budget 0.7] [--steps 3]

Plans on ``optimize()``'s default path (the compiler path where the model is captured as one graph) with
the loss the demo trains with. Prints the plan and the path, the losses of the original and the optimized
model over the same steps (they match), the peaks of a step with that loss: the original model's eager
step (measured by the allocator), the store-all plan's and the chosen plan's (predicted by the
simulator, the loss at its moment; the chosen plan's also measured), and the ratio of step times.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import models_zoo
from recompute_graph import CompiledRecomputedModule, format_bytes, optimize
from recompute_graph.planner import step_peak_bytes, store_all_plan
from recompute_graph.measure import make_training_step, peak_memory, time_step


def task_loss(output: torch.Tensor, inputs: tuple) -> torch.Tensor:
    """Next-token cross-entropy for the language model, mean squared activation otherwise."""
    if output.dim() == 3 and not inputs[0].is_floating_point():
        tokens = inputs[0]
        return F.cross_entropy(output[:, :-1].reshape(-1, output.shape[-1]), tokens[:, 1:].reshape(-1))
    return output.float().square().mean()


def train(model: torch.nn.Module, inputs: tuple, steps: int) -> list[float]:
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = task_loss(model(*inputs), inputs)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", choices=models_zoo.MODEL_NAMES)
    parser.add_argument("--preset", default="small", choices=("tiny", "small", "paper"))
    parser.add_argument("--budget", default="0.7", help="bytes, a size like 1.5GiB, or a fraction in (0, 1]")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() and "." in args.budget else (
        int(args.budget) if args.budget.isdigit() else args.budget)

    model, inputs = models_zoo.get_model(args.model, args.preset)
    twin = copy.deepcopy(model)
    print(f"{args.model} ({args.preset}): {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"input {tuple(inputs[0].shape)}, budget {args.budget}\n")
    # optimize()'s default path: torch.compile with our partitioner (the schedule executor where the
    # model cannot be captured as one graph); the loss trained with is priced beside the plan
    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        return task_loss(output, inputs)
    optimized = optimize(twin, budget, example_inputs=inputs, loss_fn=loss_fn)
    plan = optimized.recompute_plan
    path = "compiler path" if isinstance(optimized, CompiledRecomputedModule) else "schedule executor"
    print(f"{plan}\n(on the {path}: {type(optimized).__name__})\n")

    original_losses = train(model, inputs, args.steps)
    optimized_losses = train(optimized, inputs, args.steps)
    print("step  original loss  optimized loss")
    for i, (a, b) in enumerate(zip(original_losses, optimized_losses)):
        print(f"{i:>4}  {a:>13.6g}  {b:>14.6g}")

    original_step = make_training_step(model, inputs, loss_fn=loss_fn)
    optimized_step = make_training_step(optimized, inputs, loss_fn=loss_fn)
    original_peak, optimized_peak = peak_memory(original_step), peak_memory(optimized_step)
    original_time = time_step(original_step, repeats=3).median_seconds
    optimized_time = time_step(optimized_step, repeats=3).median_seconds
    # the store-all plan's predicted step (the loss at its moment), beside the original model's eager
    # step, which keeps what eager autograd saves: the two are different programs
    store_all_step = step_peak_bytes(plan.graph, store_all_plan(plan.graph).simulation)
    print(f"\n{'':<18}{'predicted peak':>16}{'measured peak':>16}{'step time':>12}")
    print(f"{'original (eager)':<18}{'':>16}{format_bytes(original_peak):>16}{original_time * 1e3:>10.1f}ms")
    print(f"{'store-all plan':<18}{format_bytes(store_all_step):>16}")
    print(f"{plan.solver:<18}{format_bytes(plan.predicted_step_peak_bytes):>16}{format_bytes(optimized_peak):>16}"
          f"{optimized_time * 1e3:>10.1f}ms")
    print(f"\nmeasured peak {optimized_peak / original_peak:.1%} of the original model's "
          f"(budget {format_bytes(plan.budget_bytes)}: {'within' if optimized_peak <= plan.budget_bytes else 'OVER'}), "
          f"step time x{optimized_time / original_time:.2f} "
          f"(predicted compute overhead +{plan.predicted_compute_overhead:.1%})")


if __name__ == "__main__":
    main()
