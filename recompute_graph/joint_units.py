"""The forward units of an AOTAutograd joint graph, and the backward nodes of each.

``torch.compile`` hands a partitioner the joint forward+backward aten graph (``joint_partition.py``).
Every node AOTAutograd traced for one forward op of the model, and every node of that op's backward,
carry the same ``meta["seq_nr"]`` (``addmm`` and the ``mm``/``sum`` of its backward).

Units (:func:`joint_units`). A *unit* is a connected group of forward nodes of one ``seq_nr`` (an op
with its ``getitem``s; a causal mask built under the same number is a unit of its own; a node without a
number is a unit of its own). The backward nodes are the tangent-dependent ones and the
*coefficients* cheaper to make in the backward than to save (``2 * x`` of ``pow(x, 2)``'s backward:
``joint_coefficients``); the other nodes are forward nodes.
Its *backward nodes* are the backward nodes of that number: of
the units sharing it, the one they read most among those the forward reads on (a transpose made only
for an attention ``bmm``'s backward is not one: nothing would order its backward after the units making
the gradient it reads); moved to the unit that consumes it when they read values its own forward does
not (a linear's weight gradient, traced under the weight transpose's number, reads the linear's
input). Backward nodes whose number no forward unit has (functionalized in-place ops: EfficientNet's
``silu_``) are placed by what they read, preferring a unit the forward reads on (the ``silu``, not the
``clone`` kept for its backward). A custom ``autograd.Function``'s backward, traced in Python, carries
one number for every application (BLOOM's scripted GELU): a node that reads a gradient made by the
backward of a unit wholly before its owner goes to the unit whose output's gradient it reads
(``_move_custom_backward_chains``); a coefficient goes with the backward that reads it
(``joint_coefficients``). Units are ordered so that every edge points
forward, including from the values a unit's backward reads (they must be live when it runs, so they
are its predecessors); units caught in a cycle are merged.

``joint_costs.joint_cost_graph`` prices the units; a solver keeps or recomputes each.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterable

import torch
from torch import fx

from .gradient_accumulation import in_place_sums
from .joint_capture import RANDOM_TARGETS, op_name, reachable
from .joint_coefficients import (coefficients_made_in_the_backward, coefficients_with_their_reader,
                                 drop_backward_copies, is_tangent, needed_by_the_forward)
from .joint_partition import _is_tensor

__all__ = ["JointUnits", "joint_units", "drop_backward_copies", "is_tangent",
           "is_gradient_sum", "incoming_gradient_sums", "gradient_readers",
           "backward_reads"]


@dataclass
class JointUnits:
    """The joint graph split into forward units (in topological order) and their backward nodes."""

    forward: list[fx.Node]                     # forward nodes, placeholders excluded
    backward: set[fx.Node]                     # tangent-dependent nodes (tangents included), coefficients
    units: list[list[fx.Node]]                 # forward nodes of each unit, in graph order
    unit_of: dict[fx.Node, int]                # forward node -> its unit
    backward_of: list[list[fx.Node]]           # backward nodes of each unit, in graph order
    unplaced_backward: list[fx.Node] = field(default_factory=list)  # backward nodes of no unit
    num_fwd_outputs: int = 0
    in_place_sums: set[str] = field(default_factory=set)  # gradient sums accumulated in place (names)
    #: tangents the plan takes as zero (outputs the planned loss does not reach; ``zero_gradients``)
    zero_tangents: tuple[str, ...] = ()

    def names(self) -> list[list[str]]:
        """The names of each unit's forward nodes: what two tracings of one graph must agree on."""
        return [[node.name for node in unit] for unit in self.units]

    def forward_outputs(self, graph: fx.Graph) -> list[fx.Node]:
        output = next(n for n in graph.nodes if n.op == "output")
        return [n for n in output.args[0][: self.num_fwd_outputs] if isinstance(n, fx.Node)]

    def gradient_outputs(self, graph: fx.Graph) -> list[fx.Node | None]:
        output = next(n for n in graph.nodes if n.op == "output")
        return list(output.args[0][self.num_fwd_outputs:])


