"""Lowering a schedule of a joint graph's units into a forward and a backward graph (compiler path).

A solver plans on ``joint_costs.joint_cost_graph`` (node ``i`` = unit ``i``) and returns a
:class:`~recompute_graph.schedule.Schedule`. :func:`lower_schedule` turns it into code by rewriting the
joint graph, then extracting the two graphs AOTAutograd runs with torch's
``_extract_fwd_bwd_modules``:

* the forward section computes the units in the order of the schedule's forward ops, each unit's nodes
  in joint-graph order (``_forward_order``);
* the backward section follows ``schedule.backward_ops``. ``Forward(u)`` there is a recomputation:
  every node of unit ``u`` is copied (reading the current copies of its inputs), and from then on
  recomputations read the copies; a later ``Forward(u)`` copies it again, so a value recomputed several
  times is computed several times. A unit's backward reads what its tape holds: the values as they were
  when it was last computed with a tape (the originals for a unit taped in the forward), as the
  simulator prices it. ``Backward(v)`` releases unit ``v``'s backward nodes, each emitted
  as soon as the backward nodes it reads have been. A gradient sum (an ``add`` of two gradients) is
  emitted once both terms exist, right after the kernels that made the last one, wherever it was
  placed, as the simulator prices it. ``FreeValue`` needs no code: fx frees a value after its last use.
* the *saved* values are the forward originals the backward section reads (and the primals it reads).

A random node (dropout) of a unit the schedule recomputes gets an RNG snapshot in the forward
(:func:`rng_snapshot`, a saved value of ``rng_state_bytes``), and its copy runs under that state
(:func:`replay_random`), so the recomputed mask is the original's and the global generator is left as it
was. A training-mode BatchNorm is recomputed without its running statistics (``batch_norm_recompute``):
normalized from the batch statistics the forward made, which its backward reads anyway, or, where those
cannot be used, from the batch (``_native_batch_norm_legit.no_stats``); other BatchNorm forms are never
copied (their outputs are saved).
:func:`graph_peak_bytes` is the liveness of the generated graphs, from the fake values of their nodes:
the judge of what a plan costs once lowered, beside the simulator's prediction.

:func:`plan_and_lower` prices the joint graph (:func:`price_joint`), plans it with ``planner.make_plan``
at the budget, and lowers the plan (:func:`lower_plan`); ``compile_backend.budget_backend``, the
``torch.compile`` backend, calls them from AOTAutograd's partitioner.
"""
from __future__ import annotations

import heapq
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import fx

from .errors import InfeasibleBudgetError, user_stacklevel
from .graph import CostGraph
from .gradient_accumulation import ACCUMULATE_IN_PLACE, accumulate_in_place, arrival_order_sums
from .joint_capture import RANDOM_TARGETS, op_name
from .joint_allocations import kernel_workspace_bytes, node_seconds, outputs_loss_bytes
from .joint_costs import joint_cost_graph, rng_state_bytes
from .joint_units import JointUnits, is_gradient_sum, is_tangent, joint_units, tangents_held_through_backward
from .joint_storage import storage_of as _storage
from .batch_norm_recompute import (copy_batch_norm, copy_normalization, normalization_statistics, reads_updated_state,
                                   training_batch_norm)
from .joint_partition import extract_graphs
from .zero_gradients import fold_zero_tangents, folds_cleanly, unreached_tangents
from .schedule import Backward, Forward, Schedule, dead_recomputations

__all__ = ["Lowered", "lower_schedule", "graph_peak_bytes", "price_joint", "lower_plan", "plan_and_lower",
           "last_lowering", "set_last_lowering", "InfeasibleBudgetWarning"]


