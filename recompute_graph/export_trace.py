"""Tracing with ``torch.export`` for models that ``torch.fx`` cannot trace symbolically.

Hugging Face ``transformers`` models are the common case: their ``forward`` takes keyword arguments
through decorated ``**kwargs`` signatures, branches on configuration and returns ``ModelOutput`` dicts,
none of which symbolic tracing handles. ``torch.export.export(model, args, kwargs, strict=False)`` runs
the real Python code on fake tensors instead and records the aten operations it reaches, so every
Python branch is resolved for the inputs at hand.

The model this module gives the rest of the library:

* **One graph per call structure.** An exported graph is specialised to its example call: which keyword
  arguments were passed, the inputs' shapes and dtypes, non-tensor values (``return_dict=True``). A call
  with another structure is exported again (``RecomputedModule`` caches one plan per structure).
* **Placeholders are the flattened call.** ``tree_flatten((args, kwargs))`` lists the graph's
  placeholder values in order (``ExportedTrace.inputs_of``); the graph returns the flat leaves of the
  model's output, which ``ExportedTrace.output_of`` puts back into the model's own structure
  (``transformers`` registers its ``ModelOutput`` classes with ``torch.utils._pytree``).
* **Shared state.** The exported module's parameters and buffers are the model's own objects, so
  gradients land in the user's parameters and an optimizer built on the original trains it.
* **Training calls drop the key/value cache.** When ``forward`` accepts ``use_cache`` and the caller did
  not pass it, ``use_cache=False`` is added (``training_kwargs``): a cache is never read in a training
  step, costs memory, and ``DynamicCache`` is not a pytree type that export can return. ``transformers``
  does the same when gradient checkpointing is on.
* **Buffer writes are data.** The functionalized graph returns every buffer write as an output (a
  BatchNorm's new running statistics). ``aten.instance_norm`` writes its running statistics without its
  schema saying so, so it is decomposed (into a BatchNorm over the repeated statistics, as its own
  kernel computes it) before functionalization: otherwise an InstanceNorm whose output the model never
  reads would be dropped with its statistics update (``_HIDDEN_STATE_WRITERS``).
"""
from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from .autograd_in_forward import export_refusals
from .errors import TraceError
from .functionalization import functionalize
from .kept_tensors import carried_by_export, kept_tensors_refused
from .library_classes import is_transformers_model
from .module_hooks import kept_hook_tensors_refused
from .random_sources import host_random_draws_refused
from .mode_switches import grad_mode_switches_refused, refuse_autocast_blocks_under_autocast
from .model_state import submodules_put_back
from .source_lines import user_frame, user_source_location
from .trace import TraceResult

__all__ = ["ExportedTrace", "export_trace", "training_kwargs"]


@dataclass(frozen=True)
class ExportedTrace:
    """A model exported for one call structure: the graph (as a :class:`TraceResult`) and the pytree
    specs of the call's ``(args, kwargs)`` and of the model's output."""

    trace: TraceResult
    in_spec: TreeSpec
    out_spec: TreeSpec

    def inputs_of(self, args: tuple, kwargs: dict) -> list[Any]:
        """The graph's placeholder values for this call; TypeError if the call has another structure."""
        leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise TypeError(f"this call's structure {spec} is not the exported one {self.in_spec}")
        return leaves

    def output_of(self, flat_output: Any) -> Any:
        """The graph's flat output in the model's own output structure (a ``ModelOutput``, a dict ...)."""
        return tree_unflatten(list(flat_output), self.out_spec)

    def __repr__(self) -> str:
        nodes = sum(1 for n in self.trace.graph_module.graph.nodes if n.op not in ("placeholder", "output"))
        return f"ExportedTrace({nodes} aten nodes, inputs {self.in_spec}, output {self.out_spec})"


def training_kwargs(model: nn.Module, kwargs: dict) -> dict:
    """``kwargs`` with ``use_cache=False`` added when ``model.forward`` accepts ``use_cache`` and the
    caller did not pass it (see the module docstring). A wrapper whose ``forward`` takes ``**kwargs``
    (``peft``'s ``PeftModel``, a user's ``forward(self, **batch)``) accepts it when it holds a
    ``transformers`` model that does: the wrapper hands its keyword arguments on."""
    if "use_cache" in kwargs or not _passes_use_cache(model):
        return kwargs
    return {**kwargs, "use_cache": False}


_PASSES_USE_CACHE: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _passes_use_cache(model: nn.Module) -> bool:
    """Whether ``model``'s forward accepts ``use_cache`` (:func:`training_kwargs`); asked once per model:
    training calls ask on every step."""
    known = _PASSES_USE_CACHE.get(model)
    if known is None:
        known = _forward_takes_use_cache(type(model)) or (
            _forward_takes_any_keyword(type(model))
            and any(is_transformers_model(m) and _forward_takes_use_cache(type(m)) for m in model.modules()))
        _PASSES_USE_CACHE[model] = known
    return known


@functools.lru_cache(maxsize=None)
def _forward_takes_use_cache(model_class: type) -> bool:
    """Whether ``model_class.forward`` has a ``use_cache`` parameter."""
    try:
        return "use_cache" in inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False


