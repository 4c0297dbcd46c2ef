"""A store-all plan's step on the compiler path against plain eager autograd, at real sizes.

    python scripts/store_all_step.py [--models resnet50 gpt2 rnn] [--rounds 7] [--device cpu|cuda]
                                     [--inductor] [--small] [--profile N]

Issue 16's target: a store-all plan (no recomputation) costs at most 1.03x of eager autograd per
training step on GPT-2 small, ResNet-50 and the LSTM at T = 200, as the median of interleaved runs. For
each model, three steps are timed in turn (``measure.time_steps_in_turn``, so a slow spell of the
machine hits all alike): the original model (eager autograd), ``optimize(model, 1.0,
solver="store_all")`` (the compiler path, ``optimize``'s default), and ``torch.compile(model,
backend="aot_eager")`` (AOTAutograd's own partition, its graphs run as generated: what compiling costs by
itself). ``--inductor`` adds two steps to each round: ``optimize(model, 1.0, solver="store_all",
graph_compiler="inductor")`` (the same plan, its generated graphs compiled by inductor) and
``torch.compile(model)`` (inductor's own partition and code), so that the plan's graphs under inductor are
judged against eager and against inductor by itself. ``--small``: the zoo's small presets instead of the
issue's sizes, to try the script quickly on a CPU. Every step is forward, the ``sum of squares`` loss,
backward, with gradients set to None first.
Prints one Markdown row per run: median and fastest step time and the ratios of the medians to eager.
``--profile N``: then, for each run, the N aten ops of most self CPU time over 3 steps
(``torch.profiler``: calls, total and mean microseconds per call), to see where a gap comes from.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import models_zoo
from recompute_graph import optimize
from recompute_graph.compiled_module import CompiledRecomputedModule
from recompute_graph.measure import make_training_step, time_steps_in_turn

#: The issue's sizes: ResNet-50 at 224² and batch 8, GPT-2 small at batch 2 and 512 tokens, and the
#: LSTM of scripts/bptt_gruslys.py at T = 200.
REAL_SIZES = {
    "resnet50": dict(preset="paper", batch=8),
    "gpt2": dict(preset="paper", batch=2, seq_len=512),
    "rnn": dict(preset="small", steps=200, batch=32, input_size=64, hidden_size=256),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(REAL_SIZES), choices=list(REAL_SIZES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--inductor", action="store_true",
                        help="also time the plan's graphs compiled by inductor, and torch.compile(model)")
    parser.add_argument("--small", action="store_true", help="the zoo's small presets (a quick try)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="top N ops of each run")
    args = parser.parse_args()
    device = torch.device(args.device)
    print("| model | run | median step | fastest step | median / eager |")
    print("|---|---|---|---|---|")
    for name in args.models:
        model, inputs = models_zoo.get_model_on(name, device, **({} if args.small else REAL_SIZES[name]))
        torch._dynamo.reset()
        planned = optimize(model, 1.0, example_inputs=inputs, solver="store_all")
        path = "compiler" if isinstance(planned, CompiledRecomputedModule) else "executor (capture fell back)"
        runs = [("eager autograd", make_training_step(model, inputs)),
                (f"store_all, {path}", make_training_step(planned, inputs)),
                ("torch.compile aot_eager", make_training_step(
                    torch.compile(model, backend="aot_eager", fullgraph=True), inputs))]
        if args.inductor:
            with_inductor = optimize(model, 1.0, example_inputs=inputs, solver="store_all",
                                     graph_compiler="inductor")
            runs += [("store_all, compiler path, inductor graphs", make_training_step(with_inductor, inputs)),
                     ("torch.compile inductor", make_training_step(torch.compile(model), inputs))]
        timings = time_steps_in_turn([step for _, step in runs], rounds=args.rounds, warmup=2,
                                     device=device if device.type == "cuda" else None)
        medians = [statistics.median(timing.seconds) for timing in timings]
        for (label, _), timing, median in zip(runs, timings, medians):
            print(f"| {name} | {label} | {median * 1e3:.1f} ms | {min(timing.seconds) * 1e3:.1f} ms | "
                  f"x{median / medians[0]:.3f} |", flush=True)
        if args.profile:
            for label, step in runs:
                print_top_ops(f"{name}, {label}", step, args.profile)


def print_top_ops(title: str, step, count: int, steps: int = 3) -> None:
    """The ``count`` aten ops of most self CPU time over ``steps`` steps, as a Markdown table."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as recorded:
        for _ in range(steps):
            step()
    events = sorted((e for e in recorded.key_averages() if e.key.startswith("aten::")),
                    key=lambda e: e.self_cpu_time_total, reverse=True)[:count]
    print(f"\n{title}, {steps} steps:\n\n| op | calls | self CPU | per call |\n|---|---|---|---|")
    for e in events:
        per_call = e.self_cpu_time_total / e.count
        print(f"| {e.key} | {e.count} | {e.self_cpu_time_total / 1e3:.1f} ms | {per_call:.1f} µs |")


if __name__ == "__main__":
    main()
