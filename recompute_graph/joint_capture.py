"""Capturing the functional joint graph of a model and its loss (the compiler path's first stage).

``capture_joint(model, example_inputs, loss_fn=...)`` traces one training step, forward *and* backward,
with AOTAutograd (``torch._functorch.aot_autograd.aot_export_module`` with ``trace_joint=True``) into one
aten-level ``fx.GraphModule``:

* its placeholders are the *primals*: the trainable parameters, then the buffers, then the user's
  tensor inputs (``JointGraph.parameter_names``, ``buffer_names``, ``input_count``);
* the graph is functional: in-place ops and writes through views are functionalized, and a buffer the
  step writes (BatchNorm's running statistics, ``num_batches_tracked``) is an *output*, its new value
  (``JointGraph.buffer_updates``), never a mutation;
* its outputs are, in order, the buffer updates, the loss, and the gradients of the parameters (those
  the loss reaches; the others are ``None``): the loss's own tangent, a ``ones_like`` of the loss, is
  inside the graph, so there are no tangent inputs;
* every node is either *forward* (an ancestor of the loss or of a buffer update: it runs in the
  forward pass) or *backward* (the rest: the gradient computation, and forward values that only the
  backward reads, such as BatchNorm's saved statistics), ``JointGraph.forward_nodes`` /
  ``backward_nodes``.

Random ops (``native_dropout``, ``bernoulli``) draw from the global generators in graph order. A
recomputation of one of them would draw a different mask, so the compiler path never recomputes a
random node: its outputs are always saved (``JointGraph.random_nodes``).

When AOTAutograd cannot trace the model directly, the step is exported first (``torch.export``, on
which model code such as ``transformers``' masks takes a traceable path) and the exported program is
captured, without the parameters it never reads (export reads a tied weight under one of its names).

A model that cannot be captured whole (data-dependent control flow, an op without a fake-tensor
implementation) raises :class:`CaptureError` naming the reason and, when it can be found, the user's
source line; ``optimize()`` then keeps the module-level path.

:meth:`JointGraph.run` executes the captured step on the model's current parameters and buffers and
returns the loss, the parameter gradients by name and the buffers' new values, so a capture can be
checked against eager autograd (tests/test_joint_capture.py).

Under a user's own ``torch.compile(model, backend=rg.backend(...))`` two things of the captured graphs
are checked before planning: symbolic shapes are refused (:func:`refuse_symbolic_shapes`, a plan's bytes
hold for one shape), and a graph a graph break ended is warned about (:func:`warn_of_graph_break`).
"""
from __future__ import annotations

import linecache
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .autograd_in_forward import export_refusals
from .errors import DynamicShapesError, GraphBreakWarning, TraceError, user_stacklevel
from .losses import default_training_loss
from .model_state import preserved_state
from .native_kernels import native_kernels

__all__ = ["CaptureError", "JointGraph", "capture_joint", "RANDOM_TARGETS", "reachable", "op_name",
           "refuse_symbolic_shapes",
           "warn_of_graph_break", "RESUME_PREFIX"]

#: aten ops that draw from the random generators (overload packets, compared by name).
RANDOM_TARGETS = frozenset({"native_dropout", "bernoulli", "bernoulli_", "rand", "rand_like", "randn",
                            "randn_like", "randint", "randint_like", "randperm", "normal", "uniform",
                            "exponential", "multinomial", "rrelu_with_noise"})


class CaptureError(TraceError):
    """The model and its loss could not be captured as one functional joint graph."""


