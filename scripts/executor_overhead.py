"""The executor's own cost per op: models with tiny tensors, where a step is almost all Python.

    python scripts/executor_overhead.py [--rounds 30] [--models rnn gpt2 mlp] [--device cpu|cuda] [--compiler]

For each model (sizes below, chosen so that kernels take microseconds), one training step (forward,
`sum of squares` loss, backward) of the original model and of plans through the executor: `store_all`
(no recomputation) and `auto` at half of the store-all budget. The steps are timed in turn, ``--rounds``
times, on one thread; the fastest time of each is kept (the least disturbed by other work on the
machine). Prints the step times and the executor's extra time per executed schedule op,
``(plan step - original step) / ops``. On a GPU that is what the executor adds to every op; on CPU at
real sizes it hides behind the kernels. ``--compiler``: the same two plans on the compiler path
(``optimize(..., compiler=True)``: generated forward and backward graphs), and ``torch.compile(model,
backend="aot_eager")`` (AOTAutograd's own partition, run as generated) as its reference; "extra per op"
is then per schedule op of the plan too.
"""
from __future__ import annotations

import argparse

import torch

import models_zoo
from recompute_graph import InfeasibleBudgetError, optimize
from recompute_graph.measure import make_training_step, time_steps_in_turn

#: Tiny sizes per zoo model: a step takes milliseconds, kernels microseconds.
TINY_SIZES = {
    "rnn": dict(preset="tiny", steps=200, batch=2, input_size=8, hidden_size=8),
    "gpt2": dict(preset="tiny", layers=6, batch=2, seq_len=64, width=16, heads=2),
    "mlp": dict(preset="tiny", depth=100, batch=64, width=8),
}


def planned_run(model: torch.nn.Module, inputs: tuple, solver: str, budget: float, prefix: str,
                options: dict) -> tuple:
    """``(label, step, schedule ops, graph nodes)`` of ``optimize(model, budget, ...)`` on one path, planned
    at the smallest feasible budget where ``budget`` is below it (the joint graph's floor can be higher)."""
    try:
        optimized = optimize(model, budget, example_inputs=inputs, solver=solver, **options)
    except InfeasibleBudgetError as error:
        optimized = optimize(model, error.min_budget_bytes, example_inputs=inputs, solver=solver, **options)
        budget = optimized.recompute_plan.budget_bytes / optimized.recompute_plan.store_all_peak_bytes
    plan = optimized.recompute_plan
    ops = len(plan.schedule.forward_ops) + len(plan.schedule.backward_ops)
    return f"{prefix}{plan.solver} @ {budget:.0%}", make_training_step(optimized, inputs), ops, len(plan.graph)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(TINY_SIZES), choices=list(TINY_SIZES))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compiler", action="store_true", help="also the compiler path and aot_eager")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print("| model | graph nodes | run | ops per step | step time | extra per op |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        model, inputs = models_zoo.get_model_on(name, device, **TINY_SIZES[name])
        runs = [("original", make_training_step(model, inputs), 0, 0)]
        for prefix, options in [("", {"compiler": False, "timing": "flops"})] + (
                [("compiler: ", {"compiler": True})] if args.compiler else []):
            if prefix:  # the compiler path's reference: torch.compile's own partition, run as generated
                torch._dynamo.reset()
                runs.append(("torch.compile aot_eager", make_training_step(
                    torch.compile(model, backend="aot_eager", fullgraph=True), inputs), 1, 0))
            for solver, budget in (("store_all", 1.0), ("auto", 0.5)):
                runs.append(planned_run(model, inputs, solver, budget, prefix, options))
        timings = time_steps_in_turn([step for _, step, _, _ in runs], rounds=args.rounds, warmup=3,
                                     device=device if device.type == "cuda" else None)
        fastest = [min(timing.seconds) for timing in timings]
        original = fastest[0]
        print(f"| {name} | {runs[1][3]} | original | | {original * 1e3:.2f} ms | |")
        for (label, _, ops, _), seconds in zip(runs[1:], fastest[1:]):
            print(f"| {name} | | {label} | {ops if ops > 1 else ''} | "
                  f"{seconds * 1e3:.2f} ms (x{seconds / original:.2f}) | "
                  f"{f'{(seconds - original) / ops * 1e6:.1f} µs' if ops > 1 else ''} |", flush=True)


if __name__ == "__main__":
    main()
