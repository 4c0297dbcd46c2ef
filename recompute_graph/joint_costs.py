"""The cost graph of an AOTAutograd joint graph: forward units a solver keeps or recomputes.

``torch.compile`` hands a partitioner the joint forward+backward aten graph (``joint_partition.py``).
Every node AOTAutograd traced for one forward op of the model, and every node of that op's backward,
carry the same ``meta["seq_nr"]`` (``addmm`` and the ``mm``/``sum`` of its backward).

Units: :func:`joint_units.joint_units` (a module call's or op's forward nodes with their backward
nodes).

Pricing (:func:`joint_cost_graph`), bytes from the fake tensors of ``meta["val"]``, storage by storage
(a view owns nothing and ``alias_of`` names the unit owning its storage):

* ``output_bytes``: storages the unit creates that other units or their backward nodes, or the
  model's outputs, read (a buffer's new value, BatchNorm's running statistics, is not a model output);
* ``saved_output_bytes`` / ``saved_buffer_bytes`` / ``saved_input_bytes``: forward values the unit's
  backward nodes read, by who owns them (the unit itself, read by others / only by its backward /
  another unit, which goes into ``backward_needs``); primals (parameters, inputs) are not counted;
* ``grad_bytes``: the size of the floating-point outputs other units read (a view's gradient is the
  view's size; the views of one storage together at most its size), when the unit has backward nodes
  or reads something that requires grad and is read on in the forward (a unit without backward nodes
  that only a backward reads passes no gradient on);
  ``param_grad_bytes``: the primal gradients whose storage its backward nodes allocate (wherever they
  are returned), or, for a sum of terms from several units' backward (a tied or shared weight), the
  first term's unit (the one whose kernel makes it), each later term counted from the backward that
  makes it to the one adding it, with the new sum unless the chain is accumulated in place
  (``gradient_accumulation``);
  ``backward_aliases_grad``: its backward nodes are only views of the gradient (or it has none);
  ``grad_term_bytes``: when its outputs are views of one storage whose gradient terms its backward
  concatenates or stacks as they were made (a ``split``'s gate and up projections: no sum), the
  bytes of the views each reader unit reads;
* ``workspace_bytes`` / ``backward_workspace_bytes``: what the unit's nodes hold beyond its outputs at
  their peak: the most of its storages live at once as its nodes run, the outputs made so far
  included, less the outputs (``joint_storage.internal_peak_bytes``); and the most of the storages the
  backward nodes allocate besides the gradients they pass on live at once, with the returned
  gradients they make (counted as if alive together); the forward's with each node's kernel temporaries
  beside what is live as it runs, the backward's plus the largest kernel temporary of its nodes,
  measured by the allocator on one run of the joint graph on real tensors
  (``joint_allocations.kernel_workspace_bytes``);
* ``backward_steps`` / ``backward_step_workspace_bytes`` / ``tape_release_steps``: the unit's backward
  nodes in order, as steps that make the predecessors' gradients and free saved values after their
  last read, each with the temporaries, returned gradients and kernel workspace it holds
  (``joint_storage.backward_steps``);
* the loss the training loop computes on the outputs, priced on their shapes
  (``joint_allocations.outputs_loss_bytes``) as ``CostGraph.loss_bytes``;
* costs: each node's seconds as measured on real tensors (``joint_allocations.node_seconds``), or
  else its FLOPs, run on meta tensors under ``FlopCounterMode``, turned into seconds by a
  ``device_profiles.DeviceProfile`` with the bytes the node reads and writes (a view, a ``getitem``:
  none, they move nothing). When they are measured, the roofline's seconds are kept beside them
  (``CostGraph.estimated_costs``) for the planner's second opinion.

A unit holding a random op (dropout) is ``random``, one reading state the step updates (BatchNorm)
``stateful``; ``joint_lowering`` replays a recomputed random op from an RNG snapshot and recomputes a
training-mode BatchNorm without its running statistics: normalized from the batch statistics its first
computation made, where its own backward alone reads those (``batch_norm_recompute``), which a
recomputation of the unit then costs (``recompute_cost``); what its recomputations read from the first
computation (those statistics, and the new running statistics its backward reads) is
``recompute_kept_bytes``. Without kernel workspace the simulator's peak
of a schedule is the liveness of the graphs it lowers to (``joint_lowering.graph_peak_bytes``).
"""
from __future__ import annotations

