"""``optimize(model, budget)``: the one call most users need."""
from __future__ import annotations

import contextlib
import functools
import os
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .collector import full_collections_deferred
from .costs import profile_graph
from .call_graphs import CallGraph, CallGraphs, profile_call, training_mode
from .errors import ChangingStateError, InfeasibleBudgetError, ProfileError, RewriteError, TraceError
from .kept_tensors import carried_by_a_run, kept_tensors_refused
from .model_state import changed_at_each_call, changing_state_message
from .module_hooks import kept_hook_tensors_refused
from .optimized_module import PreparedStep, RecomputedModule, SharedModelModule, infeasible_for_new_call

if TYPE_CHECKING:
    from .compiled_module import CompiledRecomputedModule
from .graph import CostGraph
from .planner import Budget, RecomputePlan, make_plan, make_plan_for_call, parse_budget
from .rewrite import ScheduleExecutor
from .saved_plans import load_plan, reuse_plan
from .solvers import get_solver
from .unrolled_rnn import STEP_BY_STEP, rnns_unrolled, unroll_rnns as unroll_rnns_of

__all__ = ["optimize", "plan_for"]

PROFILE_OPTIONS = ("timing", "repeats", "warmup", "device_profile", "progress")


def optimize(model: nn.Module, budget: Budget, *, example_inputs: Sequence[Any] | None = None,
             example_kwargs: dict[str, Any] | None = None, solver: str = "auto",
             plan: Union[str, "os.PathLike[str]", RecomputePlan, None] = None,
             autocast: "torch.dtype | None" = None, tracer: str = "auto",
             loss_fn: "Callable[[Any], torch.Tensor] | None" = None, cost_graph: CostGraph | None = None,
             compiler: "bool | str" = "auto", graph_compiler: str | None = None, unroll_rnns: bool = False,
             **options: Any) -> "RecomputedModule | CompiledRecomputedModule":
    """Return a module that trains like ``model`` with its step's peak memory within ``budget``.

    ``budget``: bytes (int), a size string (``"1.5GiB"``, ``"800MB"``) or a float in (0, 1] = that fraction
    of the store-all peak. ``example_inputs`` / ``example_kwargs``: a call to plan with now (positional and
    keyword arguments, as training will call the model); without them the plan is made on the first
    training call (and again whenever the call's structure, shapes or dtypes change). ``solver``: a
    registered solver name or ``"auto"`` (the best feasible plan among ``AUTO_SOLVERS``). ``options`` tune
    profiling: ``timing`` (``"measure"`` or ``"flops"``), ``repeats``, ``warmup``, ``device_profile``,
    ``progress`` (a progress bar while profiling). ``plan``: a saved plan (a path written by
    ``RecomputePlan.save``, or a plan) to reuse instead of solving, when the traced graph has the same
    structure fingerprint and the plan's predicted peak fits ``budget``; otherwise a
    ``PlanMismatchWarning`` says why and a new plan is made. ``autocast``: the dtype of the
    ``torch.autocast`` block the model will train in (``torch.bfloat16`` on CPU), so that the plan made
    now from the example call is priced with the dtypes autocast produces; a plan made on the first call
    is priced under whatever autocast is active then. Plans are cached per call signature and autocast
    setting.

    ``loss_fn``: the loss training computes on the model's output, ``loss_fn(output) -> scalar``; its
    forward and backward are priced by the allocator on the example call and kept free beside the
    plan (``losses.py``). Default: ``losses.default_training_loss``, the README loop's loss (the model's
    own ``loss`` when it returns one, else the mean square of its floating-point outputs).

    ``cost_graph``: a graph already priced for this model and call (a previous plan's ``.graph``), to
    plan from instead of profiling again (sweeps over budgets or solvers); it must come from the same
    model, call structure and tracer, else a ``RewriteError`` names the nodes that do not match.

    ``tracer``: ``"fx"`` traces the model once with ``torch.fx`` (module-level nodes, one graph for every
    input shape); ``"export"`` uses ``torch.export`` (aten-level nodes, one graph per call structure; see
    ``export_trace.py``), which handles Hugging Face ``transformers`` models and other code symbolic
    tracing cannot; ``"auto"`` (default) uses fx, and export when fx cannot trace the root module or had
    to keep a submodule opaque (falling back to the fx graph if export fails too, or its graph cannot
    be priced: an aten op with no autograd formula for its dtype).

    ``compiler``: ``"auto"`` (default) takes the compiler path (``compiled_module.py``): ``torch.compile``
    with our budgeted partitioner, which plans the functional joint forward+backward graph and generates
    a forward and a backward graph with the recompute nodes, returning a ``CompiledRecomputedModule``
    (``.recompute_plan``, ``.backward_code``); when that fails (the model cannot be captured as one
    graph, or planning the example call fails), a ``CompilerFallbackWarning`` says why and the schedule
    executor runs the plan instead (``rewrite.py``, a ``RecomputedModule``). ``True``: the compiler path
    only (``CaptureError`` when the model cannot be captured whole). ``False``: the schedule executor
    over the traced graph. A saved ``plan`` runs on the path that made it: with ``"auto"``, a plan of the
    executor's graph (``plan_for(...)``) chooses the executor, and one of the joint graph
    (``plan_for(..., compiler=True)``) the compiler; a path given explicitly does not reuse the other
    path's plan (a ``PlanMismatchWarning`` says so). ``cost_graph``, ``tracer`` and the profiling
    ``options`` belong to the executor's graph: with ``compiler=True`` they raise ValueError, with
    ``"auto"`` they choose the executor.

    ``graph_compiler``: on the compiler path, ``"inductor"`` compiles the generated forward and backward
    graphs with inductor (``inductor_lowering``: its code is measured on the example call and the graph
    planned again with less budget where that code holds more than the plan); default None, AOTAutograd's
    boxed interpreter of the generated graphs. The schedule executor has none (ValueError with
    ``compiler=False``).

    ``unroll_rnns``: run each ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` of the model step by step
    (``unrolled_rnn.py``), so that a plan can keep or recompute single time steps; a fused one is one node
    that keeps every step's gates. Its class becomes ``StepByStepLSTM`` ... (the same parameters and state
    dict, outputs equal to float rounding), the one change made to the model itself, undone if planning
    fails.

    Raises ValueError for a bad budget, solver or tracer name, TypeError for an unknown option, TraceError
    when the model cannot be traced and InfeasibleBudgetError (with ``min_budget_bytes``) when nothing
    fits. The user's model is not modified (but for ``unroll_rnns``): the returned module shares its
    parameters and buffers.
    """
    if unroll_rnns:
        with rnns_unrolled(model):
            return optimize(model, budget, example_inputs=example_inputs, example_kwargs=example_kwargs,
                            solver=solver, plan=plan, autocast=autocast, tracer=tracer, loss_fn=loss_fn,
                            cost_graph=cost_graph, compiler=compiler, graph_compiler=graph_compiler, **options)
    try:
        return _optimize(model, budget, example_inputs, example_kwargs, solver, plan, autocast, tracer, loss_fn,
                         cost_graph, compiler, graph_compiler, options)
    except InfeasibleBudgetError as error:
        fused = [type(m).__name__ for m in model.modules() if type(m) in STEP_BY_STEP]
        if not fused:
            raise
        raise InfeasibleBudgetError(
            f"{error} {type(model).__name__} holds an nn.{fused[0]}, one node that keeps every time step's gates, "
            "which no plan can recompute in part: optimize(..., unroll_rnns=True) runs it step by step, so "
            "that a plan keeps or recomputes single steps.", budget_bytes=error.budget_bytes,
            min_budget_bytes=error.min_budget_bytes) from None


