"""Tracing a PyTorch model into a torch.fx graph of module-level nodes.

Granularity: leaf modules of ``torch.nn`` (``Conv2d``, ``BatchNorm2d``, ``ReLU``, ``LSTMCell`` ...) stay
single ``call_module`` nodes; user-defined modules are traced through; torch functions and tensor methods
are ``call_function`` / ``call_method`` nodes. A user-defined submodule whose ``forward`` cannot be traced
symbolically (data-dependent Python control flow, ``.item()``, iteration over a tensor, ...) becomes one
*opaque* ``call_module`` node; the rest of the model stays fine-grained. Only if the root module's own
code cannot be traced is a :class:`~recompute_graph.errors.TraceError` raised.

In-place operations are *functionalized* after tracing (``functionalization``): ``relu_`` -> ``relu``,
``x[:, 1:] = y`` -> a write into a copy, where no other alias of the written storage is read after the
write; otherwise the write is an *unsafe mutation* (``TraceResult.unsafe_mutations``) and the model is
traced with ``torch.export`` instead. In-place writes into model inputs, parameters and buffers are kept
as they are. ``x[i] = v`` on a traced tensor is recorded as ``operator.setitem`` (torch.fx's ``Proxy``
has no ``__setitem__``: transformers' ``shift_tokens_right`` stopped every seq2seq model given labels).

Tracing never modifies the user's model: torch.fx only patches functions for the duration of the trace
and the returned ``GraphModule`` refers to the user's submodules and parameters without changing them.
"""
from __future__ import annotations

import functools
import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from .autograd_in_forward import (HookRefused, functions_kept_whole, proxy_hooks_refused,
                                  refuse_differentiation_nodes)
from .call_structure_trace import wrapped_in_varargs
from .errors import TraceError
from .functionalization import functionalize, mutated_input_constraints
from .kept_tensors import (AttributeSnapshot, KeptOutsideTheModel, carried_by_a_trace, containers_keeping_proxies,
                           kept_tensor_message)
from .mode_switches import autocast_switches_refused, grad_mode_switches_refused
from .model_state import preserved_state
from .module_hooks import kept_hook_tensors_refused
from .random_sources import host_random_draws_refused, refuse_generators_made_in_forward
from .source_lines import describe_error, user_frame, user_source_location

__all__ = ["TraceResult", "BoundInterpreter", "functionalize", "mutated_input_constraints", "trace",
           "user_source_location"]

#: Tensor constructors that torch.fx cannot trace when a size comes from a traced shape
#: (``torch.zeros(x.shape[0], 4)``); during tracing they record a node instead of failing.
SHAPE_DEPENDENT_CONSTRUCTORS = ("zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange",
                                "eye", "linspace", "tensor", "as_tensor")
#: Those that draw random numbers: recorded even with no traced argument (``torch.rand([])`` of LayerDrop,
#: noise of a fixed shape), so that every step draws anew; torch.fx drew them once while it traced and
#: the graph held what it drew (refused since session 40 as "drawn outside the traced values").
RANDOM_CONSTRUCTORS = frozenset({"rand", "randn", "randint"})
#: Stacks of layers in ``torch.nn``: traced into like the model's own modules, not kept as one leaf node
#: (an ``nn.TransformerEncoder`` was one node holding every layer's activations, so the executor could
#: recompute nothing inside it). Their fast-path checks branch on tensors, so tracing them fails, they
#: become opaque, and ``tracer="auto"`` takes ``torch.export``'s aten graph of the model instead. A single
#: layer (``nn.TransformerEncoderLayer``, ``nn.MultiheadAttention``) stays a leaf: a unit to keep or
#: recompute whole, as a user's own block is (torchvision's ViT plans better on that fx graph).
COMPOSITE_TORCH_MODULES = (nn.TransformerEncoder, nn.TransformerDecoder, nn.Transformer)


@dataclass(frozen=True)
class TraceResult:
    """A traced model: the fx ``graph_module``, the qualified names of the submodules that had to be kept
    opaque (each one is a single node) with the reason tracing them failed, the names of the nodes
    whose in-place operation was functionalized, and ``unsafe_mutations``: writes into activations
    that could not be functionalized exactly (another view of the same storage is read after the
    write), described with their source lines. A graph with unsafe mutations is not planned from: the
    tracer falls back to ``torch.export``, whose functionalization turns them into data dependencies."""

    graph_module: fx.GraphModule
    opaque_modules: tuple[str, ...]
    opaque_reasons: tuple[str, ...]
    functionalized: tuple[str, ...] = ()
    unsafe_mutations: tuple[str, ...] = ()

    def __repr__(self) -> str:
        nodes = sum(1 for n in self.graph_module.graph.nodes if n.op not in ("placeholder", "output"))
        opaque = f", opaque: {list(self.opaque_modules)}" if self.opaque_modules else ""
        return f"TraceResult({type(self.graph_module).__name__}: {nodes} nodes{opaque})"


