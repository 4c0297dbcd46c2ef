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
import time

from recompute_graph.benchmark_graphs import benchmark_graph_paths, load_graph
from recompute_graph.errors import SolverError
from recompute_graph.solvers import SOLVERS, solvers_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="*", default=["checkmate2020"])
    parser.add_argument("--graphs", nargs="*", default=None, help="name prefixes (default: all)")
    parser.add_argument("--fractions", nargs="*", type=float, default=[0.5, 0.7, 0.9])
    parser.add_argument("--zoo", nargs="*", default=[], help="zoo models (tiny presets) to trace and compare")
    parser.add_argument("--time-limit", type=float, default=30.0, help="ilp's limit per solve (seconds)")
    parser.add_argument("--backend", default="cp-sat", help="ilp's back end (cp-sat, scip, highs, cbc)")
    parser.add_argument("--plot", default=None, help="write a PNG/SVG of extra compute vs budget")
    parser.add_argument("--from-table", nargs="*", default=None, metavar="FILE",
                        help="only plot: read the rows from tables this script printed before")
    args = parser.parse_args()
    if args.from_table is not None:
        _plot(_read_tables(args.from_table), args.plot or "compare.png")
        return
    rows: list[tuple[str, str, float, float | None, float, str]] = []
    print("| graph | nodes | solver | budget | extra compute | solve time | note |")
    print("|---|---|---|---|---|---|---|")
    for stem, graph in _graphs(args):
        store_all = SOLVERS["store_all"](graph, None)
        base = store_all.simulation.compute_cost
        for fraction in args.fractions:
            budget = int(fraction * store_all.peak_bytes)
            for name in solvers_for(graph):
                if name == "store_all":
                    continue
                options = {"time_limit": args.time_limit, "backend": args.backend} if name == "ilp" else {}
                start = time.perf_counter()
                try:
                    solution = SOLVERS[name](graph, budget, **options)
                except SolverError as error:
                    seconds = time.perf_counter() - start
                    rows.append((stem, name, fraction, None, seconds, str(error).split(";")[0][:60], len(graph)))
                    print(f"| {stem} | {len(graph)} | {name} | {fraction:.0%} | - | {seconds:.2f} s | {rows[-1][5]} |",
                          flush=True)
                    continue
                seconds = time.perf_counter() - start
                fits = solution.fits(budget)
                extra = solution.simulation.recompute_cost / base if fits else None
                note = solution.description if name == "ilp" else ""
                rows.append((stem, name, fraction, extra, seconds, note, len(graph)))
                shown = f"+{extra:.2%}" if extra is not None else "-"
                print(f"| {stem} | {len(graph)} | {name} | {fraction:.0%} | {shown} | {seconds:.2f} s | {note} |",
                      flush=True)
    if args.plot:
        _plot(rows, args.plot)


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


def _read_tables(paths: list[str]) -> list:
    rows = []
    for path in paths:
        for line in open(path):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 7 or not cells[3].endswith("%") or cells[0] == "graph":
                continue
            extra = float(cells[4].lstrip("+").rstrip("%")) / 100 if cells[4] != "-" else None
            rows.append((cells[0], cells[2], float(cells[3].rstrip("%")) / 100, extra,
                         float(cells[5].removesuffix(" s")), cells[6], int(cells[1])))
    return rows


def _plot(rows: list, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    graphs = sorted({row[0] for row in rows})
    columns = min(4, len(graphs) + 1)
    lines = (len(graphs) + 1 + columns - 1) // columns
    figure, axes = plt.subplots(lines, columns, figsize=(4 * columns, 3 * lines), squeeze=False)
    for axis, graph in zip(axes.flat, graphs):
        for solver in sorted({row[1] for row in rows if row[0] == graph}):
            points = sorted((row[2], row[3]) for row in rows if row[0] == graph and row[1] == solver
                            and row[3] is not None)
            if points:
                axis.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o", label=solver)
        axis.set_title(graph, fontsize=9)
        axis.set_xlabel("budget (fraction of no-recomputation peak)")
        axis.set_ylabel("extra compute (%)")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    timing = list(axes.flat)[len(graphs)]
    for solver in sorted({row[1] for row in rows}):
        points = sorted((row[6], row[4]) for row in rows if row[1] == solver)
        if points:
            timing.scatter([p[0] for p in points], [max(p[1], 1e-3) for p in points], label=solver, s=12)
    timing.set_xscale("log")
    timing.set_yscale("log")
    timing.set_title("solve time vs graph size", fontsize=9)
    timing.set_xlabel("nodes")
    timing.set_ylabel("seconds")
    timing.legend(fontsize=7)
    for axis in list(axes.flat)[len(graphs) + 1:]:
        axis.axis("off")
    figure.tight_layout()
    figure.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