@dataclass(frozen=True)
class Lowered:
    """One lowering: the cost graph and plan, the generated graphs, what is saved and recomputed."""

    graph: CostGraph
    plan: Any  # planner.RecomputePlan
    forward_graph: fx.GraphModule
    backward_graph: fx.GraphModule
    saved: tuple[str, ...]
    recomputed: tuple[str, ...]  # names of the backward's recompute nodes, in order (repeats allowed)
    units: JointUnits | None = None  # the joint graph's units (node i of ``graph`` = unit i)
    #: what inductor's code for the graphs holds beyond them, measured on the example inputs
    #: (``inductor_lowering.inductor_excess_bytes``); None without inductor
    inductor_excess_bytes: int | None = None
    #: ``backward_graph`` with the tangents of the outputs the planned loss does not reach
    #: (``zero_tangents``) folded away (``zero_gradients``): what runs when their gradients are missing,
    #: the step the plan prices; None when there are none
    folded_backward_graph: fx.GraphModule | None = None
    zero_tangents: tuple[str, ...] = ()

    @property
    def planned_backward_graph(self) -> fx.GraphModule:
        """The backward the plan prices: ``folded_backward_graph`` where there is one, else ``backward_graph``."""
        return self.folded_backward_graph if self.folded_backward_graph is not None else self.backward_graph

    @property
    def predicted_step_peak_bytes(self) -> int:
        """The step's predicted peak: the plan's, with what inductor's code holds beyond the generated
        graphs where it was measured (less where its fusions drop intermediates)."""
        return self.plan.predicted_step_peak_bytes + (self.inductor_excess_bytes or 0)

    @property
    def backward_code(self) -> str:
        """The generated backward as Python (``planned_backward_graph``'s): each recompute node is a
        forward op before its use."""
        return self.planned_backward_graph.code

    def __repr__(self) -> str:
        inductor = (f", inductor's code {self.inductor_excess_bytes:+d} B" if self.inductor_excess_bytes is not None
                    else "")
        return (f"Lowered({self.plan.solver}: {len(self.saved)} saved, {len(self.recomputed)} recompute nodes; "
                f"predicted peak {self.plan.predicted_peak_bytes} B{inductor})")


_LAST: list[Lowered] = []


class InfeasibleBudgetWarning(UserWarning):
    """A compiled graph could not be planned within the budget and was planned at its floor
    (``budget_backend(..., on_infeasible="floor")``)."""

#: ``(cost graph, schedule) -> schedule``: applied to the plan's schedule before lowering.
SchedulePass = Callable[[CostGraph, Schedule], Schedule]


def last_lowering() -> Lowered | None:
    """The :class:`Lowered` of the most recent lowering (``compile_backend.budget_backend``'s partition),
    or None."""
    return _LAST[-1] if _LAST else None


def set_last_lowering(lowered: Lowered) -> None:
    """What :func:`last_lowering` returns from now on (a plan fitted to inductor's code after lowering)."""
    _LAST[:] = [lowered]


def _is_gradient_sum(node: fx.Node, units: JointUnits) -> bool:
    """An ``add`` of two gradients (backward values, no forward value read), a tangent among them (the
    output's gradient plus a branch's term, in a residual stream the model returns)."""
    return node in units.backward and is_gradient_sum(node, units.backward, tangent_terms=True)


def _term_views(sums: list[fx.Node], units: JointUnits) -> list[fx.Node]:
    """The backward nodes between a gradient sum and the kernel that made one of its terms that only view
    it (a linear weight's gradient ``t(mm(...))``, the ``t`` of the weight transpose unit's backward):
    emitted with the sum. Left for their unit's ``Backward``, a recomputation between the two held the
    term (an unrolled LSTM's ``weight_hh`` gradient: 4 KB over the prediction)."""
    views: dict[fx.Node, None] = {}  # ordered, for a deterministic emission order
    stack = [a for s in sums for a in s.all_input_nodes]
    while stack:
        node = stack.pop()
        inputs = [a for a in node.all_input_nodes if a in units.backward]
        if (node in units.backward and len(inputs) == 1 and node not in views
                and {key for key, _ in _storage(node)} <= {key for key, _ in _storage(inputs[0])}):
            views[node] = None
            stack.append(inputs[0])
    return list(views)


def _is_random(node: fx.Node) -> bool:
    return node.op == "call_function" and op_name(node.target) in RANDOM_TARGETS


