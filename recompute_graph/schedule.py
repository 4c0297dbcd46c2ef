"""The schedule IR: one ordered program of operations over a cost graph, for every solver.

Operations (node = index into the :class:`~recompute_graph.graph.CostGraph`):

``Forward(node, tape)``
    Compute the node's output from the current values of its predecessors, which must be live. The
    result becomes the node's current value (a previous value of the same node is dropped). With
    ``tape=True`` autograd records what the node's backward needs (its saved tensors) until
    ``Backward(node)``; with ``tape=False`` nothing is recorded (``torch.no_grad``). The first
    ``Forward`` of a node in a step is its computation; every further one is a *recomputation*.
``FreeValue(node)``
    Drop the node's current value. Its storage survives only while a tape (or a view) still refers to it.
``Backward(node)``
    Run the node's backward from its tape and the gradient of its output: add the gradients of its
    inputs into their buffers, produce its parameter gradients, then release the tape and the output
    gradient. A node whose output gradient never arrived (unused output) does nothing.

A :class:`Schedule` has ``forward_ops`` (run inside the model's forward call; the model outputs must be
live at their end) and ``backward_ops`` (run when autograd reaches the model in backward; the gradients
of the outputs are available at their start). Graphs with ``implicit_backward=False`` (joint graphs
whose backward computations are nodes of their own) use ``Forward``/``FreeValue`` only.

Strategies become schedules through one shared function, :func:`lower_segments`, which turns an
increasing sequence of lower sets ``L_1 ⊊ ... ⊊ L_k = V`` (Kusumoto et al. 2019; Chen et al.'s segments
are prefixes of a topological order) into ops, and :func:`insert_frees`, a liveness pass that frees
every value right after its last reader.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

from .errors import GraphError
from .graph import CostGraph, is_joint_cost_graph

__all__ = ["Forward", "FreeValue", "Backward", "Op", "Schedule", "lower_segments", "insert_frees",
           "store_all_lower_sets", "prefix_lower_sets", "dead_recomputations", "tape_only_reads", "DEAD_POSITIONS"]


@dataclass(frozen=True)
class Forward:
    node: int
    tape: bool = True

    def __repr__(self) -> str:
        return f"Forward({self.node}{'' if self.tape else ', tape=False'})"


@dataclass(frozen=True)
class FreeValue:
    node: int

    def __repr__(self) -> str:
        return f"FreeValue({self.node})"


@dataclass(frozen=True)
class Backward:
    node: int

    def __repr__(self) -> str:
        return f"Backward({self.node})"


Op = Union[Forward, FreeValue, Backward]


@dataclass(frozen=True)
class Schedule:
    """An ordered program of ops: ``forward_ops`` then, in backward, ``backward_ops``."""

    forward_ops: tuple[Op, ...]
    backward_ops: tuple[Op, ...] = ()

    def __hash__(self) -> int:
        """The ops' hash, computed once (a pool hashes each of its schedules of thousands of ops several
        times; equal schedules still compare op by op)."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.forward_ops, self.backward_ops))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def ops(self) -> tuple[Op, ...]:
        return self.forward_ops + self.backward_ops

    def computation_counts(self) -> Counter[int]:
        """How many times each node is computed (1 = never recomputed)."""
        return Counter(op.node for op in self.ops if isinstance(op, Forward))

    def recomputed_nodes(self) -> tuple[int, ...]:
        return tuple(sorted(n for n, count in self.computation_counts().items() if count > 1))

    def __repr__(self) -> str:
        counts = self.computation_counts()
        extra = sum(c - 1 for c in counts.values())
        return (f"Schedule({len(self.forward_ops)} forward ops, {len(self.backward_ops)} backward ops, "
                f"{extra} recomputations of {sum(1 for c in counts.values() if c > 1)} nodes)")


def _reads(graph: CostGraph, op: Op) -> tuple[int, ...]:
    return graph.nodes[op.node].read_predecessors if isinstance(op, Forward) else ()