import operator
from collections.abc import Container, Sequence
from typing import Any
from dataclasses import dataclass

import torch
from torch import fx

from .batch_norm_recompute import RECOMPUTE_SECONDS_SUFFIX, items_read_from_the_forward, normalization_statistics
from .device_profiles import DEVICE_PROFILES, DeviceProfile
from .gradient_accumulation import sum_terms
from .graph import JOINT_COST_SOURCE, CostGraph, CostNode, is_joint_cost_graph
from .joint_capture import RANDOM_TARGETS, op_name
from .joint_partition import STATE_READING_TARGETS, _is_tensor
from .joint_storage import allocates as _allocates
from .joint_storage import storage_of as _storage
from .joint_storage import backward_steps, internal_peak_bytes
from .joint_storage import value_bytes as _value_bytes
from .zero_gradients import outputs_without_gradient
from .joint_units import (JointUnits, backward_reads, gradient_readers, incoming_gradient_sums, is_tangent,
                          passes_no_gradient, tangents_held_through_backward)
from .meta_flops import meta_flops

__all__ = ["joint_cost_graph", "rng_state_bytes", "JOINT_COST_SOURCE", "is_joint_cost_graph"]


def _is_buffer_update(node: fx.Node, buffers: set[fx.Node]) -> bool:
    """A forward output that is a buffer's new value: made by an op (or an item of one) that reads a
    non-trainable primal of the same shape and dtype (``running_mean`` -> BatchNorm's new running mean,
    ``num_batches_tracked + 1``), maybe through a conversion to the buffer's dtype (a bfloat16
    BatchNorm's new running mean is ``_to_copy`` of its float32 item: taken for a model output, it kept
    the normalized activations alive to the backward, and a bfloat16 ResNet-18 was predicted 22 % over)."""
    value = node.meta.get("val")
    source = node
    while (source.op == "call_function" and op_name(source.target) in _CONVERSIONS and source.args
           and isinstance(source.args[0], fx.Node)):
        source = source.args[0]
    producer = source.args[0] if source.target is operator.getitem and isinstance(source.args[0], fx.Node) else source
    if not isinstance(value, torch.Tensor):
        return False
    return any(a in buffers and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].shape == value.shape
               and a.meta["val"].dtype == value.dtype for a in producer.all_input_nodes)


def _output_descriptions(graph: fx.Graph) -> tuple[fx.Node, "Sequence[Any] | None"]:
    """The output node and AOTAutograd's description of each output (``meta["desc"]``, torch 2.9 on;
    None where it is missing)."""
    output = next(n for n in graph.nodes if n.op == "output")
    descriptions = output.meta.get("desc")
    return output, descriptions if isinstance(descriptions, (list, tuple)) else None


def _is_input_mutation(description: Any) -> bool:
    """An output that is an input's new value (``InputMutationAOTOutput``: a buffer's, a written input's)."""
    return type(description).__name__ == "InputMutationAOTOutput"


def buffer_updates(graph: fx.Graph, forward_outputs: Sequence[fx.Node], buffers: set[fx.Node]) -> set[fx.Node]:
    """The forward outputs that are inputs' new values (a buffer's: BatchNorm's running statistics).
    AOTAutograd says so where it describes the outputs (``meta["desc"]`` of the output node, from torch
    2.9: ``InputMutationAOTOutput``). Otherwise :func:`_is_buffer_update` judges the leading outputs
    (AOTAutograd returns the inputs' new values before the model's outputs). ``buffers`` (the primals
    without a gradient) hold the model's inputs too: a ``Linear(16, 16)`` on the input, returned, was
    taken for a buffer's update and the loss on it was not priced; returned beside the logits, one was
    priced as let go of after the forward, and the step measured 24 MiB against 16 MiB predicted."""
    output, descriptions = _output_descriptions(graph)
    if descriptions is not None and len(descriptions) == len(output.args[0]):
        return {node for node, description in zip(output.args[0], descriptions)
                if isinstance(node, fx.Node) and node in forward_outputs and _is_input_mutation(description)}
    updates: set[fx.Node] = set()
    for node in forward_outputs:
        if not _is_buffer_update(node, buffers):
            break
        updates.add(node)
    return updates


