"""Returned gradients that are sums of terms, accumulated in place.

A weight read by several forward ops (an unrolled LSTM's cell weights, read at each of its T steps; a
tied embedding and head) gets one gradient term from each reader's backward, and the joint graph
AOTAutograd traces sums them out of place: ``add(add(t0, t1), t2) ...``. Each ``add`` allocates a new
buffer of the weight's size and fills it, where eager autograd accumulates into one buffer in place
(its ``InputBuffer``). At T = 200 the LSTM's backward made 800 such buffers: its ``add`` calls took
10 µs each against eager's 5.5 µs ``add_``, about 4 % of the step.

The model: a *sum chain* is the tree of ``add`` nodes (backward nodes all) ending at the storage a
returned gradient is made in (:func:`sum_terms`). An ``add`` can write into its *accumulator* (one of
its two inputs, :func:`accumulator`) when nothing but that ``add`` reads the accumulator's storage
(the previous partial sum, or the first term and the views of it on the way: a linear's weight term is
``t(t(mm))``), the storage was made by a backward node, the result has the accumulator's shape, dtype
and strides, and the other input does not share that storage. A chain whose every ``add`` can is
accumulated in place (:func:`in_place_sums`, decided once on the joint graph by ``joint_units``):

* ``joint_costs`` prices each later term of such a chain at its own bytes (out of place: its bytes and
  the new sum's);
* ``joint_lowering`` rewrites those ``add`` nodes of the generated backward into ``add_`` on the
  accumulator (:func:`accumulate_in_place`), whose value is the accumulator's own storage.

Invariants: every value is unchanged (only storage nothing else reads is written); a chain is in place
whole or not at all, so the pricing and the generated graph agree sum by sum.

An activation's gradient is a sum too, one term per forward reader, associated as eager autograd
happened to add them when AOTAutograd traced: ``add(add(add(conv, v), q), k)`` for ConvBERT's hidden
states. A schedule that runs the readers' backward in another order makes the terms in another order,
and each term then waits, alive, for its partner: the query's and key's 4 KB terms lived from the
linears' backward to the convolution's, 8 KB over a plan that sums each term as it comes.
:func:`arrival_order_sums` finds the sums the lowering may instead add in the order their terms are
made (each term read by one ``add`` of the tree, partial sums by the tree alone, one shape and dtype):
the values are the same sums, up to the rounding of another association.
"""
from __future__ import annotations

from collections import Counter
from typing import Container, Iterable

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from .joint_capture import op_name

__all__ = ["ACCUMULATE_IN_PLACE", "sum_terms", "accumulator", "in_place_sums", "accumulate_in_place",
           "SumTree", "arrival_order_sums"]

_ADD = torch.ops.aten.add.Tensor

#: the ``meta`` key marking a generated backward's ``add`` to accumulate in place
ACCUMULATE_IN_PLACE = "accumulate_in_place"


