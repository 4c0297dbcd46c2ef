"""Planning at scale without the device: GPT-2-style models of 12 to 48 layers (GPT-2-XL widths) priced on
meta tensors, planned by each solver; planning time and predicted peak.

    python scripts/scale_meta.py [--layers 12 24 36 48] [--width 1600] [--heads 25] [--seq-len 1024]
                                 [--batch 8] [--budget 0.5] [--solvers auto dp_approx chen_greedy chain_dp]
                                 [--compiler]

For each depth: pricing time (trace + meta pass, FLOP times for an H200), then per solver the plan at
``--budget`` (fraction of store-all) and the solver's lowest peak, with their times.
"""
from __future__ import annotations

import argparse
import time

import torch

import models_zoo
from recompute_graph import format_bytes
from recompute_graph.costs import profile_model
from recompute_graph.errors import InfeasibleBudgetError, SolverError
from recompute_graph.planner import make_plan, min_feasible_budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="*", type=int, default=[12, 24, 36, 48])
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--heads", type=int, default=25)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--solvers", nargs="*", default=["auto", "dp_approx", "chen_greedy", "chen_sqrt", "chain_dp"])
    parser.add_argument("--compiler", action="store_true",
                        help="plan the compiler path's joint graph instead: rg.plan_for(..., compiler=True), "
                             "timed whole (capture by torch.compile on meta, pricing, the auto pool, lowering)")
    args = parser.parse_args()
    if args.compiler:
        return compiler_rows(args)
    print(f"| layers | parameters | nodes | pricing | solver | plan at {args.budget:.0%}: peak | overhead | time "
          "| lowest peak | time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layers in args.layers:
        start = time.perf_counter()
        with torch.device("meta"):
            model, inputs = models_zoo.get_model("gpt2", "paper", layers=layers, width=args.width, heads=args.heads,
                                                 seq_len=args.seq_len, batch=args.batch)
        _, graph = profile_model(model, tuple(t.to("meta") for t in inputs), device_profile="h200")
        pricing = time.perf_counter() - start
        parameters = sum(p.numel() for p in model.parameters())
        for solver in args.solvers:
            start = time.perf_counter()
            try:
                plan = make_plan(graph, args.budget, solver)
                planned = (f"{format_bytes(plan.predicted_peak_bytes)} | +{plan.predicted_compute_overhead:.1%} | "
                           f"{time.perf_counter() - start:.1f} s")
            except (InfeasibleBudgetError, SolverError) as error:
                planned = f"- ({str(error).split(';')[0][:40]}) | | {time.perf_counter() - start:.1f} s"
            start = time.perf_counter()
            lowest = min_feasible_budget(graph, solver)
            print(f"| {layers} | {parameters / 1e9:.2f} B | {len(graph)} | {pricing:.1f} s | {solver} | {planned} | "
                  f"{format_bytes(lowest)} | {time.perf_counter() - start:.1f} s |", flush=True)


def compiler_rows(args: argparse.Namespace) -> None:
    """``rg.plan_for(..., compiler=True)`` per depth: the whole time, where it went (the planner's pool,
    its relaxation among it, and the rest of the joint graph's planning, ``plan_and_lower``; Dynamo's
    and AOTAutograd's capture on meta is the remainder) and the plan."""
    import recompute_graph as rg
    from plan_times import timed_phases
    from recompute_graph import joint_lowering, planner
    phases = ((planner, "_build_pool", "pool"), (planner, "_relaxed_pool", "relaxation"),
              (joint_lowering, "plan_and_lower", "planning"))
    print(f"| layers | joint units | plan_for(compiler=True) at {args.budget:.0%} | pool (relaxation) | "
          "all planning | solver | predicted peak | store-all | overhead |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layers in args.layers:
        torch._dynamo.reset()

        def build(layers: int = layers) -> tuple:
            return models_zoo.get_model("gpt2", "paper", layers=layers, width=args.width, heads=args.heads,
                                        seq_len=args.seq_len, batch=args.batch)
        with timed_phases(phases) as spent:
            start = time.perf_counter()
            plan = rg.plan_for(build, args.budget, compiler=True, device_profile="h200")
            seconds = time.perf_counter() - start
        print(f"| {layers} | {len(plan.graph)} | {seconds:.1f} s | {spent['pool']:.1f} s "
              f"({spent['relaxation']:.1f} s) | {spent['planning']:.1f} s | {plan.solver} | "
              f"{format_bytes(plan.predicted_peak_bytes)} | {format_bytes(plan.store_all_peak_bytes)} | "
              f"+{plan.predicted_compute_overhead:.1%} |", flush=True)


if __name__ == "__main__":
    main()
