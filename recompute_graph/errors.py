"""Typed errors of recompute_graph.

Every error the library raises on purpose derives from :class:`RecomputeError`, and the ones caused by a
bad argument also derive from the matching builtin, so ``except ValueError`` keeps working for callers
who do not know this library.
"""
from __future__ import annotations

import os
import sys

_LIBRARY_DIR = os.path.dirname(os.path.abspath(__file__))


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the function calling this one name the user's
    line: the first frame outside this library, torch and ``contextlib`` (a warning raised in a step
    passes through ``nn.Module``'s call and Dynamo's wrappers, at depths that vary)."""
    torch_module = sys.modules.get("torch")
    skipped = [_LIBRARY_DIR, *([os.path.dirname(os.path.abspath(torch_module.__file__))]
                               if torch_module is not None and torch_module.__file__ else [])]
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not any(path.startswith(d + os.sep) for d in skipped) and not path.endswith("contextlib.py"):
            return level
        frame, level = frame.f_back, level + 1
    return level


class RecomputeError(Exception):
    """Base class of every error raised on purpose by recompute_graph."""


class TraceError(RecomputeError):
    """The model could not be turned into a graph.

    ``module_path`` is the dotted name of the module whose code broke tracing ("" for the root) and
    ``source_location`` is ``"file:line"`` of the offending statement when it could be found.
    """

    def __init__(self, message: str, *, module_path: str = "", source_location: str = "") -> None:
        super().__init__(message)
        self.module_path = module_path
        self.source_location = source_location


class ProfileError(RecomputeError):
    """A traced node could not be run to measure its costs (e.g. data-dependent code on meta tensors)."""


class GraphError(RecomputeError, ValueError):
    """A cost graph is malformed (cycle, dangling edge, negative cost) or a graph file cannot be read."""


class SolverError(RecomputeError):
    """A solver cannot handle this graph (too large, missing dependency); the message says what to do."""


class InfeasibleBudgetError(RecomputeError, ValueError):
    """No plan fits the budget. ``min_budget_bytes`` is the smallest budget that is feasible."""

    def __init__(self, message: str, *, budget_bytes: int, min_budget_bytes: int | None) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes


class GraphBreakWarning(UserWarning):
    """``torch.compile(model, backend=rg.backend(...))`` split the model at a graph break. Each graph is
    planned within the budget alone, and a step holds what the earlier graphs saved while the later
    ones run, so its peak can exceed the budget; the message names the break and what to do."""


class DynamicShapesError(RecomputeError, ValueError):
    """``rg.backend`` was handed a graph with symbolic shapes. A plan's bytes hold for one shape, so
    each shape is planned on its own: ``torch.compile(model, backend=rg.backend(...), dynamic=False)``
    (a new shape compiles and plans again), or ``rg.optimize``, which compiles so. ``torch.compile``
    turns dynamic shapes on by itself when an input's shape changes between calls."""


class PlanFileError(RecomputeError, ValueError):
    """A saved plan cannot be read (missing file, not JSON, not a plan, malformed)."""


class PlanMismatchWarning(UserWarning):
    """A saved plan offered to ``optimize(..., plan=...)`` does not fit the model or the budget; the
    message says why, and a new plan is made instead."""


class BudgetExceededWarning(UserWarning):
    """A training step measured more than its plan's budget (checked on CUDA, where the caching
    allocator's statistics are free to read, on the first step of each plan). Usually the loss trained
    with is not the one planned for: pass it to ``optimize(..., loss_fn=...)``; ``rg.verify`` says more."""


class ProfilerActiveWarning(UserWarning):
    """A graph was priced on the CPU while a ``torch.profiler`` session was recording (a user's profile
    around the step that compiles): reading the allocator would end that session, so the kernels'
    temporaries are left out and the loss is priced by the liveness of the storages it makes. Compile
    (run the first step) outside the profiler for prices by the allocator."""


class CompilerFallbackWarning(UserWarning):
    """``optimize(..., compiler="auto")`` could not take the compiler path for this model (the message
    says why: a graph ``torch.compile`` cannot capture, an op the lowering does not handle) and plans it
    with the schedule executor instead."""


class EvalModeGradientWarning(UserWarning):
    """An optimized module called in ``eval()`` mode with grad enabled runs the model's plain forward:
    its plans are for training mode, so a backward from that call is not kept within the budget. Once
    per module."""


class UnplannedCallWarning(UserWarning):
    """A method of the model read through the optimized module (``optimized.compute_loss(batch)``) called
    the model itself in a training step: that call runs the plain forward, outside the plan and its
    budget. Once per module."""


class ManyCallSignaturesWarning(UserWarning):
    """An optimized module has planned many call signatures: each new input shape (or dtype, or
    autocast setting) is captured, priced and planned on its first training call, so inputs whose
    shape changes from batch to batch (padded to each batch's longest sequence) pay for a plan per
    shape. The message says how long planning took and how to pad. Once per module."""


class LossNotPricedWarning(UserWarning):
    """The ``loss_fn`` a graph was planned with could not run on the outputs it was priced on (the
    message says why): bytes are set aside for it by a guess, the outputs' size, instead of its
    measured transient. Under ``rg.backend`` the loss takes the graph's flat outputs (one tensor, or a
    tuple in the order the model returns them)."""


class ScheduleError(RecomputeError, ValueError):
    """A schedule cannot run: a value used before it exists, a backward before its inputs, ..."""


class RewriteError(RecomputeError):
    """The traced model cannot be executed under a schedule (the message says which node and why)."""


class ChangingStateError(RecomputeError, ValueError):
    """The model's forward changes a plain Python value it holds as an attribute at every call (a step
    counter, ``self.step += 1``; a temperature annealed inside forward), which no captured graph can
    reproduce: the executor's traced graph keeps the value of its trace, and Dynamo compiles the model
    again for each new value. The message names the attribute and how to keep it in a buffer instead."""


class RecompilationWarning(UserWarning):
    """A training call was captured and planned again because a Python value changed between steps:
    on the compiler path a guard of Dynamo's failed (a number the model reads; past Dynamo's
    ``recompile_limit`` the schedule executor takes over), or, on either path, a value passed to forward
    differs from the calls planned before (it is part of the call signature). The message names it.
    Each new value costs a capture and a planning. Once per call signature, or per module."""
