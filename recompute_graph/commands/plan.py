"""``recompute-graph plan MODEL --budget B``: trace and price a model, plan it, print the plan and write
it as JSON (``RecomputePlan.save``; reuse it with ``optimize(model, budget, plan=path)``)."""
from __future__ import annotations

import argparse
import time
from typing import Any

from ..units import format_bytes
from .common import add_model_arguments, add_output_flags, budget_argument, loaded_model, print_json

__all__ = ["add_parser", "run"]

#: Recomputed nodes listed in the human-readable summary.
LISTED_NODES = 12


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "plan", help="plan a model at a budget: summary table and a JSON plan file",
        description="Trace and price MODEL on its example inputs, choose the best plan within the budget, "
                    "print it and write it as JSON.")
    add_model_arguments(parser)
    parser.add_argument("--budget", required=True, type=budget_argument, metavar="B",
                        help="bytes, a size like 1.5GiB, or a fraction in (0, 1] of the store-all budget")
    parser.add_argument("--solver", default="auto", help="a solver name or auto (default)")
    parser.add_argument("-o", "--output", default=None, metavar="FILE",
                        help="the plan file to write (default: MODEL-plan.json)")
    add_output_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..call_graphs import profile_call
    from ..errors import InfeasibleBudgetError
    from ..planner import make_plan
    from ..solvers import get_solver
    if args.solver != "auto":
        get_solver(args.solver)  # an unknown name fails before the model is built
    model, inputs, label = loaded_model(args)
    start = time.perf_counter()
    call_args, call_kwargs = ((), inputs) if isinstance(inputs, dict) else (inputs, {})
    _, graph = profile_call(model, call_args, call_kwargs, timing=args.timing, progress=not args.quiet,
                            name=label)
    profile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    try:
        plan = make_plan(graph, args.budget, args.solver)
    except InfeasibleBudgetError as error:
        if args.json:
            print_json({"model": label, "feasible": False, "status": "INFEASIBLE",
                        "budget_bytes": error.budget_bytes, "min_budget_bytes": error.min_budget_bytes})
        else:
            print(f"{label}: {str(error).splitlines()[0]}")
        return 1
    solve_seconds = time.perf_counter() - start
    output = args.output or f"{label.replace('/', '_')}-plan.json"
    plan.save(output)
    counts = plan.schedule.computation_counts()
    if args.json:
        print_json({"model": label, "feasible": True, "status": "FEASIBLE", "solver": plan.solver,
                    "description": plan.description, "budget_bytes": plan.budget_bytes,
                    "predicted_peak_bytes": plan.predicted_peak_bytes,
                    "store_all_peak_bytes": plan.store_all_peak_bytes,
                    "overhead": plan.predicted_compute_overhead, "nodes": len(graph),
                    "recomputed_nodes": len(plan.recomputed_nodes), "plan_file": output,
                    "profile_seconds": profile_seconds, "solve_seconds": solve_seconds})
        return 0
    print(f"{label} ({args.preset}): {len(graph)} nodes, profiled in {profile_seconds:.1f} s, "
          f"planned in {solve_seconds:.1f} s")
    print(plan)
    recomputed = sorted(plan.recomputed_nodes, key=lambda i: -graph.nodes[i].output_bytes)
    if recomputed:
        print(f"\n  {'recomputed node':<32} {'output':>10} {'computed':>9}")
        for i in recomputed[:LISTED_NODES]:
            node = graph.nodes[i]
            print(f"  {node.name[:32]:<32} {format_bytes(node.output_bytes):>10} {counts[i]:>8}x")
        if len(recomputed) > LISTED_NODES:
            print(f"  ... and {len(recomputed) - LISTED_NODES} more")
    unrolled = ", unroll_rnns=True" if args.unroll_rnns else ""
    print(f"\nplan written to {output}  (reuse: optimize(model, budget, plan={output!r}{unrolled}))")
    return 0
