"""``recompute-graph compare GRAPH_FILE ...``: every solver that takes each graph, over a budget sweep
(``comparison.compare_solvers``): a table (or JSON), and with ``--plot`` the comparison picture."""
from __future__ import annotations

import argparse
from typing import Any

from .common import add_output_flags, print_json

__all__ = ["add_parser", "run"]


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "compare", help="compare every solver on graph files over a budget sweep",
        description="Solve each GRAPH_FILE (a Kusumoto cg_*.txt, a Checkmate .json or a saved cost graph) "
                    "with every solver that takes it, at fractions of its no-recomputation peak.")
    parser.add_argument("graph_files", nargs="+", metavar="GRAPH_FILE")
    parser.add_argument("--fractions", nargs="*", type=float, default=[0.6, 0.8, 0.9], metavar="F",
                        help="budgets as fractions of the no-recomputation peak (default 0.6 0.8 0.9)")
    parser.add_argument("--solvers", nargs="*", default=None, metavar="NAME",
                        help="solvers to run (default: every solver that takes the graph)")
    parser.add_argument("--time-limit", type=float, default=30.0, metavar="S", help="ilp: seconds per solve")
    parser.add_argument("--backend", default="cp-sat", help="ilp: cp-sat, scip, highs or cbc")
    parser.add_argument("--plot", default=None, metavar="FILE", help="also write the comparison plot (PNG/SVG)")
    add_output_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..benchmark_graphs import load_graph
    from ..comparison import compare_solvers
    from ..solvers import get_solver
    from ..solvers.ilp_backends import BACKENDS
    for name in args.solvers or []:
        get_solver(name)
    if args.backend not in BACKENDS:
        raise ValueError(f"unknown ilp backend {args.backend!r}; use one of {', '.join(BACKENDS)}")
    if any(not 0 < f <= 1 for f in args.fractions):
        raise ValueError(f"fractions must lie in (0, 1]; got {args.fractions}")
    if args.plot:
        from ..plots import pyplot
        pyplot()  # fail before solving when matplotlib is missing
    graphs = [load_graph(path) for path in args.graph_files]  # every file is read before any solve
    rows = []
    for graph in graphs:
        rows += compare_solvers(graph, args.fractions, args.solvers, time_limit=args.time_limit,
                                backend=args.backend, progress=not args.quiet)
    plot = None
    if args.plot:
        from ..plots import plot_comparison
        plot = plot_comparison(rows, [args.plot])[0]
    if args.json:
        print_json({"rows": [row.as_dict() for row in rows], "plot": plot})
        return 0
    print("| graph | nodes | solver | budget | extra compute | solve time | note |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        shown = f"+{row.extra:.2%}" if row.extra is not None else "-"
        print(f"| {row.graph} | {row.nodes} | {row.solver} | {row.fraction:.0%} | {shown} | {row.seconds:.2f} s | "
              f"{row.note} |")
    if plot:
        print(f"wrote {plot}")
    return 0