def _optimize(model: nn.Module, budget: Budget, example_inputs: Sequence[Any] | None,
              example_kwargs: dict[str, Any] | None, solver: str,
              plan: Union[str, "os.PathLike[str]", RecomputePlan, None], autocast: "torch.dtype | None",
              tracer: str, loss_fn: "Callable[[Any], torch.Tensor] | None", cost_graph: CostGraph | None,
              compiler: "bool | str", graph_compiler: str | None,
              options: dict[str, Any]) -> "RecomputedModule | CompiledRecomputedModule":
    parse_budget(budget)
    model = _original_model(model)
    _refuse_uninitialized_lazy_modules(model)
    saved = load_plan(os.fspath(plan)) if isinstance(plan, (str, os.PathLike)) else plan
    if solver != "auto":
        get_solver(solver)
    unknown = sorted(set(options) - set(PROFILE_OPTIONS))
    if unknown:
        raise TypeError(f"optimize() got unknown options {unknown}; accepted: {', '.join(PROFILE_OPTIONS)}")
    if compiler not in (False, True, "auto"):
        raise ValueError(f"compiler={compiler!r}: use False (the schedule executor), True (torch.compile with "
                         "our partitioner) or 'auto' (the compiler, falling back to the executor)")
    if graph_compiler not in (None, "inductor"):
        raise ValueError(f"graph_compiler={graph_compiler!r}: use 'inductor' (inductor compiles the generated "
                         "graphs) or None (AOTAutograd's interpreter runs them)")
    if graph_compiler is not None and compiler is False:
        raise ValueError("graph_compiler belongs to the compiler path: drop it or use compiler=True or 'auto'")
    if compiler == "auto" and saved is not None and not _of_the_joint_graph(saved):
        compiler = False  # a saved plan of the executor's graph runs on the executor
    executor_only = {"cost_graph": cost_graph} if cost_graph is not None else {}
    executor_only.update(options)
    if tracer != "auto":
        executor_only["tracer"] = tracer
    if compiler is True and executor_only:
        raise ValueError(f"optimize(..., compiler=True) does not take {', '.join(sorted(executor_only))}: "
                         "they belong to the schedule executor's graph; drop them or use compiler=False")
    again = dict(budget=budget, solver=solver, plan=plan, autocast=autocast, tracer=tracer, loss_fn=loss_fn,
                 cost_graph=cost_graph, compiler=compiler, graph_compiler=graph_compiler, **options)
    if compiler and not executor_only:
        return _optimized_with(again, _optimize_compiled(
            model, budget, example_inputs, example_kwargs, solver, autocast, loss_fn, fallback=compiler == "auto",
            saved_plan=saved, graph_compiler=graph_compiler))
    graphs = CallGraphs(model, tracer)
    planned_bytes: list[int] = []  # the budget of each call signature planned so far

    def retrace() -> None:  # a plain attribute or a submodule changed: the graph holds the old ones
        nonlocal graphs
        graphs = CallGraphs(model, tracer)

    def prepare(args: tuple, kwargs: dict) -> PreparedStep:
        named = list(model.named_modules())  # (anew: a submodule may have been replaced since)
        with full_collections_deferred(), kept_hook_tensors_refused(named, type(model).__name__), \
                kept_tensors_refused(model, carried_by_a_run, RewriteError, _KEPT_IN_A_RUN):
            return _prepare(args, kwargs)

    def _priced(call: CallGraph, args: tuple, kwargs: dict) -> CostGraph:
        with contextlib.nullcontext() if call.exported else training_mode(call.trace.graph_module):
            return profile_graph(call.trace, call.inputs_of(args, kwargs), name=type(model).__name__,
                                 loss_fn=loss_fn, output_of=call.output_of, **options)

    def _prepare(args: tuple, kwargs: dict) -> PreparedStep:
        call = graphs.graph_for(args, kwargs)
        changed = changed_at_each_call(model, lambda: model(*args, **kwargs))
        if changed:
            raise ChangingStateError(changing_state_message(type(model).__name__, changed, _TRACED_VALUE))
        graph = cost_graph
        if graph is None:
            try:
                graph = _priced(call, args, kwargs)
            except ProfileError:
                fallback = graphs.fx_fallback(call)
                if fallback is None:
                    raise
                call = fallback
                graph = _priced(call, args, kwargs)
        chosen = reuse_plan(saved, graph, budget, stacklevel=4) if saved is not None else None
        if chosen is None:
            try:
                chosen = make_plan_for_call(graph, budget, solver, earlier_bytes=max(planned_bytes, default=0))
            except InfeasibleBudgetError as error:
                if not any(node.requires_grad for node in graph.nodes):
                    error = InfeasibleBudgetError(
                        f"{error} Nothing in this call requires grad (all parameters frozen, no input with "
                        "requires_grad), so it has no backward to save memory in. If training takes gradients "
                        "with respect to an input, pass the example input as training does "
                        "(x.requires_grad_()).", budget_bytes=error.budget_bytes,
                        min_budget_bytes=error.min_budget_bytes)
                raise (infeasible_for_new_call(error, args, kwargs) if planned_bytes else error) from None
        planned_bytes.append(chosen.budget_bytes)
        executor = ScheduleExecutor(call.trace.graph_module, graph, chosen.schedule)
        exported = tuple(p for p in model.parameters() if p.requires_grad) if call.exported else ()
        return PreparedStep(executor, chosen, call.inputs_of, call.output_of, exported)

    optimized = RecomputedModule(model, prepare, lambda args, kwargs: graphs.eval_forward(args, kwargs), retrace)
    if example_inputs is not None or example_kwargs is not None:
        example_args, example_kw = _planning_copies(tuple(example_inputs or ()), dict(example_kwargs or {}))
        with _autocast_for(autocast, [*example_args, *example_kw.values()]):
            optimized.plan(*example_args, **example_kw)
    return _optimized_with(again, optimized)


