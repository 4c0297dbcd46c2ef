"""recompute_graph: train networks that do not fit in accelerator memory.

Data flows one way: trace (``trace``) -> cost graph (``costs``, ``graph``) -> solver -> schedule ->
simulate / rewrite -> measure (``measure``). Importing the package is light: the torch-dependent parts
(tracing, profiling, measuring) load on first use, so pure-Python users (solvers, benchmark loaders) never
import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

from .errors import (BudgetExceededWarning, ChangingStateError, CompilerFallbackWarning, DynamicShapesError,
                     EvalModeGradientWarning, GraphBreakWarning, GraphError, InfeasibleBudgetError,
                     LossNotPricedWarning, ManyCallSignaturesWarning, PlanFileError, PlanMismatchWarning,
                     ProfileError, ProfilerActiveWarning, RecompilationWarning, RecomputeError, RewriteError,
                     ScheduleError, SolverError, TraceError, UnplannedCallWarning)
from .graph import CostGraph, CostNode
from .units import format_bytes, parse_bytes

__version__ = "0.1.0"

_LAZY = {
    "optimize": ("api", "optimize"),
    "plan_for": ("api", "plan_for"),
    "verify": ("verification", "verify"),
    "VerifyReport": ("verification", "VerifyReport"),
    "RecomputedModule": ("optimized_module", "RecomputedModule"),
    "CompiledRecomputedModule": ("compiled_module", "CompiledRecomputedModule"),
    "RecomputePlan": ("planner", "RecomputePlan"),
    "make_plan": ("planner", "make_plan"),
    "simulate": ("simulate", "simulate"),
    "trace": ("trace", "trace"),
    "TraceResult": ("trace", "TraceResult"),
    "profile_model": ("costs", "profile_model"),
    "profile_graph": ("costs", "profile_graph"),
    "DeviceProfile": ("device_profiles", "DeviceProfile"),
    "peak_memory": ("measure", "peak_memory"),
    "time_step": ("measure", "time_step"),
    "load_graph": ("benchmark_graphs", "load_graph"),
    "backend": ("compile_backend", "budget_backend"),
    "last_lowering": ("joint_lowering", "last_lowering"),
    "unroll_rnns": ("unrolled_rnn", "unroll_rnns"),
}

__all__ = ["CostGraph", "CostNode", "RecomputeError", "TraceError", "ProfileError", "GraphError",
           "SolverError", "InfeasibleBudgetError", "ScheduleError", "RewriteError", "PlanFileError",
           "PlanMismatchWarning", "BudgetExceededWarning", "CompilerFallbackWarning", "DynamicShapesError",
           "GraphBreakWarning", "ProfilerActiveWarning", "EvalModeGradientWarning", "LossNotPricedWarning",
           "ManyCallSignaturesWarning", "UnplannedCallWarning", "ChangingStateError", "RecompilationWarning",
           "parse_bytes", "format_bytes",
           *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attribute)
    raise AttributeError(f"module 'recompute_graph' has no attribute {name!r}")
