"""Store-all vs Chen et al. 2016 baselines vs the lower-set DPs, measured end to end on CPU.

    python scripts/bench_baselines.py [--models resnet50 resnet152 unet gpt2] [--solvers ...] [--repeats 2]

For each model: trace and profile once (measured times), then for each solver its minimum-peak plan,
executed by the schedule executor: predicted peak, measured peak (allocator meter), measured median step
time, all as ratios to the original model's store-all step measured in the same run. Then the
comparison at equal memory: the lower-set DP (dp_exact where it can run, else dp_approx) planned for the
budget of each Chen plan's predicted peak ("dp @ chen_x"), so its step time can be read against Chen's.
Sizes: ResNet-50 batch 8 and ResNet-152 batch 4 at 224x224; U-Net depth 4, width 32, batch 2 at 256x256;
GPT-2-small (12 layers, width 768, 12 heads, vocabulary 50257) batch 2 at sequence 512.
"""
from __future__ import annotations

import argparse
import time

import torch

import models_zoo
from recompute_graph import SolverError, format_bytes
from recompute_graph.costs import profile_model
from recompute_graph.measure import default_loss, make_training_step, peak_memory, time_step
from recompute_graph.optimized_module import run_schedule
from recompute_graph.rewrite import ScheduleExecutor
from recompute_graph.solvers import SOLVERS

CONFIGS = {
    "resnet50": dict(name="resnet50", preset="paper", batch=8),
    "resnet152": dict(name="resnet152", preset="paper", batch=4),
    "unet": dict(name="unet", preset="small", batch=2, image_size=256, width=32),
    "gpt2": dict(name="gpt2", preset="paper", batch=2, seq_len=512, dropout=0.1),
}
SOLVER_NAMES = ("store_all", "chen_sqrt", "chen_greedy", "dp_approx", "dp_exact")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--solvers", nargs="+", default=list(SOLVER_NAMES), choices=list(SOLVER_NAMES))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print("| model | plan | predicted peak | measured peak | peak / store-all | step time | time / store-all |")
    print("|---|---|---|---|---|---|---|")
    for key in args.models:
        config = dict(CONFIGS[key])
        model, inputs = models_zoo.get_model(config.pop("name"), config.pop("preset"), **config)
        start = time.perf_counter()
        traced, graph = profile_model(model, inputs, repeats=args.repeats, warmup=1)
        profile_seconds = time.perf_counter() - start
        original = make_training_step(model, inputs)
        base_peak = peak_memory(original)
        base_time = time_step(original, repeats=args.repeats, warmup=1).median_seconds
        print(f"| {key} | original model (store-all autograd) | | {format_bytes(base_peak)} | 1.00 | "
              f"{base_time:.2f} s | 1.00 |")
        chen_peaks = {}
        runs = [(solver, None, solver) for solver in args.solvers]
        runs += [(dp, chen, f"{dp} @ {chen}") for chen in ("chen_sqrt", "chen_greedy") if chen in args.solvers
                 for dp in ("dp_exact", "dp_approx") if dp in args.solvers]
        matched = set()
        for solver, chen, label in runs:
            if chen is not None and (chen not in chen_peaks or chen in matched):
                continue
            start = time.perf_counter()
            try:
                solution = SOLVERS[solver](graph, chen_peaks.get(chen))
            except SolverError as error:
                if chen is None:
                    print(f"| {key} | {solver}: {str(error).splitlines()[0]} | | | | | |", flush=True)
                continue
            solve_seconds = time.perf_counter() - start
            if solver.startswith("chen"):
                chen_peaks[solver] = solution.peak_bytes
            if chen is not None:
                matched.add(chen)
            executor = ScheduleExecutor(traced.graph_module, graph, solution.schedule)

            def step() -> None:
                model.zero_grad(set_to_none=True)
                default_loss(run_schedule(executor, list(inputs))).backward()

            peak = peak_memory(step)
            seconds = time_step(step, repeats=args.repeats, warmup=1).median_seconds
            print(f"| {key} | {label} ({solution.description}; solved in {solve_seconds:.1f} s) | "
                  f"{format_bytes(solution.peak_bytes)} | "
                  f"{format_bytes(peak)} | {peak / base_peak:.2f} | {seconds:.2f} s | {seconds / base_time:.2f} |",
                  flush=True)
        print(f"<!-- {key}: {len(graph)} nodes, profiled in {profile_seconds:.0f} s -->", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
