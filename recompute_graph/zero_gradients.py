"""The gradients of the outputs a training loss does not reach: zero, and not made (compiler path).

A ``transformers`` language model given ``labels`` returns its own loss beside the logits and the cached
keys and values, and training backpropagates the loss alone. AOTAutograd's backward takes one gradient
(*tangent*) per differentiable output, and autograd fills those the loss does not reach with zeros when
the backward starts: a logits-sized tensor, and a sum adding it to the gradient the loss sends, that
eager PyTorch never makes (a GPT-2 at vocabulary 50,257 held 1.244 of eager's peak in a store-all step:
``python scripts/unreached_output_gradients.py``). Here such a tangent is known to be zero, and folded
away:

* Planning (``joint_lowering.price_joint``): the outputs the planned loss does not reach
  (``joint_allocations.LossOnOutputs.unreached_outputs``) name their tangents (:func:`unreached_tangents`,
  by AOTAutograd's descriptors), and the joint graph is priced with them folded (:func:`fold_zero_tangents`)
  where that leaves its units as they are (the units' forward nodes cannot change: only backward nodes
  read a tangent).
* Lowering (``joint_lowering.lower_plan``): the plan is lowered on the joint graph as it is, the
  backward every call can run, and the same backward with those tangents folded is derived from it
  (``Lowered.planned_backward_graph``): same placeholders, same saved values.
* Running (``compile_backend``): after each forward, autograd is told to leave the outputs' missing
  gradients missing (:func:`leave_gradients_missing`), and :class:`ZeroTangentBackward` runs the folded
  backward when those gradients are missing, else the whole one, with zeros in place of any missing
  gradient. A loss that reaches such an output after all (``out.loss + out.logits.sum()``) gets its
  exact gradients, with the memory of the unfolded backward.

Folding (invariant: the folded graph returns what the graph returns when the zero tangents are zeros,
up to the sign of zero and to ``0 * inf``): a node is *zero* when it is a zero tangent, an op linear in
its first argument (a view, a sum, a cast, an activation's or a loss's backward) whose first argument is
zero, a product (``mul``, ``mm``, ``bmm``) one of whose factors is zero, a sum of zeros, or an item of a
zero tuple. ``add(x, zero)`` and ``sub(x, zero)`` are ``x`` where ``x`` has the sum's shape and dtype, or a
copy of ``x`` laid out as the sum is where their strides differ (a later ``view`` may rely on the sum's).
Any other node reading a zero reads real zeros (``aten.zeros``, made once before its first such reader, laid
out as the zero value is),
and so do the graph's outputs (a parameter gradient only an unreached output would send is zeros, as
AOTAutograd returns it). Zero nodes are then dead code and removed.
"""
from __future__ import annotations

import operator
from typing import Any, Collection, Iterable, Sequence

import torch
from torch import fx

from .joint_capture import reachable
from .joint_partition import copy_graph_module
from .joint_units import is_tangent

__all__ = ["unreached_tangents", "fold_zero_tangents", "folds_cleanly", "outputs_without_gradient",
           "leave_gradients_missing", "ZeroTangentBackward"]

#: Ops whose result is zero when their first argument is: views, reductions, casts, and the backward
#: kernels that are linear in the gradient they take first (every output of a multi-output one)
LINEAR_IN_FIRST = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "squeeze", "unsqueeze", "slice",
    "select", "clone", "contiguous", "_to_copy", "convert_element_type", "alias", "as_strided", "neg", "sum",
    "mean", "div", "split", "split_with_sizes", "unbind", "chunk", "flip", "roll", "repeat",
    "tanh_backward", "sigmoid_backward", "threshold_backward", "gelu_backward", "silu_backward",
    "hardtanh_backward", "leaky_relu_backward", "hardswish_backward", "hardsigmoid_backward", "elu_backward",
    "_softmax_backward_data", "_log_softmax_backward_data", "native_dropout_backward", "nll_loss_backward",
    "nll_loss2d_backward", "slice_backward", "select_backward", "embedding_dense_backward",
    "native_layer_norm_backward", "native_group_norm_backward", "native_batch_norm_backward",
    "convolution_backward", "max_pool2d_with_indices_backward", "avg_pool2d_backward",
    "_adaptive_avg_pool2d_backward", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward", "_efficient_attention_backward", "_flash_attention_backward",
})
#: ``meta`` key of the zeros folding makes for a reader that needs real ones (a backward node)
FOLDED_ZEROS = "folded_zeros"
#: Products: zero when any tensor factor is
PRODUCTS = frozenset({"mul", "mm", "bmm", "matmul"})


