"""Quick demo of the foundation: trace and price a zoo model, check the prices against measurement.

    python scripts/demo.py [--model resnet18] [--preset tiny|small|paper]

Prints the model's cost graph, the activation memory autograd keeps (predicted from the per-node costs
vs measured with saved_tensors_hooks), the measured peak of one training step, and the sizes of one
published benchmark graph.
"""
from __future__ import annotations

import argparse
import time

import torch

import models_zoo
from recompute_graph import format_bytes
from recompute_graph.benchmark_graphs import benchmark_dir, load_graph
from recompute_graph.costs import profile_model
from recompute_graph.measure import make_training_step, peak_memory, saved_tensor_bytes, time_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", choices=models_zoo.MODEL_NAMES)
    parser.add_argument("--preset", default="small", choices=("tiny", "small", "paper"))
    args = parser.parse_args()

    model, inputs = models_zoo.get_model(args.model, args.preset)
    start = time.perf_counter()
    traced, graph = profile_model(model, inputs, repeats=3, warmup=1)
    print(f"traced and profiled {args.model} ({args.preset}) in {time.perf_counter() - start:.1f} s")
    print(graph.summary(max_rows=25))
    if traced.opaque_modules:
        print("opaque submodules:", ", ".join(traced.opaque_modules))

    predicted = graph.store_all_saved_bytes()
    measured = saved_tensor_bytes(lambda: model(*inputs))
    step = make_training_step(model, inputs)
    peak = peak_memory(step)
    timing = time_step(step, repeats=3)
    print(f"\nactivations kept for backward: predicted {format_bytes(predicted)}, "
          f"measured {format_bytes(measured)} (ratio {predicted / measured:.4f})")
    print(f"training step: peak {format_bytes(peak)} above parameters and inputs "
          f"(parameter gradients {format_bytes(graph.parameter_bytes)} included), "
          f"{timing.median_seconds * 1e3:.1f} ms median; node-wise compute sum "
          f"{(graph.total_forward_cost + graph.total_backward_cost) * 1e3:.1f} ms")

    vgg = load_graph(benchmark_dir() / "kusumoto2019" / "cg_vgg19.txt")
    print(f"\nbenchmark graph: {vgg!r}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