#: aten ops making a new tensor from an input's shape and dtype only: autograd records no node for them,
#: so they carry the sequence number of the differentiable op before them.
FACTORY_TARGETS = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones",
                             "new_empty", "new_full", "new_empty_strided"})


def is_factory(node: fx.Node, depth: int = 8) -> bool:
    """``node`` makes a tensor from its input's metadata only (``zeros_like``), or from constants only
    (``scalar_tensor``, ``arange``, a lifted ``torch.tensor(...)`` and what is computed from them, looked
    at ``depth`` nodes back; random draws excepted): no gradient flows through it."""
    if node.op != "call_function" or op_name(node.target) in RANDOM_TARGETS:
        return False
    if op_name(node.target) in FACTORY_TARGETS:
        return True
    return depth > 0 and _is_tensor(node) and all(a.op == "get_attr" or is_factory(a, depth - 1)
                                                  for a in node.all_input_nodes)


def makes_no_gradient(node: fx.Node, depth: int = 8) -> bool:
    """No gradient flows through ``node``: a constant (``get_attr``), an integer or boolean input, an
    :func:`is_factory` node, or an op reading only such values (an attention mask built from the input
    ids: ``where(ids == 0, finfo.min, 0)``), looked at ``depth`` nodes back. Autograd records no node for
    it, so it carries the sequence number of the differentiable op traced before it."""
    if node.op == "get_attr":
        return True
    if node.op == "placeholder":
        return not _is_floating(node)
    if node.op != "call_function" or op_name(node.target) in RANDOM_TARGETS:
        return False
    if op_name(node.target) in FACTORY_TARGETS:
        return True
    return depth > 0 and all(not _is_floating(a) or makes_no_gradient(a, depth - 1) for a in node.all_input_nodes)


def _is_floating(node: fx.Node) -> bool:
    """``node``'s value, or one of its values (a multi-output op's), is a floating-point tensor."""
    value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in values)


def passes_no_gradient(members: Iterable[fx.Node]) -> bool:
    """A unit of nodes no gradient flows through (:func:`makes_no_gradient`): it has no backward."""
    return all(makes_no_gradient(n) for n in members)


def tangents_held_through_backward() -> bool:
    """Whether AOTAutograd's runtime holds each output gradient (tangent) until its compiled backward
    returns, whatever the generated backward's own liveness says.

    From torch 2.13 its backward takes the tangents boxed in one mutable list
    (``torch.autograd.Function.boxed_grads_call``), and the generated code drops each after its last use.
    Before (torch 2.11, say), the engine hands them over as the arguments of ``backward(ctx, *grads)``,
    a tuple that lives until the call returns: measured on GPT-2 at its smallest budget, the logits'
    gradient stayed 10.2 MB above the graph's liveness for the whole backward. The cost graph
    (``CostGraph.output_gradients_held``) and the graphs' liveness (``joint_lowering.graph_live_bytes``)
    follow the installed runtime."""
    return not hasattr(torch.autograd.Function, "boxed_grads_call")