@functools.lru_cache(maxsize=None)
def _forward_takes_any_keyword(model_class: type) -> bool:
    """Whether ``model_class.forward`` has a ``**kwargs`` parameter."""
    try:
        parameters = inspect.signature(model_class.forward).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def functional_copy(destination: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """What functionalization's ``aten.copy(destination, source)`` computes (a new tensor shaped, typed
    and strided like ``destination``, holding ``source`` broadcast), written with ``copy_`` into a fresh
    tensor so that autograd can differentiate it (eager autograd has no formula for ``aten.copy``)."""
    fresh = destination.new_empty_strided(destination.size(), destination.stride())
    return fresh.copy_(source)


def _differentiable_copies(gm: "torch.fx.GraphModule") -> int:
    """Replace every ``aten.copy.default`` node (a write through a view, functionalized: ``x[:, :4] = y``
    becomes ``slice_scatter(x, copy(slice(x), y))``) by :func:`functional_copy`. Returns how many."""
    replaced = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.copy.default and not node.kwargs:
            node.target = functional_copy
            replaced += 1
    if replaced:
        gm.recompile()
    return replaced


def _views_as_reshapes(gm: "torch.fx.GraphModule") -> int:
    """Replace every ``aten.view.default`` node by ``aten.reshape.default``, the same view wherever one
    exists. Export traces with fake kernels, whose result layout may differ from the real kernel's (CPU
    flash attention in Hugging Face's Swin: the real output, transposed, "cannot be viewed" as the fake
    one could). Returns how many."""
    replaced = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
            replaced += 1
    if replaced:
        gm.recompile()
    return replaced


def _write_buffers_early(gm: "torch.fx.GraphModule") -> int:
    """Move each buffer write-back ``copy_(buffer, new_value)`` of a functionalized graph (the module
    form puts them all at the end) to right after ``new_value`` is computed, unless the buffer is read
    between there and the end. A new running mean then dies at once instead of keeping its producer's
    whole output alive through the forward (the cost graph keeps a tuple output alive as one value).
    Returns how many writes moved."""
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    moved = 0
    for node in nodes:
        if not (node.op == "call_function" and node.target is torch.ops.aten.copy_.default and len(node.args) >= 2
                and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "get_attr"
                and isinstance(node.args[1], torch.fx.Node) and not node.users):
            continue
        buffer, value = node.args[0], node.args[1]
        if order[buffer] > order[value]:
            continue  # the buffer's get_attr comes later; leave the write where it is
        if any(user is not node and order[user] > order[value] for user in buffer.users):
            continue
        value.append(node)
        moved += 1
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


#: Ops that write module buffers (running statistics) their schema does not mark as written, so that
#: functionalization cannot see the write: each is decomposed into ops whose writes it sees.
_HIDDEN_STATE_WRITERS = ("instance_norm",)


def _hidden_state_writer_decompositions() -> dict:
    """``torch.export``'s own decompositions of the ``_HIDDEN_STATE_WRITERS`` (their kernels' own math)."""
    table = torch.export.default_decompositions()
    ops = [getattr(torch.ops.aten, name).default for name in _HIDDEN_STATE_WRITERS]
    return {op: table[op] for op in ops if op in table}


def _draws_random(node: torch.fx.Node) -> bool:
    """A call of an op that advances a random generator (tagged ``nondeterministic_seeded``)."""
    return node.op == "call_function" and getattr(node.target, "_nondeterministic_seeded", False)


def _refuse_unused_random_draws(graph: torch.fx.Graph, model_name: str) -> None:
    """TraceError for a random op (dropout, ``rand_like``) whose result the model never uses: the
    functionalized graph drops it, so every later draw, and the generator after the step, would differ
    from the model's own (a second dropout would use the first one's mask), even with no recomputation."""
    live: set[torch.fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op == "output" or any(user in live for user in node.users):
            live.add(node)
    for node in graph.nodes:
        if node not in live and _draws_random(node):
            where = user_frame(node.meta.get("stack_trace") or "")
            where = f"\n  at {where}" if where else ""
            raise TraceError(
                f"{model_name} draws random numbers it never uses ({node.target}, node {node.name!r}){where}\n"
                "  torch.export drops the unused call, which changes every later random draw (dropout masks) "
                "and the generator's state after the step. Remove the unused call, or make the model "
                "traceable by torch.fx (optimize(..., tracer='fx')), whose graph keeps it.",
                module_path="")


def _refuse_other_random_draws(model: nn.Module, graph_module: torch.fx.GraphModule, args: tuple,
                               kwargs: dict) -> None:
    """TraceError when the functionalized graph of a model that draws random numbers computes
    something else than the model under the same seed. PyTorch's decomposition of an in-place dropout
    on a non-contiguous view fills the mask in another element order than eager dropout does (a
    channels-last activation, flattened), so the masks differ even with no recomputation. Checked by
    running both once (no grad, on copies of the inputs, buffers and random state put back); skipped
    on meta tensors and for graphs without random ops."""
    from .model_state import held_generators, preserved_state
    if not any(_draws_random(n) for n in graph_module.graph.nodes):
        return
    leaves = tree_flatten((tuple(args), dict(kwargs)))[0]
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in leaves):
        return

    def copies(values: Any) -> Any:
        return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, values)
    with preserved_state(model, rng=True), torch.no_grad():
        torch.manual_seed(0)
        expected = [t for t in tree_flatten(model(*copies(tuple(args)), **copies(dict(kwargs))))[0]
                    if isinstance(t, torch.Tensor)]
        torch.manual_seed(0)
        got = [t for t in tree_flatten(torch.fx.Interpreter(graph_module).run(*copies(leaves)))[0]
               if isinstance(t, torch.Tensor)]
    for a, b in zip(expected, got):
        if a.shape != b.shape or not a.is_floating_point():
            continue
        scale = float(a.abs().max()) if a.numel() else 0.0
        if a.numel() and float((a - b).abs().max()) > 1e-3 * max(scale, 1.0):
            own = [where for where, g in held_generators(model) if isinstance(g, torch.Generator)]
            cause = (f"it draws from a torch.Generator the model holds, {own[0]}, which the exported graph does "
                     "not" if own else "PyTorch's decomposition of an in-place dropout on a non-contiguous view "
                     "fills the mask in another order")
            raise TraceError(
                f"the functionalized graph of {type(model).__name__} draws different random numbers than "
                f"the model: under the same seed its output differs from the model's (a known cause: {cause}). "
                "It would train with other random numbers, so it is refused. Apply the dropout out of place, or "
                "on a contiguous tensor (x.contiguous()), or make the model traceable by torch.fx "
                "(optimize(..., tracer='fx')).", module_path="")