def _name(node: fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", "") if packet is not None else getattr(target, "__name__", "")


def _tangent_outputs(joint: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Each tangent placeholder of ``joint`` with the forward output it is the gradient of, matched by
    AOTAutograd's descriptors (``TangentAOTInput.output`` against the output node's ``meta["desc"]``);
    empty where the graph has none."""
    output = next(n for n in joint.graph.nodes if n.op == "output")
    descriptions, flat = output.meta.get("desc"), output.args[0]
    if descriptions is None or len(descriptions) != len(flat):
        return {}
    by_description = {repr(d): v for d, v in zip(descriptions, flat)}
    pairs = {}
    for node in joint.graph.nodes:
        if node.op == "placeholder" and is_tangent(node):
            value = by_description.get(repr(getattr(node.meta.get("desc"), "output", None)))
            if isinstance(value, fx.Node):
                pairs[node] = value
    return pairs


def unreached_tangents(joint: fx.GraphModule, unreached_outputs: Collection[str]) -> list[str]:
    """The names of the tangent placeholders of the forward outputs named ``unreached_outputs`` (the
    outputs the planned loss sends no gradient to); [] where there are none."""
    if not unreached_outputs:
        return []
    return [t.name for t, value in _tangent_outputs(joint).items() if value.name in unreached_outputs]


def outputs_without_gradient(joint: fx.GraphModule) -> set[fx.Node]:
    """The forward outputs no gradient arrives for: those whose tangent nothing reads (folded away), and,
    where every tangent is matched with its output, the forward outputs with no tangent at all. An output
    that is a view of an intermediate (ProphetNet's ``logits``, ``logits_ngram``: two views of one
    tensor) has none: AOTAutograd returns the intermediate as another output, which takes the tangent, and
    remakes the views outside the graph (both views' gradients were charged at the backward's start, a
    logits-sized tensor the step never makes: predicted 1.18 of the measured peak)."""
    pairs = _tangent_outputs(joint)
    missing = {value for tangent, value in pairs.items() if not tangent.users}
    tangents = [n for n in joint.graph.nodes if n.op == "placeholder" and is_tangent(n)]
    output = next(n for n in joint.graph.nodes if n.op == "output")
    if pairs and len(pairs) == len(tangents):
        paired = set(pairs.values())
        missing |= {value for description, value in zip(output.meta["desc"], output.args[0])
                    if isinstance(value, fx.Node) and value not in paired
                    and type(description).__name__ in _FORWARD_OUTPUT_DESCRIPTIONS}
    return missing


#: AOTAutograd's descriptions of the joint graph's forward outputs that a tangent may pair with
_FORWARD_OUTPUT_DESCRIPTIONS = frozenset({"PlainAOTOutput", "IntermediateBaseAOTOutput"})


def _backward_reads(graph: fx.Graph) -> tuple[set[str], set[str]]:
    """The names of the nodes no tangent reaches (forward nodes, coefficients, placeholders but the
    tangents), and of those of them that a node a tangent reaches reads."""
    seeds = [n for n in graph.nodes if (n.op == "placeholder" and is_tangent(n)) or n.meta.get(FOLDED_ZEROS)]
    reached = reachable(seeds, lambda n: [u for u in n.users if u.op != "output"])
    forward = {n.name for n in graph.nodes if n not in reached and n.op != "output"}
    read = {a.name for n in reached for a in n.all_input_nodes if a not in reached}
    return forward, read


def folds_cleanly(joint: fx.GraphModule, folded: fx.GraphModule) -> bool:
    """Whether folding left ``joint``'s forward as it is: the same nodes no tangent reaches, and the same
    of them read by the backward (so the same values saved). Else a forward value read only where a
    zero was folded would be priced as let go of after the forward, and the lowering, which lowers
    ``joint`` itself, saves it."""
    return _backward_reads(joint.graph) == _backward_reads(folded.graph)


def _is_zero(node: fx.Node, zero: set[fx.Node]) -> bool:
    """Whether ``node`` (whose inputs are decided) is zero given the zero nodes ``zero``."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return node.args[0] in zero
    name = _name(node)
    if name in LINEAR_IN_FIRST:
        return bool(node.args) and node.args[0] in zero
    if name in PRODUCTS:
        return any(a in zero for a in node.args[:2])
    if name in ("add", "sub") and len(node.args) == 2:
        return all(a in zero for a in node.args)
    return False


def _passed_through(node: fx.Node, zero: set[fx.Node]) -> fx.Node | None:
    """The other term of ``add(x, zero)``, ``add(zero, x)`` or ``sub(x, zero)`` when it stands for the
    sum (its shape and dtype, no ``alpha``); else None."""
    if node.op != "call_function" or _name(node) not in ("add", "sub") or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if b in zero and isinstance(a, fx.Node) and a not in zero:
        other = a
    elif _name(node) == "add" and a in zero and isinstance(b, fx.Node) and b not in zero:
        other = b
    else:
        return None
    mine, theirs = node.meta.get("val"), other.meta.get("val")
    if not isinstance(mine, torch.Tensor) or not isinstance(theirs, torch.Tensor):
        return None
    return other if mine.shape == theirs.shape and mine.dtype == theirs.dtype else None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (of one shape) step through memory alike (dimensions of size 1 aside)."""
    return all(size == 1 or x == y for size, x, y in zip(a.shape, a.stride(), b.stride()))


def _dense_order(value: torch.Tensor) -> list[int] | None:
    """The dimensions of ``value`` from outermost to innermost in memory when it is dense and does not
    overlap (a permutation of a contiguous tensor), else None."""
    order = sorted(range(value.dim()), key=lambda d: -value.stride(d))
    expected = 1
    for d in reversed(order):
        if value.shape[d] != 1 and value.stride(d) != expected:
            return None
        expected *= value.shape[d]
    return order


def _inverse(order: list[int]) -> list[int]:
    """The permutation that undoes ``permute(x, order)``."""
    return sorted(range(len(order)), key=order.__getitem__)


def _call(graph: fx.Graph, target: Any, node: fx.Node, *args: Any, **kwargs: Any) -> fx.Node:
    """``target(node, *args, **kwargs)`` at the graph's insertion point, with its (fake) value."""
    made = graph.call_function(target, (node, *args), kwargs)
    made.meta["val"] = target(node.meta["val"], *args, **kwargs)
    return made


def _laid_out_like(graph: fx.Graph, source: fx.Node, value: torch.Tensor, before: fx.Node) -> fx.Node | None:
    """A copy of ``source`` (inserted before ``before``) laid out as ``value`` is, which must be dense:
    ``permute(clone(permute(source, order)), inverse)``; None where ``value`` is not dense."""
    order = _dense_order(value)
    if order is None:
        return None
    aten, permuted = torch.ops.aten, order != sorted(order)
    with graph.inserting_before(before):
        node = _call(graph, aten.permute.default, source, order) if permuted else source
        node = _call(graph, aten.clone.default, node, memory_format=torch.contiguous_format)
        return _call(graph, aten.permute.default, node, _inverse(order)) if permuted else node


def _zeros_value(value: torch.Tensor, order: list[int]) -> torch.Tensor:
    """A value for ``meta["val"]`` of new zeros shaped like ``value`` with its dimensions in ``order``: a
    storage of its own (fake where ``value`` is)."""
    shape = [value.shape[d] for d in order]
    mode = getattr(value, "fake_mode", None)
    if mode is not None:
        with mode:
            return torch.empty(shape, dtype=value.dtype, device=value.device)
    return torch.empty(shape, dtype=value.dtype, device="meta")


def fold_zero_tangents(graph_module: fx.GraphModule, tangents: Iterable[str], *,
                       drop_placeholders: bool = False) -> fx.GraphModule:
    """A copy of ``graph_module`` (a joint or a backward graph) in which the placeholders named
    ``tangents`` are zero and folded away (module docstring). ``drop_placeholders``: remove those
    placeholders too (the folded backward is then called without them); else they stay, unread."""
    copied = copy_graph_module(graph_module)
    graph = copied.graph
    names = set(tangents)
    zero: set[fx.Node] = {n for n in graph.nodes if n.op == "placeholder" and n.name in names}
    materialized: dict[fx.Node, fx.Node] = {}

    def real_zeros(value_node: fx.Node, before: fx.Node) -> fx.Node:
        if value_node not in materialized:
            value = value_node.meta["val"]
            order = _dense_order(value) or list(range(value.dim()))
            with graph.inserting_before(before):
                made = graph.call_function(torch.ops.aten.zeros.default, ([value.shape[d] for d in order],),
                                           {"dtype": value.dtype, "layout": torch.strided, "device": value.device,
                                            "pin_memory": False})
                made.meta["val"] = _zeros_value(value, order)
                made.meta[FOLDED_ZEROS] = True
                if order != sorted(order):  # laid out as the zero value is: a reader's result may rely on it
                    made = _call(graph, torch.ops.aten.permute.default, made, _inverse(order))
            materialized[value_node] = made
        return materialized[value_node]

    for node in list(graph.nodes):
        if node in zero or node.op == "placeholder":
            continue
        if _is_zero(node, zero) and isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
            zero.add(node)
            continue
        other = _passed_through(node, zero)
        if other is not None and not _same_layout(node.meta["val"], other.meta["val"]):
            other = _laid_out_like(graph, other, node.meta["val"], before=node)
        if other is not None:
            node.replace_all_uses_with(other)
            graph.erase_node(node)
            continue
        if any(a in zero for a in node.all_input_nodes):
            def swap(a: Any) -> Any:
                return real_zeros(a, node) if isinstance(a, fx.Node) and a in zero else a
            node.args = fx.map_arg(node.args, swap)
            node.kwargs = fx.map_arg(node.kwargs, swap)
    for node in reversed(list(graph.nodes)):
        if node in zero and node.op != "placeholder" and not node.users:
            graph.erase_node(node)
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in names]:
        if node.users:
            raise RuntimeError(f"folding the zero tangent {node.name}: still read by {list(node.users)}")
        if drop_placeholders:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    copied.recompile()
    return copied