def dead_recomputations(graph: CostGraph, sequence: Sequence[Op | None],
                        outputs: Iterable[int] | None = None) -> frozenset[int]:
    """Positions in ``sequence`` (the forward ops, ``None`` for the end of the forward, then the backward
    ops; ``FreeValue`` ops are ignored) of the recomputations a joint graph's lowering emits no code for:
    nothing reads the value they make before the node is computed again (fx drops such a copy as dead
    code). Empty for any other graph: the schedule executor runs every op.

    A recomputation with a tape is one of them only when its node's backward reads none of what the
    computation makes (its own output, or a saved buffer: ``backward_needs`` holds neither the node nor
    its storage's owner, ``saved_buffer_bytes`` is 0): its tape is then only the values of
    ``backward_needs`` current at that point, which the lowering's backward reads (chain_dp recomputes a
    residual addition or a rotary product with a tape that way; the copy, and the inputs it read,
    were held by the simulator and not by the generated code). First computations and stateful nodes
    are always live. A random node's recomputation can be dead: its copy replays a snapshot of the
    generators and puts their state back, so dropping it changes no other draw (the simulator and the
    lowering then keep no snapshot for it). One reverse pass: whether a computation is read depends
    only on later ops.
    ``outputs``: what the end of the forward reads (default: the graph's outputs)."""
    if not (graph.implicit_backward and is_joint_cost_graph(graph)):
        return frozenset()
    outputs = tuple(graph.outputs if outputs is None else outputs)
    first: set[int] = set()
    seen: set[int] = set()
    for position, op in enumerate(sequence):
        if isinstance(op, Forward) and op.node not in seen:
            seen.add(op.node)
            first.add(position)
    needed: set[int] = set()
    dead: set[int] = set()
    for position in range(len(sequence) - 1, -1, -1):
        op = sequence[position]
        if op is None:
            needed.update(outputs)
            continue
        if not isinstance(op, Forward):
            continue
        node = graph.nodes[op.node]
        taped = op.tape and node.requires_grad
        live = (position in first or op.node in needed or node.stateful
                or (taped and (node.saved_buffer_bytes > 0 or op.node in node.backward_needs
                               or graph.storage_owner(op.node) in node.backward_needs)))
        needed.discard(op.node)
        if live:
            needed.update(node.read_predecessors)
            if taped:
                needed.update(node.backward_needs)
        else:
            dead.add(position)
            needed.update(tape_only_reads(graph, op))
    return frozenset(dead)


def tape_only_reads(graph: CostGraph, op: Forward) -> tuple[int, ...]:
    """What a dead recomputation (``dead_recomputations``) reads: with a tape, the nodes its backward
    needs and the inputs that view their storages (the lowered backward reads those views, as current
    when the tape was recorded); without, nothing."""
    node = graph.nodes[op.node]
    if not (op.tape and node.requires_grad):
        return ()
    needs = set(node.backward_needs)
    return tuple(sorted(needs | {p for p in node.read_predecessors if graph.storage_owner(p) in needs}))


def insert_frees(graph: CostGraph, forward_ops: Sequence[Op], backward_ops: Sequence[Op],
                 outputs: Iterable[int] | None = None) -> Schedule:
    """Add ``FreeValue`` ops so that every value is dropped right after its last reader.

    Readers: a ``Forward`` reads its predecessors; the end of the forward ops reads the model outputs.
    A value that nobody reads before it is recomputed (or before the end) is freed right after it is
    computed; what its backward needs stays alive through the tape. Existing ``FreeValue`` ops in the
    input are dropped and re-derived. On a joint graph a recomputation its lowering drops as dead code
    (``dead_recomputations``) reads only what its tape holds; their positions in the result are left on
    it (``DEAD_POSITIONS``, for the graph's own outputs), where the simulator reads them.
    """
    outputs = tuple(graph.outputs if outputs is None else outputs)
    sequence: list[Op | None] = [op for op in forward_ops if not isinstance(op, FreeValue)]
    boundary = len(sequence)
    sequence.append(None)  # the end of the forward ops: reads the outputs
    sequence += [op for op in backward_ops if not isinstance(op, FreeValue)]
    dead = dead_recomputations(graph, sequence, outputs)
    current: dict[int, int] = {}          # node -> position of the op that defined its current value
    last_read: dict[int, int] = {}        # defining position -> last position that reads it
    owner_node: dict[int, int] = {}       # defining position -> node
    for position, op in enumerate(sequence):
        reads = (outputs if op is None else tape_only_reads(graph, op) if position in dead  # type: ignore[arg-type]
                 else _reads(graph, op))
        for node in reads:
            if node in current:
                last_read[current[node]] = position
        if isinstance(op, Forward):
            current[op.node] = position
            last_read.setdefault(position, position)
            owner_node[position] = op.node
    frees_after: dict[int, list[int]] = {}
    for definition, position in last_read.items():
        frees_after.setdefault(position, []).append(owner_node[definition])
    forward: list[Op] = []
    backward: list[Op] = []
    dead_at: list[int] = []  # the dead recomputations' positions in the result, as ``simulate`` reads them
    for position, op in enumerate(sequence):
        target = forward if position < boundary else backward
        if op is not None:
            if position in dead:
                dead_at.append(len(target) if position < boundary else len(forward) + 1 + len(target))
            target.append(op)
        for node in sorted(frees_after.get(position, ())):
            (backward if position >= boundary else forward).append(FreeValue(node))
    schedule = Schedule(tuple(forward), tuple(backward))
    if outputs == tuple(graph.outputs):  # what dead_recomputations finds on the result (frees are ignored)
        object.__setattr__(schedule, DEAD_POSITIONS, frozenset(dead_at))
    return schedule