def units_reading_mutated_inputs(graph: fx.Graph, units: JointUnits) -> frozenset[int]:
    """The units with a forward node that reads an input the step writes into (AOTAutograd describes the
    write as an ``InputMutationAOTOutput`` naming the input's description), directly or through views of
    it: ``CostNode.reads_mutated_input``. ``x.mul_(2)`` on the model's input became ``mul(primal, 2)``,
    and a plan recomputing it read the input after the write (autograd refused the backward). A training
    BatchNorm reading its running statistics is left out: a recomputation normalizes from the batch's
    statistics its first computation made (``batch_norm_recompute``)."""
    _, descriptions = _output_descriptions(graph)
    if descriptions is None:
        return frozenset()
    mutated = [d.mutated_input for d in descriptions if _is_input_mutation(d)]
    values = [n for n in graph.nodes if n.op == "placeholder" and any(n.meta.get("desc") == d for d in mutated)]
    readers: set[int] = set()
    seen = set(values)
    while values:
        value = values.pop()
        for user in value.users:
            if user not in units.unit_of or user.op != "call_function":
                continue
            if op_name(user.target) in VIEW_TARGETS and user not in seen:
                seen.add(user)
                values.append(user)
            if op_name(user.target) not in STATE_READING_TARGETS:
                readers.add(units.unit_of[user])
    return frozenset(readers)


#: aten ops that convert a value to another dtype (a reduced-precision buffer's update: ``_is_buffer_update``)
_CONVERSIONS = ("_to_copy", "convert_element_type", "to")

#: aten ops whose result is a view of an input: a backward made only of them hands the gradient on.
VIEW_TARGETS = frozenset({"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice",
                          "select", "squeeze", "unsqueeze", "split", "split_with_sizes", "unbind", "alias",
                          "as_strided", "narrow", "detach", "chunk"})


def _passes_gradient_on(backward_nodes: list[fx.Node], incoming_sums: set[fx.Node]) -> bool:
    """``backward_aliases_grad``: the unit's backward only sums its incoming gradient's terms
    (``incoming_sums``) and reshapes it (views and ``getitem``s: a view's or ``cat``'s backward), or it
    has no backward nodes at all (an ``expand`` to its own shape, a ``clone``: AOTAutograd hands the
    gradient on as it is)."""
    return all(b.target is operator.getitem or op_name(b.target) in VIEW_TARGETS or b in incoming_sums
               for b in backward_nodes)


def _overwrites(user: fx.Node, value: fx.Node) -> bool:
    """``user`` is a functional ``copy`` into ``value`` (a functionalized ``value.copy_(src)``): its
    result holds ``src``'s values, and no gradient flows to ``value``."""
    return (user.op == "call_function" and op_name(user.target) == "copy" and user.args[0] is value
            and value not in user.args[1:])


#: aten ops that assemble a gradient from the terms of its views (a ``split``'s, an ``unbind``'s backward).
ASSEMBLING_TARGETS = frozenset({"cat", "stack"})


def _assembles_view_terms(backward_nodes: list[fx.Node], backward: Container[fx.Node]) -> bool:
    """The unit's backward concatenates or stacks gradient terms that other units' backward nodes
    make, each as it was made (no sum of two terms of one view among them; a view given no gradient
    gets a fill of zeros, which reads no gradient)."""
    own = set(backward_nodes)
    assembling = [b for b in backward_nodes if op_name(b.target) in ASSEMBLING_TARGETS]
    return bool(assembling) and all(
        a not in own or not any(x in backward for x in a.all_input_nodes)
        for b in assembling for a in b.all_input_nodes)