def joint_units(joint: fx.GraphModule, num_fwd_outputs: int) -> JointUnits:
    """Units and backward nodes of ``joint`` (module docstring)."""
    nodes = list(joint.graph.nodes)
    tangents = [n for n in nodes if is_tangent(n)]
    gradient_flow = reachable(tangents, lambda n: [u for u in n.users if u.op != "output"])
    backward = set(gradient_flow)
    needed = needed_by_the_forward(next(n for n in nodes if n.op == "output"), num_fwd_outputs)
    needed |= {u for n in needed for u in n.users if u.target is operator.getitem}  # all of an op's items
    backward |= coefficients_made_in_the_backward(nodes, needed, gradient_flow)
    forward = [n for n in nodes if n not in backward and n.op not in ("placeholder", "output")]
    by_seq: dict[Any, int] = {}
    groups: list[list[fx.Node]] = []
    group_of: dict[fx.Node, int] = {}
    for node in forward:
        seq = node.meta.get("seq_nr")
        factory = is_factory(node)
        if node.target is operator.getitem:  # an item of a multi-output op: the op's group
            index = next((group_of[a] for a in node.all_input_nodes if a in group_of), None)
        elif factory:  # traced under the last differentiable op's number: a group of its own
            index = None
        else:  # a node without seq_nr is a group of its own
            index = by_seq.get(seq) if seq is not None else None
        if index is None:
            index = len(groups)
            groups.append([])
            if seq is not None and not factory:  # the number is not the factory's
                by_seq[seq] = index
        group_of[node] = index
        groups[index].append(node)
    # ops traced under one seq_nr that do not read each other (GPT-2's scaling ``mul`` and the causal
    # mask built beside it) are separate units: each unit's value is one connected computation
    units = [part for members in groups for part in _connected_parts(members)]
    unit_of = {node: i for i, members in enumerate(units) for node in members}
    candidates: dict[Any, list[int]] = {}
    for index, members in enumerate(units):
        if passes_no_gradient(members):  # it has no backward
            continue
        for seq in {n.meta.get("seq_nr") for n in members} - {None}:
            candidates.setdefault(seq, []).append(index)
    by_seq_backward: dict[Any, list[fx.Node]] = {}
    unplaced = []
    for node in nodes:
        if node in backward and not is_tangent(node):
            seq = node.meta.get("seq_nr")
            (by_seq_backward.setdefault(seq, []) if seq in candidates else unplaced).append(node)
    backward_of: list[list[fx.Node]] = [[] for _ in units]
    for seq, backward_nodes in by_seq_backward.items():
        owner = _owner_of_backward(backward_nodes, candidates[seq], units, unit_of)
        owner = _consumer_that_reads_it_all(owner, backward_nodes, units, unit_of)
        backward_of[_read_for_the_backward_only(owner, units, unit_of)].extend(backward_nodes)
    sums = _gradient_sums_out(backward_of, backward)
    _move_custom_backward_chains(backward_of, units, unit_of)
    unplaced = _place_by_reads(sums + unplaced, units, unit_of, backward_of)
    coefficients_with_their_reader(backward - gradient_flow, backward_of, units)
    units, unit_of, backward_of = _topological(units, unit_of, backward_of)
    result = JointUnits(forward, backward, units, unit_of, backward_of, unplaced, num_fwd_outputs)
    returned = [g for g in result.gradient_outputs(joint.graph) if isinstance(g, fx.Node)]
    result.in_place_sums = in_place_sums(joint.graph, returned, {b for nodes in backward_of for b in nodes})
    return result


def _gradient_sums_out(backward_of: list[list[fx.Node]], backward: set[fx.Node]) -> list[fx.Node]:
    """Take out of each unit the gradient sums traced under its seq_nr that add other units' gradients
    (DenseNet's concatenated features: hundreds of ``add``s under the classifier's number), to be
    placed with the backward that reads them."""
    taken: list[fx.Node] = []
    for nodes in backward_of:
        sums = incoming_gradient_sums(nodes, backward)
        if sums:
            nodes[:] = [b for b in nodes if b not in sums]
            taken.extend(sums)
    return taken


def incoming_gradient_sums(nodes: list[fx.Node], backward: Container[fx.Node]) -> set[fx.Node]:
    """The ``add`` nodes among a unit's backward ``nodes`` that sum gradients other units' backward
    nodes make (or partial sums of those): the accumulation of a value's gradient terms, priced where
    each term is made (the simulator sums them in as they come), not as the unit's own work."""
    own = set(nodes)
    sums: set[fx.Node] = set()
    for b in nodes:
        inputs = b.all_input_nodes
        if (op_name(b.target) == "add" and len(inputs) >= 2
                and all(a in backward and (a not in own or a in sums) for a in inputs)):
            sums.add(b)
    return sums


