"""The BPTT setting of Gruslys et al. 2016: an LSTM unrolled over T steps, one cell reused at every step.

    python scripts/bptt_gruslys.py [--steps 1000] [--batch 64] [--hidden 512] [--input 128] [--memory 0.05]
                                   [--solver chain_dp] [--device cpu|cuda] [--rounds 5] [--compiler]

Plans the unrolled model with chain_dp (rotor) for an activation budget of ``--memory`` times the
store-all activation memory, then measures one training step of the original model and of the plan:
activation memory = measured peak minus parameter gradients (as in the paper); step times: the original
step, its forward alone and the plan's step are timed in turn ``--rounds`` times, the fastest of each kept.
Also prints beta, the original step's backward time over its forward time: at a few per cent of the
activations only a few steps' internal states fit, so almost every step is computed twice, and no plan
takes much less than ``(2 + beta) / (1 + beta)`` times the original step.
``--compiler``: plan on ``optimize()``'s compiler path (the joint graph, ``solver`` ``auto`` unless
given otherwise) instead of the schedule executor's graph; a budget under the joint graph's floor is
raised to it, and the script says so.
On ``--device cuda`` the model runs on the GPU and the peak is the CUDA allocator's
(``torch.cuda.max_memory_allocated`` above what was live before the step).
"""
from __future__ import annotations

import argparse
import time

import torch

import models_zoo
from recompute_graph import format_bytes, optimize
from recompute_graph.errors import InfeasibleBudgetError
from recompute_graph.measure import default_loss, make_training_step, peak_memory, time_steps_in_turn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--input", type=int, default=128)
    parser.add_argument("--memory", type=float, default=0.05)
    parser.add_argument("--solver", default="chain_dp")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compiler", action="store_true", help="plan on the compiler path (the joint graph)")
    args = parser.parse_args()
    device = torch.device(args.device)
    meter = device if device.type == "cuda" else None
    model, inputs = models_zoo.get_model("rnn", "paper", steps=args.steps, batch=args.batch,
                                         hidden_size=args.hidden, input_size=args.input)
    model, inputs = model.to(device), tuple(t.to(device) for t in inputs)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    original = make_training_step(model, inputs)
    original_peak = peak_memory(original, device=meter)
    original_activations = original_peak - parameter_bytes
    budget = parameter_bytes + int(args.memory * original_activations)
    start = time.perf_counter()
    if args.compiler:
        solver = "auto" if args.solver == "chain_dp" else args.solver
        try:
            optimized = optimize(model, budget, example_inputs=inputs, solver=solver, compiler=True)
        except InfeasibleBudgetError as error:
            print(f"the joint graph's floor is {format_bytes(error.min_budget_bytes)} (the budget asked: "
                  f"{format_bytes(budget)}): planning at the floor")
            budget = error.min_budget_bytes
            optimized = optimize(model, budget, example_inputs=inputs, solver=solver, compiler=True)
    else:
        optimized = optimize(model, budget, example_inputs=inputs, solver=args.solver, timing="flops")
    plan_seconds = time.perf_counter() - start
    plan = optimized.recompute_plan
    step = make_training_step(optimized, inputs)
    peak = peak_memory(step, device=meter)
    timings = time_steps_in_turn([original, lambda: default_loss(model(*inputs)), step], rounds=args.rounds,
                                 device=meter)
    original_time, forward_time, seconds = (min(timing.seconds) for timing in timings)
    beta = (original_time - forward_time) / forward_time
    activations = peak - parameter_bytes
    path = "compiler path" if args.compiler else "schedule executor"
    print(f"LSTM T={args.steps} batch {args.batch} hidden {args.hidden} on {device.type}, {path}: {plan.solver} "
          f"({plan.description}), "
          f"planned in {plan_seconds:.0f} s")
    print(f"activations: store-all {format_bytes(original_activations)}, plan {format_bytes(activations)} "
          f"(predicted {format_bytes(plan.predicted_peak_bytes - parameter_bytes)}): "
          f"{1 - activations / original_activations:.1%} saved")
    print(f"step time: store-all {original_time:.2f} s, plan {seconds:.2f} s: x{seconds / original_time:.2f}")
    print(f"backward / forward of the original step: beta = {beta:.2f}; a plan that recomputes every step once "
          f"takes at least x{(2 + beta) / (1 + beta):.2f}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
