"""Coefficients: the joint graph's nodes no gradient reaches that the forward's outputs do not need.

AOTAutograd traces a backward formula's factors that read no gradient (``2 * x`` of ``pow(x, 2)``'s
backward, the tanh terms of a custom ``autograd.Function``'s GELU, the ``clone`` a functionalized
``silu_`` keeps of its input) beside the forward. Taken as forward units, a store-all plan saves them;
made in the backward, they cost their inputs' bytes, kept to then, and their temporaries there.

* :func:`drop_backward_copies`: a ``clone`` only the backward reads is read as its input (the graph is
  functional), unless it copies part of a storage;
* :func:`coefficients_made_in_the_backward`: which coefficients the backward makes, judged by bytes;
* :func:`coefficients_with_their_reader`: each moved coefficient goes with the unit whose backward
  reads it.

``joint_units`` uses all three. Units: bytes (from the nodes' fake tensors).
"""
from __future__ import annotations

import networkx as nx
import torch
from torch import fx

from .joint_capture import op_name, reachable
from .joint_storage import storage_of

__all__ = ["is_tangent", "drop_backward_copies", "coefficients_made_in_the_backward",
           "coefficients_with_their_reader"]


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" in node.name


def drop_backward_copies(joint: fx.GraphModule, num_fwd_outputs: int) -> int:
    """Erase from ``joint`` each ``clone`` of a whole storage, with its layout, that no tangent reaches
    and the model does not return: its readers read its input instead. The graph is functional, so both
    hold the same values for the whole step. Returns how many.

    * Functionalized, an in-place activation (EfficientNet's ``silu_``) is a ``clone`` of its input,
      kept for its backward, beside the ``silu``: the backward would copy a value it can read as it is.
    * ``nn.Dropout(0.0)`` in training returns its input itself in eager PyTorch, and AOTAutograd traces
      it as a ``clone``. After a softmax (the attention dropout of timm's and torchvision's Swin), the
      forward saved the softmax for its backward and the copy (through the ``bmm``'s views) for the
      ``bmm``'s: two attention matrices where eager saves one.

    Not a copy of a placeholder's storage (an input or a buffer the step writes back before the
    backward runs), of part of a storage (a slice: reading it would keep its whole base), or to another
    layout (the views read from the copy follow its strides)."""
    nodes = list(joint.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    gradient_flow = reachable([n for n in nodes if is_tangent(n)], lambda n: list(n.users))
    placeholder_keys = {key for n in nodes if n.op == "placeholder" for key, _ in storage_of(n)}
    dropped = 0
    for node in nodes:
        source = node.args[0] if node.args else None
        if (node.target is torch.ops.aten.clone.default and node not in gradient_flow and output not in node.users
                and node.kwargs.get("memory_format", torch.preserve_format) == torch.preserve_format
                and isinstance(source, fx.Node) and _whole_storage(source) and _same_layout(node, source)
                and not any(key in placeholder_keys for key, _ in storage_of(source))):
            copied = {key for key, _ in storage_of(node)}
            node.replace_all_uses_with(source)
            joint.graph.erase_node(node)
            _views_read_from(source, copied)
            dropped += 1
    if dropped:
        joint.recompile()
    return dropped


def _views_read_from(source: fx.Node, copied: set[int]) -> None:
    """Give the views that were of the erased copy (their fake values on its storage, ``copied``) and
    now read ``source`` fake values on ``source``'s storage, each made again from its inputs' values:
    the graph's liveness and the cost graph count storages by these values."""
    from torch._guards import detect_fake_mode
    mode = detect_fake_mode([source.meta.get("val")])
    if mode is None:
        return
    stack = list(source.users)
    while stack:
        node = stack.pop(0)
        if node.op != "call_function" or not any(key in copied for key, _ in storage_of(node)):
            continue
        args = fx.map_arg(node.args, lambda a: a.meta.get("val"))
        kwargs = fx.map_arg(node.kwargs, lambda a: a.meta.get("val"))
        try:
            with mode:
                node.meta["val"] = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - left on the copy's storage: priced as a copy, over
            continue
        stack.extend(node.users)


def _same_layout(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype and va.stride() == vb.stride())


def needed_by_the_forward(output: fx.Node, num_fwd_outputs: int) -> set[fx.Node]:
    """The nodes the joint graph's forward outputs (the first ``num_fwd_outputs`` of ``output``) read,
    directly or not, with those outputs."""
    return reachable([n for n in output.args[0][:num_fwd_outputs] if isinstance(n, fx.Node)],
                     lambda n: n.all_input_nodes)


def _whole_storage(node: fx.Node) -> bool:
    """``node``'s value is a tensor that spans its whole storage (not a view of part of another)."""
    value = node.meta.get("val")
    try:
        return (isinstance(value, torch.Tensor)
                and value.untyped_storage().nbytes() <= value.numel() * value.element_size())
    except (NotImplementedError, RuntimeError):  # a storage it cannot tell (a subclass)
        return False


def coefficients_made_in_the_backward(nodes: list[fx.Node], needed: set[fx.Node], gradient_flow: set[fx.Node]
                                       ) -> set[fx.Node]:
    """The *coefficients* (nodes no tangent reaches that the forward's outputs do not need: ``2 * x`` of
    ``pow(x, 2)``'s backward) the backward makes from what it reads, as PyTorch's partitioners do. They
    are judged by connected region: a region moves when the values it reads that nothing else in the
    backward reads (through views) are smaller than its values the backward reads, which a forward
    region would save. Saved beside ``x``, the ``2 * x`` of each RMS norm held a tiny Llama's store-all
    step at 1.205 of eager's peak (nothing new to save: it moves). BLOOM's scripted GELU reads its
    input, which only it reads, for a coefficient of the same size: it stays a forward unit, which a
    plan saves or recomputes (made in the backward, its ten temporaries came on top of the backward's
    peak: store-all 300,800 B against 243,712 B). XCiT's ``F.normalize`` reads a 2 KB norm for two
    q-sized coefficients: it moves."""
    candidates = [n for n in nodes if n.op == "call_function" and n not in needed and n not in gradient_flow]
    if not candidates:
        return set()
    read_by_gradients = {_viewed_value(a) for n in gradient_flow for a in n.all_input_nodes}
    inside = set(candidates)

    def newly_saved(n: fx.Node) -> list[fx.Node]:  # what moving ``n`` would save that nothing else does
        values = (_viewed_value(a) for a in n.all_input_nodes)
        return [a for a in values if a not in inside and a.op not in ("placeholder", "get_attr")
                and a not in read_by_gradients]
    # connected regions, and regions reading one value that would be newly saved, are judged together
    # (XCiT's normalize: two regions read ``q``, saved once for both)
    groups = nx.Graph()
    groups.add_nodes_from(candidates)
    for n in candidates:
        groups.add_edges_from((n, a) for a in n.all_input_nodes if a in inside)
        groups.add_edges_from((n, a) for a in newly_saved(n))
    moved: set[fx.Node] = set()
    for component in nx.connected_components(groups):
        members = [n for n in component if n in inside]
        cost = sum(_node_bytes(a) for a in {a for n in members for a in newly_saved(n)})
        kept = {_viewed_value(n) for n in members if any(u in gradient_flow for u in n.users)}
        if not cost or cost < sum(_node_bytes(n) for n in kept if n in inside):
            moved.update(members)
    return moved


#: aten ops whose result views their one tensor input: reading one reads what the input holds
_VIEW_OPS = frozenset({"detach", "expand", "view", "_unsafe_view", "alias", "t", "transpose", "permute",
                       "unsqueeze", "squeeze", "slice", "select"})


def _viewed_value(node: fx.Node) -> fx.Node:
    """The value ``node`` views, through views (``detach``, ``expand``: module constant), else ``node``."""
    while (node.op == "call_function" and op_name(node.target) in _VIEW_OPS and node.args
           and isinstance(node.args[0], fx.Node)):
        node = node.args[0]
    return node


def _node_bytes(node: fx.Node) -> int:
    """Bytes of ``node``'s tensor values (its fake tensors), 0 for others."""
    value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else (value,)
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def coefficients_with_their_reader(coefficients: set[fx.Node], backward_of: list[list[fx.Node]],
                                    units: list[list[fx.Node]]) -> None:
    """Move each backward node no gradient reaches (a *coefficient*: ``2 * x`` of ``pow(x, 2)``'s
    backward, a custom ``autograd.Function``'s tanh terms) to the backward that reads it: of the units
    whose backward nodes read it, the one whose forward ends last (its backward runs first). Its
    sequence number says little: a custom Function's backward carries the last application's for
    every application, whose backward would make every layer's coefficient and hold it. Taken in
    reverse graph order, so a chain of coefficients follows its reader."""
    if not coefficients:
        return
    position = {n: k for k, n in enumerate(next(iter(coefficients)).graph.nodes)}
    last = [max((position[n] for n in members), default=-1) for members in units]
    placed = {b: i for i, nodes in enumerate(backward_of) for b in nodes}
    for b in sorted(coefficients, key=position.get, reverse=True):
        readers = {placed[u] for u in b.users if u in placed}
        if not readers or b not in placed:
            continue
        target = max(readers, key=lambda i: last[i])
        if target != placed[b]:
            backward_of[placed[b]].remove(b)
            backward_of[target].append(b)
            placed[b] = target
    for nodes in backward_of:
        nodes.sort(key=position.get)
