"""What relaxing the pool's plans buys on a model's joint graph, against per-block checkpointing.

    python scripts/relaxed_plans.py [--model resnet50] [--preset paper] [--size batch=8]
                                    [--fractions 0.36 0.37 0.4 0.42 0.5]

Compiles one training step of the zoo model with ``rg.backend(1.0)`` on CPU, takes the joint cost graph
the compiler path priced (``rg.last_lowering().graph``), and prints ``auto``'s plan at each fraction of
the store-all budget with the pool's plans as the solvers made them and with them relaxed
(``planner._relaxed_pool``), each with its simulated peak and predicted extra compute, and the seconds
the relaxation took, then the relaxed pool's plans under ``--pool-below`` MiB. For ResNets it also
simulates per-block checkpointing written as a schedule on the same graph: each bottleneck's input kept
(no tape), the bottleneck run again with its tape right before its backward, the stem and the head
taped as usual.
"""
from __future__ import annotations

import argparse
import pickle
import time
import warnings

import torch

import models_zoo
import recompute_graph as rg
from recompute_graph import planner
from recompute_graph.graph import CostGraph
from recompute_graph.losses import default_training_loss
from recompute_graph.solvers import Solution
from recompute_graph.solvers.chain_dp import Chain, lower_chain_ops
from recompute_graph.solvers.chen import split_candidates


def per_block_checkpointing(graph: CostGraph) -> Solution | None:
    """``torch.utils.checkpoint`` around every residual block, as a schedule of ``graph``: the blocks end
    at the split candidates that are a ReLU of a two-input ``add`` (a bottleneck's output); None when the
    graph has no such blocks."""
    nodes = graph.nodes
    candidates = split_candidates(graph)

    def block_end(c: int) -> bool:
        before = nodes[c].predecessors
        return (nodes[c].target == "relu" and len(before) == 1 and nodes[before[0]].target == "add"
                and len(nodes[before[0]].predecessors) == 2)
    ends = [c for c in candidates if block_end(c)]
    # the stem ends at the last split candidate before the first block, not at its residual add
    stem = [c for c in candidates if ends and c < ends[0] and c not in nodes[ends[0]].predecessors]
    if len(ends) < 2 or not stem:
        return None
    bounds = [-1, stem[-1]] + ends + [len(graph) - 1]
    stages = tuple(tuple(range(bounds[i] + 1, bounds[i + 1] + 1)) for i in range(len(bounds) - 1))
    last = len(stages) - 1
    chain = Chain(stages, (0.0,) * len(stages), (0.0,) * len(stages), (0,) * (last + 2), (0,) * (last + 2), 0)
    ops = [("Fe", 0)] + [("Fn", s) for s in range(1, last)] + [("Fe", last), ("B", last)]
    for s in range(last - 1, 0, -1):
        ops += [("Fe", s), ("B", s)]
    ops.append(("B", 0))
    return Solution.of("per_block", graph, lower_chain_ops(graph, chain, ops), f"{last - 1} blocks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--size", action="append", default=[], help="NAME=INT, e.g. batch=8")
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.36, 0.37, 0.4, 0.42, 0.5])
    parser.add_argument("--save-graph", metavar="FILE", help="pickle the joint cost graph to FILE")
    parser.add_argument("--pool-below", type=float, default=300.0, metavar="MIB",
                        help="list the relaxed pool's plans of a simulated peak under MIB (default 300)")
    args = parser.parse_args()
    sizes = {k: int(v) for k, v in (s.split("=") for s in args.size)} or {"batch": 8}
    torch.manual_seed(0)
    model, inputs = models_zoo.get_model(args.model, args.preset, **sizes)
    compiled = torch.compile(model, backend=rg.backend(1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default_training_loss(compiled(*inputs)).backward()
    graph = rg.last_lowering().graph
    if args.save_graph:
        with open(args.save_graph, "wb") as file:
            pickle.dump(graph, file)
    base = planner.store_all_plan(graph).simulation.compute_cost
    print(f"{args.model} ({args.preset}, {sizes}): joint cost graph of {len(graph)} nodes, "
          f"store-all {planner.store_all_plan(graph).peak_bytes / 2**20:.1f} MiB")
    relaxed_pool = planner._relaxed_pool

    def plans(relaxing: bool) -> dict[float, tuple[str, float, float]]:
        graph.__dict__.pop("_graph_memo", None)  # the pool made again
        planner._relaxed_pool = relaxed_pool if relaxing else (lambda g, pool: pool)
        try:
            out = {}
            for fraction in args.fractions:
                plan = planner.make_plan(graph, fraction)
                out[fraction] = (plan.solver, plan.predicted_peak_bytes / 2**20,
                                 plan.simulation.recompute_cost / base)
            return out
        finally:
            planner._relaxed_pool = relaxed_pool
    before = plans(False)
    pool = planner.candidate_pool(graph)
    start = time.perf_counter()
    relaxed_pool(graph, pool)
    seconds = time.perf_counter() - start
    after = plans(True)
    print(f"relaxing the pool's {len(pool)} plans: {seconds:.1f} s")
    print("| fraction | without relaxation | relaxed pool |\n|---|---|---|")
    for fraction in args.fractions:
        (s0, p0, c0), (s1, p1, c1) = before[fraction], after[fraction]
        print(f"| {fraction:.0%} | {s0}, {p0:.1f} MiB at +{c0:.1%} | {s1}, {p1:.1f} MiB at +{c1:.1%} |")
    print(f"the relaxed pool's plans under {args.pool_below:g} MiB:")
    for plan in planner.candidate_pool(graph):
        if plan.peak_bytes < args.pool_below * 2**20:
            print(f"  {plan.solver}{' (relaxed)' if plan.description.endswith('relaxed') else ''}: "
                  f"{plan.peak_bytes / 2**20:.1f} MiB at +{plan.recompute_cost / base:.1%}")
    block = per_block_checkpointing(graph)
    if block is not None:
        print(f"per-block checkpointing ({block.description}) simulated: {block.peak_bytes / 2**20:.1f} MiB "
              f"at +{block.recompute_cost / base:.1%}")


if __name__ == "__main__":
    main()
