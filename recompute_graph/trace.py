"""Tracing a PyTorch model into a torch.fx graph of module-level nodes.

Granularity: leaf modules of ``torch.nn`` (``Conv2d``, ``BatchNorm2d``, ``ReLU``, ``LSTMCell`` ...) stay
single ``call_module`` nodes; user-defined modules are traced through; torch functions and tensor methods
are ``call_function`` / ``call_method`` nodes. A user-defined submodule whose ``forward`` cannot be traced
symbolically (data-dependent Python control flow, ``.item()``, iteration over a tensor, ...) becomes one
*opaque* ``call_module`` node; the rest of the model stays fine-grained. Only if the root module's own
code cannot be traced is a :class:`~recompute_graph.errors.TraceError` raised.

In-place operations are *functionalized* after tracing (``relu_`` -> ``relu``, ``ReLU(inplace=True)``
-> a copy with ``inplace=False``, ``x += y`` -> ``x + y``) and later readers of the mutated tensor read the
in-place node's result, which is what they saw in the original program. A recomputation schedule can
then keep, free and recompute every value independently; the price is one transient activation where
the original wrote in place. A write through a view (``x.flatten(1)`` then an in-place dropout, ``x[:, :4].zero_()``) is
functionalized the same way when no other alias of the storage (the base, another view) is read after
it; otherwise it is an *unsafe mutation* (``TraceResult.unsafe_mutations``) and the model is traced with
``torch.export`` instead. In-place writes into model inputs, parameters and buffers are kept as they are
(functionalizing them would change what the program does).

Tracing never modifies the user's model: torch.fx only patches functions for the duration of the trace
and the returned ``GraphModule`` refers to the user's submodules and parameters without changing them.
"""
from __future__ import annotations

import copy
import functools
import operator
import os
import traceback
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
from .kept_tensors import (AttributeSnapshot, KeptOutsideTheModel, carried_by_a_trace, containers_keeping_proxies,
                           kept_tensor_message)
from .mode_switches import autocast_switches_refused, grad_mode_switches_refused
from .model_state import preserved_state
from .module_hooks import kept_hook_tensors_refused
from .random_sources import host_random_draws_refused, refuse_generators_made_in_forward

__all__ = ["TraceResult", "BoundInterpreter", "functionalize", "trace", "user_source_location"]

_TORCH_DIR = os.path.dirname(torch.__file__)
#: Tensor constructors that torch.fx cannot trace when a size comes from a traced shape
#: (``torch.zeros(x.shape[0], 4)``); during tracing they record a node instead of failing.
SHAPE_DEPENDENT_CONSTRUCTORS = ("zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange",
                                "eye", "linspace", "tensor", "as_tensor")
_THIS_FILE = os.path.abspath(__file__)
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
        proxy_originals = {dunder: fx.Proxy.__dict__.get(dunder) for dunder in (*IN_PLACE_OPERATORS, "__setattr__")}
        try:
            for name, function in originals.items():
                setattr(torch, name, self._recording(function))
            for dunder, function in IN_PLACE_OPERATORS.items():
                setattr(fx.Proxy, dunder, _in_place_operator(function))
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

    def _recording(self, function: Any) -> Any:
        @functools.wraps(function)
        def constructor(*args: Any, **kwargs: Any) -> Any:
            if any(isinstance(leaf, fx.Proxy) for leaf in tree_flatten((args, kwargs))[0]):
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


_LIBRARY_DIR = os.path.dirname(_THIS_FILE)


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
            opaque[failure.qualname] = _describe(failure.error)
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
        refuse_differentiation_nodes(type(model).__name__, graph, _user_frame)
        graph_module = fx.GraphModule(tracer.root, graph, class_name=f"Traced{type(model).__name__}")
        for name in set(model.__dict__) - set(before[0][1]):  # fx's constants (``_opaque_obj0``): the copy's now
            del model.__dict__[name]
        functionalized, unsafe = functionalize(graph_module)
        return TraceResult(graph_module, tuple(opaque), tuple(opaque.values()), functionalized, unsafe), tracer.made
    raise TraceError(f"tracing {type(model).__name__} did not converge")  # pragma: no cover


#: Out-of-place twins of in-place Python operators.
OUT_OF_PLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
    operator.ipow: operator.pow, operator.iand: operator.and_, operator.ior: operator.or_,
    operator.ixor: operator.xor, operator.ilshift: operator.lshift, operator.irshift: operator.rshift,
    operator.imatmul: operator.matmul,
}
#: Producers whose result may share storage with another tensor: writing into them in place changes that
#: other tensor too, so such writes are not functionalized.
_VIEW_METHODS = frozenset({"view", "view_as", "reshape", "reshape_as", "permute", "transpose", "t", "narrow",
                           "select", "squeeze", "unsqueeze", "flatten", "unflatten", "expand", "expand_as",
                           "split", "chunk", "unbind", "diagonal", "unfold", "as_strided", "movedim",
                           "swapaxes", "detach", "__getitem__", "contiguous", "real", "imag"})


