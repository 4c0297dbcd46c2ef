"""The conformance models on the compiler path: ``torch.compile(model, backend=rg.backend(f))``.

    python scripts/compiler_conformance.py [--models NAME ...] [--fractions 1.0 0.8] [--out FILE]
    python scripts/compiler_conformance.py --optimize [--executor] [--second-set] [--dtype bfloat16]
                                           [--fractions 0.8 0.5] [--out FILE]
    python scripts/compiler_conformance.py --inductor [--models NAME ...] [--fractions 1.0 0.8]

``--optimize``: through ``optimize()``'s default path instead (``compiler="auto"``: the compiler path, the
schedule executor where capture fails), with the conformance checks of ``models_zoo.conformance.check_model``
(budgets at a fraction of the activation memory, a budget under the floor raised to it), each row saying
which path ran. ``--executor`` with it: every model on the schedule executor (``compiler=False``), the
path ``optimize()`` falls back to. ``--dtype bfloat16`` (or ``float16``) with it: each model and its
floating-point inputs cast to that dtype first; the gradients are judged against
``torch.compile(model, backend="aot_eager")``'s in that dtype (compiled and eager PyTorch round
differently there), eager's error beside them.

For every model of ``models_zoo.third_party.CONFORMANCE_MODELS`` and every fraction ``f`` of the
store-all budget: one seeded step (the README loop's loss, ``losses.default_training_loss``) of the
compiled model against eager autograd: the largest gradient error relative to each parameter's largest
gradient, whether every buffer ends equal, the planner's predicted peak of the last compiled graph
(``predicted_step_peak_bytes``) and the peak the allocator measures for the whole step. A model that
``torch.compile`` splits into several graphs (graph breaks) is planned graph by graph, each at ``f`` of
its own store-all budget, so its prediction covers the last graph only (the row says how many graphs).
A graph whose budget is below its floor is planned at the floor (``on_infeasible="floor"``), marked
"(floor)".

``--inductor``: inductor compiles the generated graphs (``rg.backend(f, graph_compiler="inductor")``,
``recompute_graph.inductor_lowering``, with ``fallback_random``). Inductor rounds differently from eager,
so the gradient error is then relative to the model's largest gradient (and the prediction includes what
inductor's code held beyond the generated graphs when the plan was made, ``inductor_excess_bytes``), beside the error of
``torch.compile(model)`` (inductor with its own partitioner) measured the same way; a row passes within
1e-4 or 1.5 times inductor's own error, and with the buffers (BatchNorm's running statistics, each
relative to its largest value) within 1e-5 or 1.5 times inductor's own buffer error (an integer buffer
must be equal). Without inductor, gradients within 1e-5 and buffers within ``verify``'s
``BUFFER_TOLERANCE``.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings

import torch

import recompute_graph as rg
from models_zoo import third_party
from models_zoo.conformance import call_of
from recompute_graph.losses import default_training_loss
from recompute_graph.joint_lowering import InfeasibleBudgetWarning
from recompute_graph.measure import allocator_peak_memory
from recompute_graph.verification import (BUFFER_TOLERANCE, model_buffer_error, model_gradient_error,
                                          parameter_gradient_error)


def row(name: str, fraction: float, inductor: bool = False) -> str:
    model, call = third_party.build(name)
    args, kwargs = call_of(call)
    reference = copy.deepcopy(model)
    initial = copy.deepcopy(model) if inductor else None  # inductor's own step starts where the others did

    def step(module, forward) -> None:
        module.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        default_training_loss(forward(*args, **kwargs)).backward()
    step(reference, reference)
    lowerings: list = []

    def compile_at(budget):
        torch._dynamo.reset()
        lowerings.clear()
        backend = rg.backend(budget, on_infeasible="floor", **({"graph_compiler": "inductor"} if inductor else {}))

        def counting(gm, example_inputs):
            compiled = backend(gm, example_inputs)
            lowerings.append(rg.last_lowering())
            return compiled
        return torch.compile(model, backend=counting)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = compile_at(fraction)
            step(model, compiled)
        at_floor = " (floor)" if any(issubclass(w.category, InfeasibleBudgetWarning) for w in caught) else ""
    except Exception as error:  # noqa: BLE001 - a failing model is a row
        lines = [line for line in str(error).splitlines() if "Error" in line] or str(error).splitlines() or [""]
        return f"| {name} | {fraction:.0%} | fail | {type(error).__name__}: {lines[0][:150]} |||||"
    seconds = time.perf_counter() - start
    lowered = rg.last_lowering()
    # under inductor's rounding: against the model's largest gradient, beside inductor's own (below)
    error = model_gradient_error(model, reference) if inductor else parameter_gradient_error(model, reference)
    missing = sum(1 for p, q in zip(model.parameters(), reference.parameters())
                  if (q.grad is None) != (p.grad is None))
    buffer_error = model_buffer_error(model, reference)
    # a first step under the profiler may compile again (HF ViT, two graphs under a user's torch.compile:
    # a guard fails there), and the backend's own measurement of kernel temporaries then ends the
    # profiler's session: that step recorded no memory event at all (0 B)
    allocator_peak_memory(lambda: step(model, compiled))
    measured = allocator_peak_memory(lambda: step(model, compiled))
    if inductor:  # after the measurement: a reset would make the planned model compile again
        plain = copy.deepcopy(initial)
        torch._dynamo.reset()
        step(plain, torch.compile(plain, backend="inductor"))
        inductor_error = model_gradient_error(plain, reference)
        inductor_buffer_error = model_buffer_error(plain, reference)
        buffers = buffer_error <= max(1e-5, 1.5 * inductor_buffer_error)
    else:
        buffers = buffer_error <= BUFFER_TOLERANCE
    # under inductor: with what its code held beyond the generated graphs at planning time
    predicted = lowered.predicted_step_peak_bytes
    ok = error <= (max(1e-4, 1.5 * inductor_error) if inductor else 1e-5) and buffers and not missing
    graphs = len(lowerings)
    ratio = f"{predicted / measured:.3f}" if graphs == 1 else f"(last of {graphs} graphs)"
    own = f" (inductor's own: {inductor_error:.1e})" if inductor else ""
    if inductor and buffer_error:
        own += f"; buffers {buffer_error:.1e} (inductor's own: {inductor_buffer_error:.1e})"
    return (f"| {name} | {fraction:.0%}{at_floor} | {'pass' if ok else 'FAIL'} | {lowered.plan.solver} | {error:.1e}{own}"
            f"{'' if buffers else ', buffers differ'}{f', {missing} gradients missing' if missing else ''} | "
            f"{predicted:,} | {measured:,} | {ratio} | {seconds:.0f} s |")


def optimize_row(name: str, fraction: float, compiler: "bool | str" = "auto", dtype: torch.dtype | None = None
                 ) -> str:
    """One row of ``optimize()``'s default path (``check_model(..., compiler="auto")``), or of its
    fallback, the schedule executor (``compiler=False``); ``dtype``: the model cast to it."""
    from models_zoo.conformance import check_model
    from recompute_graph.units import format_bytes
    start = time.perf_counter()
    try:
        (r,) = check_model(name, fractions=(fraction,), solvers=("auto",), compiler=compiler, dtype=dtype)
    except Exception as error:  # noqa: BLE001 - a failing model is a row
        return f"| {name} | {fraction:.0%} | | fail | {type(error).__name__}: {str(error).splitlines()[0][:150]} ||||||"
    if r.error or r.skipped:
        return f"| {name} | {fraction:.0%} | | fail | {(r.error or r.skipped)[:150]} ||||||"
    ratio = r.predicted_peak_bytes / max(1, r.measured_peak_bytes)
    floor = " (floor)" if r.at_floor else ""
    buffers = ", buffers differ" if r.buffer_mismatches else ""
    error = (f"{r.gradient_error:.1e}" if r.compiled_reference_error is None
             else f"{r.compiled_reference_error:.1e} (eager: {r.gradient_error:.1e})")
    return (f"| {name} | {fraction:.0%}{floor} | {r.path} | {'pass' if r.passed else 'FAIL'} | {r.chosen} | "
            f"{error}{buffers} | {format_bytes(r.budget_bytes)} | {r.predicted_peak_bytes:,} | "
            f"{r.measured_peak_bytes:,} | {ratio:.3f} | {time.perf_counter() - start:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None,
                        help="default: the first 45 conformance models (with --second-set: the models added after)")
    parser.add_argument("--second-set", action="store_true",
                        help="the models added after the first 45 (third_party.SECOND_SET)")
    parser.add_argument("--fractions", nargs="*", type=float, default=[1.0, 0.8])
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument("--optimize", action="store_true", help="through optimize()'s default path")
    parser.add_argument("--inductor", action="store_true", help="inductor compiles the generated graphs")
    parser.add_argument("--executor", action="store_true",
                        help="with --optimize: every model on the schedule executor, the fallback path")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default=None,
                        help="with --optimize: each model and its floating-point inputs cast to this dtype")
    args = parser.parse_args()
    if args.dtype and not args.optimize:
        parser.error("--dtype goes with --optimize")
    if args.models is None:
        first = [name for name in third_party.CONFORMANCE_MODELS if name not in third_party.SECOND_SET]
        args.models = list(third_party.SECOND_SET) if args.second_set else first
    if args.inductor:
        torch._inductor.config.fallback_random = True  # torch's random kernels: eager's dropout masks
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    lines = ["| model | budget | status | solver | grad error | predicted (B) | measured (B) | predicted / measured "
             "| compile+step |",
             "|---|---|---|---|---|---|---|---|---|"]
    if args.optimize:
        lines = ["| model | budget | path | status | solver | grad error | budget | predicted (B) | measured (B) "
                 "| predicted / measured | plan+step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name in args.models:
        if not third_party.available(name):
            continue
        for fraction in args.fractions:
            line = (optimize_row(name, fraction, False if args.executor else "auto",
                                 getattr(torch, args.dtype) if args.dtype else None) if args.optimize
                    else row(name, fraction, args.inductor))
            lines.append(line)
            print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