#: The attribute where ``insert_frees`` leaves the dead recomputations of the schedule it makes (the
#: simulator reads them instead of finding them again)
DEAD_POSITIONS = "_dead_positions"


def _check_lower_sets(graph: CostGraph, lower_sets: Sequence[frozenset[int]]) -> None:
    everything = frozenset(range(len(graph)))
    if not lower_sets or lower_sets[-1] != everything:
        raise GraphError("a strategy must end with the lower set of all nodes")
    previous: frozenset[int] = frozenset()
    for position, lower in enumerate(lower_sets):
        if not previous < lower:
            raise GraphError(f"lower set {position} does not strictly contain the previous one")
        for v in lower - previous:  # the previous set's nodes have their predecessors in it
            if any(p not in lower for p in graph.nodes[v].predecessors):
                raise GraphError(f"set {position} is not a lower set: node {v} is in it but not all its "
                                 "predecessors")
        previous = lower


def lower_segments(graph: CostGraph, lower_sets: Sequence[Iterable[int]]) -> Schedule:
    """Lower an increasing sequence of lower sets ``L_1 ⊊ ... ⊊ L_k = V`` to a schedule.

    Forward: segments ``V_i = L_i \\ L_{i-1}`` in order; segments before the last run without tape and
    keep only what later segments read (the boundary); the last segment runs with tape and is not
    recomputed. Backward, for ``i = k..1``: segments before the last are recomputed with tape (nodes
    whose output needs no gradient only if a recomputed node reads them), then every node of ``V_i``
    runs its backward in reverse topological order. Frees come from :func:`insert_frees`.
    """
    sets = [frozenset(lower) for lower in lower_sets]
    _check_lower_sets(graph, sets)
    if not graph.implicit_backward:
        raise GraphError(f"graph {graph.name!r} has explicit backward nodes; lower_segments needs a graph "
                         "whose backward is implicit")
    segments = _sources_with_first_reader(graph, sets)
    last = len(segments) - 1
    forward_ops: list[Op] = []
    for i, segment in enumerate(segments):
        for v in segment:
            forward_ops.append(Forward(v, tape=(i == last) and graph.nodes[v].requires_grad))
    backward_ops: list[Op] = []
    for i in range(last, -1, -1):
        segment = segments[i]
        if i < last:
            backward_ops += [Forward(v, tape=graph.nodes[v].requires_grad)
                             for v in _recomputed_in_segment(graph, segment)]
        backward_ops += [Backward(v) for v in reversed(segment) if graph.nodes[v].requires_grad]
    return insert_frees(graph, forward_ops, backward_ops)


def _sources_with_first_reader(graph: CostGraph, sets: Sequence[frozenset[int]]) -> list[list[int]]:
    """The segments ``L_i \\ L_{i-1}``, with every source (a node without predecessors: a parameter's
    transpose, a constant; not a random one) moved into the segment of its first successor; the sets
    stay lower sets, since all its successors are in that segment or later ones. A source's backward
    then runs right after its readers' backward, where its gradient is made: a linear's weight gradient
    is computed by its reader's backward (the joint graph's ``mm``), and a source left in an early
    segment would have that gradient arrive at the end of the backward in the simulation (VGG-11-BN:
    49 MiB under-predicted)."""
    segment_of: dict[int, int] = {}
    previous: frozenset[int] = frozenset()
    for i, lower in enumerate(sets):
        for v in lower - previous:
            segment_of[v] = i
        previous = lower
    for node in graph.nodes:
        # a random source stays: moved later, it drew its mask after the random nodes it precedes (a
        # dropout on the model input computed after one on a convolution's output: both masks swapped)
        if not node.predecessors and node.successors and not node.random:
            segment_of[node.index] = min(segment_of[s] for s in node.successors)
    segments: list[list[int]] = [[] for _ in sets]
    for v in sorted(segment_of):
        segments[segment_of[v]].append(v)
    return segments


def _recomputed_in_segment(graph: CostGraph, segment: list[int]) -> list[int]:
    """Nodes of a segment to recompute: those needing a tape, and what a recomputed node reads."""
    members = set(segment)
    needed = {v for v in segment if graph.nodes[v].requires_grad}
    for v in reversed(segment):
        if v in needed:
            needed.update(p for p in graph.nodes[v].predecessors if p in members)
    return [v for v in segment if v in needed]


def store_all_lower_sets(graph: CostGraph) -> list[frozenset[int]]:
    """The strategy that recomputes nothing: one segment, everything taped."""
    return [frozenset(range(len(graph)))]


def prefix_lower_sets(graph: CostGraph, split_after: Iterable[int]) -> list[frozenset[int]]:
    """Segments cut after the given positions of the topological order (each prefix is a lower set)."""
    cuts = sorted(set(i for i in split_after if 0 <= i < len(graph) - 1))
    return [frozenset(range(i + 1)) for i in cuts] + [frozenset(range(len(graph)))]
