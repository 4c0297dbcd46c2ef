"""``recompute-graph check MODEL [--budget B]``: plan MODEL and run one planned step against the original
(``verify()``): the largest gradient error, the buffers, the allocator-measured peak against the budget
and the prediction. Exit status 0 when every check passes, 1 when one fails."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from .common import add_model_arguments, add_output_flags, budget_argument, print_json

__all__ = ["add_parser", "run"]


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "check", help="trust a plan before a long run: one planned step against the original",
        description="Plan MODEL at the budget, then run one seeded training step of the original and of the "
                    "planned module with the same loss: gradients, buffers (BatchNorm statistics) and the "
                    "allocator-measured peak against the budget and the prediction.")
    add_model_arguments(parser)
    parser.add_argument("--budget", type=budget_argument, default=0.8, metavar="B",
                        help="bytes, a size like 1.5GiB, or a fraction in (0, 1] of the store-all budget "
                             "(default 0.8)")
    parser.add_argument("--solver", default="auto", help="a solver name or auto (default)")
    parser.add_argument("--seed", type=int, default=0, help="the step's random seed (dropout masks)")
    add_output_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import InfeasibleBudgetError
    from ..model_specs import load_model, parse_sizes
    from ..solvers import get_solver
    from ..verification import verify
    if args.solver != "auto":
        get_solver(args.solver)
    model, inputs, label = load_model(args.model, args.preset, parse_sizes(args.size))  # (fused: the reference)
    model.train()
    call_args, call_kwargs = ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), {})
    try:
        report = verify(model, args.budget, example_inputs=call_args, example_kwargs=call_kwargs,
                        solver=args.solver, seed=args.seed, timing=args.timing, progress=not args.quiet,
                        unroll_rnns=args.unroll_rnns)
    except InfeasibleBudgetError as error:
        if args.json:
            print_json({"model": label, "ok": False, "status": "INFEASIBLE", "budget_bytes": error.budget_bytes,
                        "min_budget_bytes": error.min_budget_bytes})
        else:
            print(f"{label}: {str(error).splitlines()[0]}")
        return 1
    if args.json:
        fields = dataclasses.asdict(report)
        fields.update(model=label, ok=report.ok, prediction_error=report.prediction_error,
                      within_budget=report.within_budget)
        print_json(fields)
    else:
        print(str(report).replace(f"verify {report.model}", f"check {label}", 1))
    return 0 if report.ok else 1
