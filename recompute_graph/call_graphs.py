"""From a model and a call to the graph the planner prices: torch.fx once, or torch.export per call.

``CallGraphs(model, tracer)`` decides how the model is traced (the rule is in ``optimize()``'s
docstring) and, for each call ``model(*args, **kwargs)``, gives a :class:`CallGraph`: the traced graph,
how the call's values map onto its placeholders and how its output maps back to what the model returns.
An fx graph serves every call (its placeholders mirror ``forward``'s signature); an exported graph serves
one call structure (``export_trace.py``); where neither can be made, an fx graph of the call structure
does (``call_structure_trace.py``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from torch import nn

from .call_structure_trace import call_structure, call_values, root_function
from .costs import profile_graph
from .errors import TraceError
from .graph import CostGraph
from .export_trace import export_trace, training_kwargs
from .kept_tensors import KEPT_TENSOR_WORDS, KeptOutsideTheModel
from .optimized_module import placeholder_binder
from .trace import TraceResult, trace

__all__ = ["TRACERS", "CallGraph", "CallGraphs", "profile_call", "training_mode"]

TRACERS = ("auto", "fx", "export")


@dataclass(frozen=True)
class CallGraph:
    """The graph for one call: ``trace``; ``inputs_of(args, kwargs)``, the placeholder values of a call;
    ``output_of(output)``, the graph's output as the model returns it; ``exported``: from torch.export
    (recorded in training mode already: such a graph module refuses ``train()``)."""

    trace: TraceResult
    inputs_of: Callable[[tuple, dict], list[Any]]
    output_of: Callable[[Any], Any]
    exported: bool


class CallGraphs:
    """Traces ``model`` with ``tracer`` ("auto", "fx" or "export"); see ``optimize()`` for the rule.

    The fx trace is attempted now (a ``TraceError`` is raised now for ``tracer="fx"``); exports happen
    per call in :meth:`graph_for`.
    """

    def __init__(self, model: nn.Module, tracer: str = "auto") -> None:
        if tracer not in TRACERS:
            raise ValueError(f"unknown tracer {tracer!r}; use one of {', '.join(TRACERS)}")
        self.model, self.tracer = model, tracer
        self.fx_trace: TraceResult | None = None
        self.fx_error: TraceError | None = None
        if tracer != "export":
            try:
                self.fx_trace = trace(model)
            except TraceError as error:
                if tracer == "fx" or isinstance(error, KeptOutsideTheModel):
                    raise
                self.fx_error = error
        if self.fx_trace is not None and self.fx_trace.unsafe_mutations and tracer == "fx":
            raise TraceError(
                f"cannot plan {type(model).__name__} from its torch.fx graph: it writes into an activation "
                f"through one view while another view of it is read later: {self.fx_trace.unsafe_mutations[0]}."
                " Use tracer='export' (or 'auto'), whose functionalization makes the write a data dependency,"
                " or make the write out of place.", module_path="")
        self.uses_export = (tracer == "export" or self.fx_error is not None
                            or (tracer == "auto" and bool(self.fx_trace.opaque_modules
                                                          or self.fx_trace.unsafe_mutations)))
        self._bind = placeholder_binder(model, self.fx_trace.graph_module) if self.fx_trace is not None else None
        self._per_call: dict[tuple, CallGraph] = {}  # fx graphs per CallStructure.key (_fx_graph_for_call)

    def graph_for(self, args: tuple, kwargs: dict) -> CallGraph:
        """The graph for calls like ``model(*args, **kwargs)``: exported when export is in use (falling
        back to the fx graph, if there is one, when export fails), else the fx graph."""
        if not self.uses_export:
            return self._fx_graph()
        try:
            with training_mode(self.model):
                exported = export_trace(self.model, args, training_kwargs(self.model, kwargs))
        except TraceError as export_error:
            if self.fx_trace is not None and not self.fx_trace.unsafe_mutations:
                return self._fx_graph()
            if self.fx_trace is not None:
                raise TraceError(
                    f"{type(self.model).__name__} writes into an activation through a view that another view "
                    f"reads later ({self.fx_trace.unsafe_mutations[0]}), which only torch.export's "
                    f"functionalization plans exactly, and export failed:\n{export_error}",
                    module_path="", source_location=export_error.source_location) from export_error
            both_kept = all(KEPT_TENSOR_WORDS in str(e) for e in (self.fx_error, export_error))
            if self.fx_error is None or both_kept:
                raise  # (both tracers refused the same kept tensor: export's words say it)
            return self._fx_graph_for_call(args, kwargs, export_error)
        model = self.model

        def inputs_of(call_args: tuple, call_kwargs: dict) -> list[Any]:
            return exported.inputs_of(call_args, training_kwargs(model, call_kwargs))
        return CallGraph(exported.trace, inputs_of, exported.output_of, exported=True)

    def fx_fallback(self, call: CallGraph) -> CallGraph | None:
        """The fx graph to plan instead when ``call``'s export graph cannot be priced (an aten op of the
        functionalized graph with no autograd formula for its dtype: complex ``slice_scatter``), or None
        where there is no such graph or only export plans the model exactly."""
        if not call.exported or self.fx_trace is None or self.fx_trace.unsafe_mutations or self.tracer != "auto":
            return None
        return self._fx_graph()

    def eval_forward(self, args: tuple, kwargs: dict) -> Any:
        """The plain forward: the model itself (its hooks as they are now, its ``self.training``
        branches taken in eval mode, which the fx graph traced in training mode has baked in)."""
        return self.model(*args, **kwargs)

    def _fx_graph_for_call(self, args: tuple, kwargs: dict, export_error: TraceError) -> CallGraph:
        """Where neither the fx graph of ``forward`` as written nor an export exists: an fx graph of this
        call structure (``call_structure_trace``), made once per structure; else ``TraceError`` with
        what each tracer said."""
        structure = call_structure(self.model, args, kwargs)
        fx_error = self.fx_error
        if structure is not None and structure.key in self._per_call:
            return self._per_call[structure.key]
        if structure is not None:
            try:
                traced = trace(self.model, root_function(self.model, structure))
            except TraceError as error:
                fx_error = error
            else:
                if not traced.unsafe_mutations:
                    call = CallGraph(traced, call_values(self.model, structure), _unchanged, exported=False)
                    self._per_call[structure.key] = call
                    return call
                fx_error = TraceError(
                    f"cannot plan {type(self.model).__name__} from its torch.fx graph: it writes into an activation"
                    f" through one view while another view of it is read later: {traced.unsafe_mutations[0]}",
                    module_path="")
        raise TraceError(f"{fx_error}\n{export_error}", module_path=fx_error.module_path,
                         source_location=fx_error.source_location) from export_error

    def _fx_graph(self) -> CallGraph:
        return CallGraph(self.fx_trace, self._bind, _unchanged, exported=False)


def profile_call(model: nn.Module, args: tuple, kwargs: dict, *, tracer: str = "auto",
                 **options: Any) -> tuple[CallGraph, CostGraph]:
    """Trace ``model`` for the call ``model(*args, **kwargs)`` (``CallGraphs``) and price it in training
    mode (``costs.profile_graph`` with ``options``): the model-agnostic form of ``costs.profile_model``."""
    call = CallGraphs(model, tracer).graph_for(args, kwargs)
    with training_mode(model if call.exported else call.trace.graph_module):
        graph = profile_graph(call.trace, call.inputs_of(args, kwargs), output_of=call.output_of, **options)
    return call, graph


def _unchanged(output: Any) -> Any:
    return output


@contextlib.contextmanager
def training_mode(module: nn.Module) -> Iterator[None]:
    """Trace and profile in training mode (what the plan is for), then put every submodule's mode back."""
    modes = [(m, m.training) for m in module.modules()]
    module.train()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