_TRACED_VALUE = ("the schedule executor's traced graph runs no Python: its training calls would not change the "
                 "value, and would compute with the value of the trace")
_KEPT_IN_A_RUN = ("a module the executor runs whole stores it at each run of its node, recomputations included, "
                  "on tensors outside the model's autograd graph")


def _planning_copies(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Copies of the example call's tensors for planning, which runs the forward several times: a model
    writing into its input (``x /= 255``) changed the user's example batch once per run (8x on the
    executor, 4x on the compiler path, before session 43). A tensor passed twice stays one tensor."""
    copies: dict[int, torch.Tensor] = {}

    def copied(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
            return value
        if id(value) not in copies:
            copies[id(value)] = value.detach().clone().requires_grad_(value.requires_grad)
        return copies[id(value)]
    return tree_map(copied, (args, kwargs))


def _original_model(model: nn.Module) -> nn.Module:
    """The model to plan: the original of a module ``optimize()`` returned (planned again at the new
    budget; the first module keeps its own plans). A model holding such a module inside raises
    TraceError: its plan would run inside the outer one's, which plans the whole model at once."""
    if isinstance(model, SharedModelModule):
        model = model._original
    for name, module in model.named_modules():
        if name and isinstance(module, SharedModelModule):
            raise TraceError(
                f"{type(model).__name__}.{name} is a module optimize() returned: optimize() plans a whole model "
                f"at once. Put back the module you passed to optimize() there and optimize the outer model, "
                f"or train the outer model as it is (the inner one keeps its plan).")
    return model


