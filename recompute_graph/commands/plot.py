"""``recompute-graph plot [MODEL]``: the three pictures of a plan (plots.py) for a model: the Pareto curve
of peak memory against compute overhead for every solver over a budget sweep, the memory timeline of one
training step (predicted and measured) under the plan at ``--budget``, and that plan drawn on the graph."""
from __future__ import annotations

import argparse
import os
from typing import Any

from .common import add_model_arguments, add_output_flags, budget_argument, print_json, profile_positional_model

__all__ = ["add_parser", "run"]

#: Solvers left out of the sweep unless named with --solvers (they can take minutes).
SLOW_SOLVERS = ("ilp",)
DEFAULT_FRACTIONS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "plot", help="write the Pareto, timeline and strategy plots of a model (PNG and SVG)",
        description="Profile MODEL, sweep every solver over budgets (Pareto plot), plan it at --budget and "
                    "draw that plan's memory timeline (predicted and measured) and its strategy on the graph.")
    add_model_arguments(parser, default="unet")
    parser.set_defaults(preset="tiny")
    parser.add_argument("--budget", type=budget_argument, default=0.6, metavar="B",
                        help="the plan drawn in the timeline and strategy plots (default 0.6)")
    parser.add_argument("--solver", default="auto", help="the solver of that plan (default auto)")
    parser.add_argument("--solvers", nargs="*", default=None, metavar="NAME",
                        help="solvers of the Pareto sweep (default: every solver but ilp)")
    parser.add_argument("--fractions", nargs="*", type=float, default=list(DEFAULT_FRACTIONS), metavar="F",
                        help="budget fractions of the sweep")
    parser.add_argument("--out-dir", default="plots", metavar="DIR", help="where to write (default ./plots)")
    parser.add_argument("--format", nargs="*", default=["png", "svg"], choices=("png", "svg", "pdf"),
                        dest="formats", help="file formats (default png svg)")
    parser.add_argument("--no-measure", dest="measure", action="store_false",
                        help="draw the predicted timeline only (no training step is run)")
    add_output_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..planner import make_plan
    from ..plots import pyplot, plot_pareto, plot_strategy, plot_timeline
    from ..solvers import solvers_for
    from ..sweeps import budget_sweep
    pyplot()  # fail early without matplotlib
    model, inputs, label, traced, graph = profile_positional_model(args, "plot", (args.solvers or []) + [args.solver])
    solvers = args.solvers or [s for s in solvers_for(graph) if s not in SLOW_SOLVERS]
    points = budget_sweep(graph, solvers, args.fractions, progress=not args.quiet)
    plan = make_plan(graph, args.budget, args.solver)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, label.replace("/", "_"))
    written: dict[str, list[str]] = {}
    written["pareto"] = plot_pareto(points, f"{label} ({args.preset}): every solver over budgets",
                                    [f"{stem}-pareto.{f}" for f in args.formats])
    measured = None
    if args.measure:
        from ..timeline import measure_timeline
        measured = measure_timeline(traced.graph_module, graph, plan.schedule, inputs)
    written["timeline"] = plot_timeline(graph, plan.schedule, plan.simulation,
                                        f"{label}: {plan.solver} at {plan.budget_bytes / 2**20:.1f} MiB",
                                        [f"{stem}-timeline.{f}" for f in args.formats], measured)
    written["strategy"] = plot_strategy(graph, plan.schedule, f"{label}: {plan.solver}",
                                        [f"{stem}-strategy.{f}" for f in args.formats])
    measured_peak = max((p.peak_bytes for p in measured), default=None) if measured else None
    if args.json:
        print_json({"model": label, "files": written, "solver": plan.solver,
                    "predicted_peak_bytes": plan.predicted_peak_bytes, "measured_peak_bytes": measured_peak})
        return 0
    print(f"{label}: {plan.one_line()}"
          + (f"; measured peak {measured_peak / 2**20:.2f} MiB" if measured_peak is not None else ""))
    for kind, paths in written.items():
        print(f"  {kind:<9} {', '.join(paths)}")
    return 0
