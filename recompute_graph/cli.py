"""Command line: ``recompute-graph`` (also ``python -m recompute_graph``).

    recompute-graph plan MODEL --budget B [--solver NAME] [-o plan.json] [--json] [-q]
    recompute-graph check MODEL [--budget B] [--solver NAME] [--seed N] [--json] [-q]
    recompute-graph bench MODEL [--fractions F ...] [--solvers NAME ...] [--peers] [--json] [-q]
    recompute-graph compare GRAPH_FILE ... [--fractions F ...] [--solvers NAME ...] [--plot FILE] [--json]
    recompute-graph plot [MODEL] [--budget B] [--out-dir DIR]
    recompute-graph solve GRAPH_FILE --solver NAME (--budget B | --min-budget) [--variant time|memory] [--json]
    recompute-graph solve GRAPH_FILE --solver ilp --budget B [--time-limit S] [--workers N]
                          [--backend cp-sat|scip|highs|cbc] [--json]

``GRAPH_FILE``: a Kusumoto 2019 ``cg_*.txt``, a Checkmate 2020 / random layered ``.json`` or a saved
``CostGraph``. ``B``: bytes, a size string (``1.5GiB``) or a fraction in (0, 1] of the store-all budget,
as in ``optimize()`` (for ``ilp``: a fraction of the store-all peak itself, as in Checkmate and Moccasin).
Peaks and overheads are the simulator's (the same judge for every solver). With ``ilp``, ``status`` is
OPTIMAL only when the solver (CP-SAT, or a MIP solver with ``--backend``) proved it, FEASIBLE for a schedule without that proof (``gap`` says how far the
bound is), INFEASIBLE when proven that nothing fits, UNKNOWN when nothing was found in the time limit.
Exit status: 0 when a plan fits, 1 when the budget is infeasible (or nothing was found; for ``check``:
when a check fails), 2 on errors (one line, no traceback).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence

from .benchmark_graphs import load_graph
from .errors import InfeasibleBudgetError, RecomputeError
from .planner import make_plan, min_feasible_budget
from .solvers import SOLVERS
from .solvers.ilp_backends import BACKENDS
from .commands import bench as bench_command
from .commands import check as check_command
from .commands import compare as compare_command
from .commands import plan as plan_command
from .commands import plot as plot_command
from .commands.common import budget_argument
from .units import format_bytes

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block): ``recompute-graph plan: error: ...``."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="recompute-graph", description="Plan activation recomputation: which activations "
                     "to keep and which to recompute so that a training step fits a memory budget.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for command in (plan_command, check_command, bench_command, compare_command, plot_command):
        command.add_parser(commands)
    solve = commands.add_parser("solve", help="solve a graph file at a budget or find its minimum budget",
                                description=__doc__.split("\n\n")[2])
    solve.add_argument("graph_file", metavar="GRAPH_FILE")
    solve.add_argument("--solver", default="auto", help=f"one of: auto, {', '.join(sorted(SOLVERS))}")
    budget = solve.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget", type=budget_argument, metavar="B", help="bytes, a size like 1.5GiB, or a fraction")
    budget.add_argument("--min-budget", action="store_true", help="find the smallest feasible budget")
    solve.add_argument("--variant", choices=("time", "memory"), default="time",
                       help="lower-set DPs: least overhead (time) or least checkpoint memory (memory)")
    solve.add_argument("--time-limit", type=float, default=60.0, metavar="S",
                       help="ilp: seconds before returning the best schedule found (default 60)")
    solve.add_argument("--workers", type=int, default=2, metavar="N", help="ilp: search threads")
    solve.add_argument("--backend", choices=BACKENDS, default="cp-sat",
                       help="ilp: CP-SAT (default) or a MIP solver through pywraplp (SCIP proves optimality "
                            "faster on some graphs, docs/ilp.md)")
    solve.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    solve.set_defaults(run=_run_solve)
    return parser


def _solve_ilp(args: argparse.Namespace, graph: Any) -> dict[str, Any]:
    from .planner import parse_budget
    from .solvers import store_all
    from .solvers.ilp import solve_from_start
    if args.min_budget:
        raise ValueError("--min-budget is not available for ilp yet: give --budget")
    baseline = store_all.store_all(graph, None)
    kind, value = parse_budget(args.budget)
    budget_bytes = int(value * baseline.peak_bytes) if kind == "fraction" else int(value)
    result = solve_from_start(graph, budget_bytes, time_limit=args.time_limit, workers=args.workers,
                              progress=not args.json, backend=args.backend)
    base_cost = baseline.simulation.compute_cost
    out: dict[str, Any] = {"graph": graph.name, "solver": "ilp", "backend": result.backend, "status": result.status,
                           "feasible": result.schedule is not None, "budget_bytes": budget_bytes,
                           "store_all_peak_bytes": baseline.peak_bytes, "solve_seconds": result.solve_seconds,
                           "objective": result.objective, "bound": result.bound, "gap": result.gap,
                           "variables": result.variables, "constraints": result.constraints,
                           "peak_bytes": None, "overhead": None}
    if result.schedule is not None:
        from .simulate import simulate
        simulation = simulate(graph, result.schedule)
        out.update(peak_bytes=simulation.peak_bytes, overhead=simulation.recompute_cost / base_cost,
                   recomputed_nodes=len(result.schedule.recomputed_nodes()),
                   description=f"{result.status}, gap {result.gap or 0.0:.2%}"
                   + (f" ({result.note})" if result.note else ""))
    return out


def _solve(args: argparse.Namespace) -> dict[str, Any]:
    if args.solver != "auto" and args.solver not in SOLVERS:
        raise ValueError(f"unknown solver {args.solver!r}; available: auto, {', '.join(sorted(SOLVERS))}")
    graph = load_graph(args.graph_file)
    if args.solver == "ilp" and not graph.implicit_backward:
        return _solve_ilp(args, graph)
    if args.solver == "ilp":  # through the joint view, seeded with the lower-set DP
        from .solvers import ilp as ilp_module
        ilp_module.DEFAULT_TIME_LIMIT = args.time_limit
        ilp_module.DEFAULT_BACKEND = args.backend
    start = time.perf_counter()
    result: dict[str, Any] = {"graph": graph.name, "solver": args.solver, "variant": args.variant}
    if args.min_budget:
        smallest = min_feasible_budget(graph, args.solver, variant=args.variant)
        plan = make_plan(graph, smallest, args.solver, variant=args.variant)
        result.update(status="FEASIBLE", feasible=True, min_budget_bytes=smallest)
    else:
        try:
            plan = make_plan(graph, args.budget, args.solver, variant=args.variant)
        except InfeasibleBudgetError as error:
            result.update(status="INFEASIBLE", feasible=False, budget_bytes=error.budget_bytes,
                          min_budget_bytes=error.min_budget_bytes, peak_bytes=None, overhead=None,
                          solve_seconds=time.perf_counter() - start)
            return result
        result.update(status="FEASIBLE", feasible=True)
    result.update(solver=plan.solver, budget_bytes=plan.budget_bytes, peak_bytes=plan.predicted_peak_bytes,
                  overhead=plan.predicted_compute_overhead, store_all_peak_bytes=plan.store_all_peak_bytes,
                  recomputed_nodes=len(plan.recomputed_nodes), description=plan.description,
                  solve_seconds=time.perf_counter() - start)
    return result


def _print_human(result: dict[str, Any]) -> None:
    if result["solver"] == "ilp" and not result["feasible"]:
        print(f"{result['graph']}: ilp {result['status']} at {format_bytes(result['budget_bytes'])} after "
              f"{result['solve_seconds']:.1f} s")
        return
    if not result["feasible"]:
        print(f"{result['graph']}: INFEASIBLE at {format_bytes(result['budget_bytes'])}; smallest feasible "
              f"budget {format_bytes(result['min_budget_bytes'])} ({result['min_budget_bytes']} bytes)")
        return
    if "min_budget_bytes" in result:
        print(f"{result['graph']}: smallest feasible budget {format_bytes(result['min_budget_bytes'])} "
              f"({result['min_budget_bytes']} bytes)")
    print(f"{result['graph']}: {result['solver']} ({result['description']}), peak "
          f"{format_bytes(result['peak_bytes'])} of budget {format_bytes(result['budget_bytes'])} (store-all "
          f"{format_bytes(result['store_all_peak_bytes'])}), overhead +{result['overhead']:.1%}, "
          f"{result['recomputed_nodes']} nodes recomputed, {result['solve_seconds']:.2f} s")


def _run_solve(args: argparse.Namespace) -> int:
    result = _solve(args)
    if args.json:
        print(json.dumps(result))
    else:
        _print_human(result)
    return 0 if result["feasible"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (0 done, 1 infeasible budget, 2 error: one line on
    stderr, no traceback)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (RecomputeError, ValueError, OSError, ImportError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"recompute-graph {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
