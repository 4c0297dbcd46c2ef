"""In-place writes in a traced fx graph made out of place, where that is exact (*functionalization*).

``relu_`` -> ``relu``, ``ReLU(inplace=True)`` -> a copy with ``inplace=False``, ``x += y`` -> ``x + y``; a
write with no out-of-place twin (``x[:, 1:] = y``, ``x.copy_(y)``, ``x.zero_()``) becomes a write into a
copy of ``x`` (:func:`setitem_into_copy`, :func:`method_into_copy`). Later readers of the written tensor
then read the rewritten node's result, which is what they saw in the original program, and a
recomputation schedule can keep, free and recompute every value independently. The price is one
transient activation where the original wrote in place.

Invariant: a write is rewritten only when nothing but the written tensor itself, among the tensors that
may share its storage (its base and every view of it), is read after the write. Otherwise it is an
*unsafe mutation*, reported for the caller to refuse or to trace with ``torch.export``. Writes into
model inputs, parameters and buffers are kept in place (rewriting them would change what the program
does); :func:`mutated_input_constraints` says what they ask of a schedule.
"""
from __future__ import annotations

import copy
import operator
from typing import Any

import torch
from torch import fx

from .source_lines import describe_node

__all__ = ["functionalize", "method_into_copy", "mutated_input_constraints", "setitem_into_copy"]


def setitem_into_copy(tensor: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """``tensor[index] = value`` made out of place: a copy of ``tensor`` (its strides kept) with the write."""
    written = tensor.clone()
    written[index] = value
    return written


def method_into_copy(tensor: torch.Tensor, method: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``tensor.<method>(*args, **kwargs)``, an in-place method with no out-of-place twin (``copy_``,
    ``zero_``), made out of place: the write into a copy of ``tensor`` (its strides kept)."""
    written = tensor.clone()
    getattr(written, method)(*args, **kwargs)
    return written


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
    """Whether the in-place ``node`` writing into ``mutated`` can become out of place exactly: True when,
    among the tensors that may share its storage, only ``mutated`` itself and the views taken from it
    after the write (``h[:, 0] = 0`` then ``h[:, :4]``), which will read the new value, are read after
    the write (later readers of ``mutated`` are handed the rewritten node). None when the write reaches a
    model input, parameter or buffer (kept in place on purpose); False otherwise (a write whose effect
    other aliases would see: the base of a written view, a view taken before the write)."""
    base, members = _alias_group(mutated, gm)
    if base.op in ("placeholder", "get_attr"):
        return None
    fresh = {mutated}  # what reads the new value once rewritten: mutated, views of it taken after the write
    for member in sorted(members - {mutated}, key=order.__getitem__):
        if order[member] > order[node] and member.args[0] in fresh:
            fresh.add(member)
        elif any(order[user] > order[node] and user is not node for user in member.users):
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
        rewrite = _out_of_place_twin(gm, node) or _write_into_copy(node)
        if rewrite is None:
            if _writes_without_twin(node) and _alias_group(node.args[0], gm)[0].op not in ("placeholder", "get_attr"):
                unsafe.append(describe_node(node))  # an aten write of an fx graph (export's are functional)
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


def _write_into_copy(node: fx.Node) -> Any:
    """How to rewrite a write with no out-of-place twin into a write into a copy (``x[i] = v`` ->
    ``setitem_into_copy(x, i, v)``, ``x.zero_()`` -> ``method_into_copy(x, "zero_")``), or None."""
    if not _writes_without_twin(node):
        return None
    if node.op == "call_function" and node.target is operator.setitem:
        return lambda: setattr(node, "target", setitem_into_copy)
    if node.op == "call_method":
        method = node.target

        def into_copy() -> None:
            node.op, node.target = "call_function", method_into_copy
            node.args = (node.args[0], method, *node.args[1:])
        return into_copy
    return None
