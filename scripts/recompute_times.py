"""A plan's recomputation as the generated graphs run it, against the cost graph's prediction.

    python scripts/recompute_times.py [--model resnet50] [--preset paper] [--size batch=8] [--fraction 0.37]

Compiles one training step of the zoo model with ``rg.backend(fraction)`` and runs its generated forward
and backward graphs through an interpreter that times every node (the least of ``--steps`` steps). Prints
the plan, the cost graph's forward, backward and recomputation seconds against the measured ones, and
the recomputation by aten op: predicted (each recomputed unit's ``forward_cost``, by the unit's first op)
and measured (the backward's recompute nodes, ``Lowered.recomputed``).
"""
from __future__ import annotations

import argparse
import collections
import time
import warnings

import torch
from torch import fx

import models_zoo
from recompute_graph.joint_capture import op_name
from recompute_graph.compile_backend import budget_backend
from recompute_graph.joint_lowering import last_lowering
from recompute_graph.losses import default_training_loss
from recompute_graph.schedule import Forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--size", action="append", default=[], help="NAME=INT, e.g. batch=8")
    parser.add_argument("--fraction", type=float, default=0.37)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    sizes = {k: int(v) for k, v in (s.split("=") for s in args.size)} or {"batch": 8}
    warnings.simplefilter("ignore")
    model, inputs = models_zoo.get_model(args.model, args.preset, **sizes)
    seconds: dict[tuple[str, str], float] = {}
    graphs: dict[str, fx.GraphModule] = {}

    class Timed(fx.Interpreter):
        def __init__(self, graph_module: fx.GraphModule, tag: str) -> None:
            super().__init__(graph_module)
            self.tag = tag

        def run_node(self, n: fx.Node):
            start = time.perf_counter()
            result = super().run_node(n)
            took = time.perf_counter() - start
            key = (self.tag, n.name)
            seconds[key] = min(took, seconds.get(key, took))
            return result

    def timed_compiler(graph_module: fx.GraphModule, _example_inputs):
        tag = "backward" if any(n.op == "placeholder" and n.name.startswith("tangents")
                                for n in graph_module.graph.nodes) else "forward"
        graphs[tag] = graph_module

        def run(arguments: list):
            return Timed(graph_module, tag).boxed_run(arguments)
        run._boxed_call = True
        return run

    compiled = torch.compile(model, backend=budget_backend(args.fraction, loss_fn=default_training_loss,
                                                           on_infeasible="floor", graph_compiler=timed_compiler))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        default_training_loss(compiled(*inputs)).backward()
    step()
    lowered = last_lowering()
    seconds.clear()
    for _ in range(args.steps):
        step()
    graph = lowered.graph
    forward = sum(n.forward_cost for n in graph.nodes)
    backward = sum(n.backward_cost for n in graph.nodes)
    predicted = collections.Counter()
    seen: set[int] = set()
    for op in (*lowered.plan.schedule.forward_ops, *lowered.plan.schedule.backward_ops):
        if isinstance(op, Forward):
            if op.node in seen:
                predicted[graph.nodes[op.node].target] += graph.nodes[op.node].forward_cost
            seen.add(op.node)
    recomputed = set(lowered.recomputed)
    backward_nodes = {n.name: n for n in graphs["backward"].graph.nodes}
    measured = collections.Counter()
    totals = collections.Counter()
    for (tag, name), took in seconds.items():
        totals[tag] += took
        if tag == "backward" and name in recomputed:
            measured[op_name(backward_nodes[name].target)] += took
    print(lowered.plan)
    print(f"| seconds | predicted | measured |\n|---|---|---|")
    print(f"| forward | {forward:.3f} | {totals['forward']:.3f} |")
    print(f"| backward without recomputation | {backward:.3f} | {totals['backward'] - sum(measured.values()):.3f} |")
    print(f"| recomputation | {sum(predicted.values()):.3f} | {sum(measured.values()):.3f} |")
    print("\nrecomputation by aten op (ms; predicted by the unit's first op, measured by node):")
    for name in sorted(set(predicted) | set(measured), key=lambda k: -max(predicted[k], measured[k])):
        print(f"  {name:40s} predicted {predicted[name] * 1e3:8.1f}  measured {measured[name] * 1e3:8.1f}")


if __name__ == "__main__":
    main()