def _device(like: torch.Tensor | torch.device) -> torch.device:
    return like if isinstance(like, torch.device) else like.device


def rng_snapshot(like: torch.Tensor | torch.device) -> torch.Tensor:
    """The state of the generator a random op on ``like``'s device (or on the device ``like``) draws
    from (a node of the forward)."""
    device = _device(like)
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def replay_random(state: torch.Tensor, like: torch.Tensor | torch.device, target: Any, *args: Any,
                  **kwargs: Any) -> Any:
    """``target(*args, **kwargs)`` drawing from ``state`` (the snapshot taken before the original ran),
    the global generator left as it was: a recomputed dropout reproduces its mask."""
    device = _device(like)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        return target(*args, **kwargs)


def _device_of_random(node: fx.Node, read: Callable[[fx.Node], fx.Node]) -> fx.Node | torch.device:
    """What tells the generated code which generator ``node`` draws from: its first tensor input, or,
    for an op that makes its tensor from a shape (``torch.rand(shape, device=...)``: stochastic depth in
    Hugging Face's Swin), the device of its value."""
    tensor_input = next((a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)), None)
    return read(tensor_input) if tensor_input is not None else node.meta["val"].device


def _snapshot_value(like: fx.Node | torch.device) -> torch.Tensor:
    value = like if isinstance(like, torch.device) else like.meta.get("val")
    nbytes = rng_state_bytes(_device(value) if isinstance(value, (torch.Tensor, torch.device)) else None)
    return torch.empty(nbytes, dtype=torch.uint8, device="meta")