#: functionalized in-place writes into a view: the base with the view's new values.
SCATTER_TARGETS = frozenset({"select_scatter", "slice_scatter", "as_strided_scatter", "diagonal_scatter"})


def _place_by_reads(unplaced: list[fx.Node], units: list[list[fx.Node]], unit_of: dict[fx.Node, int],
                    backward_of: list[list[fx.Node]]) -> list[fx.Node]:
    """Backward nodes whose seq_nr no forward unit has (an in-place op's backward, functionalized:
    EfficientNet's ``silu_``): a node that reads forward values goes to the unit, among those values'
    units and the units reading them, with the nearest seq_nr; one that reads only gradients goes
    with the backward that reads it, else with the first gradient it reads. Returns those left
    unplaced."""
    position = {n: k for k, n in enumerate(next(iter(unit_of)).graph.nodes)} if unit_of else {}
    unplaced = sorted(unplaced, key=position.get)
    seq_of = [min((n.meta["seq_nr"] for n in members if n.meta.get("seq_nr") is not None), default=None)
              for members in units]
    placed: dict[fx.Node, int] = {b: i for i, bs in enumerate(backward_of) for b in bs}
    units_of_seq: dict[Any, set[int]] = {}
    for i, seq in enumerate(seq_of):
        units_of_seq.setdefault(seq, set()).add(i)

    def read_in_forward(i: int) -> bool:
        return any(u in unit_of and unit_of[u] != i for n in units[i] for u in n.users)
    # an in-place write into a view, functionalized (``out[:, t] = x``: a ``copy`` and a
    # ``select_scatter``), gets its backward (autograd's CopySlices) under the next sequence number
    after_scatter = {seq_of[i] + 1: i for i, members in enumerate(units) if seq_of[i] is not None
                     and any(n.op == "call_function" and op_name(n.target) in SCATTER_TARGETS for n in members)}
    gradient_only = []
    for b in unplaced:
        read = {unit_of[a] for a in b.all_input_nodes if a in unit_of}
        if not read and b.meta.get("seq_nr") in after_scatter:
            placed[b] = after_scatter[b.meta["seq_nr"]]
            backward_of[placed[b]].append(b)
            continue
        consumers = {unit_of[u] for i in read for n in units[i] for u in n.users if u in unit_of}
        # and the ops traced beside what it reads: ``silu_`` functionalized is a ``clone`` of its input,
        # kept for the backward, and the ``silu``, under one number; the backward reads the clone and
        # the gradient of the ``silu``, whose readers' backward make it: placed with the clone, which
        # no forward unit reads, it could run before them (CoAtNet: 7 MB over the simulated peak)
        beside = {j for i in read for j in units_of_seq.get(seq_of[i], ()) if seq_of[i] is not None}
        candidates = [i for i in read | consumers | beside if seq_of[i] is not None]
        seq = b.meta.get("seq_nr")
        if candidates and seq is not None:
            placed[b] = min(candidates, key=lambda i: (abs(seq_of[i] - seq), not read_in_forward(i), -i))
            backward_of[placed[b]].append(b)
        else:
            gradient_only.append(b)
    # a node that reads only gradients (a sum of gradients, DenseNet's concatenated features): with the
    # backward that reads it, else with the gradient it reads
    left = []
    for b in reversed(gradient_only):
        index = next((placed[u] for u in b.users if u in placed), None)
        if index is not None:
            placed[b] = index
            backward_of[index].append(b)
    for b in gradient_only:
        if b in placed:
            continue
        index = next((placed[a] for a in b.all_input_nodes if a in placed), None)
        if index is None:
            left.append(b)
            continue
        placed[b] = index
        backward_of[index].append(b)
    for nodes in backward_of:
        nodes.sort(key=position.get)
    return left