def _out_of_place_twin(gm: fx.GraphModule, node: fx.Node) -> Any:
    """How to rewrite ``node`` out of place: a callable applying the change, or None if not in place."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        twin = _out_of_place_aten_twin(node.target)
        return None if twin is None else (lambda: setattr(node, "target", twin))
    if node.op == "call_function":
        if node.target in OUT_OF_PLACE_OPERATORS:
            twin = OUT_OF_PLACE_OPERATORS[node.target]
            return lambda: setattr(node, "target", twin)
        name = getattr(node.target, "__name__", "")
        if (name.endswith("_") and not name.startswith("_") and getattr(torch, name, None) is node.target
                and callable(getattr(torch, name[:-1], None))):
            twin = getattr(torch, name[:-1])
            return lambda: setattr(node, "target", twin)
        if node.kwargs.get("inplace") is True:
            return lambda: setattr(node, "kwargs", {**node.kwargs, "inplace": False})
    elif node.op == "call_method":
        name = node.target
        if name.endswith("_") and not name.startswith("_") and callable(getattr(torch.Tensor, name[:-1], None)):
            return lambda: setattr(node, "target", name[:-1])
    elif node.op == "call_module":
        module = gm.get_submodule(node.target)
        if getattr(module, "inplace", None) is True:
            def replace_module() -> None:
                twin = copy.copy(module)  # shares parameters; the user's module keeps inplace=True
                twin.inplace = False
                parent, _, leaf = node.target.rpartition(".")
                setattr(gm.get_submodule(parent), leaf, twin)
            return replace_module
    return None


def _out_of_place_aten_twin(op: "torch._ops.OpOverload") -> Any:
    """``aten.relu.default`` for ``aten.relu_.default``, ``aten.add.Tensor`` for ``aten.add_.Tensor``
    (graphs from ``torch.export``); None when ``op`` is not in place or has no twin."""
    namespace, _, name = op._schema.name.partition("::")
    if not name.endswith("_") or name.startswith("_") or not op._schema.arguments:
        return None
    if not (op._schema.arguments[0].alias_info is not None and op._schema.arguments[0].alias_info.is_write):
        return None
    packet = getattr(getattr(torch.ops, namespace, None), name[:-1], None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def _is_view_of_argument(node: fx.Node) -> bool:
    """Whether ``node``'s result may share storage with its first argument (a view, an item, a detach)."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target.is_view
    if node.op == "call_function":
        return node.target is operator.getitem or getattr(node.target, "__name__", "") in _VIEW_METHODS
    return False


def _alias_group(target: fx.Node, gm: fx.GraphModule | None = None) -> tuple[fx.Node, set[fx.Node]]:
    """The base whose storage ``target`` may share (walking up through views and, given ``gm``, through
    writes kept in place: ``w.mul_(0.9).add_(v)`` writes twice into ``w``) and every node that may alias
    it (the base and all views taken from it, transitively)."""
    base = target
    while _is_view_of_argument(base) or (gm is not None and _writes_in_place(gm, base)):
        base = base.args[0]
    members, stack = {base}, [base]
    while stack:
        for user in stack.pop().users:
            if user not in members and _is_view_of_argument(user) and user.args[0] in members:
                members.add(user)
                stack.append(user)
    return base, members