def lower_schedule(joint: fx.GraphModule, units: JointUnits, schedule: Schedule, graph: CostGraph
                   ) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node], list[str]]:
    """The rewritten joint module, its saved tensor values and symbolic values, and the names of the
    recompute nodes (module docstring). Pass the first three to ``_extract_fwd_bwd_modules``.
    ``graph``: the units' cost graph, which says which recomputations nothing reads
    (``schedule.dead_recomputations``): they get no code, as the simulator prices them."""
    old = joint.graph
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}      # old node -> its node in the forward section / backward
    current: dict[fx.Node, fx.Node] = {}  # old forward node -> the copy the backward reads now
    dead = dead_recomputations(graph, (*schedule.forward_ops, None, *schedule.backward_ops))
    # the units the backward recomputes with code (a dead copy replays no random op: no snapshot)
    recomputed_units = {op.node for at, op in enumerate(schedule.backward_ops, start=len(schedule.forward_ops) + 1)
                        if isinstance(op, Forward) and at not in dead}
    snapshots: dict[fx.Node, fx.Node] = {}  # random node recomputed later -> its RNG snapshot
    position = {n: i for i, n in enumerate(old.nodes)}
    for node in [n for n in old.nodes if n.op == "placeholder"] + _forward_order(old, units, schedule, position):
        if node in units.unit_of and units.unit_of[node] in recomputed_units and _is_random(node):
            like = _device_of_random(node, env.__getitem__)
            snapshot = new.call_function(rng_snapshot, (like,))
            snapshot.meta["val"] = _snapshot_value(like)
            snapshots[node] = snapshot
        env[node] = new.node_copy(node, lambda a: env[a])
    emitted: set[fx.Node] = set()
    waiting: dict[fx.Node, int] = {}        # released, not yet emitted -> backward inputs not yet emitted
    ready: list[tuple[int, fx.Node]] = []   # heap by joint-graph position
    recomputed: list[str] = []

    # the schedule's tapes: a unit's backward reads the forward values as they were when it was last
    # computed with a tape (in the forward: the originals; recomputed: the copies current then), as the
    # simulator prices it, even when a newer copy exists by the time its backward runs
    tape_view: dict[int, dict[fx.Node, fx.Node]] = {op.node: {} for op in schedule.forward_ops
                                                    if isinstance(op, Forward) and op.tape}
    unit_of_backward = {b: i for i, nodes in enumerate(units.backward_of) for b in nodes}

    def read(a: fx.Node) -> fx.Node:
        if a in units.backward or a.op == "placeholder":
            return env[a]
        return current.get(a, env[a])

    def reader_of(node: fx.Node) -> Callable[[fx.Node], fx.Node]:
        view = tape_view.get(unit_of_backward.get(node, -1))
        if view is None:
            return read
        return lambda a: env[a] if a in units.backward or a.op == "placeholder" else view.get(a, env[a])

    # activation gradients summed in the order their terms are made (``arrival_order_sums``)
    output = next(n for n in old.nodes if n.op == "output")
    sum_trees = arrival_order_sums(old, units.backward, [g for g in output.args[0][units.num_fwd_outputs:]
                                                         if isinstance(g, fx.Node)])
    tree_of_term = {t: tree for tree in sum_trees for t in tree.terms}
    in_trees = {s for tree in sum_trees for s in tree.sums}
    partial_sum: dict[fx.Node, fx.Node] = {}  # root -> the sum of its terms made so far
    terms_left = {tree.root: len(tree.terms) for tree in sum_trees}

    def release(nodes: Iterable[fx.Node]) -> None:
        for node in nodes:
            if node in emitted or node in waiting or node in in_trees:
                continue
            waiting[node] = sum(1 for a in set(node.all_input_nodes)
                                if a in units.backward and not is_tangent(a) and a not in emitted)
            if not waiting[node]:
                heapq.heappush(ready, (position[node], node))

    def made(node: fx.Node) -> None:
        emitted.add(node)
        for user in node.users:
            if user in waiting:
                waiting[user] -= 1
                if not waiting[user]:
                    heapq.heappush(ready, (position[user], user))
        if node in tree_of_term:
            terms_made.append(node)

    def add_term(term: fx.Node) -> None:
        """Add ``term`` to its sum's terms so far; the last one makes the sum: the first addition into a
        new buffer (the root's), each later one into that buffer in place (``add_``), which nothing else
        reads, as the simulator accumulates a gradient and as the graphs' liveness, one storage for
        every partial sum, counts it (added out of place, each partial sum was a new buffer beside the
        one before it that neither saw: Mamba's scan, 64 KB over the plan at its floor)."""
        root = tree_of_term[term].root
        so_far = partial_sum.get(root)
        if so_far is None:
            partial_sum[root] = env[term]
        elif so_far.meta.get("val") is root.meta["val"]:  # a partial sum this lowering made
            partial_sum[root] = new.call_function(torch.ops.aten.add_.Tensor, (so_far, env[term]))
            partial_sum[root].meta["val"] = root.meta["val"]
            # a mutation is kept in the forward graph unless tagged as the backward's
            partial_sum[root].meta["partitioner_tag"] = "is_backward"
        else:
            partial_sum[root] = new.call_function(torch.ops.aten.add.Tensor, (so_far, env[term]))
            partial_sum[root].meta["val"] = root.meta["val"]
        terms_left[root] -= 1
        if not terms_left[root]:
            env[root] = partial_sum[root]
            made(root)

    terms_made: list[fx.Node] = []  # terms made by the kernels being emitted, summed after them

    def emit_ready() -> None:
        """The ready backward nodes in the joint graph's order, then the sums of the terms they made, as the
        simulator makes them (made at its term, HF RWKV's token-shift sum held a kernel's product: +3.8 KB)."""
        while ready or terms_made:
            while ready:
                _, node = heapq.heappop(ready)
                env[node] = new.node_copy(node, reader_of(node))
                if node.name in units.in_place_sums:  # names change here; the mark travels with the node
                    env[node].meta[ACCUMULATE_IN_PLACE] = True
                del waiting[node]
                made(node)
            made_now, terms_made[:] = list(terms_made), []
            for term in made_now:
                add_term(term)

    # gradient sums are emitted once both terms exist (``emit_ready``): a sum left for the backward that
    # reads it kept each term alive until then (DenseNet's concatenations' gradients: 5.8 MB over the plan)
    sums = [n for n in old.nodes if _is_gradient_sum(n, units)]
    release(_term_views(sums, units))
    release(sums)
    for term in [t for t in tree_of_term if t.op == "placeholder"]:  # a tangent is there from the start
        add_term(term)
    for at, op in enumerate(schedule.backward_ops, start=len(schedule.forward_ops) + 1):
        if isinstance(op, Forward) and at in dead:  # no code: nothing reads the copy
            if op.tape:
                tape_view[op.node] = dict(current)
        elif isinstance(op, Forward):
            normalized: dict[fx.Node, fx.Node] = {}  # a BatchNorm normalized from its saved statistics -> copy
            own_backward = set(units.backward_of[op.node])
            for node in units.units[op.node]:
                if reads_updated_state(node):
                    continue
                if node.target is operator.getitem and node.args[0] in normalized:
                    if node.args[1] == 0:  # the output; the statistics are read from the forward
                        current[node] = normalized[node.args[0]]
                    continue
                statistics = normalization_statistics(node, own_backward)
                if statistics is not None:
                    copy = normalized[node] = copy_normalization(new, node, read, (env[statistics[0]],
                                                                                   env[statistics[1]]))
                elif training_batch_norm(node):
                    copy = copy_batch_norm(new, node, read)
                elif node in snapshots:
                    args, kwargs = fx.node.map_arg((node.args, node.kwargs), read)
                    copy = new.call_function(replay_random, (snapshots[node], _device_of_random(node, read),
                                                             node.target, *args), kwargs)
                    copy.meta = dict(node.meta)
                else:
                    copy = new.node_copy(node, read)
                current[node] = copy
                recomputed.append(copy.name)
            if op.tape:
                tape_view[op.node] = dict(current)
        elif isinstance(op, Backward):
            release(units.backward_of[op.node])
            emit_ready()
    release(n for n in old.nodes if n in units.backward and not is_tangent(n))
    emit_ready()
    if waiting:
        first = min(waiting, key=position.get)
        raise RuntimeError(f"joint lowering: {len(waiting)} backward nodes could not be placed "
                           f"({first.name} first)")
    forward_outputs = list(output.args[0][: units.num_fwd_outputs])
    gradients = list(output.args[0][units.num_fwd_outputs:])
    new.output(tuple(fx.node.map_arg(forward_outputs, lambda a: env[a]))
               + tuple(fx.node.map_arg(gradients, read)))
    new.lint()
    module = fx.GraphModule(joint, new)
    # saved: the forward originals (and primals) the backward section reads
    forward_new = {env[n] for n in old.nodes if n.op == "placeholder" and not is_tangent(n)} | \
                  {env[n] for n in units.unit_of} | set(snapshots.values())
    backward_new = [n for n in new.nodes if n not in forward_new and n.op not in ("placeholder", "output")]
    read_set = {a for node in backward_new for a in node.all_input_nodes if a in forward_new}
    read_set |= {read(value) for value in output.args[0][units.num_fwd_outputs:]
                 if isinstance(value, fx.Node) and value not in units.backward and read(value) in forward_new}
    order = {n: i for i, n in enumerate(new.nodes)}
    read_from_forward = sorted({_viewed_base(n, forward_new) for n in read_set}, key=order.get)
    saved = [n for n in read_from_forward if isinstance(n.meta.get("val"), torch.Tensor)]
    saved_sym = [n for n in read_from_forward if not isinstance(n.meta.get("val"), torch.Tensor)]
    return module, saved, saved_sym, recomputed