_KEPT_FAKE = ("torch.export stored a fake tensor of its trace there and put the old value back after it, "
              "and the executor's graph runs no Python to store the tensor")


def export_trace(model: nn.Module, args: tuple, kwargs: dict) -> ExportedTrace:
    """Export ``model`` for the call ``model(*args, **kwargs)`` (non-strict ``torch.export``).

    Raises :class:`TraceError` with export's own first line and the user code it points at when the
    model cannot be exported either. The model is not modified.
    """
    try:
        with grad_mode_switches_refused(model, "torch.export"), export_refusals(type(model).__name__), \
                host_random_draws_refused(model, "torch.export"), kept_tensors_refused(
                    model, carried_by_export, lambda message: TraceError(message, module_path=""), _KEPT_FAKE,
                    in_forward=True), kept_hook_tensors_refused(
                    list(model.named_modules()), type(model).__name__, lambda message: TraceError(message)), \
                submodules_put_back(model), warnings.catch_warnings():
            # export's own word on a tensor kept on an attribute: the refusal above says it with what to do
            warnings.filterwarnings("ignore", message=r"The tensor attributes? .* assigned during export")
            program = torch.export.export(model, tuple(args), dict(kwargs), strict=False)
    except TraceError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of export is reported the same way
        text = str(error).strip()
        first_line = text.splitlines()[0] if text else type(error).__name__
        location = user_source_location(error)
        raise TraceError(
            f"cannot export {type(model).__name__} with torch.export either: {type(error).__name__}: "
            f"{first_line}" + (f"\n  at {location}" if location else "") + (
                "\n  The forward branches on a tensor's value there (a layer skipped at random, LayerDrop: "
                "transformers' layerdrop=0 turns it off; a check for NaNs), so no one graph holds its ops; make "
                "the branch depend on shapes or configuration only, or compile the model yourself with "
                "torch.compile(model, backend=rg.backend(budget), dynamic=False), which plans the graphs on "
                "either side of the branch within one budget."
                if type(error).__name__ == "GuardOnDataDependentSymNode" else
                "\n  Pass example inputs exactly as training calls the model (keyword arguments included); "
                "if the model returns a custom object, register it with torch.utils._pytree."),
            module_path="", source_location=location) from error
    in_spec, out_spec = program.call_spec.in_spec, program.call_spec.out_spec
    _refuse_unused_random_draws(program.graph, type(model).__name__)
    refuse_autocast_blocks_under_autocast(program.graph, type(model).__name__)
    try:
        # functionalized: writes through views become data edges, buffer writes outputs. torch's own copy
        # of the program's specs warns that it uses a deprecated check: nothing a user can act on
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    category=FutureWarning)
            program = program.run_decompositions(_hidden_state_writer_decompositions())
    except Exception as error:  # noqa: BLE001
        raise TraceError(f"cannot functionalize the exported graph of {type(model).__name__}: "
                         f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}",
                         module_path="") from error
    graph_module = program.module()
    _differentiable_copies(graph_module)
    _views_as_reshapes(graph_module)
    _write_buffers_early(graph_module)
    functionalized, unsafe = functionalize(graph_module)
    if unsafe:
        raise TraceError(f"the exported graph of {type(model).__name__} still writes into activations "
                         f"through views after functionalization: {unsafe[0]}", module_path="")
    _refuse_other_random_draws(model, graph_module, args, kwargs)
    return ExportedTrace(TraceResult(graph_module, (), (), functionalized, unsafe), in_spec, out_spec)
