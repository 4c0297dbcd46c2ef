"""What planning on the FLOP roofline's times as well as the measured ones buys, per model.

    python scripts/estimated_times_pool.py [--models hf_bloom resnet50 ...] [--preset small]
                                           [--size batch=8] [--fractions 1.0 0.9 0.8 0.7 0.6 0.5]

Compiles one training step of each model with ``rg.backend(1.0, solver="store_all")`` on CPU (a
conformance model of ``models_zoo.third_party`` by its name, else a zoo model at ``--preset`` and ``--size``), takes
the joint cost graph it priced with measured node times (``rg.last_lowering().graph``), and builds
``auto``'s pool twice: with the plans the solvers make on the roofline's times
(``planner.estimated_times_graph``) and without them (the same graph less ``estimated_costs``). For
each it prints the pool's least budget (the floor), the floor an ``InfeasibleBudgetError`` names
(``planner.reproducible_floor_bytes``: that of the plans the measured times do not decide) and the
seconds it took, then ``auto``'s plan at each
fraction of the store-all budget: its predicted step peak and extra compute, both priced with the
measured times. Node times are measured at each capture, so the numbers move a little between runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
import warnings

import torch

import models_zoo
import recompute_graph as rg
from models_zoo import third_party
from models_zoo.conformance import call_of
from recompute_graph import planner
from recompute_graph.errors import InfeasibleBudgetError
from recompute_graph.graph import CostGraph
from recompute_graph.losses import default_training_loss


def captured_graph(name: str, preset: str, sizes: dict[str, int] | None = None) -> CostGraph:
    """The joint cost graph of one compiled training step of model ``name``."""
    torch.manual_seed(0)
    if name in third_party.CONFORMANCE_MODELS:
        model, call = third_party.build(name)
        args, kwargs = call_of(call)
    else:
        model, inputs = models_zoo.get_model(name, preset, **(sizes or {}))
        args, kwargs = tuple(inputs), {}
    compiled = torch.compile(model, backend=rg.backend(1.0, solver="store_all"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default_training_loss(compiled(*args, **kwargs)).backward()
    return rg.last_lowering().graph


def report(name: str, graph: CostGraph, fractions: list[float]) -> None:
    without = dataclasses.replace(graph, estimated_costs=())
    print(f"## {name}: {len(graph)} units, {graph.cost_source}")
    print("| pool | floor (bytes) | named floor (bytes) | pool seconds | " + " | ".join(f"{f:g}" for f in fractions)
          + " |")
    print("|---|---|---|---|" + "---|" * len(fractions))
    for label, candidate in (("measured times", without), ("measured + estimated times", graph)):
        started = time.perf_counter()
        floor = planner.min_feasible_budget(candidate)
        seconds = time.perf_counter() - started
        named = planner.reproducible_floor_bytes(candidate)
        cells = []
        for fraction in fractions:
            try:
                plan = planner.make_plan(candidate, fraction, "auto")
            except InfeasibleBudgetError:
                cells.append("-")
                continue
            cells.append(f"{plan.predicted_step_peak_bytes:,} B {plan.predicted_compute_overhead:+.1%}"
                         + (" (est.)" if "estimated times" in plan.description else ""))
        print(f"| {label} | {floor:,} | {named:,} ({named / floor - 1:+.1%}) | {seconds:.1f} | " + " | ".join(cells) + " |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["hf_bloom", "hf_llama", "resnet50", "unet"])
    parser.add_argument("--preset", default="small", help="the zoo models' preset (default small)")
    parser.add_argument("--size", action="append", default=[], help="NAME=INT for the zoo models, e.g. batch=8")
    parser.add_argument("--fractions", nargs="+", type=float, default=[1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    args = parser.parse_args()
    for name in args.models:
        sizes = {k: int(v) for k, v in (s.split("=") for s in args.size)}
        report(name, captured_graph(name, args.preset, sizes), args.fractions)


if __name__ == "__main__":
    main()