def _forward_order(graph: fx.Graph, units: JointUnits, schedule: Schedule, position: dict[fx.Node, int]
                   ) -> list[fx.Node]:
    """The forward section's nodes: the units in the order the schedule's forward ops first compute them,
    each unit's nodes in joint-graph order, then the units the forward ops never compute, in joint-graph
    order. The simulator prices that order; the joint graph's can differ: a custom autograd Function's
    backward coefficient that reads no tangent (BLOOM's scripted GELU) is a forward unit placed after
    the loss there, which held its input to the end of the forward, 17 KB over the plan. The joint
    graph's order is kept when the schedule's would draw random numbers in another order (the masks
    would differ from eager's) or read a value before it is made. ``position``: each node's place in
    the joint graph."""
    rank: dict[int, int] = {}
    for op in schedule.forward_ops:
        if isinstance(op, Forward):
            rank.setdefault(op.node, len(rank))
    joint_order = [n for n in graph.nodes if n in units.unit_of]
    ordered = sorted(joint_order, key=lambda n: (rank.get(units.unit_of[n], len(rank)), position[n]))
    if [n for n in ordered if _is_random(n)] != [n for n in joint_order if _is_random(n)]:
        return joint_order
    made: set[fx.Node] = set()
    for node in ordered:
        if any(a in units.unit_of and a not in made for a in node.all_input_nodes):
            return joint_order
        made.add(node)
    return ordered


