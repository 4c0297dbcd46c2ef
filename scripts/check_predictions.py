"""Predicted vs measured peak of every baseline plan on every tiny zoo model, and gradient agreement.

    python scripts/check_predictions.py [--preset tiny]

For each model and solver (minimum-peak plan, as ``planner.run_solver`` makes it): the simulator's predicted peak, the storage meter's
measured peak of one step through the executor (``measure.default_loss``), their ratio, and the largest
relative difference of parameter gradients from the original model's.
"""
from __future__ import annotations

import argparse

import torch

import models_zoo
from recompute_graph.costs import profile_model
from recompute_graph.measure import default_loss, peak_memory
from recompute_graph.optimized_module import run_schedule
from recompute_graph.rewrite import ScheduleExecutor
from recompute_graph.errors import SolverError
from recompute_graph.planner import run_solver
from recompute_graph.solvers import solvers_for


def gradients(model: torch.nn.Module, forward, inputs) -> tuple[int, dict[str, torch.Tensor]]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        default_loss(forward(inputs)).backward()
    peak = peak_memory(step)
    return peak, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    args = parser.parse_args()
    print("| model | solver | predicted peak (B) | measured peak (B) | predicted / measured | max grad rel. error |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for name in models_zoo.MODEL_NAMES:
        model, inputs = models_zoo.get_model(name, args.preset)
        traced, graph = profile_model(model, inputs, timing="flops")
        buffers = {k: b.clone() for k, b in model.named_buffers()}
        _, reference = gradients(model, lambda x: model(*x), inputs)
        for solver in solvers_for(graph):
            try:
                solution = run_solver(solver, graph, None)  # as the planner runs it (passes included)
            except SolverError as error:
                print(f"| {name} | {solver} | - | - | - | not run: {str(error).split(';')[0]} |", flush=True)
                continue
            executor = ScheduleExecutor(traced.graph_module, graph, solution.schedule)
            with torch.no_grad():
                for k, b in model.named_buffers():
                    b.copy_(buffers[k])
            peak, grads = gradients(model, lambda x: run_schedule(executor, list(x)), inputs)
            error = max(((grads[k] - reference[k]).abs().max() / reference[k].abs().max().clamp_min(1e-12)).item()
                        for k in reference)
            ratios.append(solution.peak_bytes / peak)
            print(f"| {name} | {solver} | {solution.peak_bytes} | {peak} | {solution.peak_bytes / peak:.3f} | "
                  f"{error:.1e} |", flush=True)
    print(f"\npredicted / measured: min {min(ratios):.3f}, max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
