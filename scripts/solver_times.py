"""Solve time of the lower-set DPs on Kusumoto et al.'s graphs, at multiples of each one's minimal budget.

    python scripts/solver_times.py [--graphs resnet152 resnet50 unet ...] [--factors 1 1.5 3]

One solve per cell (wall clock of the solver call, including building the transition table and the
simulator check), on this machine; "over the limit" is dp_exact's SolverError (more lower sets than
``DEFAULT_MAX_LOWER_SETS``).
"""
from __future__ import annotations

import argparse
import time

from recompute_graph.benchmark_graphs import benchmark_dir, load_graph
from recompute_graph.errors import SolverError
from recompute_graph.planner import min_feasible_budget
from recompute_graph.solvers import get_solver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="*", default=["resnet152", "resnet50", "unet", "vgg19", "densenet",
                                                         "googlenet", "pspnet"])
    parser.add_argument("--factors", nargs="*", type=float, default=[1.0, 1.5, 3.0])
    args = parser.parse_args()
    print("| graph | solver | " + " | ".join(f"x{f:g} budget" for f in args.factors) + " |")
    print("|---|---|" + "---|" * len(args.factors))
    for name in args.graphs:
        graph = load_graph(benchmark_dir() / "kusumoto2019" / f"cg_{name}.txt")
        for solver in ("dp_exact", "dp_approx"):
            try:
                minimum = min_feasible_budget(graph, solver)
            except SolverError as error:
                print(f"| {name} | {solver} | over the limit: {str(error).split(':')[0]} |" + " |" * (len(args.factors) - 1))
                continue
            cells = []
            for factor in args.factors:
                start = time.perf_counter()
                get_solver(solver)(graph, int(minimum * factor))
                cells.append(f"{time.perf_counter() - start:.2f} s")
            print(f"| {name} | {solver} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