def _view_term_bytes(members: list[fx.Node], index: int, units: JointUnits, forward_outputs: Container[fx.Node],
                     backward_nodes: list[fx.Node]) -> tuple[tuple[int, int], ...]:
    """``grad_term_bytes`` of a unit whose outputs are views of one storage: ``(reader, bytes)``, the
    bytes of the views each other forward unit reads, when every view is read by one unit at most,
    none is a model output, and the backward assembles their terms (:func:`_assembles_view_terms`)."""
    terms: dict[int, int] = {}
    for n in members:
        if not (_is_tensor(n) and n.meta["val"].is_floating_point()):
            continue
        readers = {units.unit_of[u] for u in n.users if u in units.unit_of} - {index}
        if not readers:
            continue
        if len(readers) > 1 or n in forward_outputs:
            return ()
        value = n.meta["val"]
        reader = readers.pop()
        terms[reader] = terms.get(reader, 0) + value.numel() * value.element_size()
    if len(terms) < 2 or not _assembles_view_terms(backward_nodes, units.backward):
        return ()
    return tuple(sorted(terms.items()))


def rng_state_bytes(device: torch.device | None) -> int:
    """Bytes of one snapshot of the generator a random op on ``device`` draws from
    (``joint_lowering.rng_snapshot``): the CUDA generator's state on a GPU, else the CPU generator's."""
    state = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else torch.get_rng_state()
    return state.numel() * state.element_size()


def _rng_state_bytes(primals: list[fx.Node]) -> int:
    """:func:`rng_state_bytes` of the device the step runs on (a GPU if a primal is on one)."""
    return rng_state_bytes(next((n.meta["val"].device for n in primals if _is_tensor(n) and n.meta["val"].is_cuda),
                                None))


def _moved_bytes(node: fx.Node) -> int:
    if node.target is operator.getitem or op_name(node.target) in VIEW_TARGETS:
        return 0  # a view or a tuple's item: no kernel reads or writes its bytes
    return _value_bytes(node) + sum(_value_bytes(a) for a in node.all_input_nodes)


def _seconds(node: fx.Node, flops: int, profile: DeviceProfile, measured: dict[str, float]) -> float:
    """A node's time: measured, or the roofline's for its FLOPs and moved bytes."""
    took = measured.get(node.name)
    return took if took is not None else profile.seconds(flops, _moved_bytes(node))


def _normalization_seconds(node: fx.Node, profile: DeviceProfile, measured: dict[str, float]) -> float:
    """A training BatchNorm's normalization from its statistics (``batch_norm_recompute``): measured beside
    the node, or the roofline's for a multiply and an add per element, reading and writing the input."""
    took = measured.get(node.name + RECOMPUTE_SECONDS_SUFFIX)
    if took is not None:
        return took
    data = node.args[0].meta["val"]
    return profile.seconds(2 * data.numel(), 2 * data.numel() * data.element_size())


def _backward_storage_makers(graph: fx.Graph, unit_of_backward: dict[fx.Node, int], primal_keys: set[int]
                            ) -> dict[int, tuple[int, fx.Node]]:
    """``{storage key: (unit, node)}`` of every storage a backward node allocates: the node allocating
    it first, in execution order, and its unit (``unit_of_backward``: backward node -> its unit). A view
    of it in another unit's backward (a gradient read there, a ``t`` returning a weight gradient) is not
    that unit's allocation."""
    makers: dict[int, tuple[int, fx.Node]] = {}
    for node in graph.nodes:
        if node in unit_of_backward and _allocates(node):
            for key, _ in _storage(node):
                if key not in primal_keys:
                    makers.setdefault(key, (unit_of_backward[node], node))
    return makers


@dataclass
class _ReturnedGradients:
    """How the returned (parameter and input) gradients are priced, per unit of the joint graph."""

    made: list[dict[int, int]]  # {storage key: bytes} live from the unit's backward to the step's end
    summed_bytes: list[int]     # later terms (made or added here) and out-of-place new sums, transient
    accumulation_keys: set[int]  # terms and partial sums, priced through the two above


