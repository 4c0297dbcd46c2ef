"""The ilp solver against the lower-set DP on graphs with an implicit backward: predicted recomputation
(the simulator's) of each at budgets between the DP's smallest peak and the store-all peak.

    python scripts/ilp_vs_dp.py [--zoo mlp unet resnet18 gpt2] [--kusumoto vgg19 unet] [--time-limit 60]

Zoo models use their tiny presets, priced with FLOP-based times. "ilp" never costs more than the DP: it
is seeded with the DP's plan and returns it unless a joint-view plan fits and costs less.
"""
from __future__ import annotations

import argparse
import time

import models_zoo
from recompute_graph.benchmark_graphs import benchmark_dir, load_graph
from recompute_graph.costs import profile_model
from recompute_graph.solvers import get_solver
from recompute_graph.solvers.lower_set_dp import dp_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", nargs="*", default=["mlp", "unet", "resnet18", "gpt2"])
    parser.add_argument("--kusumoto", nargs="*", default=["vgg19", "unet"])
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    graphs = []
    for name in args.zoo:
        model, inputs = models_zoo.get_model(name, "tiny")
        graphs.append((f"{name} (tiny)", profile_model(model, inputs, timing="flops")[1]))
    for name in args.kusumoto:
        graphs.append((f"{name} (Kusumoto)", load_graph(benchmark_dir() / "kusumoto2019" / f"cg_{name}.txt")))
    print("| graph | nodes | budget | DP | DP recompute | ilp recompute | ilp plan | ilp time |")
    print("|---|---|---|---|---|---|---|---|")
    for label, graph in graphs:
        dp = dp_for(graph) or "chen_greedy"
        low = get_solver(dp)(graph, None).peak_bytes
        high = get_solver("store_all")(graph, None).peak_bytes
        for position in (0.1, 0.5):
            budget = int(low + position * (high - low))
            seed = get_solver(dp)(graph, budget)
            start = time.perf_counter()
            solution = get_solver("ilp")(graph, budget, time_limit=args.time_limit)
            seconds = time.perf_counter() - start
            base = seed.simulation.compute_cost - seed.simulation.recompute_cost
            print(f"| {label} | {len(graph)} | {budget / high:.0%} of store-all | {dp} | "
                  f"+{seed.simulation.recompute_cost / base:.2%} | +{solution.simulation.recompute_cost / base:.2%} | "
                  f"{solution.description} | {seconds:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