def _refuse_uninitialized_lazy_modules(model: nn.Module) -> None:
    """``TraceError`` for a lazy module (``nn.LazyLinear``) not initialized yet: its parameters have no
    shape to plan with, its first forward draws their values (the compiled forward then drew other
    random numbers than eager PyTorch) and removes its initializing hook (which the executor read as a
    hook removed after planning)."""
    from torch.nn.modules.lazy import LazyModuleMixin
    for name, module in model.named_modules():
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
            raise TraceError(f"{type(model).__name__}: module {name or '(the root)'!r} ({type(module).__name__}) "
                             "has uninitialized lazy parameters, whose shapes a plan needs. Run the model once "
                             "(model(*example_inputs)) before optimize() to initialize them.", module_path=name)


def _optimized_with(options: dict[str, Any], optimized: nn.Module) -> nn.Module:
    """``optimized``, remembering ``optimize()``'s arguments (less the example call) for its copies:
    ``copy.deepcopy`` and pickling optimize a copy of the original model with them
    (``SharedModelModule.__reduce_ex__``)."""
    object.__setattr__(optimized, "_optimize_options", options)
    return optimized


def _optimize_compiled(model: nn.Module, budget: Budget, example_inputs: Sequence[Any] | None,
                       example_kwargs: dict[str, Any] | None, solver: str, autocast: "torch.dtype | None",
                       loss_fn: Any, fallback: bool, saved_plan: RecomputePlan | None = None,
                       graph_compiler: str | None = None) -> "RecomputedModule | CompiledRecomputedModule":
    """``optimize``'s compiler path, planned on the example call when there is one; with ``fallback``,
    the executor's module when the compiler path fails (``CompiledRecomputedModule``'s ``fallback``)."""
    from .compiled_module import CompiledRecomputedModule

    def executor() -> RecomputedModule:
        return optimize(model, budget, solver=solver, autocast=autocast, loss_fn=loss_fn, plan=saved_plan,
                        compiler=False)
    compiled = CompiledRecomputedModule(model, budget, solver=solver, loss_fn=loss_fn,
                                        fallback=executor if fallback else None, saved_plan=saved_plan,
                                        graph_compiler=graph_compiler)
    if example_inputs is not None or example_kwargs is not None:
        args, kwargs = _planning_copies(tuple(example_inputs or ()), dict(example_kwargs or {}))
        with _autocast_for(autocast, [*args, *kwargs.values()]):
            compiled.plan(*args, **kwargs)
        if compiled.delegate is not None:
            return compiled.delegate
    return compiled


