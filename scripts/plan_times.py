"""Seconds from nothing to a planned module, on both of ``optimize()``'s paths.

    python scripts/plan_times.py [--models resnet152:0.5 gpt2:0.6] [--preset small]

For each zoo model and budget fraction: ``optimize(model, f, example_inputs=...)`` with
``compiler=False`` (trace, profile with measured times, the planner's pool, the executor) and
``compiler=True`` (Dynamo and AOTAutograd capture, pricing with the allocator's kernel workspace, the
pool, lowering and the trial step), timed end to end on one torch thread; prints the plans. Beside them,
the floor of the compiler path that is not ours: ``torch.compile(model, backend="aot_eager")`` and its
first forward (Dynamo, AOTAutograd's capture and its own partitioner), in the same process. The plan
column ends with where the seconds went: the profiling passes (executor), the kernel-workspace run and
the pricing of the joint graph (compiler), and the planner's pool (both).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import time
import warnings

import torch

import models_zoo
import recompute_graph as rg
from recompute_graph import costs, joint_lowering, planner

#: (module, function, label): the phases timed inside optimize()
PHASES = ((costs, "_run_counted", "profiling passes"), (joint_lowering, "kernel_workspace_bytes", "workspace run"),
          (joint_lowering, "node_seconds", "timed runs"), (joint_lowering, "joint_cost_graph", "joint pricing"),
          (planner, "_build_pool", "pool"))


@contextlib.contextmanager
def timed_phases(phases: tuple = PHASES):
    """Seconds spent in each of ``phases`` (``PHASES``) while the block runs (a Counter by label)."""
    seconds: collections.Counter = collections.Counter()
    originals = [(module, name, getattr(module, name)) for module, name, _ in phases]

    def timing(function, label):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start
        return timed
    for (module, name, label), (_, _, function) in zip(phases, originals):
        setattr(module, name, timing(function, label))
    try:
        yield seconds
    finally:
        for module, name, function in originals:
            setattr(module, name, function)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet152:0.5", "gpt2:0.6"], help="NAME:FRACTION")
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print("| model | budget | path | seconds | plan |\n|---|---|---|---|---|")
    for spec in args.models:
        name, fraction = spec.split(":")
        for compiler in (False, True):
            model, inputs = models_zoo.get_model(name, args.preset)
            torch._dynamo.reset()
            with timed_phases() as phases:
                start = time.perf_counter()
                optimized = rg.optimize(model, float(fraction), example_inputs=inputs, compiler=compiler)
                seconds = time.perf_counter() - start
            spent = ", ".join(f"{label} {phases[label]:.1f} s" for _, _, label in PHASES if phases[label])
            print(f"| {name} ({args.preset}) | {float(fraction):.0%} | {'compiler' if compiler else 'executor'} | "
                  f"{seconds:.1f} | {optimized.recompute_plan.one_line()} ({spent}) |", flush=True)
        model, inputs = models_zoo.get_model(name, args.preset)
        torch._dynamo.reset()
        start = time.perf_counter()
        torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)(*inputs)
        print(f"| {name} ({args.preset}) | - | torch.compile aot_eager, no plan | {time.perf_counter() - start:.1f} "
              "| (torch's own partitioner) |", flush=True)


if __name__ == "__main__":
    main()
