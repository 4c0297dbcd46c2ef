"""Passes that improve any solver's schedule without changing the values it computes.

``keep_free_tapes``: some nodes' backward needs nothing from the forward (an addition, a view, a
scale by a constant): their tape costs no memory (``backward_needs`` empty, no saved buffer). The
lower-set and chain DPs recompute such a node in backward only to record its tape, and with it the
inputs that recomputation reads. An addition that joins a residual branch is the costly case: its
output and both inputs are recomputed, three activations, while the backward of the two branches only
needs what the branches' own nodes saved. This pass:

1. records the tape of every free-tape node at its first computation and drops the tape from its
   recomputations (a node holds one tape at a time);
2. removes the recomputations whose value nobody reads any more (a reverse liveness pass), repeatedly,
   since removing one can leave its inputs' recomputations unread too. It never removes a first
   computation, nor any computation of a random or stateful node (dropout masks and running
   statistics are tied to first computations);
3. re-derives the ``FreeValue`` ops (``schedule.insert_frees``).

The result computes the same values in the same order, with fewer recomputations; its memory and time
come from the simulator like any schedule's. Graphs with explicit backward nodes are returned unchanged.

``computed_once``: a node that reads an input's value from before the step wrote into it
(``CostNode.reads_mutated_input``) cannot be recomputed: the value it read is gone. Every recomputation
of such a node is dropped, and the node's first computation is kept in its place (with the tape, where a
dropped recomputation recorded it); then the frees are derived again and the recomputations that only
fed the dropped ones are removed (``keep_free_tapes``). ``solvers.Solution.of`` applies it to every
solver's schedule, so the plans the planner compares are priced as they will run.
"""
from __future__ import annotations

from .graph import CostGraph
from .graph_memo import memoized
from .schedule import Forward, FreeValue, Op, Schedule, insert_frees

__all__ = ["free_tape_nodes", "keep_free_tapes", "computed_once_nodes", "computed_once"]


def free_tape_nodes(graph: CostGraph) -> frozenset[int]:
    """Nodes whose tape costs no memory: they need grad, save nothing, need no value in backward and
    own their output's storage. Views and tuple items are left out: recomputing them allocates nothing,
    and their output tensor is also their owner's, which a tape must not keep (the executor empties a
    freed value that only a tape still holds)."""
    return frozenset(n.index for n in graph.nodes
                     if n.requires_grad and not n.backward_needs and n.saved_buffer_bytes == 0
                     and n.alias_of is None)


def keep_free_tapes(graph: CostGraph, schedule: Schedule) -> Schedule:
    """``schedule`` with free tapes recorded at first computations and unread recomputations removed
    (module docstring); the same schedule object when nothing changes."""
    if not graph.implicit_backward:
        return schedule
    free = free_tape_nodes(graph)
    sequence: list[Op | None] = [op for op in schedule.forward_ops if not isinstance(op, FreeValue)]
    sequence.append(None)  # the end of the forward ops: reads the model outputs
    sequence += [op for op in schedule.backward_ops if not isinstance(op, FreeValue)]
    computed: set[int] = set()
    first = set()
    for position, op in enumerate(sequence):
        if isinstance(op, Forward):
            if op.node not in computed:
                first.add(position)
            if op.node in free:
                sequence[position] = Forward(op.node, tape=op.node not in computed)
            computed.add(op.node)
    protected = {n.index for n in graph.nodes if n.random or n.stateful}
    sequence = _without_unread_recomputations(graph, sequence, first, protected)
    boundary = sequence.index(None)
    forward_ops = [op for op in sequence[:boundary] if op is not None]
    backward_ops = [op for op in sequence[boundary + 1:] if op is not None]
    improved = insert_frees(graph, forward_ops, backward_ops)
    return schedule if improved == schedule else improved


def _without_unread_recomputations(graph: CostGraph, sequence: list[Op | None], first: set[int],
                                   protected: set[int]) -> list[Op | None]:
    """Drop recomputations without a tape whose value is never read, until none is left (reverse
    liveness: a computation is needed if a later op reads its value before the node is computed again).
    ``first``: positions of first computations (kept)."""
    keep = [True] * len(sequence)
    changed = True
    while changed:
        changed = False
        needed: set[int] = set()
        for position in range(len(sequence) - 1, -1, -1):
            op = sequence[position]
            if not keep[position]:
                continue
            if op is None:
                needed.update(graph.outputs)
                continue
            if not isinstance(op, Forward):
                continue
            read = op.node in needed
            if not read and not op.tape and position not in first and op.node not in protected:
                keep[position] = False
                changed = True
                continue
            needed.discard(op.node)
            needed.update(graph.nodes[op.node].predecessors)
    return [op for op, kept in zip(sequence, keep) if kept]


def computed_once_nodes(graph: CostGraph) -> frozenset[int]:
    """The nodes that read an input's value from before the step wrote into it (module docstring)."""
    return memoized(graph, "computed_once_nodes",
                    lambda: frozenset(n.index for n in graph.nodes if n.reads_mutated_input))


def computed_once(graph: CostGraph, schedule: Schedule) -> Schedule:
    """``schedule`` without recomputations of ``computed_once_nodes(graph)`` (module docstring); the
    same schedule object when it has none."""
    once = computed_once_nodes(graph)
    if not once:  # most graphs: nothing to look at (``Solution.of`` runs this on every schedule)
        return schedule
    program = [*schedule.forward_ops, None, *schedule.backward_ops]
    computed = [op.node for op in program if isinstance(op, Forward) and op.node in once]
    if len(computed) == len(set(computed)):
        return schedule
    kept: list[Op | None] = []
    first: dict[int, int] = {}  # node -> position of its first computation in ``kept``
    for op in program:
        if isinstance(op, FreeValue):
            continue
        if isinstance(op, Forward) and op.node in once:
            if op.node in first:
                if op.tape:
                    kept[first[op.node]] = Forward(op.node, tape=True)
                continue
            first[op.node] = len(kept)
        kept.append(op)
    boundary = kept.index(None)
    forward_ops = [op for op in kept[:boundary] if op is not None]
    backward_ops = [op for op in kept[boundary + 1:] if op is not None]
    return keep_free_tapes(graph, insert_frees(graph, forward_ops, backward_ops))