#: Augmented assignments (``x += y``) that torch.fx would otherwise record as out-of-place ``x = x + y``,
#: changing both aliasing semantics and memory; they are recorded as ``operator.iadd`` etc. instead.
IN_PLACE_OPERATORS = {
    "__iadd__": operator.iadd, "__isub__": operator.isub, "__imul__": operator.imul,
    "__itruediv__": operator.itruediv, "__ifloordiv__": operator.ifloordiv, "__imod__": operator.imod,
    "__ipow__": operator.ipow, "__iand__": operator.iand, "__ior__": operator.ior, "__ixor__": operator.ixor,
    "__ilshift__": operator.ilshift, "__irshift__": operator.irshift, "__imatmul__": operator.imatmul,
}


def _in_place_operator(function: Any) -> Any:
    def method(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", function, (self, other), {})
    return method


def _recorded_setitem(proxy: fx.Proxy, index: Any, value: Any) -> None:
    """``Proxy.__setitem__`` while tracing: ``x[index] = value`` recorded as an ``operator.setitem`` node
    (``functionalization`` makes it a write into a copy where that is exact)."""
    proxy.tracer.create_proxy("call_function", operator.setitem, (proxy, index, value), {})


class _SubmoduleTraceFailure(Exception):
    def __init__(self, qualname: str, error: BaseException) -> None:
        super().__init__(qualname)
        self.qualname = qualname
        self.error = error


def _settle_lazy_torch_tables() -> None:
    """Build the tables torch builds lazily from ``torch.<name>`` before :meth:`_ModuleLevelTracer.trace`
    swaps the constructors: Dynamo's table of in-graph torch functions
    (``torch._dynamo.trace_rules.get_torch_obj_rule_map``, cached on first use) built during a trace
    records the swapped ``torch.arange`` and ``torch.ones``, and every later ``torch.compile`` of a
    model that calls them breaks its graph there (the zoo GPT-2 compiled into six graphs)."""
    import torch._dynamo.trace_rules as trace_rules
    rule_map = getattr(trace_rules, "get_torch_obj_rule_map", None)
    if rule_map is not None:
        rule_map()


def _refused_tensor_attribute_writes(proxy: fx.Proxy, name: str, value: Any) -> None:
    """``Proxy.__setattr__`` while tracing: ``p.data = p.data * m + ...`` (MoCo's momentum update in
    ``forward``) set an attribute on the proxy and left no node, so the executor never made the update."""
    if name in ("data", "requires_grad", "grad"):
        raise RuntimeError(f"forward assigns a tensor's .{name} ({proxy.node.name}.{name} = ...), which torch.fx "
                           "does not record: the schedule executor would never make that change. Write it "
                           "in place under torch.no_grad() instead (tensor.mul_(m).add_(...)), which "
                           "optimize()'s compiler path (compiler='auto' or True) plans exactly")
    object.__setattr__(proxy, name, value)


class _ModuleLevelTracer(fx.Tracer):
    """fx tracer that treats ``opaque`` submodules as leaves and reports which submodule failed."""

    def __init__(self, opaque: frozenset[str], root_function: Any = None) -> None:
        super().__init__()
        self.opaque = opaque
        self.root_function = root_function  # traced in place of ``forward`` (``call_structure_trace``)
        self.made: list[weakref.ref[fx.Proxy]] = []  # every proxy of the trace (``containers_keeping_proxies``)
        self.record_stack_traces = True  # so that errors can name the user's source line
        # buffers read as attributes (``self.num_batches_tracked.add_(1)`` in timm's BatchNormAct2d)
        # become graph nodes; otherwise the write would run once, at trace time, and never in training
        self.proxy_buffer_attributes = True

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        _settle_lazy_torch_tables()
        originals = {name: getattr(torch, name) for name in SHAPE_DEPENDENT_CONSTRUCTORS}
        proxy_originals = {dunder: fx.Proxy.__dict__.get(dunder)
                           for dunder in (*IN_PLACE_OPERATORS, "__setattr__", "__setitem__")}
        try:
            for name, function in originals.items():
                setattr(torch, name, self._recording(function, always=name in RANDOM_CONSTRUCTORS))
            for dunder, function in IN_PLACE_OPERATORS.items():
                setattr(fx.Proxy, dunder, _in_place_operator(function))
            fx.Proxy.__setitem__ = _recorded_setitem  # type: ignore[method-assign]
            fx.Proxy.__setattr__ = _refused_tensor_attribute_writes  # type: ignore[method-assign]
            return super().trace(root, concrete_args)
        finally:
            for name, function in originals.items():
                setattr(torch, name, function)
            for dunder, method in proxy_originals.items():
                if method is None:
                    delattr(fx.Proxy, dunder)
                else:
                    setattr(fx.Proxy, dunder, method)

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> Any:
        if self.root_function is not None:
            root_fn = self.root_function
        elif is_module and wrapped_in_varargs(root_fn):
            raise RuntimeError(f"forward is a decorator's (*args, **kwargs) wrapper of {root_fn.__qualname__}, "
                               "whose signature torch.fx cannot mirror (tracer='auto' traces the model for each "
                               "call structure where torch.export fails)")
        return super().create_args_for_root(root_fn, is_module, concrete_args)

    def create_proxy(self, *args: Any, **kwargs: Any) -> fx.Proxy:
        proxy = super().create_proxy(*args, **kwargs)
        self.made.append(weakref.ref(proxy))
        return proxy

    def _recording(self, function: Any, always: bool = False) -> Any:
        @functools.wraps(function)
        def constructor(*args: Any, **kwargs: Any) -> Any:
            if always or any(isinstance(leaf, fx.Proxy) for leaf in tree_flatten((args, kwargs))[0]):
                return self.create_proxy("call_function", function, args, kwargs)
            return function(*args, **kwargs)
        return constructor

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.opaque or isinstance(m, torch.jit.ScriptModule):
            return True  # a scripted module traced into is a call of its C++ module: its parameters unseen
        return not isinstance(m, COMPOSITE_TORCH_MODULES) and super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        try:
            qualname = self.path_of_module(m)
        except NameError:  # a module made in forward (transformers' ``loss_fct = CrossEntropyLoss()``)
            if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None:
                raise  # (its state would be made anew at every call: the trace could not hold it)
            return forward(*args, **kwargs)  # stateless: its code is traced where it is called
        if self.is_leaf_module(m, qualname):
            return super().call_module(m, forward, args, kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except (_SubmoduleTraceFailure, HookRefused):
            raise
        except Exception as error:  # noqa: BLE001 - any failure while tracing this module's code
            raise _SubmoduleTraceFailure(qualname, error) from error


def trace(model: nn.Module, root_function: Any = None) -> TraceResult:
    """Trace ``model`` into a module-level fx graph, making untraceable submodules opaque; with
    ``root_function``, that function in place of ``forward`` (``call_structure_trace.root_function``).

    Raises :class:`TraceError` naming the root module and the source line if the root's own
    ``forward`` cannot be traced. The user's model is never modified.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"expected an nn.Module, got {type(model).__name__}")
    with preserved_state(model):  # tracing runs the model's Python code: what it writes into buffers is undone
        name = type(model).__name__
        with grad_mode_switches_refused(model, "torch.fx"), autocast_switches_refused(model), \
                functions_kept_whole(name), proxy_hooks_refused(name), \
                host_random_draws_refused(model, "torch.fx", torch_generator=True), kept_hook_tensors_refused(
                    list(model.named_modules()), name, lambda message: TraceError(message, module_path="")):
            result, made = _trace(model, root_function)
        outside = containers_keeping_proxies(made, model)  # (after the hooks' own refusals, which say more)
        if outside:
            raise KeptOutsideTheModel(kept_tensor_message(
                name, f"{outside[0]} outside the model (a global or a closure variable)", _KEPT_OUTSIDE),
                module_path="")
        refuse_generators_made_in_forward(model, result.graph_module, "torch.fx")
        return result


def assign_buffer(buffer: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The write a traced ``self.center = 0.9 * self.center + ...`` makes into the buffer (fx recorded the
    new value but no write, so the executor never updated it): in place, as the same tensor, refused where
    the value's shape or dtype differs from the buffer's (the model's buffer would change them)."""
    if value.shape != buffer.shape or value.dtype != buffer.dtype:
        raise RuntimeError(f"forward assigns a buffer of shape {tuple(buffer.shape)} ({buffer.dtype}) a tensor of "
                           f"shape {tuple(value.shape)} ({value.dtype}), which the schedule executor's graph "
                           "cannot make; write it in place (buffer.copy_(...)) or use compiler='auto'")
    with torch.no_grad():
        return buffer.copy_(value)


def _buffer_assignments(graph: fx.Graph, assigned: list[tuple[str, fx.Proxy]]) -> None:
    """Adds to ``graph``, before its output, an :func:`assign_buffer` for each buffer the forward assigned
    a new value (``(qualified name, proxy)``), where that value is not an in-place write into the buffer
    itself (``self.steps += 1``, which the graph already makes)."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for target, proxy in assigned:
        node = proxy.node
        source = node.args[0] if node.args and (node.target in IN_PLACE_OPERATORS.values() or (
            node.op == "call_method" and node.target.endswith("_"))) else node
        if isinstance(source, fx.Node) and source.op == "get_attr" and source.target == target:
            continue
        with graph.inserting_before(output):
            graph.call_function(assign_buffer, (graph.get_attr(target), node))


def _drop_leaked_proxies(before: list[tuple[nn.Module, dict, dict, dict]]) -> list[tuple[nn.Module, str, fx.Proxy]]:
    """Undo what tracing assigned to the modules: with buffers read as proxies, ``self.steps += 1``
    assigned the proxy to the buffer itself, and ``self.last_attention = attention`` a proxy to an
    attribute; the model then ran on proxies after the trace (``KeyError`` in the executor's pricing,
    the graph growing nodes after its output). Each attribute or buffer holding a proxy gets its value
    from before the trace back, or is removed when it had none. Returns the buffers assigned a proxy."""
    assigned = [(module, name, value) for module, _, _, _ in before for name, value in module._buffers.items()
                if isinstance(value, fx.Proxy)]
    for module, attributes, buffers, parameters in before:
        for table, saved in ((module._buffers, buffers), (module._parameters, parameters),
                             (module.__dict__, attributes)):
            for name in [name for name, value in table.items() if isinstance(value, fx.Proxy)]:
                if name in saved:
                    table[name] = saved[name]
                else:
                    del table[name]
    return assigned


_KEPT_PROXY = "torch.fx kept a proxy of its trace there, and the executor's graph runs no Python to store the tensor"
_KEPT_OUTSIDE = ("torch.fx left a proxy of its trace there (taken out now), torch.export would leave a fake tensor, "
                 "and the executor's graph runs no Python to fill it")


def _trace(model: nn.Module, root_function: Any = None) -> "tuple[TraceResult, list[weakref.ref[fx.Proxy]]]":
    opaque: dict[str, str] = {}
    submodule_count = sum(1 for _ in model.modules())
    for _attempt in range(submodule_count + 1):
        tracer = _ModuleLevelTracer(frozenset(opaque), root_function)
        before = [(module, dict(module.__dict__), dict(module._buffers), dict(module._parameters))
                  for module in model.modules()]
        attributes = AttributeSnapshot(model)
        try:
            try:
                graph = tracer.trace(model)
            finally:  # before the graph module copies the attributes its graph reads
                kept = attributes.kept(carried_by_a_trace)
                attributes.restore(kept)
                assigned = _drop_leaked_proxies(before)
        except _SubmoduleTraceFailure as failure:
            if failure.qualname in opaque:  # cannot happen: an opaque module is a leaf
                raise _trace_error(model, "", failure.error) from failure.error
            opaque[failure.qualname] = describe_error(failure.error)
            continue
        except HookRefused:
            raise
        except Exception as error:  # noqa: BLE001
            raise _trace_error(model, "", error) from error
        if kept:
            raise TraceError(kept_tensor_message(type(model).__name__, kept[0][0], _KEPT_PROXY), module_path="")
        names = {id(module): name for name, module in model.named_modules()}
        _buffer_assignments(graph, [(f"{names[id(m)]}.{b}".lstrip("."), proxy) for m, b, proxy in assigned])
        del assigned
        refuse_differentiation_nodes(type(model).__name__, graph, user_frame)
        graph_module = fx.GraphModule(tracer.root, graph, class_name=f"Traced{type(model).__name__}")
        for name in set(model.__dict__) - set(before[0][1]):  # fx's constants (``_opaque_obj0``): the copy's now
            del model.__dict__[name]
        functionalized, unsafe = functionalize(graph_module)
        return TraceResult(graph_module, tuple(opaque), tuple(opaque.values()), functionalized, unsafe), tracer.made
    raise TraceError(f"tracing {type(model).__name__} did not converge")  # pragma: no cover


def _trace_error(model: nn.Module, qualname: str, error: BaseException) -> TraceError:
    location = user_source_location(error)
    module = f"{type(model).__name__}" + (f".{qualname}" if qualname else " (the root module)")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    message = (f"cannot trace {module}: {type(error).__name__}: {first_line}"
               + (f"\n  at {location}" if location else "")
               + "\n  The root module's own forward must be traceable by torch.fx; move data-dependent "
               "control flow into a submodule (it then becomes one opaque node) or make it shape-based.")
    return TraceError(message, module_path=qualname, source_location=location)


class BoundInterpreter(fx.Interpreter):
    """An interpreter of a traced graph run on the values ``optimized_module.placeholder_binder`` gives:
    one per placeholder, a ``*args`` one the tuple, a ``**kwargs`` one the dict. (fx's own gives a starred
    placeholder the list of the values left, so ``forward(self, x, **extra)`` read ``extra`` as
    ``[{...}]``: ``ProfileError: 'list' object has no attribute 'get'``.)"""

    def placeholder(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return next(self.args_iter)
