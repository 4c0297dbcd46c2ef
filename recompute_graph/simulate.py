"""The simulator: the one judge of every solver's schedule.

``simulate(graph, schedule)`` replays a :class:`~recompute_graph.schedule.Schedule` on the cost graph and
returns the predicted peak memory, the compute time and a memory timeline, or raises
:class:`ScheduleError` for a schedule that cannot run.

Memory model (bytes of tensor storage above what was live before the step; see docs/concepts.md):

* A ``Forward(v)`` creates a storage of ``output_bytes(v)``; a view or alias node (``alias_of``) creates
  none and refers to the storage of the predecessor it views. During the op, ``workspace_bytes(v)`` is
  live on top, and so are its ``saved_buffer_bytes`` (made by the kernel; without a tape they die at
  once).
* With a tape, the node's internal saved buffers (``saved_buffer_bytes``) are allocated and the tape
  holds references to the storages its backward reads (``backward_needs``: its inputs' and its own).
  A node of several outputs whose backward saves some of them (``saved_output_bytes`` below
  ``output_bytes``: a sort keeps its indices, not its values) has two storages: the tape holds the saved
  part only, which outlives the rest once the value and its views are freed.
* A storage lives while a value or a tape refers to it (reference counting, as in PyTorch).
* At the start of backward the gradients of the model outputs arrive (``grad_bytes``); autograd holds
  them until the model's whole backward has run (``output_gradients_held``; else each is released after
  its node's backward, as the compiler path's generated backward drops its tangents). The loss itself
  is modelled as lean: it keeps the outputs until its backward and makes one output-sized gradient (what ``measure.default_loss`` does);
  a loss holding more (cross-entropy keeps its log-softmax) needs that much more budget. A ``Backward(v)``
  allocates a gradient buffer (``grad_bytes``) for each predecessor needing one that has none yet (a
  predecessor by an edge that only orders the backward, ``order_only_predecessors``, adds no term to
  a buffer it has), has
  ``backward_workspace_bytes`` live on top while it runs (plus, for predecessors that already have a
  buffer, the incoming gradient); a gradient assembled from view terms (``grad_term_bytes``) grows
  by each term as it is made instead, with no sum; then, for those, the new sum is made the first time (unless the buffer
  was handed on by a pass-through backward and nothing else holds it: autograd sums into that one in place;
  a joint graph's generated backward does not, its first sum is a new buffer of the gradient's size, and
  the handed-on one, a slice of a ``cat``'s gradient, goes: U-Net's skip inputs, 32 KB over before),
  beside the parameter gradients the node's kernels have just made,
  after the node's own output gradient is released when nothing else holds it; keeps its parameter gradients
  (``param_grad_bytes``, to the end of the step), then frees the node's tape and its output gradient
  (first, when ``backward_aliases_grad`` says the buffer is handed on to the inputs: the inputs getting
  their first gradient share it, as the views autograd gives them do: an addition's two inputs, the
  slices ``cat`` hands to its inputs).

A backward given in steps (``backward_steps``, a joint graph's unit: its generated backward is a
sequence of kernels that frees each value after its last read) makes the gradients its steps name in
their order, after those no step names, with each step's own bytes (``backward_step_workspace_bytes``)
on top of what is live then, and lets go of each tape reference after the step that reads it last
(``tape_release_steps``): GELU's product frees one factor between its two gradients. Its output
gradient goes after the step that reads it last (``grad_release_step``) when nothing else holds it.

On the compiler path (``output_gradients_held`` False) the training loop has dropped the model's
outputs, its loss run, when the generated backward takes their gradients: the ``FreeValue`` ops that
open the backward run before the gradients arrive (``outputs_dropped_bytes``; ``planner.step_peak_bytes``
puts them back for a loss that holds the outputs while it makes their gradients).

Time: ``forward_cost`` for every first ``Forward`` of a node (``recompute_cost`` for each later one, when
the node has one) and ``backward_cost`` for every ``Backward`` that ran; computations beyond the first of
a node count as ``recompute_cost``.

A joint graph's recomputation whose value nothing reads (``schedule.dead_recomputations``) is no code
in its lowering: it reads none of its inputs, costs no time and makes no storage; with a tape it only
holds the storages its backward needs, current at that point.

Random nodes are first computed in the order of their indices (the model's order), or the schedule is
refused: they draw from one random stream, and out of order each would draw another's mask. Random
nodes computed more than once: the first computation keeps a snapshot of the generators
(``rng_state_bytes``, one per random op of the node: ``random_op_count``) until the node's last live
computation (a dead one replays nothing), and each recomputation holds the current state transiently
while it replays the snapshot (the executor's ``replayed_rng``, the compiler path's ``rng_snapshot``
read by ``replay_random``; both let go of the snapshot after its last replay).

A node computed more than once whose recomputations read saved buffers of its first computation
(``recompute_kept_bytes``: a training BatchNorm's batch statistics) keeps those from its first live
computation to the last of its live computations and its ``Backward``; no computation makes them
again, and every tape of the node refers to them.

A node's first computation also makes its ``state_update_bytes`` (a training BatchNorm's new running
statistics), which live to the end of the forward ops: the generated forward returns them, and they are
copied into the buffers after it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from .errors import ScheduleError
from .graph import CostGraph, CostNode, is_joint_cost_graph
from .graph_memo import memoized
from .schedule import DEAD_POSITIONS, Backward, Forward, FreeValue, Op, Schedule, dead_recomputations

__all__ = ["ScheduleError", "SimulationResult", "TimelinePoint", "simulate"]


class TimelinePoint(NamedTuple):
    """Memory around one op: ``live_bytes`` after it and ``peak_bytes`` while it ran. (A named tuple:
    one is made per op, millions of them planning a large graph, and a frozen dataclass's constructor
    cost several times as much.)"""

    phase: str  # "forward" or "backward"
    position: int  # index within its phase's ops
    op: Op | None  # None: the arrival of the output gradients at the start of backward
    live_bytes: int
    peak_bytes: int


@dataclass(frozen=True)
class SimulationResult:
    """What a schedule costs. Bytes above what was live before the step; costs in ``graph.cost_unit``."""

    peak_bytes: int
    forward_peak_bytes: int
    compute_cost: float
    recompute_cost: float
    final_bytes: int
    timeline: tuple[TimelinePoint, ...] = field(repr=False)
    #: bytes freed before the output gradients arrived (the compiler path: values the schedule frees
    #: first, the outputs among them, are gone when its generated backward starts)
    outputs_dropped_bytes: int = 0

    def overhead(self, baseline_cost: float) -> float:
        """Extra compute relative to ``baseline_cost`` (usually the store-all compute)."""
        return self.recompute_cost / baseline_cost if baseline_cost > 0 else 0.0


class _Simulation:
    def __init__(self, graph: CostGraph) -> None:
        self.graph = graph
        self.node_count = len(graph)
        self.reads, self.owners = memoized(graph, "simulate.reads_and_owners", lambda: (
            tuple(node.read_predecessors for node in graph.nodes), tuple(map(graph.storage_owner, range(len(graph))))))
        self.phase, self.position, self.op = "forward", -1, None  # the op running (``run``)
        self.storage_bytes: dict[int, int] = {}
        self.storage_refs: dict[int, int] = {}
        # the part a tape may outlive: storage -> the storage of the saved part of the same value
        self.saved_part: dict[int, int] = {}
        self.next_storage = 0
        self.value: dict[int, int] = {}            # node -> storage id of its current value
        self.tape: dict[int, list[int]] = {}       # node -> storages its tape refers to
        self.grad: set[int] = set()                # nodes holding a gradient buffer
        self.grad_storage: dict[int, int] = {}     # node -> storage id of its gradient buffer
        self.accumulated: set[int] = set()         # buffers already summed into once (owned since)
        self.shared_grads: set[int] = set()        # buffers handed on by a pass-through backward
        self.backward_done: set[int] = set()
        self.computed: set[int] = set()
        self.live = 0
        self.peak = 0
        self.compute_cost = 0.0
        self.recompute_cost = 0.0
        self.timeline: list[TimelinePoint] = []
        self.op_peak = 0
        self.replayed_random: set[int] = set()     # random nodes computed more than once
        self.computations_left: Counter[int] = Counter()  # of each replayed random node, after the current one
        self.rng_snapshot: dict[int, int] = {}     # replayed random node -> storage of its generators' snapshot
        self.kept_uses_left: Counter[int] = Counter()  # node keeping its first computation's buffers ->
        # its live computations and Backward still to come
        self.kept_storage: dict[int, int] = {}     # such a node -> the storage of those buffers
        self.last_random = -1                      # the random node computed first most recently
        # a joint graph's generated backward makes a gradient's first sum in a new buffer, also where
        # autograd would sum into a buffer handed on by a pass-through backward (``_propagate_gradient``)
        self.joint = is_joint_cost_graph(graph)
        # the outputs whose gradients arrive from outside (their buffers are what autograd holds): not a
        # returned value that only the model's own loss differentiates (PegasusX's logits, 12 MB)
        self.arriving_outputs = frozenset(graph.gradient_outputs) if graph.implicit_backward else frozenset()
        self.dead: dict[str, frozenset[int]] = {"forward": frozenset(), "backward": frozenset()}  # positions
        # of dead recomputations, by phase
        self.state_updates: list[int] = []         # storages of the buffers' new values (``state_update_bytes``)

    # ---------------------------------------------------------------- storages
    def _new_storage(self, nbytes: int) -> int:
        sid = self.next_storage
        self.next_storage = sid + 1
        self.storage_bytes[sid] = nbytes
        self.storage_refs[sid] = 1
        self._add(nbytes)
        return sid

    def _ref(self, sid: int) -> int:
        self.storage_refs[sid] += 1
        return sid

    def _unref(self, sid: int) -> None:
        self.storage_refs[sid] -= 1
        if self.storage_refs[sid] == 0:
            self.live -= self.storage_bytes.pop(sid)
            del self.storage_refs[sid]
            if self.saved_part and sid in self.saved_part:
                self._unref(self.saved_part.pop(sid))

    def _add(self, nbytes: int) -> None:
        live = self.live = self.live + nbytes
        if live > self.op_peak:
            self.op_peak = live
        if live > self.peak:
            self.peak = live

    def _where(self) -> str:
        """Where the current op is (``run`` sets it), for an error message (formatted only when one is
        raised: the simulator runs millions of ops planning a large graph)."""
        op = self.op
        return f"{self.phase} op {self.position} {op!r} (node {self.graph.nodes[op.node].name!r})"

    # ---------------------------------------------------------------- ops
    def forward(self, op: Forward) -> None:
        index = op.node
        node = self.graph.nodes[index]
        if op.tape and index in self.tape:
            raise ScheduleError(f"{self._where()}: the node already holds a tape; run Backward({op.node}) first")
        if self.position in self.dead[self.phase]:
            self._tape_only(op, node)
            return
        value = self.value
        for p in self.reads[index]:
            if p not in value:
                raise ScheduleError(f"{self._where()}: reads node {p} ({self.graph.nodes[p].name!r}), whose value is "
                                    "not live: compute it first or do not free it before")
        if node.random and index not in self.computed:
            if index < self.last_random:
                raise ScheduleError(f"{self._where()}: a random node first computed after random node "
                                    f"{self.last_random} ({self.graph.nodes[self.last_random].name!r}), which "
                                    "follows it in the model: each would draw the other's mask")
            self.last_random = index
        saved_part = None
        if node.alias_of is None and 0 < node.saved_output_bytes < node.output_bytes and self.graph.implicit_backward:
            # several outputs, of which the backward saves some (a sort's indices, not its values): the
            # saved ones stay with the tape once the value and its views are freed
            sid = self._new_storage(node.output_bytes - node.saved_output_bytes)
            saved_part = self.saved_part[sid] = self._new_storage(node.saved_output_bytes)
        elif node.alias_of is None:
            sid = self._new_storage(node.output_bytes)
        else:
            sid = self._ref(self._storage_of_owner(op.node, node.alias_of, "the node views"))
        if node.state_update_bytes and index not in self.computed and self.phase == "forward":  # to its end
            self.state_updates.append(self._new_storage(node.state_update_bytes))
        # what the node would save (dropout masks, internal copies) exists by the kernel's end, beside
        # its workspace; without a tape it is transient
        transient = node.workspace_bytes + node.saved_buffer_bytes
        kept = None
        if self.kept_uses_left and index in self.kept_uses_left:
            kept = self.kept_storage.get(index)
            if kept is None:  # the first computation: its buffers stay for the recomputations
                kept = self.kept_storage[index] = self._new_storage(node.recompute_kept_bytes)
            transient -= node.recompute_kept_bytes
        if op.node in self.replayed_random:
            self.computations_left[op.node] -= 1
            if op.node in self.computed:
                transient += self.graph.rng_state_bytes  # the generators' state, put back afterwards
            else:  # the snapshot replayed later, kept until the last replay
                self.rng_snapshot[op.node] = self._new_storage(self.graph.rng_state_bytes * node.random_op_count)
        if self.live + transient > self.op_peak:  # the step's peak follows the op's (``run``)
            self.op_peak = self.live + transient
        if op.tape and node.requires_grad and self.graph.implicit_backward:  # the saved buffers stay
            refs = [self._new_storage(node.saved_buffer_bytes - (0 if kept is None else node.recompute_kept_bytes))]
            own = self.owners[index]
            for q in node.backward_needs:
                mine = sid if saved_part is None else saved_part
                refs.append(self._ref(mine if q == own else self._storage_of_owner(index, q, "its backward needs")))
            if kept is not None:
                refs.append(self._ref(kept))
            self.tape[index] = refs
        if index in value:
            self._unref(value[index])
        value[index] = sid
        if index in self.computed:
            cost = node.recomputation_cost
            self.recompute_cost += cost
        else:
            cost = node.forward_cost
        self.compute_cost += cost
        self.computed.add(index)
        if self.rng_snapshot and index in self.rng_snapshot and not self.computations_left[index]:
            self._unref(self.rng_snapshot.pop(index))  # replayed for the last time
        if kept is not None:
            self._used_kept(index)

    def _used_kept(self, index: int) -> None:
        """One use of a node's kept buffers done; after the last, they are let go of (a tape may hold them)."""
        self.kept_uses_left[index] -= 1
        if not self.kept_uses_left[index]:
            del self.kept_uses_left[index]
            self._unref(self.kept_storage.pop(index))

    def _tape_only(self, op: Forward, node: CostNode) -> None:
        """A dead recomputation (module docstring): a tape of what its backward needs, an empty value."""
        if op.tape and node.requires_grad:
            refs = [self._new_storage(0)]
            refs += [self._ref(self._storage_of_owner(op.node, q, "its backward needs"))
                     for q in node.backward_needs]
            if op.node in self.kept_storage:
                refs.append(self._ref(self.kept_storage[op.node]))
            self.tape[op.node] = refs
        if op.node in self.value:
            self._unref(self.value[op.node])
        self.value[op.node] = self._new_storage(0)
        self.computed.add(op.node)

    def _storage_of_owner(self, index: int, owner: int, why: str) -> int:
        """The live storage of ``owner`` that node ``index`` reaches: through the input it read, else the
        owner's own current value."""
        for p in self.graph.nodes[index].predecessors:
            if self.owners[p] == owner and p in self.value:
                return self.value[p]
        if owner in self.value:
            return self.value[owner]
        raise ScheduleError(f"{self._where()}: {why} node {owner}'s storage, which is not live")

    def free(self, op: FreeValue) -> None:
        if op.node not in self.value:
            raise ScheduleError(f"{self._where()}: the value is not live")
        self._unref(self.value.pop(op.node))

    def check_outputs_live(self) -> None:
        """End of the forward ops: the outputs must be live (implicit backward). A joint graph (explicit
        backward nodes) has no such point: its schedule only has to compute every node (checked at the
        end)."""
        if not self.graph.implicit_backward:
            return
        for o in self.graph.outputs:
            if o not in self.value:
                raise ScheduleError(f"model output node {o} ({self.graph.nodes[o].name!r}) is not live at the "
                                    "end of the forward ops")

    def arrive_output_gradients(self) -> None:
        """The gradients of the outputs arrive (implicit backward)."""
        if not self.graph.implicit_backward:
            return
        arriving = [o for o in self.graph.gradient_outputs if o not in self.grad]
        for o in arriving:
            self.grad.add(o)
            self.grad_storage[o] = self._new_storage(self.graph.nodes[o].grad_bytes)

    def backward(self, op: Backward) -> None:
        if not self.graph.implicit_backward:
            raise ScheduleError(f"{self._where()}: graph {self.graph.name!r} has explicit backward nodes; compute them "
                                "with Forward instead")
        node = self.graph.nodes[op.node]
        if op.node in self.backward_done:
            raise ScheduleError(f"{self._where()}: the backward of this node already ran")
        if op.node not in self.tape:
            raise ScheduleError(f"{self._where()}: no tape: compute the node with Forward(..., tape=True) first")
        for s in node.successors:
            if self._propagates(s, op.node) and s not in self.backward_done:
                raise ScheduleError(f"{self._where()}: runs before the backward of node {s} "
                                    f"({self.graph.nodes[s].name!r}), whose gradient it needs")
        tape = self.tape.pop(op.node)
        if op.node in self.grad:
            self._propagate_gradient(op.node, node, tape)
        elif not node.successors and node.param_grad_bytes:
            # no gradient can reach it, yet its backward returns parameter gradients made from what it
            # reads: a joint graph's weight-transpose unit that no forward unit reads (HF GPT-2's Conv1D
            # weights: 100 KB of gradients this simulator did not count), as every solver counts them
            self.op_peak = max(self.op_peak, self.live + node.backward_workspace_bytes)
            self._add(node.param_grad_bytes)
        for sid in tape:
            if sid is not None:  # None: let go of at a step (``tape_release_steps``)
                self._unref(sid)
        self.backward_done.add(op.node)
        if self.kept_uses_left and op.node in self.kept_uses_left:
            self._used_kept(op.node)

    def _release_after(self, node: CostNode, tape: list[int | None], step: int) -> int:
        """Drop the tape references the backward reads for the last time at ``step``
        (``tape_release_steps``); the bytes that frees."""
        before = self.live
        for k, last in enumerate(node.tape_release_steps):
            sid = tape[k + 1]  # tape[0] is the saved buffer, kept to the end
            if last == step and sid is not None:
                tape[k + 1] = None
                self._unref(sid)
        return before - self.live

    def _propagate_gradient(self, index: int, node: CostNode, tape: list[int | None]) -> None:
        """Backward of ``node`` from its output gradient buffer (see the module docstring).

        The output gradient is released when the backward ends, except one that arrived from outside
        (``graph.gradient_outputs``), which autograd holds until the whole model's backward returns
        (unless ``graph.output_gradients_held`` is False); a returned value that only the model's own
        loss differentiates (the logits beside a ``transformers`` loss) gets its gradient from that loss,
        inside the step, and lets go of it as any value does.
        A pass-through backward (``backward_aliases_grad``:
        an addition, a view, ``cat``) hands its buffer on without a copy: every input that gets its first
        gradient shares that one storage (an addition's two inputs; the slices of ``cat``), and when none
        does, the buffer is released before the inputs' buffers appear.

        A backward with ``backward_steps`` makes the gradients its steps name at those steps, after the
        others, with each step's own bytes on top, and lets go of each tape reference after the step
        that reads it last; the terms for inputs that already have a buffer are counted from the step
        that makes them (those no step names from the first), and the sums after every step, beside
        what it released (an RMS norm's ``pow`` makes ``2 * x`` and its product before the term)."""
        graph = self.graph
        handed = self.grad_storage.pop(index)
        held = index in self.arriving_outputs and graph.output_gradients_held
        # an edge that only orders the backward (``order_only_predecessors``) hands on the gradient the
        # other backward reads, when that one has none yet (BLOOM's GELU coefficient), and is no term of
        # a sum when it has (Falcon's projection, which shares its addition's gradient)
        fresh = [p for p in node.predecessors if graph.nodes[p].requires_grad and p not in self.grad]
        shared = set(fresh) if node.backward_aliases_grad else set()
        released = False
        if node.backward_aliases_grad and not shared and not held:
            self._unref(handed)
            released = True
        incoming_bytes = 0
        first_sum_bytes = 0
        summed: list[int] = []

        def make_gradient(p: int) -> None:
            nonlocal incoming_bytes, first_sum_bytes
            if not graph.nodes[p].requires_grad or (p in node.order_only_predecessors and p not in fresh):
                return
            term = next((nbytes for reader, nbytes in graph.nodes[p].grad_term_bytes if reader == index), None)
            if p in fresh:
                self.grad.add(p)
                self.grad_storage[p] = (self._ref(handed) if p in shared
                                        else self._new_storage(graph.nodes[p].grad_bytes if term is None else term))
                if p in shared:
                    self.shared_grads.add(p)
                return
            if term is not None:  # one more view's term beside those made: the gradient grows, no sum
                previous = self.grad_storage[p]
                if self.storage_refs[previous] == 1:
                    self.storage_bytes[previous] += term
                    self._add(term)
                else:  # a buffer handed on and still held elsewhere: p's own, the terms so far and this
                    self._unref(previous)
                    self.grad_storage[p] = self._new_storage(self.storage_bytes[previous] + term)
                self.shared_grads.discard(p)
                return
            # adding into an existing buffer: the incoming gradient (unless handed on) and, the first
            # time, a new sum (the buffer may be shared, or a broadcast that cannot be written: mean's
            # gradient), except for a buffer handed on by a pass-through backward that nothing else
            # holds any more: autograd and the executor sum into that one in place
            incoming = 0 if node.backward_aliases_grad else graph.nodes[p].grad_bytes
            handed_and_free = (p in self.shared_grads and not self.joint
                               and self.storage_refs.get(self.grad_storage[p], 0) == 1)
            first_sum = graph.nodes[p].grad_bytes if p not in self.accumulated and not handed_and_free else 0
            incoming_bytes += incoming
            first_sum_bytes += first_sum
            if first_sum:
                summed.append(p)
            self.accumulated.add(p)

        steps = node.backward_steps if not shared else ()
        named = set(steps)
        for p in node.predecessors:
            if p not in named:
                make_gradient(p)
        released_early = 0  # bytes the steps let go of; the transients after them count them live
        step_peak = 0
        for step, p in enumerate(steps):
            if p >= 0:
                make_gradient(p)
            step_peak = max(step_peak, self.live + node.backward_step_workspace_bytes[step] + incoming_bytes)
            if node.tape_release_steps:
                released_early += self._release_after(node, tape, step)
            if (step == node.grad_release_step and not released and not held
                    and self.storage_refs.get(handed) == 1):  # the output gradient read for the last time
                self._unref(handed)
                released = True
        # the backward computes the incoming gradients (with its workspace); then its output gradient,
        # read by nothing else, is released before the sums are made, as autograd's engine and the
        # generated backward both do
        handed_free = (self.storage_bytes[handed] if not released and not held and not node.backward_aliases_grad
                       and self.storage_refs.get(handed) == 1 else 0)
        sums = incoming_bytes + first_sum_bytes
        if steps:  # each step with the terms made so far (those no step names: before the first)
            workspace_peak = step_peak
        else:
            workspace_peak = self.live + node.backward_workspace_bytes + incoming_bytes
        # the sums come after the kernels: the parameter gradients those made are alive beside them
        # (a convolution's weight gradient at the add of its input's two terms, tiny ResNet-50)
        self.op_peak = max(self.op_peak, workspace_peak,
                           self.live + released_early - handed_free + sums + node.param_grad_bytes if sums else 0)
        for p in summed:  # the sum replaces the first buffer, which lives on if shared
            previous = self.grad_storage[p]
            self.grad_storage[p] = self._new_storage(graph.nodes[p].grad_bytes)
            self._unref(previous)
        self._add(node.param_grad_bytes)
        self.compute_cost += node.backward_cost
        self.grad.discard(index)
        if not released and not held:
            self._unref(handed)

    def _propagates(self, successor: int, node: int) -> bool:
        return self.graph.nodes[successor].requires_grad and self.graph.nodes[node].requires_grad

    def finish(self) -> None:
        if not self.graph.implicit_backward:
            missing = [v for v in range(len(self.graph)) if v not in self.computed]
            if missing:
                names = ", ".join(repr(self.graph.nodes[v].name) for v in missing[:5])
                raise ScheduleError(f"the schedule never computes nodes {names}"
                                    f"{' ...' if len(missing) > 5 else ''} of the joint graph")
            return
        missing = sorted(self.grad)
        if missing:
            names = ", ".join(repr(self.graph.nodes[v].name) for v in missing[:5])
            raise ScheduleError(f"the schedule ends with gradients that never propagated: nodes {names}"
                                f"{' ...' if len(missing) > 5 else ''} still need Backward")

    def run(self, phase: str, position: int, op: Op) -> None:
        kind = type(op)
        if kind not in _OP_KINDS or not 0 <= op.node < self.node_count:
            raise ScheduleError(f"{phase} op {position} {op!r}: not an op over this graph's nodes")
        self.phase, self.position, self.op = phase, position, op
        self.op_peak = self.live
        if kind is Forward:
            self.forward(op)  # type: ignore[arg-type]
        elif kind is FreeValue:
            self.free(op)  # type: ignore[arg-type]
        else:
            self.backward(op)  # type: ignore[arg-type]
        if self.op_peak > self.peak:  # the step's peak is the largest op's
            self.peak = self.op_peak
        # tuple.__new__: a named tuple's own constructor is a Python function, and one point is made per op
        self.timeline.append(_new_tuple(TimelinePoint, (phase, position, op, self.live, self.op_peak)))


