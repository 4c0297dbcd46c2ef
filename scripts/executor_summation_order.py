"""On the schedule executor, a recomputing plan's gradients against a store-all plan's, same path, same dtype.

    python scripts/executor_summation_order.py [--model hf_gpt2] [--dtypes float32 bfloat16] [--budgets 0.8 0.5]

A conformance model (``models_zoo.third_party``) cast to each dtype is planned on the executor
(``optimize(..., compiler=False, timing="flops")``: deterministic plans) at store-all and at each budget (a
fraction of the store-all budget, raised to the floor the error names when infeasible), and one seeded
step of each is compared: the largest gradient difference relative to each parameter's largest. The
recomputed values are bitwise the forward's; what differs is the order in which the backward sums some
gradients, which float32 rounds at about 1e-7 and bfloat16 at about 1e-2.
"""
from __future__ import annotations

import argparse
import copy
import warnings

import torch

import recompute_graph as rg
from models_zoo import third_party
from models_zoo.conformance import call_of
from recompute_graph.model_state import training_step
from recompute_graph.verification import parameter_gradient_error


def planned_step_gradients(model: torch.nn.Module, args: tuple, kwargs: dict, budget: float, solver: str
                           ) -> tuple[torch.nn.Module, rg.RecomputePlan]:
    """A copy of ``model`` after one seeded step planned at ``budget`` (or the floor it is raised to)."""
    twin = copy.deepcopy(model)
    options = dict(example_inputs=args or None, example_kwargs=kwargs or None, compiler=False, timing="flops",
                   solver=solver)
    try:
        optimized = rg.optimize(twin, budget, **options)
    except rg.InfeasibleBudgetError as error:
        optimized = rg.optimize(twin, error.min_budget_bytes, **options)
    training_step(optimized, args, kwargs, seed=0)()
    return twin, optimized.recompute_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="hf_gpt2")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.8, 0.5])
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print("| model | dtype | budget | solver | recomputed nodes | gradient difference from store-all |")
    print("|---|---|---|---|---|---|")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        torch.manual_seed(0)
        model, call = third_party.build(args.model)
        inputs, kwargs = call_of(call)
        cast = (lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
        model, inputs, kwargs = model.to(dtype).train(), tuple(cast(t) for t in inputs), \
            {k: cast(v) for k, v in kwargs.items()}
        reference, _ = planned_step_gradients(model, inputs, kwargs, 1.0, "store_all")
        for budget in args.budgets:
            twin, plan = planned_step_gradients(model, inputs, kwargs, budget, "auto")
            print(f"| {args.model} | {name} | {budget:g} ({plan.budget_bytes:,} B) | {plan.solver} | "
                  f"{len(plan.recomputed_nodes)} | {parameter_gradient_error(twin, reference):.1e} |", flush=True)


if __name__ == "__main__":
    main()