def _consumer_that_reads_it_all(owner: int, backward_nodes: list[fx.Node], units: list[list[fx.Node]],
                                unit_of: dict[fx.Node, int]) -> int:
    """``owner``, or, when these backward nodes read values ``owner``'s forward does not (a linear's
    weight gradient, traced under the weight transpose's seq_nr, reads the linear's input), the unit
    reading ``owner``'s value, or reading what it reads, whose forward reads all of them (the linear)."""
    def inputs_of(index: int) -> set[int]:
        return {unit_of[a] for n in units[index] for a in n.all_input_nodes if a in unit_of} | {index}
    read = {unit_of[a] for b in backward_nodes for a in b.all_input_nodes if a in unit_of}
    if read <= inputs_of(owner):
        return owner
    consumers = sorted({unit_of[u] for n in units[owner] for u in n.users if u in unit_of} - {owner})
    # or a sibling: a unit reading what ``owner`` reads (``t(t(weight))``, made for the backward only,
    # beside the linear that reads ``t(weight)``)
    siblings = sorted({unit_of[u] for n in units[owner] for a in n.all_input_nodes for u in a.users
                       if u in unit_of} - {owner} - set(consumers))
    return next((c for c in consumers + siblings if read <= inputs_of(c) | {owner}), owner)


def is_gradient_sum(node: fx.Node, backward: Container[fx.Node], tangent_terms: bool = False) -> bool:
    """An ``add`` of two gradients: both inputs are backward nodes (``backward``), neither a tangent
    unless ``tangent_terms`` (the lowering makes ``tangents_1 + term`` as soon as the term exists)."""
    inputs = node.all_input_nodes
    return (node.op == "call_function" and op_name(node.target) == "add" and len(inputs) == 2
            and all(a in backward and (tangent_terms or not is_tangent(a)) for a in inputs))


def gradient_readers(backward_of: list[list[fx.Node]], predecessors: Callable[[int], Iterable[int]]
                     ) -> list[set[int]]:
    """For each unit, the other units whose backward nodes read what its backward nodes make, and that
    nothing orders after it already (its ancestors through ``predecessors``). Their backward runs after
    its own, so they become its predecessors. A pow's backward, traced as ``mul(grad, 2 * x)`` with ``2 * x``
    computed in the forward, is placed with that ``2 * x``, a unit nothing reads in the forward;
    unordered, its backward ran early in the simulator and late in the generated graph, which held
    ``2 * x`` in between (T5 at 80 %: 0.962 of the allocator). Gradient sums are left out: they are
    made as soon as both terms exist, wherever they are placed (a tied embedding's weight gradient)."""
    unit_of_backward = {b: i for i, nodes in enumerate(backward_of) for b in nodes}
    readers: list[set[int]] = [set() for _ in backward_of]
    for index, nodes in enumerate(backward_of):
        for b in nodes:
            if is_gradient_sum(b, unit_of_backward):
                continue
            for a in b.all_input_nodes:
                maker = unit_of_backward.get(a)
                if maker is not None and maker != index:
                    readers[maker].add(index)
    for maker, found in enumerate(readers):
        if not found:
            continue
        # an ancestor's backward runs after the maker's in every schedule (a unit's backward waits for
        # its successors'), so it is ordered already: as a predecessor it would be priced as getting a
        # gradient from the maker's backward (a view of attention scores a bias was added to: BEiT's
        # softmax backward made two score-sized gradients, 17 % over the allocator)
        stack, seen = [maker], set()
        while stack and found - seen:
            for p in predecessors(stack.pop()):
                if p not in seen:
                    seen.add(p)
                    stack.append(p)
        found -= seen
    return readers


def backward_reads(units: JointUnits, index: int) -> set[int]:
    """The other units whose values unit ``index``'s backward nodes read (a linear's weight gradient,
    traced under the weight transpose's seq_nr, reads the linear's input)."""
    return {units.unit_of[a] for b in units.backward_of[index] for a in b.all_input_nodes
            if a in units.unit_of and units.unit_of[a] != index}


