"""The ilp solver on the Checkmate 2020 joint graphs and the random layered graphs, at fractions of the
no-recomputation peak (Checkmate's and Moccasin's budgets).

    python scripts/ilp_checkmate.py [--graphs VGG19 vgg_unet fcn_8 segnet ...] [--fractions 0.9 0.8]
                                    [--time-limit 120] [--workers 2] [--passes 1]
                                    [--backend cp-sat|scip|highs|cbc]

Prints a Markdown row per (graph, budget): status (OPTIMAL = proven), extra compute over the
no-recomputation schedule (the simulator's) of the starting schedule and of the result, the solver's gap,
solve time, wall time of the whole call (starting schedule, model, solve), model size, and the simulated
peak as a fraction of the budget. CP-SAT starts from the no-recomputation schedule when it fits, else
from the cheaper of the ``evict`` and ``shave`` heuristics' (``--no-hint``: from nothing). The time
limit covers finding that schedule, building the model and solving it; a model too large to build
returns the starting schedule with its gap to the bound of docs/ilp.md.
"""
from __future__ import annotations

import argparse
import time

from recompute_graph.benchmark_graphs import benchmark_graph_paths, load_graph
from recompute_graph.errors import SolverError
from recompute_graph.simulate import simulate
from recompute_graph.solvers import get_solver
from recompute_graph.solvers.ilp import solve_from_start, solve_ilp
from recompute_graph.solvers.ilp_backends import BACKENDS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="*", default=["VGG19", "vgg_unet", "fcn_8", "segnet"])
    parser.add_argument("--fractions", nargs="*", type=float, default=[0.9, 0.8])
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--backend", choices=BACKENDS, default="cp-sat")
    parser.add_argument("--no-hint", dest="hint", action="store_false",
                        help="start CP-SAT without the store-all / evict schedule")
    args = parser.parse_args()
    paths = benchmark_graph_paths("checkmate2020")
    print("| graph | nodes / edges | budget | status | start | extra compute | gap | solve time | wall time "
          "| variables | peak / budget |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.graphs:
        matches = [p for p in paths if p.name.startswith(name)]
        if not matches:
            raise SystemExit(f"no checkmate2020 graph starts with {name!r}")
        graph = load_graph(matches[0])
        store_all = get_solver("store_all")(graph, None)
        base = store_all.simulation.compute_cost
        for fraction in args.fractions:
            budget = int(fraction * store_all.peak_bytes)
            row = f"| {graph.name} | {len(graph)} / {len(graph.edges)} | {fraction:.0%} |"
            start = time.perf_counter()
            options = dict(workers=args.workers, passes=args.passes, backend=args.backend)
            try:
                result = (solve_from_start(graph, budget, time_limit=args.time_limit, **options) if args.hint
                          else solve_ilp(graph, budget, time_limit=args.time_limit, **options))
            except SolverError as error:  # no starting schedule and no model
                print(f"{row} - | none | | | | {time.perf_counter() - start:.1f} s | | "
                      f"{str(error).split(';')[0]} |", flush=True)
                continue
            wall = time.perf_counter() - start
            started = (f"+{simulate(graph, result.start).recompute_cost / base:.2%}" if result.start is not None
                       else "none")
            if result.schedule is None:
                print(f"{row} {result.status} | {started} | | | {result.solve_seconds:.1f} s | {wall:.1f} s | "
                      f"{result.variables:,} | |", flush=True)
                continue
            simulation = simulate(graph, result.schedule)
            gap = result.gap or 0.0
            variables = f"{result.variables:,}" if not result.note else "not built"
            print(f"{row} {result.status} | {started} | +{simulation.recompute_cost / base:.2%} | {gap:.2%} | "
                  f"{result.solve_seconds:.1f} s | {wall:.1f} s | {variables} | {simulation.peak_bytes / budget:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