def _of_the_joint_graph(plan: RecomputePlan) -> bool:
    """Whether a saved plan was made on the compiler path's joint graph."""
    from .joint_costs import is_joint_cost_graph
    return is_joint_cost_graph(plan.graph)


def _autocast_for(dtype: "torch.dtype | None", inputs: Sequence[Any]) -> Any:
    """``torch.autocast`` on the inputs' device type with ``dtype``, or nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    devices = {t.device.type for t in inputs if isinstance(t, torch.Tensor)}
    return torch.autocast(device_type="cuda" if "cuda" in devices else "cpu", dtype=dtype)


def plan_for(build: "Callable[[], tuple[nn.Module, Any]]", budget: Budget, *, solver: str = "auto",
             device_profile: str = "cpu", progress: bool = False, tracer: str = "auto",
             loss_fn: "Callable[[Any], torch.Tensor] | None" = None, compiler: bool = False,
             unroll_rnns: bool = False) -> RecomputePlan:
    """Plan a model without the device and without its weights: ``build()`` runs under
    ``torch.device("meta")`` and returns ``(model, example_inputs)``, where ``example_inputs`` is a
    sequence of positional inputs or a dict of keyword arguments (``{"input_ids": ..., "labels": ...}``
    for a ``transformers`` model); inputs are moved to ``meta``. The model is priced on meta tensors with
    FLOP-based times for ``device_profile`` (``device_profiles.DEVICE_PROFILES``: "cpu", "h100", "h200", ...) and
    planned at ``budget``. Save the plan (``plan.save(path)``) and apply it to the real model later with
    ``optimize(model, budget, example_inputs=..., plan=path)``: the graph of the real model has the same
    structure fingerprint, so the plan is reused as is. ``tracer`` and ``loss_fn`` as in ``optimize()``.
    ``compiler=True`` plans the compiler path's joint graph instead (captured by ``torch.compile`` on the
    meta tensors, without kernel workspace, which is priced when the plan is applied): reuse it with
    ``optimize(model, budget, example_inputs=..., compiler=True, plan=path)``. ``unroll_rnns`` as in
    ``optimize()`` (pass it there too when applying the plan).
    """
    with torch.device("meta"):
        model, inputs = build()
    if unroll_rnns:
        unroll_rnns_of(model)
    moved: dict[int, torch.Tensor] = {}  # the same tensor passed twice (input_ids as labels) stays one

    def meta_tensor(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and id(value) not in moved:
            moved[id(value)] = value.to("meta")
        return moved[id(value)] if isinstance(value, torch.Tensor) else value
    to_meta = functools.partial(tree_map, meta_tensor)
    args, kwargs = ((), to_meta(dict(inputs))) if isinstance(inputs, dict) else (to_meta(tuple(inputs)), {})
    if compiler:
        from .compiled_module import CompiledRecomputedModule
        parse_budget(budget)
        return CompiledRecomputedModule(model.train(), budget, solver=solver, loss_fn=loss_fn,
                                        device_profile=device_profile).plan(*args, **kwargs)
    _, graph = profile_call(model, args, kwargs, tracer=tracer, name=type(model).__name__, timing="flops",
                            device_profile=device_profile, progress=progress, loss_fn=loss_fn)
    return make_plan(graph, budget, solver)
