"""Step time of a plan that already fits, as the solver made it and after ``keep_free_tapes``: the pass
takes tapes out of the executor's fused backward runs (why the planner only uses it on schedules that
do not fit).

    python scripts/free_tapes_timing.py [--model resnet50] [--preset small] [--size KEY=VALUE ...]
                                        [--budget 0.8] [--solver chain_dp]

Prints, for each schedule, the number of fused backward runs, the measured peak and the median of 5
step times (after one warm-up step).
"""
from __future__ import annotations

import argparse
import statistics
import time

import models_zoo
from recompute_graph.costs import profile_model
from recompute_graph.measure import default_loss, peak_memory
from recompute_graph.model_specs import parse_sizes
from recompute_graph.optimized_module import run_schedule
from recompute_graph.planner import make_plan
from recompute_graph.rewrite import ScheduleExecutor
from recompute_graph.schedule_passes import keep_free_tapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--size", action="append", default=[], metavar="KEY=VALUE",
                        help="override a size of the zoo model (repeatable), e.g. --size batch=16")
    parser.add_argument("--budget", type=float, default=0.8)
    parser.add_argument("--solver", default="chain_dp")
    args = parser.parse_args()
    model, inputs = models_zoo.get_model(args.model, args.preset, **parse_sizes(args.size))
    traced, graph = profile_model(model, inputs, timing="flops")
    schedule = make_plan(graph, args.budget, args.solver).schedule
    for label, candidate in (("as solved", schedule), ("free tapes kept", keep_free_tapes(graph, schedule))):
        executor = ScheduleExecutor(traced.graph_module, graph, candidate)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            default_loss(run_schedule(executor, list(inputs))).backward()
        peak = peak_memory(step)
        seconds = []
        for _ in range(5):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        print(f"{label:16} fused runs {len(executor._fused_runs):3}  peak {peak} B  "
              f"median step {statistics.median(seconds) * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