def _writes_in_place(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` writes into its first argument (what :func:`functionalize` has not rewritten)."""
    return (bool(node.args) and isinstance(node.args[0], fx.Node)
            and (_out_of_place_twin(gm, node) is not None or _writes_without_twin(node)))


def _functionalizable(node: fx.Node, mutated: fx.Node, order: dict[fx.Node, int],
                      gm: fx.GraphModule | None = None) -> bool | None:
    """Whether the in-place ``node`` writing into ``mutated`` can become out of place exactly: True when
    nothing but ``mutated`` itself, among the tensors that may share its storage, is read after the
    write (later readers of ``mutated`` then read the new value). None when the write reaches a model
    input, parameter or buffer (kept in place on purpose); False otherwise (a write whose effect other
    aliases would see)."""
    base, members = _alias_group(mutated, gm)
    if base.op in ("placeholder", "get_attr"):
        return None
    for member in members - {mutated}:
        if any(order[user] > order[node] and user is not node for user in member.users):
            return False
    return True


def functionalize(gm: fx.GraphModule) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Rewrite in-place nodes out of place (see the module docstring). Returns the names of the nodes
    rewritten and a description (node, code, source line) of each write into an activation that could
    not be rewritten exactly because another alias of its storage is read after it."""
    rewritten, unsafe = [], []
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if not node.args or not isinstance(node.args[0], fx.Node):
            continue
        rewrite = _out_of_place_twin(gm, node)
        if rewrite is None:
            if _writes_without_twin(node) and _alias_group(node.args[0], gm)[0].op not in ("placeholder", "get_attr"):
                unsafe.append(describe_node(node))  # x[:, :4] = 0, x.copy_(y), x.zero_() on an activation
            continue
        mutated = node.args[0]
        exact = _functionalizable(node, mutated, order, gm)
        if exact is None:
            continue
        if not exact:
            unsafe.append(describe_node(node))
            continue
        rewrite()
        for user in list(mutated.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(mutated, node)
        rewritten.append(node.name)
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return tuple(rewritten), tuple(unsafe)


#: In-place tensor methods that change no values.
_METADATA_IN_PLACE = frozenset({"requires_grad_", "retain_grad", "share_memory_", "resize_", "set_"})


def mutated_input_constraints(gm: fx.GraphModule) -> tuple[frozenset[str], dict[str, set[str]]]:
    """What writes kept in place into a model input, parameter or buffer (:func:`functionalize` keeps
    them) ask of a schedule: ``(once, after)``.

    ``once``: the writing nodes and the nodes that read the written tensor or a view of it before the
    write; a recomputation of either would read the value after the write (``CostNode.reads_mutated_input``).
    ``x.mul_(2)`` on the input, recomputed, doubled it again; a momentum update of a frozen parameter in
    ``forward`` was applied twice. Views are left out (a view of the written storage shows the new values
    however often it is taken), and so is a batch norm reading its running statistics (an exported graph
    writes them back at its end): in training it normalizes with the batch's own, and the executor
    restores the statistics after each recomputation (``stateful``).

    ``after``: for each node, the nodes it must follow besides those it reads: a reader of the written
    tensor after the write follows the write, which follows the readers before it. The graph has no edge
    between them (later readers read the input, not the write's result), and a plan ran the write after
    the first block that read the input (forward outputs off by 4)."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    once: set[str] = set()
    after: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        if not _writes_in_place(gm, node):
            continue
        base, members = _alias_group(node.args[0], gm)
        if base.op not in ("placeholder", "get_attr"):
            continue
        once.add(node.name)
        for user in {user for member in members for user in member.users}:
            if user is node or user in members or user.op == "output":
                continue
            if order[user] > order[node]:
                after.setdefault(user.name, set()).add(node.name)
            elif "batch_norm" not in getattr(user.target, "__name__", str(user.target)):
                once.add(user.name)
                after.setdefault(node.name, set()).add(user.name)
    return frozenset(once), after


def _writes_without_twin(node: fx.Node) -> bool:
    """An in-place write that has no out-of-place twin here: ``operator.setitem``, or a tensor method
    or aten op whose name ends in ``_`` (``copy_``, ``fill_``, ``zero_``, ``index_put_``)."""
    if node.op == "call_function" and node.target is operator.setitem:
        return True
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("_") and node.target not in _METADATA_IN_PLACE
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        arguments = node.target._schema.arguments
        return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
    return False


def describe_node(node: fx.Node) -> str:
    """``name = code`` of an fx node and, when tracing recorded it, the user's source line."""
    text = f"{node.name} = {node.format_node()}"
    location = _user_frame(node.stack_trace or "")
    return f"{text} at {location}" if location else text


def _user_frame(stack_trace: str) -> str:
    """The innermost ``file:line (code)`` of a recorded stack trace outside torch and this library."""
    lines = stack_trace.strip().splitlines()
    found = ""
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith('File "'):
            path = line.split('"')[1]
            if os.path.abspath(path).startswith((_TORCH_DIR, _LIBRARY_DIR)):
                continue
            number = line.split("line ")[1].split(",")[0] if "line " in line else "?"
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            found = f"{path}:{number}" + (f" ({code})" if code else "")
    return found


def _describe(error: BaseException) -> str:
    location = user_source_location(error)
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{type(error).__name__}: {first_line}" + (f" at {location}" if location else "")


def user_source_location(error: BaseException) -> str:
    """``file:line`` of the innermost traceback frame in user code (outside torch and this library)."""
    location = ""
    for frame in traceback.extract_tb(error.__traceback__):
        path = os.path.abspath(frame.filename)
        if path.startswith((_TORCH_DIR, _LIBRARY_DIR)):  # this library's wrappers (random_sources' mode) too
            continue
        location = f"{frame.filename}:{frame.lineno}"
        if frame.line:
            location += f" ({frame.line.strip()})"
    return location


def _trace_error(model: nn.Module, qualname: str, error: BaseException) -> TraceError:
    location = user_source_location(error)
    module = f"{type(model).__name__}" + (f".{qualname}" if qualname else " (the root module)")
    message = (f"cannot trace {module}: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
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