def leave_gradients_missing(outputs: Sequence[Any]) -> None:
    """Tell autograd not to fill the missing gradients of ``outputs`` (the compiled graph's) with zeros:
    their ``CompiledFunctionBackward`` node (the output's own, or one below a view AOTAutograd replays
    on it) gets ``set_materialize_grads(False)``, and its backward receives None for an output the loss
    does not reach (:class:`ZeroTangentBackward` takes it from there)."""
    done: set[int] = set()
    for value in outputs:
        node = getattr(value, "grad_fn", None) if isinstance(value, torch.Tensor) else None
        for candidate in (node, *(f for f, _ in getattr(node, "next_functions", ()) if f is not None)):
            if type(candidate).__name__ == "CompiledFunctionBackward" and id(candidate) not in done:
                done.add(id(candidate))
                candidate.set_materialize_grads(False)


class ZeroTangentBackward:
    """A backward graph's compiled function for AOTAutograd (boxed convention) that runs ``folded`` (the
    backward with the tangents at ``zero_positions`` folded away and dropped) when exactly those
    arguments are None, else ``compile_whole()``'s function (compiled on first need) with zeros in place
    of every None tangent. ``tangent_values``: each tangent position's ``meta["val"]`` (shape, dtype,
    device of the zeros)."""

    _boxed_call = True

    def __init__(self, folded: Any, compile_whole: Any, zero_positions: Sequence[int],
                 tangent_values: dict[int, torch.Tensor]) -> None:
        self.folded, self.compile_whole, self.whole = folded, compile_whole, None
        self.zero_positions, self.tangent_values = frozenset(zero_positions), tangent_values
        self.folded_calls = self.whole_calls = 0

    def __repr__(self) -> str:
        return (f"ZeroTangentBackward({len(self.zero_positions)} tangents folded; ran folded "
                f"{self.folded_calls} times, whole {self.whole_calls} times)")

    def __call__(self, args: list) -> Any:
        if all(args[i] is None for i in self.zero_positions):
            self._fill(args, skip=self.zero_positions)
            kept = [a for i, a in enumerate(args) if i not in self.zero_positions]
            args.clear()
            self.folded_calls += 1
            return self.folded(kept)
        self._fill(args, skip=frozenset())
        if self.whole is None:
            self.whole = self.compile_whole()
        self.whole_calls += 1
        return self.whole(args)

    def _fill(self, args: list, skip: frozenset[int]) -> None:
        for i, value in self.tangent_values.items():
            if i not in skip and args[i] is None:
                args[i] = torch.zeros(value.shape, dtype=value.dtype, device=value.device)
