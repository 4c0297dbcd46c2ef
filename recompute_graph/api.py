"""``optimize(model, budget)``: the one call most users need."""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Iterator, Sequence, Union

import torch
from torch import nn

from .costs import profile_graph
from .optimized_module import RecomputedModule
from .errors import PlanMismatchWarning
from .graph import CostGraph
from .planner import (Budget, RecomputePlan, loss_allowance_bytes, make_plan, min_budget_for_peak, parse_budget,
                      replan_schedule)
from .rewrite import ScheduleExecutor
from .saved_plans import load_plan, mismatch_reason
from .solvers import get_solver
from .trace import trace

__all__ = ["optimize", "plan_for"]

PROFILE_OPTIONS = ("timing", "repeats", "warmup", "device_profile", "progress")


def optimize(model: nn.Module, budget: Budget, *, example_inputs: Sequence[Any] | None = None,
             solver: str = "auto", plan: Union[str, "os.PathLike[str]", RecomputePlan, None] = None,
             autocast: "torch.dtype | None" = None, **options: Any) -> RecomputedModule:
    """Return a module that trains like ``model`` with its step's peak memory within ``budget``.

    ``budget``: bytes (int), a size string (``"1.5GiB"``, ``"800MB"``) or a float in (0, 1] = that fraction
    of the store-all peak. ``example_inputs``: positional inputs to plan with now; ``None`` plans on the
    first training call (and again whenever input shapes or dtypes change). ``solver``: a registered
    solver name or ``"auto"`` (the best feasible plan among ``AUTO_SOLVERS``). ``options`` tune profiling:
    ``timing`` (``"measure"`` or ``"flops"``), ``repeats``, ``warmup``, ``device_profile``, ``progress``
    (a progress bar while profiling). ``plan``: a saved plan (a path written by ``RecomputePlan.save``,
    or a plan) to reuse instead of solving, when the traced graph has the same structure fingerprint and
    the plan's predicted peak fits ``budget``; otherwise a ``PlanMismatchWarning`` says why and a new
    plan is made. ``autocast``: the dtype of the ``torch.autocast`` block the model will train in
    (``torch.bfloat16`` on CPU), so that the plan made now from ``example_inputs`` is priced with the
    dtypes autocast produces; a plan made on the first call is priced under whatever autocast is active
    then. Plans are cached per input signature and autocast setting.

    Raises ValueError for a bad budget or solver name, TypeError for an unknown option, TraceError when the
    model cannot be traced and InfeasibleBudgetError (with ``min_budget_bytes``) when nothing fits. The
    user's model is never modified: the returned module shares its parameters and buffers.
    """
    parse_budget(budget)
    saved = load_plan(os.fspath(plan)) if isinstance(plan, (str, os.PathLike)) else plan
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
        chosen = _reuse(saved, graph, budget) if saved is not None else None
        if chosen is None:
            chosen = make_plan(graph, budget, solver)
        return ScheduleExecutor(graph_module, graph, chosen.schedule), chosen

    optimized = RecomputedModule(model, graph_module, plan_for)
    if example_inputs is not None:
        with _autocast_for(autocast, example_inputs):
            optimized.plan(*example_inputs)
    return optimized


def _autocast_for(dtype: "torch.dtype | None", inputs: Sequence[Any]) -> Any:
    """``torch.autocast`` on the inputs' device type with ``dtype``, or nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    devices = {t.device.type for t in inputs if isinstance(t, torch.Tensor)}
    return torch.autocast(device_type="cuda" if "cuda" in devices else "cpu", dtype=dtype)


def plan_for(build: "Callable[[], tuple[nn.Module, Sequence[Any]]]", budget: Budget, *, solver: str = "auto",
             device_profile: str = "cpu", progress: bool = False) -> RecomputePlan:
    """Plan a model without the device and without its weights: ``build()`` runs under
    ``torch.device("meta")`` and returns ``(model, example_inputs)`` (inputs are moved to ``meta``); the
    model is priced on meta tensors with FLOP-based times for ``device_profile`` (``costs.DEVICE_PROFILES``:
    "cpu", "h100", "h200", ...) and planned at ``budget``. Save the plan (``plan.save(path)``) and apply it
    to the real model later with ``optimize(model, budget, example_inputs=..., plan=path)``: the graph of
    the real model has the same structure fingerprint, so the plan is reused as is.
    """
    with torch.device("meta"):
        model, inputs = build()
    inputs = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs)
    with _training_mode(model):
        traced = trace(model)
        graph = profile_graph(traced, inputs, name=type(model).__name__, timing="flops",
                              device_profile=device_profile, progress=progress)
    return make_plan(graph, budget, solver)


def _reuse(saved: RecomputePlan, graph: CostGraph, budget: Budget) -> RecomputePlan | None:
    """``saved`` re-priced on ``graph`` when it is the same structure and fits ``budget``; else None after
    a PlanMismatchWarning that says why."""
    reason = mismatch_reason(saved.graph, graph)
    if reason is None:
        reused = replan_schedule(saved, graph, budget)
        needed = min_budget_for_peak(reused.predicted_peak_bytes, loss_allowance_bytes(graph))
        if needed <= reused.budget_bytes:
            return reused
        reason = (f"its predicted peak {reused.predicted_peak_bytes} bytes needs a budget of {needed} bytes, "
                  f"over the {reused.budget_bytes} asked for")
    warnings.warn(f"saved plan not reused: {reason}; making a new plan", PlanMismatchWarning, stacklevel=4)
    return None


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

