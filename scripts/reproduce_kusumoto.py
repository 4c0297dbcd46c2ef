"""Kusumoto et al. 2019 on their own graphs, in their own cost model.

    python scripts/reproduce_kusumoto.py [--max-lower-sets 3000]

For each of the seven graphs of ../shared/benchmarks/graphs/kusumoto2019/: the number of lower sets, the
smallest feasible budget of each DP as ``recompute-graph solve GRAPH --solver NAME --min-budget`` gives
it (the simulator's lowest peak of the DP's schedule: the one number of a (graph, solver) pair), then
the minimal budget in the DP's own cost model and three Chen-style baselines, evaluated with the paper's
formula (algorithms.md §1.3), as a fraction
of ``2·M(V)`` (the model's peak of keeping everything); then overhead (``T`` units of recomputation /
``T(V)``) against the budget for both DPs, time- and memory-centric.

Baselines, as lower-set strategies priced by the same formula: ``chen_sqrt`` and ``chen_greedy`` (this
library's, on the topological order), and the paper's own Chen baseline (``Chen.cpp``: single-node cuts
``|∂(L)| = 1`` sorted by ``M(L)``, cut when ``M(L)`` passes the next multiple of ``M(V)/k``,
``k = ⌊√#cuts⌋``).
"""
from __future__ import annotations

import argparse
import math
import time

from recompute_graph import SolverError
from recompute_graph.benchmark_graphs import benchmark_graph_paths, load_graph
from recompute_graph.graph import CostGraph
from recompute_graph.planner import min_feasible_budget
from recompute_graph.schedule import prefix_lower_sets
from recompute_graph.solvers.chen import GREEDY_GRID_POINTS, greedy_cuts, split_candidates
from recompute_graph.solvers.lower_set_dp import (LowerSetFamily, PaperModel, enumerate_lower_sets,
                                                  minimal_model_budget, principal_lower_sets, run_dp,
                                                  strategy_cost)


def paper_peak(graph: CostGraph, lower_sets: list[frozenset[int]]) -> tuple[float, float]:
    """(overhead, peak) of a strategy under the paper's formula."""
    masks = {0, (1 << len(graph)) - 1} | {sum(1 << v for v in s) for s in lower_sets}
    return strategy_cost(PaperModel(LowerSetFamily(graph, sorted(masks))), lower_sets)


def paper_chen(graph: CostGraph) -> list[frozenset[int]]:
    """The paper's Chen baseline (module docstring), on the principal lower sets with one-node cuts."""
    family = principal_lower_sets(graph)
    memory = [n.output_bytes for n in graph.nodes]
    cuts = [s for s, b in zip(family.sets, family.boundary) if bin(b).count("1") == 1]
    cuts.sort(key=lambda s: family.total(memory, s))
    k = max(math.isqrt(len(cuts)), 1)
    step = graph.total_output_bytes / k
    chosen, threshold = [], step
    for position, lower in enumerate(cuts):
        size = family.total(memory, lower)
        if position in (0, len(cuts) - 1) or size > threshold:
            chosen.append(lower)
            while threshold <= size:
                threshold += step
    full = (1 << len(graph)) - 1
    ordered = sorted(set(chosen) - {0, full}, key=lambda s: bin(s).count("1"))
    chain, last = [], 0
    for lower in ordered:  # keep an increasing chain
        if lower & last == last and lower != last:
            chain.append(lower)
            last = lower
    return [frozenset(v for v in range(len(graph)) if m >> v & 1) for m in chain + [full]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-lower-sets", type=int, default=3000)
    args = parser.parse_args()
    curves = []
    print("| graph | nodes | lower sets | dp_exact | dp_approx | dp_exact (paper model) | dp_approx (paper model) | "
          "chen (paper's) | chen_sqrt | chen_greedy | exact DP time |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for path in benchmark_graph_paths("kusumoto2019"):
        graph = load_graph(path)
        vanilla = 2 * graph.total_output_bytes
        approx = PaperModel(principal_lower_sets(graph))
        start = time.perf_counter()
        try:
            exact = PaperModel(enumerate_lower_sets(graph, args.max_lower_sets))
            count = f"{len(exact.family.sets):,}"
            exact_budget = minimal_model_budget(exact)
            exact_text = f"{exact_budget / vanilla:.1%}"
        except SolverError as error:
            exact, count = None, str(error).split(" has ")[1].split(" lower")[0]
            exact_text = "over the limit"
        exact_seconds = time.perf_counter() - start
        approx_budget = minimal_model_budget(approx)
        chen_paper = paper_peak(graph, paper_chen(graph))[1]
        candidates = split_candidates(graph)
        k = max(1, math.isqrt(len(candidates)))
        sqrt_peak = paper_peak(graph, prefix_lower_sets(graph, [c for j, c in enumerate(candidates) if (j + 1) % k == 0]))[1]
        stored = sum(graph.stored_bytes_per_node()) + graph.total_output_bytes
        greedy_peak = min(paper_peak(graph, prefix_lower_sets(graph, greedy_cuts(graph, stored * (i + 1) / GREEDY_GRID_POINTS)))[1]
                          for i in range(GREEDY_GRID_POINTS))
        # the number `recompute-graph solve GRAPH --solver NAME --min-budget` prints: the simulator's
        # lowest peak of the solver's schedule (no planning margin on graph files)
        simulated = {name: (f"{min_feasible_budget(graph, name) / vanilla:.1%}" if name != "dp_exact" or exact
                            else "over the limit") for name in ("dp_exact", "dp_approx")}
        print(f"| {graph.name} | {len(graph)} | {count} | {simulated['dp_exact']} | {simulated['dp_approx']} | "
              f"{exact_text} | {approx_budget / vanilla:.1%} | "
              f"{chen_paper / vanilla:.1%} | {sqrt_peak / vanilla:.1%} | {greedy_peak / vanilla:.1%} | "
              f"{exact_seconds:.1f} s |", flush=True)
        for name, model, low in (("dp_exact", exact, exact_budget if exact else None),
                                 ("dp_approx", approx, approx_budget)):
            if model is None:
                continue
            for variant in ("time", "memory"):
                row = [run_dp(model, low * f, variant).overhead / graph.total_forward_cost
                       for f in (1.0, 1.25, 1.5, 2.0, 3.0)]
                curves.append(f"| {graph.name} | {name} | {variant} | " + " | ".join(f"{r:.1%}" for r in row) + " |")
    print("\nOverhead (recomputed T / T(V)) at multiples of each DP's own minimal budget:\n")
    print("| graph | solver | variant | x1.0 | x1.25 | x1.5 | x2 | x3 |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(curves))


if __name__ == "__main__":
    main()