def _connected_parts(members: list[fx.Node]) -> list[list[fx.Node]]:
    """``members`` split into the groups connected by data edges among them, in graph order."""
    member_set = set(members)
    root = {n: n for n in members}

    def find(n: fx.Node) -> fx.Node:
        while root[n] is not n:
            root[n] = root[root[n]]
            n = root[n]
        return n
    for n in members:
        for a in n.all_input_nodes:
            if a in member_set:
                root[find(a)] = find(n)
    parts: dict[fx.Node, list[fx.Node]] = {}
    for n in members:
        parts.setdefault(find(n), []).append(n)
    return list(parts.values())


def _move_custom_backward_chains(backward_of: list[list[fx.Node]], units: list[list[fx.Node]],
                                 unit_of: dict[fx.Node, int]) -> None:
    """Move out of a unit's backward the nodes that read a gradient made by the backward of a unit
    wholly before it in the graph (one its forward reads, whose backward runs after its own): a custom
    ``autograd.Function``'s backward, traced in Python, carries the sequence number of the last forward
    op for every application (BLOOM's scripted GELU: the four layers' ``coefficient * grad`` all went to
    the last GELU's backward, which then held every layer's coefficient and let them all go at once,
    two tensors under the generated backward's liveness). Such a node goes to the unit whose output's
    gradient it reads: of the units the making unit's forward reads, the last whose output has the
    gradient's shape and dtype; a node reading a node moved so goes with it. Left in place when no unit
    matches."""
    position = {n: k for k, n in enumerate(next(iter(unit_of)).graph.nodes)} if unit_of else {}
    first = [min(position[n] for n in members) for members in units]
    last = [max(position[n] for n in members) for members in units]
    placed = {b: i for i, nodes in enumerate(backward_of) for b in nodes}
    moved: dict[fx.Node, int] = {}
    for owner, nodes in enumerate(backward_of):
        for b in list(nodes):
            target = None
            for g in b.all_input_nodes:
                if g in moved:
                    target = moved[g]
                    break
                maker = placed.get(g)
                if maker is None or maker == owner or last[maker] >= first[owner]:
                    continue
                value = g.meta.get("val")
                read = sorted({unit_of[a] for n in units[maker] for a in n.all_input_nodes if a in unit_of},
                              key=lambda i: last[i])
                target = next((i for i in reversed(read) if isinstance(value, torch.Tensor) and any(
                    _is_tensor(n) and n.meta["val"].shape == value.shape and n.meta["val"].dtype == value.dtype
                    for n in units[i])), None)
                break
            if target is not None and target != owner:
                nodes.remove(b)
                backward_of[target].append(b)
                moved[b] = placed[b] = target
    for nodes in backward_of:
        nodes.sort(key=position.get)


def _read_for_the_backward_only(owner: int, units: list[list[fx.Node]], unit_of: dict[fx.Node, int]) -> int:
    """``owner``, or, when ``owner`` is views only that nothing in the forward reads (nor returns) and
    they view one other unit's value, that unit. An in-place op on a view (``relu_(out[:, 1:])``),
    functionalized, is the op and a ``slice_scatter``; the view of the result its backward saves
    (``slice(scatter)``) is traced after them under the in-place op's own sequence number, which its
    backward carries too, and that backward reads the view. But the view's index orders nothing: its
    backward ran before the backward of a later reader of the scatter (a ``mean``) had made its term of
    the gradient that backward reads (16 KB under the graphs' liveness; found by
    tests/test_fuzz_compiled.py). A view has no gradient of its own there: the backward is the scatter's
    unit's. (A value of its own made for the backward, a tanh-GELU's coefficient, keeps its backward.)"""
    if _read_on(owner, units, unit_of):
        return owner
    if not all(_is_view(n) for n in units[owner]):  # a value of its own (a GELU's coefficient): its backward
        return owner
    read = {unit_of[a] for n in units[owner] for a in n.all_input_nodes if a in unit_of} - {owner}
    return read.pop() if len(read) == 1 else owner


