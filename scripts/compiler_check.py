"""The compiler path on zoo models: exact gradients, predicted vs measured peak, step time.

    python scripts/compiler_check.py [--models gpt2 resnet18 unet] [--preset tiny] [--fractions 1.0 0.9 0.8 0.7]
                                     [--inductor]

For each model and budget fraction: ``torch.compile(model, backend=rg.backend(fraction))`` (our
solvers on the joint graph's units, the plan lowered to a forward and a backward graph with recompute
nodes), one seeded step against eager autograd (largest gradient error relative to each parameter's
largest gradient; BatchNorm buffers equal), the planner's predicted peak (``predicted_step_peak_bytes``),
the liveness of the generated graphs (``joint_lowering.graph_peak_bytes``, no kernel workspace), the
peak the allocator measures (``measure.allocator_peak_memory``), and the step time against eager autograd
and against ``torch.compile(backend="aot_eager")`` (AOTAutograd's default partitioner), medians of
interleaved runs. The loss is the mean square of the output.

``--inductor``: the generated graphs compiled by inductor (``rg.backend(fraction, graph_compiler="inductor")``,
``recompute_graph.inductor_lowering``), against ``torch.compile(model)`` (inductor with its own
partitioner) instead of ``aot_eager``, both with ``fallback_random`` (torch's random kernels, eager's
dropout masks); gradients and buffers agree to inductor's rounding rather than exactly.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import models_zoo
import recompute_graph as rg
from recompute_graph.joint_lowering import graph_peak_bytes
from recompute_graph.measure import allocator_peak_memory
from recompute_graph.verification import parameter_gradient_error


def loss_of(out):
    return (out[0] if isinstance(out, tuple) else out).float().square().mean()


def make_step(model, forward, inputs):
    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss_of(forward(*inputs)).backward()
    return step


def interleaved_medians(steps: dict, repeats: int) -> dict:
    times = {label: [] for label in steps}
    for _ in range(repeats):
        for label, step in steps.items():
            start = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) for label, t in times.items()}


def check(name: str, preset: str, fraction: float, repeats: int, inductor: bool = False) -> str:
    model, inputs = models_zoo.get_model(name, preset)
    reference = copy.deepcopy(model)
    make_step(reference, reference, inputs)()
    torch._dynamo.reset()
    start = time.perf_counter()
    compiled = torch.compile(model, backend=rg.backend(fraction, **({"graph_compiler": "inductor"} if inductor else {})))
    step = make_step(model, compiled, inputs)
    try:
        step()
    except Exception as error:  # noqa: BLE001 - an infeasible budget is a row
        reason = next((line for line in str(error).splitlines() if "Error:" in line), str(error).splitlines()[0])
        return f"| {name} | {fraction:.0%} | - | {reason.split(';')[0][:120]} |||||||||"
    compile_seconds = time.perf_counter() - start
    lowered = rg.last_lowering()
    error = parameter_gradient_error(model, reference)
    buffers = all((torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-6) if inductor else torch.equal(a, b))
                  for a, b in zip(model.buffers(), reference.buffers()))
    measured = allocator_peak_memory(step)
    predicted = lowered.plan.predicted_step_peak_bytes
    liveness = graph_peak_bytes(lowered.forward_graph, lowered.planned_backward_graph)
    eager_model = copy.deepcopy(reference)
    default_model = copy.deepcopy(reference)
    default = torch.compile(default_model, backend="inductor" if inductor else "aot_eager")
    steps = {"ours": step, "eager": make_step(eager_model, eager_model, inputs),
             "aot_eager": make_step(default_model, default, inputs)}
    for s in steps.values():
        s()
    eager_peak = allocator_peak_memory(steps["eager"])
    medians = interleaved_medians(steps, repeats)
    return (f"| {name} | {fraction:.0%} | {lowered.plan.solver} | "
            f"{error:.1e}{'' if buffers else ' (buffers differ)'} | "
            f"{len(lowered.recomputed)} | {predicted:,} | {liveness:,} | {measured:,} | {predicted / measured:.3f} | "
            f"{measured / eager_peak:.2f} | x{medians['ours'] / medians['eager']:.2f} | "
            f"x{medians['ours'] / medians['aot_eager']:.2f} | {compile_seconds:.1f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["mlp", "gpt2", "resnet18", "unet"])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--fractions", nargs="*", type=float, default=[1.0, 0.9, 0.8, 0.7])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--inductor", action="store_true", help="inductor compiles the generated graphs")
    args = parser.parse_args()
    if args.inductor:
        torch._inductor.config.fallback_random = True  # the peer too: torch's random kernels
    print("| model | budget | solver | grad error | recompute nodes | predicted (B) | liveness (B) | measured (B) "
          f"| predicted / measured | peak / eager's | time / eager | time / {'inductor' if args.inductor else 'aot_eager'} "
          "| compile |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for fraction in args.fractions:
            print(check(name, args.preset, fraction, args.repeats, args.inductor), flush=True)


if __name__ == "__main__":
    main()