@dataclass(frozen=True)
class JointGraph:
    """One training step as a functional aten graph (module docstring)."""

    graph_module: fx.GraphModule
    call: _Call                         # the structure of the captured call: which leaves are inputs
    parameter_names: tuple[str, ...]    # trainable parameters (a tied one under each name), first
    buffer_names: tuple[str, ...]       # then the buffers
    input_count: int                    # then the user's tensor inputs
    buffer_updates: tuple[str, ...]     # the buffers the step writes, in the order of the first outputs
    gradient_names: tuple[str | None, ...]  # per parameter: the output node of its gradient, or None
    loss_node: str                      # the output node holding the loss
    forward_nodes: frozenset[str]
    backward_nodes: frozenset[str]
    random_nodes: frozenset[str]

    def __repr__(self) -> str:
        ops = sum(1 for n in self.graph_module.graph.nodes if n.op == "call_function")
        return (f"JointGraph({ops} aten ops: {len(self.forward_nodes)} forward, {len(self.backward_nodes)} "
                f"backward; {len(self.parameter_names)} parameters, {len(self.buffer_names)} buffers "
                f"({len(self.buffer_updates)} updated), {self.input_count} inputs, "
                f"{len(self.random_nodes)} random)")

    def primals(self, model: nn.Module, args: Sequence[Any], kwargs: dict | None = None) -> list[torch.Tensor]:
        """The placeholder values for ``model``'s current parameters and buffers and a call like the
        captured one (``model(*args, **kwargs)``, same structure, same constants)."""
        call, inputs = _Call.of(tuple(args), dict(kwargs or {}))
        if call != self.call:
            raise CaptureError("this call's structure or constants differ from the captured call's")
        parameters = dict(model.named_parameters(remove_duplicate=False))  # tied weights under each name
        buffers = dict(model.named_buffers(remove_duplicate=False))
        return ([parameters[n] for n in self.parameter_names] + [buffers[n] for n in self.buffer_names]
                + list(inputs))

    def run(self, model: nn.Module, args: Sequence[Any], kwargs: dict | None = None
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
        """Execute the captured step: ``(loss, gradient per parameter name, new value per updated
        buffer name)``; a tied parameter's gradients are summed under the name ``named_parameters()``
        gives it. Nothing is written into ``model``."""
        with torch.no_grad():
            outputs = self.graph_module(*self.primals(model, args, kwargs))
        updates = dict(zip(self.buffer_updates, outputs[:len(self.buffer_updates)]))
        loss = outputs[len(self.buffer_updates)]
        grads = list(outputs[len(self.buffer_updates) + 1:])[:len(self.parameter_names)]
        # a tied weight is one placeholder per name: its gradient is the sum, under its first name
        canonical = {id(p): name for name, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
        tensors = dict(model.named_parameters(remove_duplicate=False))
        summed: dict[str, torch.Tensor | None] = {}
        for name, grad in zip(self.parameter_names, grads):
            key = canonical[id(tensors[name])]
            if grad is not None and summed.get(key) is not None:
                summed[key] = summed[key] + grad
            elif summed.get(key) is None:
                summed[key] = grad
        return loss, summed, updates


class _StepOf(nn.Module):
    """The model followed by the loss, returning ``(loss,)`` as ``aot_export_module`` wants it. Its
    positional inputs are the tensor leaves of the call's ``(args, kwargs)``; the other leaves are the
    call's constants."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any], torch.Tensor], call: _Call) -> None:
        super().__init__()
        self.model, self.loss_fn, self.call = model, loss_fn, call

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor]:
        args, kwargs = self.call.rebuild(tensors)
        return (self.loss_fn(self.model(*args, **kwargs)),)


def _drop_unread_parameters(exported: fx.GraphModule) -> None:
    """Remove the parameters the exported graph never reads: export reads a tied weight under one of its
    names, and AOTAutograd wants a gradient for every parameter it is given (a parameter the loss does
    not reach at all then has no gradient, ``None``, as in eager)."""
    for node in [n for n in exported.graph.nodes if n.op == "get_attr" and not n.users]:
        exported.graph.erase_node(node)
    exported.recompile()
    read = {n.target for n in exported.graph.nodes if n.op == "get_attr"}
    for name, _ in list(exported.named_parameters(remove_duplicate=False)):
        if name not in read:
            owner, _, attribute = name.rpartition(".")
            del exported.get_submodule(owner)._parameters[attribute]


@dataclass(frozen=True)
class _Call:
    """The structure of a call ``model(*args, **kwargs)``: its pytree spec, and each leaf either a tensor
    (a graph input, ``None`` here) or a constant."""

    spec: Any
    constants: tuple[Any, ...]

    @staticmethod
    def of(args: tuple, kwargs: dict) -> tuple["_Call", list[torch.Tensor]]:
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        return _Call(spec, tuple(None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)), tensors

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple, dict]:
        given = iter(tensors)
        leaves = [next(given) if constant is None else constant for constant in self.constants]
        return tree_unflatten(leaves, self.spec)


def capture_joint(model: nn.Module, example_inputs: Sequence[Any], example_kwargs: dict | None = None,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None) -> JointGraph:
    """Capture ``loss_fn(model(*example_inputs, **example_kwargs))`` and its backward as one functional
    joint graph (module docstring; default loss ``losses.default_training_loss``). The tensors of the
    call, keyword arguments included, are graph inputs; its other values are constants. The model's
    buffers and the random generators are as they were afterwards. Raises :class:`CaptureError`."""
    from torch._functorch.aot_autograd import aot_export_module
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected an nn.Module, got {type(model).__name__}")
    call, tensors = _Call.of(tuple(example_inputs), dict(example_kwargs or {}))
    frozen = [p for p in model.parameters() if not p.requires_grad]
    if frozen:
        raise CaptureError(f"{len(frozen)} parameters do not require grad; the joint capture needs every "
                           "parameter trainable (frozen parameters: use the module-level path)")
    step = _StepOf(model, loss_fn or default_training_loss, call)
    with preserved_state(model, rng=True), native_kernels():
        try:
            gm, signature = aot_export_module(step, tuple(tensors), trace_joint=True, output_loss_index=0)
        except Exception as error:  # noqa: BLE001 - any failure to capture is reported the same way
            try:
                # through torch.export: model code that asks "am I being exported?" (transformers'
                # masks) takes its traceable path, and one graph without Python control flow comes back
                with export_refusals(type(model).__name__):  # what the exported graph would lose
                    exported = torch.export.export(step, tuple(tensors), strict=False).module()
                _drop_unread_parameters(exported)
                gm, signature = aot_export_module(exported, tuple(tensors), trace_joint=True,
                                                  output_loss_index=0)
            except Exception:  # noqa: BLE001 - the first failure is the one to report
                raise CaptureError(_describe_failure(model, error)) from error
    prefix = "model."
    parameter_names = tuple(name[len(prefix):] for name in signature.parameters)
    buffer_names = tuple(name[len(prefix):] for name in signature.buffers)
    grads = signature.backward_signature.gradients_to_parameters if signature.backward_signature else {}
    by_parameter = {name[len(prefix):]: node for node, name in grads.items()}
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = list(output_node.args[0])
    buffer_updates = tuple(signature.buffers_to_mutate[o.name][len(prefix):]
                           for o in outputs[:len(signature.buffers_to_mutate)])
    loss_node = outputs[len(signature.buffers_to_mutate)]
    forward = reachable([loss_node, *outputs[:len(signature.buffers_to_mutate)]], lambda n: n.all_input_nodes)
    computing = [n for n in gm.graph.nodes if n.op == "call_function"]
    forward_nodes = frozenset(n.name for n in computing if n in forward)
    backward_nodes = frozenset(n.name for n in computing if n not in forward)
    random_nodes = frozenset(n.name for n in computing if op_name(n.target) in RANDOM_TARGETS)
    return JointGraph(gm, call, parameter_names, buffer_names, len(signature.user_inputs), buffer_updates,
                      tuple(by_parameter.get(name) for name in parameter_names), loss_node.name,
                      forward_nodes, backward_nodes, random_nodes)


def reachable(roots: list[fx.Node], neighbours: Callable[[fx.Node], Any]) -> set[fx.Node]:
    """The nodes reached from ``roots`` (included) by following ``neighbours(node)``."""
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(neighbours(node))
    return seen


def op_name(target: Any) -> str:
    """``aten.native_dropout.default`` -> ``"native_dropout"``."""
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _describe_failure(model: nn.Module, error: BaseException) -> str:
    """Why the capture failed, with the innermost frame of user code (not torch's) when there is one."""
    frames = traceback.extract_tb(error.__traceback__)
    user = [f for f in frames if "/torch/" not in f.filename and "recompute_graph" not in f.filename]
    where = f"\n  at {user[-1].filename}:{user[-1].lineno} ({(user[-1].line or '').strip()})" if user else ""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (f"cannot capture the training step of {type(model).__name__} as one joint graph: "
            f"{type(error).__name__}: {first_line}{where}\n  Data-dependent control flow and ops without "
            "a fake-tensor implementation cannot be captured whole; the module-level path still plans "
            "such a model.")


def refuse_symbolic_shapes(joint: fx.GraphModule) -> None:
    """``DynamicShapesError`` when an input of ``joint`` has a symbolic size (or is one): the graph was
    compiled for a range of shapes, and its bytes cannot be priced. Before this check, such a graph
    was priced with sizes that were ``SymInt``s, and the solvers' arithmetic on them ran for minutes."""
    symbolic = []
    for node in joint.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        sizes = (value,) if isinstance(value, torch.SymInt) else (
            tuple(value.shape) if isinstance(value, torch.Tensor) else ())
        if any(isinstance(size, torch.SymInt) for size in sizes):
            symbolic.append(f"{node.name} {tuple(str(s) for s in sizes) if len(sizes) > 1 else sizes[0]}")
    if symbolic:
        raise DynamicShapesError(
            f"the graph has symbolic shapes ({', '.join(symbolic[:3])}{', ...' if len(symbolic) > 3 else ''}): "
            "torch.compile compiled it for a range of shapes, as it does when an input's shape changes "
            "between calls, and a plan's bytes hold for one shape. Compile with "
            "torch.compile(model, backend=rg.backend(...), dynamic=False), which plans each new shape "
            "again, or use rg.optimize(model, budget), which does so.")


#: The name Dynamo gives the code after a graph break (a resume function's frame)
RESUME_PREFIX = "torch_dynamo_resume_in_"


def warn_of_graph_break(gm: fx.GraphModule) -> bool:
    """Whether the graph Dynamo hands a backend is one of several graphs of a step: it ends at a graph
    break (its ``compile_subgraph_reason``), which is warned about with a ``GraphBreakWarning`` naming
    the break's file, line and code, or it is the code after one (a resume function's)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    stack = getattr(reason, "user_stack", None) or []
    resumed = any(frame.name.startswith(RESUME_PREFIX) for frame in stack)
    if not getattr(reason, "graph_break", False):
        return resumed
    where = ""
    if stack:
        code = linecache.getline(stack[-1].filename, stack[-1].lineno).strip()
        where = f" at {stack[-1].filename}:{stack[-1].lineno}" + (f" (`{code}`)" if code else "")
    why = (str(getattr(reason, "reason", "")).strip().splitlines() or ["no reason given"])[0]
    warnings.warn(
        f"torch.compile split the model at a graph break{where}, Dynamo's reason: {why}. rg.backend "
        "learns the step's graphs in the first step, which runs each graph at its smallest-memory plan, "
        "then plans them together within the budget from the second step on (the backend's step_plan); "
        "what runs at the break itself is not counted. Remove the break (torch.compile(..., "
        "fullgraph=True) raises at it), or use rg.optimize(model, budget), which captures the model "
        "whole or plans it with the schedule executor.", GraphBreakWarning, stacklevel=user_stacklevel())
    return True