def _read_on(index: int, units: list[list[fx.Node]], unit_of: dict[fx.Node, int]) -> bool:
    """Whether another unit of the forward reads unit ``index``'s nodes, or the graph returns one."""
    return any(u.op == "output" or (u in unit_of and unit_of[u] != index) for n in units[index] for u in n.users)


def _is_view(node: fx.Node) -> bool:
    """A call of an aten op whose result aliases an input (its schema's first return is annotated)."""
    schema = getattr(node.target, "_schema", None)
    return (node.op == "call_function" and schema is not None and bool(schema.returns)
            and schema.returns[0].alias_info is not None)


def _owner_of_backward(backward_nodes: list[fx.Node], candidates: list[int], units: list[list[fx.Node]],
                       unit_of: dict[fx.Node, int]) -> int:
    """Of the units sharing a seq_nr, the one whose backward these nodes are: of those whose value the
    forward reads on (or returns), the one they read most, else the last with a floating-point value
    (a mask built beside an op has no backward). A unit made for the backward only (the transposes an
    attention ``bmm`` saves for its backward) is chosen only when no other is: its backward would read
    the gradient of the op's value without being ordered after the units that make it (nothing reads
    it in the forward, so nothing orders its backward)."""
    reads = [unit_of[a] for b in backward_nodes for a in b.all_input_nodes
             if a in unit_of and unit_of[a] in candidates]
    read_on = [i for i in candidates if _read_on(i, units, unit_of)]
    if len(read_on) < len(candidates) and read_on:
        candidates = read_on
        reads = [i for i in reads if i in read_on]
    if reads:
        return max(set(reads), key=lambda i: (reads.count(i), i))
    floating = [i for i in candidates if any(_is_tensor(n) and n.meta["val"].is_floating_point() for n in units[i])]
    # the op whose backward it is, by name (``convolution`` for ``convolution_backward``): a view of an
    # input without grad (a ``permute`` of the model's input) carries the last differentiable op's
    # number but has no backward; chosen as the last, it took the convolution's, whose gradient the
    # simulator then let go before that backward read it (16 KB under the allocator; found by
    # tests/test_fuzz_compiled.py)
    named = {op_name(b.target).removesuffix("_backward") for b in backward_nodes
             if b.op == "call_function" and op_name(b.target).endswith("_backward")}
    matching = [i for i in floating if any(n.op == "call_function" and op_name(n.target) in named for n in units[i])]
    return (matching or floating or candidates)[-1]


def _topological(units: list[list[fx.Node]], unit_of: dict[fx.Node, int], backward_of: list[list[fx.Node]]
                 ) -> tuple[list[list[fx.Node]], dict[fx.Node, int], list[list[fx.Node]]]:
    """Order units so that every edge points forward: from the units a unit reads, from those its
    backward reads (their values must be live when it runs, to be saved), and from the units whose
    backward reads a gradient its backward makes (``gradient_readers``, where that makes no cycle);
    units caught in a cycle (an op whose nodes interleave with another's) are merged."""
    import networkx as nx
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(units)))
    for index, members in enumerate(units):
        for node in (*members, *backward_of[index]):
            for a in node.all_input_nodes:
                if a in unit_of and unit_of[a] != index:
                    dag.add_edge(unit_of[a], index)
    for index, later in enumerate(gradient_readers(backward_of, lambda u: list(dag.predecessors(u)))):
        for reader in later:
            if not nx.has_path(dag, index, reader):  # an order, not a cycle
                dag.add_edge(reader, index)
    condensed = nx.condensation(dag)
    order = list(nx.lexicographical_topological_sort(condensed, key=lambda c: min(condensed.nodes[c]["members"])))
    position = {n: i for i, n in enumerate(next(iter(unit_of)).graph.nodes)} if unit_of else {}
    merged = [sorted((node for u in condensed.nodes[c]["members"] for node in units[u]), key=position.get)
              for c in order]
    merged_backward = [sorted((node for u in condensed.nodes[c]["members"] for node in backward_of[u]),
                              key=position.get) for c in order]
    return merged, {node: i for i, members in enumerate(merged) for node in members}, merged_backward