def _returned_gradients(graph: fx.Graph, units: JointUnits, unit_of_backward: dict[fx.Node, int],
                        makers: dict[int, tuple[int, fx.Node]]) -> _ReturnedGradients:
    """A returned gradient counts at the unit whose backward node allocates its storage, not at the
    unit returning it. A linear's weight gradient is an ``mm`` of the linear's backward, returned
    through a ``t`` traced under the weight transpose's number, whose backward runs later: the ``mm``
    lives beside the linear's output and input gradients (GPT-2 tiny at 70 %: 0.976 of the allocator's
    peak when it was counted at the transpose). A gradient that is a sum of terms made by several
    units' backward (a tied weight: GPT-2's ``wte`` in the embedding and the head; a weight shared by
    every step of an LSTM) is summed as soon as both terms exist: one buffer of its size lives from the
    first term on, and each later term adds itself and the new sum while its backward runs (itself
    alone where the sum is accumulated in place, ``gradient_accumulation``). One no
    backward node allocates (a view of a tangent) counts at the unit returning it."""
    position = {n: k for k, n in enumerate(graph.nodes)}

    def made_in(term: fx.Node) -> int:  # the unit whose backward allocates the term's storage
        return next((makers[k][0] for k, _ in _storage(term) if k in makers), unit_of_backward[term])
    priced = _ReturnedGradients([{} for _ in units.units], [0] * len(units.units), set())
    for g in units.gradient_outputs(graph):
        if not isinstance(g, fx.Node):
            continue
        for key, nbytes in _storage(g):
            unit, node = makers.get(key, (unit_of_backward.get(g), None))
            terms, sums = sum_terms(node, unit_of_backward) if node is not None else ([], [])
            if len(terms) < 2:
                if unit is not None:
                    priced.made[unit][key] = nbytes
                continue
            terms.sort(key=position.get)
            priced.made[made_in(terms[0])][key] = nbytes
            in_place = all(s.name in units.in_place_sums for s in sums)
            for term in terms[1:]:  # live from its kernel to its sum (a linear's: the ``mm``, then its ``t``)
                priced.summed_bytes[made_in(term)] += nbytes
                priced.summed_bytes[unit_of_backward[term]] += (nbytes if made_in(term) != unit_of_backward[term]
                                                                else 0) + (0 if in_place else nbytes)
            priced.accumulation_keys |= {k for n in (*terms, *sums) for k, _ in _storage(n)} - {key}
    return priced