def _viewed_base(node: fx.Node, forward_new: set[fx.Node]) -> fx.Node:
    """What a forward value the backward reads views, through views (an op of one tensor input whose
    value shares that input's storage: ``detach``, ``t``, ``select``, ``view``), else the value. The
    base is saved and the views are remade in the backward, for nothing (the same storage lives as
    long): AOTAutograd's runtime handles each saved tensor, and the LSTM at T = 200 saved 2,801, 1,400
    of them views (now 1,405; ``aot_eager`` saves 2,002). Its store-all step went from 1.28x eager's to
    1.25x, within noise (``aot_eager``: 1.06x; docs/benchmarks.md)."""
    while node.op == "call_function" and node in forward_new and not _is_random(node):
        inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        value = node.meta.get("val")
        if len(inputs) != 1 or not isinstance(value, torch.Tensor) or inputs[0] not in forward_new:
            break
        shared = _storage(node)
        if not shared or shared[:1] != _storage(inputs[0])[:1]:
            break
        node = inputs[0]
    return node


def graph_peak_bytes(forward_graph: fx.GraphModule, backward_graph: fx.GraphModule) -> int:
    """Peak bytes of activations while the forward then the backward graph run, by their own liveness:
    the largest of :func:`graph_live_bytes`."""
    return max((live for _, _, live in graph_live_bytes(forward_graph, backward_graph)), default=0)


def graph_live_bytes(forward_graph: fx.GraphModule, backward_graph: fx.GraphModule,
                     tangents_held: bool | None = None) -> list[tuple[str, str, int]]:
    """``(graph, node name, live bytes)`` while each node of the forward (``"forward"``), then of the
    backward graph (``"backward"``), runs: its own value held, with everything live before it, by the
    graphs' own liveness (fake values of ``meta["val"]``, storage by storage: a view holds its base's
    storage). A value is live from its node to its last use; the forward's outputs (the model's outputs
    and the saved values) stay live into the backward, the saved ones until the backward's last use of
    them; the model's outputs no further (the README loop, ``loss_fn(model(x)).backward()``, has dropped
    them once its loss ran; a loop that keeps them holds them to the end, beyond the prediction); the
    backward's outputs (gradients) to the end. Storages of the forward's placeholders (parameters,
    inputs) are not counted. The tangents (the outputs' gradients) live to their last use, or to the end
    of the backward where AOTAutograd's runtime holds them (``tangents_held``, by default
    ``joint_units.tangents_held_through_backward()``)."""
    from collections import Counter

    primal_keys = {key for n in forward_graph.graph.nodes if n.op == "placeholder" for key, _ in _storage(n)}
    holders: Counter[int] = Counter()
    sizes: dict[int, int] = {}

    def hold(node: fx.Node) -> None:
        for key, nbytes in _storage(node):
            if key not in primal_keys:
                holders[key] += 1
                sizes[key] = nbytes

    def release(node: fx.Node) -> None:
        for key, _ in _storage(node):
            if key in holders:
                holders[key] -= 1
                if holders[key] <= 0:
                    del holders[key]

    def live_bytes() -> int:
        return sum(sizes[key] for key in holders)

    points: list[tuple[str, str, int]] = []
    forward_outputs = _outputs(forward_graph)
    held = tangents_held if tangents_held is not None else tangents_held_through_backward()
    held_tangents = {n for n in backward_graph.graph.nodes if is_tangent(n)} if held else set()
    for tag, graph_module, kept in (("forward", forward_graph, set(forward_outputs)),
                                    ("backward", backward_graph, set(_outputs(backward_graph)) | held_tangents)):
        nodes = list(graph_module.graph.nodes)
        last_use = {a: i for i, node in enumerate(nodes) for a in node.all_input_nodes}
        if graph_module is backward_graph:
            for node in forward_outputs:  # the forward's holds end; the backward's placeholders take over
                release(node)
        for i, node in enumerate(nodes):
            if node.op == "output" or (node.op == "placeholder" and not node.users and graph_module is backward_graph
                                       and node not in kept):
                continue  # (a tangent folded away is None at run time; a value saved for the whole backward only)
            if node.op != "placeholder" or graph_module is backward_graph:
                hold(node)
            points.append((tag, node.name, live_bytes()))
            if not node.users and node not in kept:
                release(node)
            for a in set(node.all_input_nodes):
                if last_use.get(a) == i and a not in kept:
                    release(a)
    return points


