"""``optimize(model, budget)``: the one call most users need."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from torch import nn

from .costs import profile_graph
from .optimized_module import RecomputedModule
from .planner import Budget, RecomputePlan, make_plan, parse_budget
from .rewrite import ScheduleExecutor
from .solvers import get_solver
from .trace import trace

__all__ = ["optimize"]

PROFILE_OPTIONS = ("timing", "repeats", "warmup", "device_profile")


def optimize(model: nn.Module, budget: Budget, *, example_inputs: Sequence[Any] | None = None,
             solver: str = "auto", **options: Any) -> RecomputedModule:
    """Return a module that trains like ``model`` with its step's peak memory within ``budget``.

    ``budget``: bytes (int), a size string (``"1.5GiB"``, ``"800MB"``) or a float in (0, 1] = that fraction
    of the store-all peak. ``example_inputs``: positional inputs to plan with now; ``None`` plans on the
    first training call (and again whenever input shapes or dtypes change). ``solver``: a registered
    solver name or ``"auto"`` (the best feasible plan among ``AUTO_SOLVERS``). ``options`` tune profiling:
    ``timing`` (``"measure"`` or ``"flops"``), ``repeats``, ``warmup``, ``device_profile``.

    Raises ValueError for a bad budget or solver name, TypeError for an unknown option, TraceError when the
    model cannot be traced and InfeasibleBudgetError (with ``min_budget_bytes``) when nothing fits. The
    user's model is never modified: the returned module shares its parameters and buffers.
    """
    parse_budget(budget)
    if solver != "auto":
        get_solver(solver)
    unknown = sorted(set(options) - set(PROFILE_OPTIONS))
    if unknown:
        raise TypeError(f"optimize() got unknown options {unknown}; accepted: {', '.join(PROFILE_OPTIONS)}")
    traced = trace(model)
    graph_module = traced.graph_module

    def plan_for(inputs: list[Any]) -> tuple[ScheduleExecutor, RecomputePlan]:
        with _training_mode(graph_module):
            graph = profile_graph(traced, inputs, name=type(model).__name__, **options)
        plan = make_plan(graph, budget, solver)
        return ScheduleExecutor(graph_module, graph, plan.schedule), plan

    optimized = RecomputedModule(model, graph_module, plan_for)
    if example_inputs is not None:
        optimized.plan(*example_inputs)
    return optimized


@contextlib.contextmanager
def _training_mode(module: nn.Module) -> Iterator[None]:
    """Profile in training mode (what the plan is for), then put every submodule's mode back."""
    modes = [(m, m.training) for m in module.modules()]
    module.train()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training

