"""Solve time of the lower-set DPs on Kusumoto et al.'s graphs, at multiples of each one's minimal budget.

    python scripts/solver_times.py [--graphs resnet152 resnet50 unet ...] [--factors 1 1.5 3]
    python scripts/solver_times.py --pool [--graphs resnet50 resnet152 densenet unet] [--fractions 0.95 0.85 0.75]

One solve per cell (wall clock of the solver call, including building the transition table and the
simulator check), on this machine; "over the limit" is dp_exact's SolverError (more lower sets than
``DEFAULT_MAX_LOWER_SETS``).

``--pool``: instead, the time of ``planner.candidate_pool`` per graph (what ``solver="auto"`` chooses from:
every auto solver at up to ten budgets, docs/solvers.md), the number of plans in it, and the plan
``make_plan(graph, fraction, "auto")`` chooses at each fraction (solver, predicted peak, predicted
recomputation). Pin it to one core for stable times (``taskset -c 1``).
"""
from __future__ import annotations

import argparse
import time

from recompute_graph import format_bytes
from recompute_graph.benchmark_graphs import benchmark_dir, load_graph
from recompute_graph.errors import SolverError
from recompute_graph.planner import candidate_pool, make_plan, min_feasible_budget
from recompute_graph.solvers import get_solver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="*")
    parser.add_argument("--factors", nargs="*", type=float, default=[1.0, 1.5, 3.0])
    parser.add_argument("--pool", action="store_true", help="time the auto pool and show the plans it chooses")
    parser.add_argument("--fractions", nargs="*", type=float, default=[0.95, 0.85, 0.75])
    args = parser.parse_args()
    if args.pool:
        return pool_rows(args.graphs or ["resnet50", "resnet152", "densenet", "unet"], args.fractions)
    args.graphs = args.graphs or ["resnet152", "resnet50", "unet", "vgg19", "densenet", "googlenet", "pspnet"]
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


def pool_rows(graphs: list[str], fractions: list[float]) -> None:
    print("| graph | nodes | pool | plans | " + " | ".join(f"auto at {f:.0%}" for f in fractions) + " |")
    print("|---|---|---|---|" + "---|" * len(fractions))
    for name in graphs:
        graph = load_graph(benchmark_dir() / "kusumoto2019" / f"cg_{name}.txt")
        start = time.perf_counter()
        pool = candidate_pool(graph)
        seconds = time.perf_counter() - start
        chosen = [make_plan(graph, fraction, "auto") for fraction in fractions]
        print(f"| {name} | {len(graph)} | {seconds:.1f} s | {len(pool)} | " + " | ".join(
            f"{p.solver} {format_bytes(p.predicted_peak_bytes)} +{p.predicted_compute_overhead:.1%}" for p in chosen)
              + " |", flush=True)


if __name__ == "__main__":
    main()