def _outputs(graph_module: fx.GraphModule) -> list[fx.Node]:
    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    from torch.utils._pytree import tree_flatten
    return [n for n in tree_flatten(output.args)[0] if isinstance(n, fx.Node)]


def price_joint(joint: fx.GraphModule, *, num_fwd_outputs: int, name: str = "compiled", joint_inputs: Any = None,
                loss_fn: Any = None, device_profile: Any = "cpu", timing: str = "measure"
                ) -> tuple[JointUnits, CostGraph]:
    """``joint``'s units and cost graph. ``timing``: ``"measure"`` times each node on real tensors
    shaped like ``joint_inputs`` (``joint_allocations.node_seconds``) when they are given, and their
    kernels' workspace is measured on them; ``"flops"``, or nodes that could not be timed (meta
    inputs), are priced from their FLOPs by ``device_profile`` (``device_profiles.DEVICE_PROFILES``).
    ``loss_fn``: the loss on the outputs, priced (``joint_allocations.outputs_loss_bytes``)."""
    if timing not in ("measure", "flops"):
        raise ValueError(f"timing={timing!r}: use 'measure' (time the joint graph's nodes) or 'flops'")
    units = joint_units(joint, num_fwd_outputs)
    workspace = kernel_workspace_bytes(joint, joint_inputs) if joint_inputs is not None else {}
    seconds = (node_seconds(joint, joint_inputs, warm_up=not workspace)  # the workspace's run warmed it
               if joint_inputs is not None and timing == "measure" else {})
    loss = outputs_loss_bytes(joint, units, loss_fn) if loss_fn is not None else None
    priced, priced_units = joint, units
    unreached_bytes = loss.unreached_gradient_bytes if loss is not None else 0
    zero = unreached_tangents(joint, loss.unreached_outputs) if loss is not None else []
    if zero:  # priced with the zero gradients of the outputs the loss does not reach folded away
        folded = fold_zero_tangents(joint, zero)
        folded_units = joint_units(folded, num_fwd_outputs) if folds_cleanly(joint, folded) else None
        if folded_units is not None and folded_units.names() == units.names():  # (the plan's units are the joint's)
            priced, priced_units = folded, folded_units
            units.zero_tangents = tuple(zero)
            unreached_bytes = max(0, unreached_bytes - sum(n.meta["val"].numel() * n.meta["val"].element_size()
                                                           for n in joint.graph.nodes if n.name in units.zero_tangents))
    graph = joint_cost_graph(priced, priced_units, name, workspace=workspace,
                             loss_bytes=loss.transient_bytes if loss is not None else None,
                             loss_unreached_gradient_bytes=unreached_bytes,
                             device_profile=device_profile, node_seconds=seconds)
    return units, graph