def sum_terms(node: fx.Node, backward: Container[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The terms and the ``add`` nodes of a gradient sum ending at ``node``, all of whose inputs are in
    ``backward`` (no sum: ``([node], [])``)."""
    terms, sums, stack = [], [], [node]
    while stack:
        current = stack.pop()
        inputs = current.all_input_nodes
        if op_name(current.target) == "add" and len(inputs) >= 2 and all(a in backward for a in inputs):
            sums.append(current)
            stack.extend(inputs)
        elif current not in terms:
            terms.append(current)
    return terms, sums


def _storage_keys(node: fx.Node) -> set[int]:
    keys = set()
    for value in tree_flatten(node.meta.get("val"))[0]:
        if isinstance(value, torch.Tensor):
            try:
                keys.add(value.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):
                continue
    return keys


def _sharing(node: fx.Node) -> tuple[fx.Node, set[fx.Node]] | None:
    """The node that allocated ``node``'s (single) storage and every node holding that storage, found
    through inputs and users that hold it; None if ``node`` holds no single storage."""
    keys = _storage_keys(node)
    if len(keys) != 1:
        return None
    root = node
    while True:
        holders = [a for a in root.all_input_nodes if keys <= _storage_keys(a)]
        if not holders:
            break
        root = holders[0]
    found, stack = {root}, [root]
    while stack:
        for user in stack.pop().users:
            if user not in found and user.op != "output" and keys <= _storage_keys(user):
                found.add(user)
                stack.append(user)
    return root, found


def accumulator(add: fx.Node, backward: Container[fx.Node]) -> fx.Node | None:
    """The input of ``add`` (an ``aten.add.Tensor`` of two tensors) it can write its sum into (module
    docstring), or None. ``backward``: the nodes whose storages are the backward's own."""
    if add.target is not _ADD or add.kwargs or len(add.args) != 2:
        return None
    value = add.meta.get("val")
    if not all(isinstance(a, fx.Node) for a in add.args) or not isinstance(value, torch.Tensor):
        return None
    for candidate, other in (add.args, reversed(add.args)):
        held = candidate.meta.get("val")
        if not isinstance(held, torch.Tensor) or (held.shape, held.dtype, held.stride()) != (
                value.shape, value.dtype, value.stride()):
            continue
        sharing = _sharing(candidate)
        if sharing is None:
            continue
        root, holders = sharing
        if root.op == "placeholder" or root not in backward or _storage_keys(other) & _storage_keys(root):
            continue
        if all(user in holders or user is add for holder in holders for user in holder.users):
            return candidate
    return None


def in_place_sums(graph: fx.Graph, returned: Iterable[fx.Node], backward: Container[fx.Node]) -> set[str]:
    """Names of the ``add`` nodes of every returned gradient's sum chain whose every ``add`` has an
    :func:`accumulator`. ``returned``: the nodes the backward returns as gradients; ``backward``: the
    backward nodes a chain's terms and sums are among."""
    names: set[str] = set()
    for gradient in returned:
        sharing = _sharing(gradient)
        if sharing is None:
            continue
        _, sums = sum_terms(sharing[0], backward)
        if sums and all(accumulator(s, backward) is not None for s in sums):
            names |= {s.name for s in sums}
    return names


def accumulate_in_place(backward_graph: fx.GraphModule) -> int:
    """Rewrite each ``add`` of ``backward_graph`` marked ``meta[ACCUMULATE_IN_PLACE]`` (the lowering
    marks the nodes of ``in_place_sums`` as it copies them, since the copies may be renamed) into
    ``add_`` on its accumulator,
    whose value it then is (``meta["val"]`` too, so the graph's liveness sees one storage), and return
    how many. A named ``add`` whose accumulator some later node still reads would be priced in place
    and run out of place: that is an error of the lowering, raised."""
    position = {n: i for i, n in enumerate(backward_graph.graph.nodes)}
    backward = {n for n in backward_graph.graph.nodes if n.op != "placeholder"}
    # every accumulator is found before any add is rewritten: a rewritten add shares its accumulator's
    # storage, and a chain of T terms would then be walked T times (quadratic in an unrolled RNN's steps)
    marked = [n for n in backward_graph.graph.nodes if n.op == "call_function" and n.meta.get(ACCUMULATE_IN_PLACE)]
    targets = []
    for node in marked:
        target = accumulator(node, backward)
        later = [] if target is None else [u for h in _sharing(target)[1] for u in h.users
                                             if u is not node and position[u] > position[node]]
        if target is None or later:
            raise RuntimeError(f"joint lowering: the gradient sum {node.name} was priced in place, but its "
                               "accumulator is read elsewhere in the generated backward")
        targets.append(target)
    for node, target in zip(marked, targets):
        other = node.args[1] if node.args[0] is target else node.args[0]
        node.target = torch.ops.aten.add_.Tensor
        node.args = (target, other)
        node.meta["val"] = target.meta["val"]
    if marked:
        backward_graph.recompile()
    return len(marked)


class SumTree:
    """A gradient sum the lowering adds in arrival order: its ``root`` (the total), its ``terms`` and its
    ``sums`` (the ``add`` nodes, the root among them)."""

    def __init__(self, root: fx.Node, terms: list[fx.Node], sums: list[fx.Node]) -> None:
        self.root, self.terms, self.sums = root, terms, sums

    def __repr__(self) -> str:
        return f"SumTree({self.root.name}: {len(self.terms)} terms)"


def arrival_order_sums(graph: fx.Graph, backward: Container[fx.Node], returned: Iterable[fx.Node]
                       ) -> list[SumTree]:
    """The sums of three or more gradient terms (``add`` trees of ``backward`` nodes) whose association
    the lowering may change (module docstring): not in a ``returned`` gradient's storage (those are
    priced as traced), every ``add`` an ``aten.add.Tensor`` of two tensors of the root's shape and
    dtype, every partial sum read once by its tree alone, every term by one ``add`` of it, once, and a
    term of no other tree. A tangent may be a term: the lowering adds it first."""
    returned_keys = set().union(*(_storage_keys(r) for r in returned))
    trees = []
    for node in graph.nodes:
        if (node.target is not _ADD or node not in backward or _storage_keys(node) & returned_keys
                or any(u.target is _ADD and u in backward for u in node.users)):
            continue  # not the root of a tree: a later add reads it
        terms, sums = sum_terms(node, backward)
        # a tree: each add reached once and each term read once (``sum_terms`` lists a term once however
        # often it is read), so that ``len(sums) + 1`` distinct terms. A partial sum read twice
        # (``dv = a + s + s``, ``s`` added into it twice: a value read twice by one op, ``v + v``) is a
        # DAG, and summing its distinct terms once each would drop a term
        if len(terms) < 3 or len(set(sums)) != len(sums) or len(terms) != len(sums) + 1:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        tree = set(sums)

        def plain(n: fx.Node) -> bool:
            held = n.meta.get("val")
            return isinstance(held, torch.Tensor) and (held.shape, held.dtype) == (value.shape, value.dtype)
        if (all(s.target is _ADD and not s.kwargs and len(s.args) == 2 and plain(s) for s in sums)
                and all(all(u in tree for u in s.users) for s in sums if s is not node)
                and all(sum(u in tree for u in t.users) == 1 and plain(t) for t in terms)):
            trees.append(SumTree(node, terms, sums))
    in_trees = Counter(t for tree in trees for t in tree.terms)
    return [tree for tree in trees if all(in_trees[t] == 1 for t in tree.terms)]
