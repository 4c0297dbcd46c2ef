"""Every solver that takes a graph, on the public benchmark graphs, over a budget sweep: extra compute (the
simulator's, relative to no recomputation), solve time and, for ilp, status and gap.

    python scripts/compare_solvers.py [--family checkmate2020 kusumoto2019] [--graphs VGG19 vgg_unet ...]
                                      [--zoo mlp unet resnet18] [--fractions 0.5 0.7 0.9]
                                      [--time-limit 30] [--backend cp-sat] [--plot compare.png]

Budgets are fractions of the no-recomputation peak. Kusumoto's graphs and the zoo models (``--zoo``:
their tiny presets, traced and priced with FLOP-based times; implicit backward) run the lower-set DPs,
Chen's baselines, the chain solvers and ``ilp`` through its joint view; Checkmate's and the random
layered graphs (joint graphs) run ``evict`` and ``ilp``. "-" marks a solver whose best plan does not fit
the budget. ``--plot`` draws extra compute against budget, one panel per graph, and ``ilp``'s solve time
against graph size (needs matplotlib); ``--family`` with no name skips the benchmark graphs.
"""
from __future__ import annotations

import argparse

from recompute_graph.benchmark_graphs import benchmark_graph_paths, load_graph
from recompute_graph.comparison import ComparisonRow, compare_solvers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="*", default=["checkmate2020"])
    parser.add_argument("--graphs", nargs="*", default=None, help="name prefixes (default: all)")
    parser.add_argument("--zoo", nargs="*", default=[], help="zoo models (tiny presets) to trace and compare")
    parser.add_argument("--fractions", nargs="*", type=float, default=[0.5, 0.7, 0.9])
    parser.add_argument("--time-limit", type=float, default=30.0, help="ilp's limit per solve (seconds)")
    parser.add_argument("--backend", default="cp-sat", help="ilp's back end (cp-sat, scip, highs, cbc)")
    parser.add_argument("--plot", default=None, help="write a PNG/SVG of extra compute vs budget")
    parser.add_argument("--from-table", nargs="*", default=None, metavar="FILE",
                        help="only plot (and --pivot): read the rows from tables this script printed before")
    parser.add_argument("--pivot", action="store_true",
                        help="also print one row per (graph, budget) with a column per solver, the best in bold")
    args = parser.parse_args()
    if args.from_table is not None:
        rows = _read_tables(args.from_table)
        if args.pivot:
            _print_pivot(rows)
        _plot(rows, args.plot or "compare.png")
        return
    rows: list[ComparisonRow] = []
    print("| graph | nodes | solver | budget | extra compute | solve time | note |")
    print("|---|---|---|---|---|---|---|")
    for stem, graph in _graphs(args):
        for row in compare_solvers(graph, args.fractions, label=stem, time_limit=args.time_limit,
                                   backend=args.backend):
            rows.append(row)
            shown = f"+{row.extra:.2%}" if row.extra is not None else "-"
            print(f"| {row.graph} | {row.nodes} | {row.solver} | {row.fraction:.0%} | {shown} | "
                  f"{row.seconds:.2f} s | {row.note} |", flush=True)
    if args.pivot:
        _print_pivot(rows)
    if args.plot:
        _plot(rows, args.plot)


def _print_pivot(rows: list[ComparisonRow]) -> None:
    """Extra compute per (graph, budget) and solver: "-" when the plan does not fit, empty when the solver
    does not take the graph, bold for the least (as shown, to 0.01 %), "(opt)" where ilp proved its plan
    optimal."""
    solvers = list(dict.fromkeys(row.solver for row in rows))
    cells: dict[tuple[str, int, float], dict[str, ComparisonRow]] = {}
    for row in rows:
        cells.setdefault((row.graph, row.nodes, row.fraction), {})[row.solver] = row
    print("\n| graph | nodes | budget | " + " | ".join(solvers) + " |")
    print("|---|---|---|" + "---|" * len(solvers))
    for (graph, nodes, fraction), by_solver in cells.items():
        fitting = [row.extra for row in by_solver.values() if row.extra is not None]
        best = min(fitting) if fitting else None
        shown = []
        for name in solvers:
            row = by_solver.get(name)
            if row is None or "takes no" in row.note:
                shown.append("")
            elif row.extra is None:
                shown.append("-")
            else:
                text = f"+{row.extra:.2%}" + (" (opt)" if row.note.startswith("OPTIMAL") else "")
                # ties as shown: the ILP's memory units round bytes up, so a heuristic can be a hair cheaper
                shown.append(f"**{text}**" if f"{row.extra:.2%}" == f"{best:.2%}" else text)
        print(f"| {graph} | {nodes} | {fraction:.0%} | " + " | ".join(shown) + " |")


def _graphs(args: argparse.Namespace):
    """(name, cost graph) pairs: the benchmark graphs of ``--family`` matching ``--graphs``, then the
    zoo models of ``--zoo``."""
    for family in args.family:
        for path in benchmark_graph_paths(family):
            stem = path.stem.removeprefix("cg_")
            if args.graphs and not any(stem.startswith(g) for g in args.graphs):
                continue
            yield stem, load_graph(path)
    if args.zoo:
        import models_zoo
        from recompute_graph.costs import profile_model
        for name in args.zoo:
            model, inputs = models_zoo.get_model(name, "tiny")
            yield f"{name} (zoo, tiny)", profile_model(model, inputs, timing="flops")[1]


def _read_tables(paths: list[str]) -> list[ComparisonRow]:
    rows = []
    for path in paths:
        for line in open(path):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 7 or not cells[3].endswith("%") or cells[0] == "graph":
                continue
            extra = float(cells[4].lstrip("+").rstrip("%")) / 100 if cells[4] != "-" else None
            rows.append(ComparisonRow(cells[0], int(cells[1]), cells[2], float(cells[3].rstrip("%")) / 100, extra,
                                      float(cells[5].removesuffix(" s")), cells[6]))
    return rows


def _plot(rows: list[ComparisonRow], path: str) -> None:
    try:
        from recompute_graph.plots import plot_comparison
        plot_comparison(rows, [path])
    except ImportError as error:
        raise SystemExit(str(error)) from None
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