def lower_plan(joint: fx.GraphModule, units: JointUnits, graph: CostGraph, plan: Any, *, num_fwd_outputs: int,
               schedule_pass: SchedulePass | None = None) -> Lowered:
    """``plan`` (a ``RecomputePlan`` of ``graph``, the cost graph of ``joint``'s ``units``) lowered into
    the forward and backward graphs, after ``schedule_pass(graph, schedule)`` when given."""
    schedule = schedule_pass(graph, plan.schedule) if schedule_pass is not None else plan.schedule
    module, saved, saved_sym, recomputed = lower_schedule(joint, units, schedule, graph)
    forward_graph, backward_graph = extract_graphs(module, saved, saved_sym, num_fwd_outputs=num_fwd_outputs,
                                                   recomputed=frozenset(recomputed))
    folded = _folded_backward(backward_graph, units.zero_tangents)
    accumulate_in_place(backward_graph)
    lowered = Lowered(graph, plan, forward_graph, backward_graph, tuple(n.name for n in saved), tuple(recomputed),
                      units, folded_backward_graph=folded,
                      zero_tangents=units.zero_tangents if folded is not None else ())
    _LAST[:] = [lowered]
    return lowered


def _folded_backward(backward_graph: fx.GraphModule, zero_tangents: Sequence[str]) -> fx.GraphModule | None:
    """``backward_graph`` with the tangents ``zero_tangents`` folded away (``zero_gradients``), its
    gradient sums accumulated in place as the whole one's; None without such tangents, or where the
    folded graph's sums cannot be. The whole backward then runs, with the zero gradients made, which
    the plan, priced folded, does not count (not seen on the conformance models)."""
    present = {n.name for n in backward_graph.graph.nodes if n.op == "placeholder"}
    if not zero_tangents or not set(zero_tangents) <= present:
        return None
    folded = fold_zero_tangents(backward_graph, zero_tangents)
    try:
        accumulate_in_place(folded)
    except RuntimeError:
        return None
    return folded


def plan_and_lower(joint: fx.GraphModule, budget: Any, *, num_fwd_outputs: int, solver: str = "auto",
                   name: str = "compiled", schedule_pass: SchedulePass | None = None,
                   joint_inputs: Any = None, loss_fn: Any = None, on_infeasible: str = "raise",
                   saved_plan: Any = None, device_profile: Any = "cpu", timing: str = "measure",
                   earlier_bytes: int = 0) -> Lowered:
    """Price ``joint`` (:func:`price_joint`), plan it at ``budget`` (``planner.make_plan``) and lower the
    plan (:func:`lower_plan`), after ``schedule_pass(graph, schedule)`` when given (a hook to lower
    other valid schedules). ``saved_plan``: a ``RecomputePlan`` to reuse instead of solving when its
    cost graph has the joint cost graph's structure and fits the budget (``saved_plans.reuse_plan``; a
    ``PlanMismatchWarning`` says why not otherwise). ``on_infeasible``: ``"raise"``, or ``"floor"``:
    plan at the smallest feasible budget, with an ``InfeasibleBudgetWarning``. ``earlier_bytes``: the
    most an earlier call signature of the same module was planned at (``planner.make_plan_for_call``)."""
    from .planner import make_plan, make_plan_for_call
    from .saved_plans import reuse_plan
    units, graph = price_joint(joint, num_fwd_outputs=num_fwd_outputs, name=name, joint_inputs=joint_inputs,
                               loss_fn=loss_fn, device_profile=device_profile, timing=timing)
    try:
        plan = reuse_plan(saved_plan, graph, budget) if saved_plan is not None else None
        plan = plan or make_plan_for_call(graph, budget, solver, earlier_bytes=earlier_bytes)
    except InfeasibleBudgetError as error:
        if on_infeasible != "floor":
            raise
        warnings.warn(f"graph {name!r}: {error} Planning it at its smallest feasible budget, "
                      f"{error.min_budget_bytes} bytes (on_infeasible='floor').", InfeasibleBudgetWarning,
                      stacklevel=user_stacklevel())
        plan = make_plan(graph, error.min_budget_bytes, solver)
    return lower_plan(joint, units, graph, plan, num_fwd_outputs=num_fwd_outputs, schedule_pass=schedule_pass)
