"""Measured node times of a model's joint graph against the FLOP roofline, by aten op.

    python scripts/node_times.py [--model resnet50] [--preset paper] [--size batch=8] [--profile cpu]

Compiles one training step of the zoo model with ``rg.backend(1.0)``, keeps the joint forward+backward
graph AOTAutograd hands the partitioner, times every node on real tensors as the compiler path prices it
(``joint_allocations.node_seconds``) and prints, per aten op, the roofline's seconds
(``device_profiles.DEVICE_PROFILES[--profile]`` on the node's FLOPs and moved bytes, a view or a
``getitem`` at nothing) against the measured ones: where the roofline would misrank recomputing one op
against another. ``--old-views`` prices views and items at their bytes, as the roofline did before.
"""
from __future__ import annotations

import argparse
import collections
import warnings

import torch

import models_zoo
import recompute_graph as rg
from recompute_graph.device_profiles import DEVICE_PROFILES
from recompute_graph.joint_allocations import node_seconds
from recompute_graph.joint_capture import op_name
from recompute_graph.joint_costs import _moved_bytes
from recompute_graph.joint_storage import value_bytes
from recompute_graph.losses import default_training_loss
from recompute_graph.meta_flops import meta_flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--size", action="append", default=[], help="NAME=INT, e.g. batch=8")
    parser.add_argument("--profile", default="cpu", choices=sorted(DEVICE_PROFILES))
    parser.add_argument("--old-views", action="store_true", help="price views and items at their bytes")
    parser.add_argument("--top", type=int, default=20, help="ops listed, most measured time first")
    args = parser.parse_args()
    sizes = {k: int(v) for k, v in (s.split("=") for s in args.size)} or {"batch": 8}
    warnings.simplefilter("ignore")
    model, inputs = models_zoo.get_model(args.model, args.preset, **sizes)
    captured = {}
    compiled = torch.compile(model, backend=rg.backend(
        1.0, on_joint=lambda joint, joint_inputs: captured.update(joint=joint, inputs=joint_inputs)))
    default_training_loss(compiled(*inputs)).backward()
    joint = captured["joint"]
    measured = node_seconds(joint, captured["inputs"])
    profile = DEVICE_PROFILES[args.profile]
    table = collections.defaultdict(lambda: [0.0, 0.0, 0])
    flops_by_signature: dict = {}
    for node in joint.graph.nodes:
        if node.op != "call_function":
            continue
        moved = (value_bytes(node) + sum(value_bytes(a) for a in node.all_input_nodes)) if args.old_views \
            else _moved_bytes(node)
        row = table[op_name(node.target)]
        row[0] += profile.seconds(meta_flops(node, flops_by_signature), moved)
        row[1] += measured.get(node.name, 0.0)
        row[2] += 1
    print(f"{args.model} ({args.preset}, {sizes}): joint graph of {len(joint.graph.nodes)} nodes, "
          f"{len(measured)} timed; roofline {profile.name!r} against measured, per aten op")
    print(f"| op | nodes | roofline ms | measured ms | measured / roofline |")
    print("|---|---|---|---|---|")
    for name, (estimate, seconds, count) in sorted(table.items(), key=lambda kv: -kv[1][1])[:args.top]:
        ratio = f"{seconds / estimate:.2f}" if estimate > 0 else "-"
        print(f"| {name} | {count} | {estimate * 1e3:.2f} | {seconds * 1e3:.2f} | {ratio} |")
    total_estimate = sum(v[0] for v in table.values())
    total_measured = sum(v[1] for v in table.values())
    print(f"| all | {sum(v[2] for v in table.values())} | {total_estimate * 1e3:.1f} | {total_measured * 1e3:.1f} | "
          f"{total_measured / total_estimate:.2f} |")


if __name__ == "__main__":
    main()