def joint_cost_graph(joint: fx.GraphModule, units: JointUnits, name: str = "joint",
                     device_profile: DeviceProfile | str = "cpu", workspace: dict[str, int] | None = None,
                     loss_bytes: int | None = None, node_seconds: dict[str, float] | None = None,
                     loss_unreached_gradient_bytes: int = 0) -> CostGraph:
    """The implicit-backward :class:`CostGraph` of ``units`` (module docstring), node ``i`` = unit ``i``,
    named after the unit's first node. ``loss_bytes``: the loss's transient
    (``joint_allocations.outputs_loss_bytes``; None: the planner guesses), and
    ``loss_unreached_gradient_bytes`` the zero gradients of the outputs it does not reach. ``workspace``: each node's
    kernel temporaries (``joint_allocations.kernel_workspace_bytes``); a unit's forward workspace holds
    each node's beside what is live as it runs, and its backward's the largest of its backward nodes' on top of the
    temporaries they keep and the returned gradients they make. ``node_seconds``: each node's measured
    run time (``joint_allocations.node_seconds``); a node without one is priced by ``device_profile``
    from its FLOPs and the bytes it moves."""
    workspace = workspace or {}
    measured = node_seconds or {}
    profile = DEVICE_PROFILES[device_profile] if isinstance(device_profile, str) else device_profile
    graph = joint.graph
    primal_keys = {key for n in graph.nodes if n.op == "placeholder" for key, _ in _storage(n)}
    owner: dict[int, int] = {}  # storage key -> unit that created it
    for index, members in enumerate(units.units):
        for node in members:
            for key, _ in _storage(node):
                if key not in primal_keys:
                    owner.setdefault(key, index)
    gradient_outputs = units.gradient_outputs(graph)
    primals = [n for n in graph.nodes if n.op == "placeholder" and not is_tangent(n)]
    trainable = {p for p, g in zip(primals, gradient_outputs) if g is not None}
    # the model's outputs; a buffer's new value (BatchNorm's running statistics, written back after the
    # forward) is not one: it would keep its unit's whole value (the normalized activations) alive
    returned = set(units.forward_outputs(graph))
    updates = buffer_updates(graph, units.forward_outputs(graph), set(primals) - trainable)
    forward_outputs = returned - updates
    update_keys = {key for n in updates for key, _ in _storage(n)}
    backward_unit = {b: i for i, nodes in enumerate(units.backward_of) for b in nodes}
    makers = _backward_storage_makers(graph, backward_unit, primal_keys)
    returned_gradients = _returned_gradients(graph, units, backward_unit, makers)
    made_gradients = returned_gradients.made
    requires_grad: list[bool] = []
    parameter_views: list[bool] = []
    nodes: list[CostNode] = []
    estimated: list[tuple[float, float]] = []  # the roofline's seconds beside measured ones
    unit_predecessors: list[tuple[int, ...]] = []
    has_backward = [bool(b) for b in units.backward_of]
    computed_once = units_reading_mutated_inputs(graph, units)
    unit_inputs = [{units.unit_of[a] for n in members for a in n.all_input_nodes
                    if a in units.unit_of and units.unit_of[a] != index} | backward_reads(units, index)
                   for index, members in enumerate(units.units)]
    readers_of_gradients = gradient_readers(units.backward_of, unit_inputs.__getitem__)
    flops_by_signature: dict[Any, int] = {}
    for index, members in enumerate(units.units):
        member_set = set(members)
        own_keys = {key: nbytes for n in members for key, nbytes in _storage(n) if owner.get(key) == index}
        def read_by_other_units(n: fx.Node, overwritten: bool = True) -> bool:
            """Read by another unit's forward node (the output node counts through forward_outputs);
            ``overwritten`` False: not counting a ``copy`` into it (:func:`_overwrites`)."""
            return any(u not in member_set and u not in units.backward and u.op != "output"
                       and (overwritten or not _overwrites(u, n)) for u in n.users)
        # an output: what the model returns, other units read, or other units' backward reads (the
        # ``clone`` a functionalized ``silu_`` keeps for the ``silu``'s backward lives until then)
        read_outside = {key for n in members if n in forward_outputs or read_by_other_units(n)
                        or any(backward_unit.get(u, index) != index for u in n.users) for key, _ in _storage(n)}
        output_bytes = sum(nbytes for key, nbytes in own_keys.items() if key in read_outside)
        foreign = [owner[key] for n in members for key, _ in _storage(n) if key in owner and owner[key] != index]
        alias_of = foreign[0] if foreign and not output_bytes else None
        backward_nodes = units.backward_of[index]
        read_by_backward = {a for b in backward_nodes for a in b.all_input_nodes if a in units.unit_of}
        saved_output = saved_buffer = saved_input = 0
        needs: set[int] = set()
        counted: set[int] = set()
        kept_internal: set[int] = set()
        for value in read_by_backward:
            for key, nbytes in _storage(value):
                if key in counted or key in primal_keys or key not in owner:
                    continue
                counted.add(key)
                if owner[key] == index:
                    if key in read_outside:  # the unit's output: its backward needs its value
                        saved_output += nbytes
                        needs.add(index)
                    else:  # internal: held by the backward alone (the simulator keeps it with the tape)
                        saved_buffer += nbytes
                        kept_internal.add(key)
                else:
                    saved_input += nbytes
                    needs.add(owner[key])
        # the buffers' new values: returned by the generated forward, they live to its end (those its
        # backward reads live with the tape, ``saved_buffer_bytes``)
        state_updates = {key: own_keys[key] for key in update_keys & own_keys.keys() - read_outside - kept_internal}
        inputs = {a for n in members for a in n.all_input_nodes if a not in member_set}
        # a view of parameters (a linear's ``t(weight)``, ``t(t(weight))``) gets no gradient buffer:
        # the parameter's gradient is made by backward nodes from the consumer's incoming gradient and
        # counted where they return it (``param_grad_bytes``)
        parameter_view = all(a.op == "placeholder" or (a in units.unit_of and parameter_views[units.unit_of[a]])
                             for a in inputs) and all(_is_tensor(n) and not _allocates(n) for n in members)
        parameter_views.append(parameter_view)
        # a unit with no backward nodes that only a backward reads (a transpose saved for a ``bmm``'s or
        # a Conv1D's backward), or only a ``copy`` overwrites (the view an ``out[:, t] = x`` writes
        # into), or that only makes a tensor of its input's shape (``zeros_like``), passes no gradient
        # on: the simulator would sum one into its input
        read_on = any(n in forward_outputs or read_by_other_units(n, overwritten=False) for n in members)
        grad = bool(backward_nodes) or (read_on and not passes_no_gradient(members) and any(
            (a in trainable) or (a in units.unit_of and requires_grad[units.unit_of[a]]) for a in inputs))
        requires_grad.append(grad)
        # the gradient of the unit's outputs that other forward units read: as large as each tensor (a
        # view's gradient is the view's size, not its base storage's), the views of one storage together
        # at most its size (the three ``getitem``s of an ``unbind`` get three gradients: ViT's q, k and v,
        # counted as one, were 400 KB under its attention's backward)
        floating: dict[Any, int] = {}
        storage_bytes: dict[Any, int] = {}
        for n in members:
            if _is_tensor(n) and n.meta["val"].is_floating_point() and (n in forward_outputs or read_by_other_units(n)):
                value = n.meta["val"]
                key, nbytes = (_storage(n) or [(n, 0)])[0]
                floating[key] = floating.get(key, 0) + value.numel() * value.element_size()
                storage_bytes[key] = max(nbytes, value.numel() * value.element_size())
        grad_bytes = sum(min(b, storage_bytes[k]) for k, b in floating.items()) if grad and not parameter_view else 0
        own_backward = set(backward_nodes)
        returned = [g for g in gradient_outputs if isinstance(g, fx.Node) and g in own_backward]
        # passed on: the returned parameter gradients, and the input gradients other units' backward
        # nodes read (the simulator counts those as the predecessors' grad_bytes)
        passed_keys = {key for b in backward_nodes if b in returned or any(u not in own_backward for u in b.users)
                       for key, _ in _storage(b)}
        # the sums of the gradient terms other units' backward make are priced where each term is
        # made (GPT-J's GELU input: three terms, whose two sums were priced again here, 7 % over)
        incoming_sums = incoming_gradient_sums(backward_nodes, units.backward)
        summed_keys = {key for b in incoming_sums for key, _ in _storage(b)}
        backward_made = {key: nbytes for b in backward_nodes for key, nbytes in _storage(b)
                         if makers.get(key, (None,))[0] == index and key not in passed_keys
                         and key not in returned_gradients.accumulation_keys and key not in summed_keys}
        # what its backward reads must be live when it runs, to be saved
        predecessors = tuple(sorted(unit_inputs[index] | {r for r in readers_of_gradients[index] if r < index}))
        unit_predecessors.append(predecessors)
        steps, step_bytes, release_steps, grad_release_step = backward_steps(
            backward_nodes, predecessors, sorted(needs), owner, backward_unit, unit_predecessors, has_backward,
            temporaries=backward_made, returned=made_gradients[index],
            constant_bytes=returned_gradients.summed_bytes[index], kernel_bytes=workspace,
            incoming={a for b in backward_nodes for a in b.all_input_nodes
                      if a in units.backward and a not in own_backward} | incoming_sums)
        flops = {n: meta_flops(n, flops_by_signature) for n in (*members, *backward_nodes)}
        forward_flops = sum(flops[n] for n in members)
        backward_flops = sum(flops[b] for b in backward_nodes)
        # the internal storages live at once beside the outputs made so far (an output made last
        # overlaps none of them): the workspace is what the unit holds beyond its outputs at its peak
        internal = internal_peak_bytes(members, own_keys, kept_internal | read_outside | state_updates.keys(),
                                       [workspace.get(n.name, 0) for n in members]) - output_bytes
        internal -= sum(state_updates.values())
        targets = {op_name(n.target) for n in members if n.op == "call_function"}
        forward_seconds = sum(_seconds(n, flops[n], profile, measured) for n in members)
        estimated_forward = sum(profile.seconds(flops[n], _moved_bytes(n)) for n in members)
        estimated_backward = sum(profile.seconds(flops[b], _moved_bytes(b)) for b in backward_nodes)
        # a training BatchNorm recomputed from its statistics, kept from the first computation
        statistics = {n: s for n in members if (s := normalization_statistics(n, own_backward)) is not None}
        # the storages its recomputations read from the first computation instead of making them again
        kept_storages = dict(kv for n in members for item in items_read_from_the_forward(n, statistics.get(n))
                             for kv in _storage(item))
        recompute_seconds = estimated_recompute = None
        if statistics:
            recompute_seconds = forward_seconds + sum(_normalization_seconds(n, profile, measured)
                                                      - _seconds(n, flops[n], profile, measured) for n in statistics)
            estimated_recompute = estimated_forward + sum(
                _normalization_seconds(n, profile, {}) - profile.seconds(flops[n], _moved_bytes(n)) for n in statistics)
        estimated.append((estimated_forward, estimated_backward) if estimated_recompute is None
                         else (estimated_forward, estimated_backward, estimated_recompute))
        nodes.append(CostNode(
            index=index, name=members[0].name, kind="function", target=op_name(members[0].target),
            predecessors=predecessors,
            order_only_predecessors=tuple(p for p in predecessors if p not in unit_inputs[index]),
            backward_steps=steps, backward_step_workspace_bytes=step_bytes,
            tape_release_steps=release_steps, grad_release_step=grad_release_step,
            output_bytes=output_bytes, alias_of=alias_of, grad_bytes=grad_bytes,
            saved_input_bytes=saved_input, saved_output_bytes=saved_output, saved_buffer_bytes=saved_buffer,
            backward_needs=tuple(sorted(needs)),
            workspace_bytes=max(0, internal - saved_buffer),
            backward_aliases_grad=_passes_gradient_on(backward_nodes, incoming_sums),
            grad_term_bytes=_view_term_bytes(members, index, units, forward_outputs, backward_nodes)
            if grad and not parameter_view and len(floating) == 1 else (),
            # the returned gradients it makes live from their kernel to the end of the step, beside
            # the other storages and the largest kernel temporaries of its backward
            backward_workspace_bytes=internal_peak_bytes(backward_nodes, backward_made, set())
            + sum(made_gradients[index].values())
            + returned_gradients.summed_bytes[index]
            + max((workspace.get(b.name, 0) for b in backward_nodes), default=0),
            param_grad_bytes=sum(made_gradients[index].values()),
            forward_cost=forward_seconds, recompute_cost=recompute_seconds,
            recompute_kept_bytes=sum(nbytes for key, nbytes in kept_storages.items() if key in kept_internal),
            state_update_bytes=sum(state_updates.values()),
            backward_cost=sum(_seconds(b, flops[b], profile, measured) for b in backward_nodes),
            forward_flops=forward_flops, backward_flops=backward_flops, requires_grad=grad,
            random=bool(targets & RANDOM_TARGETS), stateful=bool(targets & STATE_READING_TARGETS),
            random_op_count=max(1, sum(1 for n in members if n.op == "call_function"
                                       and op_name(n.target) in RANDOM_TARGETS)),
            reads_mutated_input=index in computed_once))
    outputs = tuple(sorted({units.unit_of[n] for n in forward_outputs if n in units.unit_of}))
    no_gradient = outputs_without_gradient(joint)
    input_bytes = sum(_value_bytes(p) for p in primals if p not in trainable)
    return CostGraph(name=name, nodes=tuple(nodes), cost_unit="seconds", loss_bytes=loss_bytes,
                     cost_source=(f"measured ({len(measured)} nodes timed)" if measured
                                  else f"flop-estimate ({profile.name})") + f", {JOINT_COST_SOURCE}",
                     input_bytes=input_bytes,
                     parameter_bytes=sum(_value_bytes(p) for p in trainable), source="traced",
                     output_indices=outputs, rng_state_bytes=_rng_state_bytes(primals),
                     # every differentiable output gets a gradient at the start of the backward: AOTAutograd's
                     # backward takes one tangent per output, and autograd fills those the loss does not
                     # reach with zeros (T5's cached keys and values: 36 KB a plan of 331 KB did not see),
                     # unless the tangent is folded away (``zero_gradients``: nothing reads it)
                     loss_gradient_outputs=tuple(sorted({units.unit_of[n] for n in forward_outputs
                                                         if n in units.unit_of and n not in no_gradient})),
                     # the generated backward drops each after its last use, where AOTAutograd's runtime
                     # lets go of them (torch 2.13 on); before, they live until its backward returns
                     output_gradients_held=tangents_held_through_backward(),
                     estimated_costs=tuple(estimated) if measured else (),
                     loss_unreached_gradient_bytes=loss_unreached_gradient_bytes)
