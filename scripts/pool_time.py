"""How long ``solver="auto"``'s pool of plans takes on the published graphs, and what it chooses.

    python scripts/pool_time.py [--graphs resnet50 resnet152 densenet unet] [--fractions 0.95 0.85 0.75]

For each Kusumoto et al. 2019 graph (``../shared/benchmarks/graphs/kusumoto2019/cg_NAME.txt``): the time of
``planner.candidate_pool`` (every auto solver at up to ten budgets, docs/solvers.md), the number of plans in
the pool, and the plan ``make_plan(graph, fraction, "auto")`` chooses at each fraction (solver, predicted
peak, predicted recomputation). Pin it to one core for stable times (``taskset -c 1``).
"""
from __future__ import annotations

import argparse
import time

from recompute_graph import format_bytes
from recompute_graph.benchmark_graphs import benchmark_dir, load_graph
from recompute_graph.planner import candidate_pool, make_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="*", default=["resnet50", "resnet152", "densenet", "unet"])
    parser.add_argument("--fractions", nargs="*", type=float, default=[0.95, 0.85, 0.75])
    args = parser.parse_args()
    print("| graph | nodes | pool | plans | " + " | ".join(f"auto at {f:.0%}" for f in args.fractions) + " |")
    print("|---|---|---|---|" + "---|" * len(args.fractions))
    for name in args.graphs:
        graph = load_graph(benchmark_dir() / "kusumoto2019" / f"cg_{name}.txt")
        start = time.perf_counter()
        pool = candidate_pool(graph)
        seconds = time.perf_counter() - start
        chosen = []
        for fraction in args.fractions:
            plan = make_plan(graph, fraction, "auto")
            chosen.append(f"{plan.solver} {format_bytes(plan.predicted_peak_bytes)} "
                          f"+{plan.predicted_compute_overhead:.1%}")
        print(f"| {name} | {len(graph)} | {seconds:.1f} s | {len(pool)} | " + " | ".join(chosen) + " |", flush=True)


if __name__ == "__main__":
    main()
