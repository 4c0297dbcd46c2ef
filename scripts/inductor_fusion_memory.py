"""What inductor's code for a store-all plan holds, as its fusion is limited.

    python scripts/inductor_fusion_memory.py [--model rnn] [--sizes 64 16 4 1]

The model's store-all plan on the compiler path (``optimize(model, 1.0, solver="store_all",
graph_compiler="inductor")``, the zoo's small preset) is lowered to its two generated graphs; each is
then compiled by inductor (``inductor_lowering.compiled_graphs_peak_bytes``) with
``torch._inductor.config.max_fusion_size`` at each size, and run once on real tensors. Prints the
generated graphs' peak (what the plan predicts) and inductor's at each size, in bytes and as a ratio;
then ``optimize``'s own choice (``fit_plan_to_inductor``: the fusion limit where no plan fits with
inductor's default), its predicted step and one step's peak by the profiler's allocator events.
The unrolled LSTM's store-all plan held 5.6x its graphs' peak under inductor's default (64): inductor
fuses ops of many time steps into one kernel, whose outputs all exist at once (docs/compiler.md,
session 32).
"""
from __future__ import annotations

import argparse

import models_zoo
from recompute_graph import inductor_lowering, optimize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="rnn")
    parser.add_argument("--sizes", nargs="+", type=int, default=[64, 16, 4, 1])
    args = parser.parse_args()
    from torch._inductor import config as inductor_config
    model, inputs = models_zoo.get_model_on(args.model, "cpu")
    lowered = []
    fit = inductor_lowering.fit_plan_to_inductor
    inductor_lowering.fit_plan_to_inductor = lambda plan, budget, replan: (lowered.append(plan), plan)[1]
    try:
        optimize(model, 1.0, example_inputs=inputs, solver="store_all", graph_compiler="inductor")
    finally:
        inductor_lowering.fit_plan_to_inductor = fit
    forward, backward = lowered[-1].forward_graph, lowered[-1].backward_graph
    generated = inductor_lowering.compiled_graphs_peak_bytes(forward, backward, inductor_lowering.boxed_interpreter)
    print(f"| {args.model} | max_fusion_size | peak (B) | / generated graphs |\n|---|---|---|---|")
    print(f"| | generated graphs | {generated:,} | 1.000 |")
    for size in args.sizes:
        with inductor_config.patch(max_fusion_size=size):
            peak = inductor_lowering.compiled_graphs_peak_bytes(forward, backward)
        print(f"| | {size} | {peak:,} | {peak / generated:.3f} |", flush=True)
    import warnings

    from recompute_graph.joint_lowering import last_lowering
    from recompute_graph.measure import make_training_step, profiler_peak_memory
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimized = optimize(model, 1.0, example_inputs=inputs, solver="store_all", graph_compiler="inductor")
        step = make_training_step(optimized, inputs)
        step()
    chosen = last_lowering()
    optimized.zero_grad(set_to_none=True)
    measured = profiler_peak_memory(step)
    settings = chosen.forward_graph.meta.get(inductor_lowering.CONFIG_KEY, "inductor's default fusion")
    print(f"\noptimize(..., graph_compiler='inductor') compiled with {settings}: predicted step "
          f"{chosen.predicted_step_peak_bytes:,} B, measured {measured:,} B, budget {chosen.plan.budget_bytes:,} B")
    for warning in caught:
        if issubclass(warning.category, inductor_lowering.InductorBudgetWarning):
            print(f"warning: {warning.message}")


if __name__ == "__main__":
    main()