#: The op types, exactly (no subclasses exist), and the C constructor of a tuple
_OP_KINDS = frozenset((Forward, FreeValue, Backward))
_new_tuple = tuple.__new__


def simulate(graph: CostGraph, schedule: Schedule) -> SimulationResult:
    """Replay ``schedule`` on ``graph``; raise :class:`ScheduleError` if it cannot run (see module doc)."""
    sim = _Simulation(graph)
    sequence = (*schedule.forward_ops, None, *schedule.backward_ops)
    dead = schedule.__dict__.get(DEAD_POSITIONS)
    if dead is None:
        dead = dead_recomputations(graph, sequence)
    # a dead recomputation replays nothing: the snapshot is kept to the last live one
    computations = Counter(op.node for at, op in enumerate(sequence) if isinstance(op, Forward) and at not in dead)
    sim.replayed_random = {v for v, count in computations.items() if count > 1 and graph.nodes[v].random}
    sim.computations_left = Counter({v: computations[v] for v in sim.replayed_random})
    keeping = [v for v, count in computations.items() if count > 1 and graph.nodes[v].recompute_kept_bytes]
    if keeping:
        backwards = Counter(op.node for op in schedule.backward_ops if isinstance(op, Backward))
        sim.kept_uses_left = Counter({v: computations[v] + backwards[v] for v in keeping})
    forward_count = len(schedule.forward_ops)
    sim.dead = {"forward": frozenset(p for p in dead if p < forward_count),
                "backward": frozenset(p - forward_count - 1 for p in dead if p > forward_count)}
    for position, op in enumerate(schedule.forward_ops):
        sim.run("forward", position, op)
    forward_peak = sim.peak
    for sid in sim.state_updates:  # copied into the buffers once the forward has run
        sim._unref(sid)
    sim.check_outputs_live()
    ops = schedule.backward_ops
    first = 0
    forward_end_bytes = sim.live
    if graph.implicit_backward and not graph.output_gradients_held:
        # the compiler path: the training loop has dropped the outputs (its loss ran) when the generated
        # backward takes their gradients, so what the schedule frees first is gone by then
        while first < len(ops) and isinstance(ops[first], FreeValue):
            sim.run("backward", first, ops[first])
            first += 1
    dropped_bytes = forward_end_bytes - sim.live
    sim.op_peak = sim.live
    sim.arrive_output_gradients()
    sim.timeline.append(TimelinePoint("backward", -1, None, sim.live, sim.op_peak))
    for position in range(first, len(ops)):
        sim.run("backward", position, ops[position])
    sim.finish()
    return SimulationResult(peak_bytes=sim.peak, forward_peak_bytes=forward_peak,
                            compute_cost=sim.compute_cost, recompute_cost=sim.recompute_cost,
                            final_bytes=sim.live, timeline=tuple(sim.timeline),
                            outputs_dropped_bytes=dropped_bytes)
