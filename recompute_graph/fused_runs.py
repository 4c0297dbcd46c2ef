"""Which backward ops of a schedule the executor (``rewrite.py``) runs as one autograd call.

A run of two or more ``Backward`` ops (with ``FreeValue`` ops between, and no ``Forward``) is fused: its
incoming gradients enter through one ``autograd.grad`` call, and the tapes it back-propagates are
connected where one reads another's value, so autograd hands gradients between them. A run stays node
by node when fusing would hold more than the simulator counts or run in another order: its tapes out
of reverse order, a tape reading a value of the run that is not the one the run back-propagates, a
value from outside read by three or more of its tapes (or by two, when it has a gradient buffer from an
earlier backward op already), or parameters that already have a gradient buffer from an earlier backward
op.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from torch import nn

from .graph import CostGraph
from .schedule import Backward, Forward, FreeValue, Schedule

__all__ = ["plan_fused_runs"]


def plan_fused_runs(schedule: Schedule, graph: CostGraph, cost_inputs: Sequence[Sequence[int]],
                    node_parameters: Sequence[Sequence[nn.Parameter]]
                    ) -> tuple[dict[int, int], dict[int, frozenset[int]]]:
    """The backward runs of ``schedule`` to fuse into one autograd call each, ``{first position: end}``,
    and, for each taped forward feeding one, the inputs its tape reads through their autograd edge
    (``{forward position: inputs}``). Positions count ``forward_ops`` then ``backward_ops``;
    ``cost_inputs[v]``: the cost-graph inputs node ``v`` reads; ``node_parameters[v]``: its parameters."""
    ops = list(schedule.forward_ops) + list(schedule.backward_ops)
    start = len(schedule.forward_ops)
    run_of: dict[int, int] = {}          # Backward position -> run id
    runs: list[tuple[int, int, set[int]]] = []  # (first, end, nodes)
    position = start
    while position < len(ops):
        end = position
        while end < len(ops) and isinstance(ops[end], (Backward, FreeValue)):
            end += 1
        backwards = [p for p in range(position, end) if isinstance(ops[p], Backward)]
        if len(backwards) >= 2:
            for p in backwards:
                run_of[p] = len(runs)
            runs.append((position, end, {ops[p].node for p in backwards}))
        position = max(end, position + 1)
    latest_tape: dict[int, int] = {}     # node -> position of the taped Forward whose tape is current
    current: dict[int, int] = {}         # node -> position of the Forward that made its current value
    tape_run: dict[int, int] = {}        # taped Forward position -> run consuming its tape
    run_tapes: dict[int, list[int]] = {}  # run -> its Backward ops' taped Forward positions, in order
    reads: list[tuple[int, int, int | None]] = []
    for position, op in enumerate(ops):
        if isinstance(op, Forward):
            if op.tape:
                reads += [(position, u, current.get(u)) for u in cost_inputs[op.node]]
                latest_tape[op.node] = position
            current[op.node] = position
        elif isinstance(op, Backward):
            taped = latest_tape.pop(op.node, None)
            if taped is not None and position in run_of:
                tape_run[taped] = run_of[position]
                run_tapes.setdefault(run_of[position], []).append(taped)
    connections: dict[int, set[int]] = {}
    # autograd's engine runs the ready node taped last first: a run whose Backward ops do not follow
    # their tapes in reverse would run in another order than the simulator's, holding gradients
    # meanwhile (a safeguard; the run that broke Mamba's budget was in order, its cause is below)
    broken: set[int] = {k for k, tapes in run_tapes.items() if any(a <= b for a, b in zip(tapes, tapes[1:]))}
    # a value from outside the run read by several of its tapes gets one gradient from each, held
    # until the fused call returns, where node by node each is summed in as it is made (three or
    # more hold more than the simulator counts: Mamba's 16 slices of one tensor, 1 MB)
    outside_readers: Counter[tuple[int, int]] = Counter()
    for position, u, source in reads:
        run = tape_run.get(position)
        if run is None:
            continue
        if source is not None and tape_run.get(source) == run:
            connections.setdefault(position, set()).add(u)
        elif u in runs[run][2]:
            broken.add(run)   # reads a value of a run node that is not the tape the run back-propagates
        elif graph.nodes[u].requires_grad:
            outside_readers[run, u] += 1
    broken |= {run for (run, _), count in outside_readers.items() if count >= 3}
    # Parameters with a gradient buffer from an earlier backward op: the fused call would hold its
    # own sum of their gradients next to that buffer (one parameter size more than node by node,
    # which the simulator does not model), so runs using them stay node by node. So do runs where two
    # of their tapes read a value from outside that has a gradient buffer already: the call sums their
    # two terms in a buffer of its own, which is then added into that one (GPT-2's GELU input, read by
    # its recomputed pow and add after the 0.5 * x product's backward: 16 KB over the conformance budget).
    run_at = {first: k for k, (first, _, _) in enumerate(runs)}
    read_twice: dict[int, set[int]] = {}
    for (run, u), count in outside_readers.items():
        if count == 2:
            read_twice.setdefault(run, set()).add(u)
    seen: set[int] = set()
    with_gradient: set[int] = set()  # values an earlier backward op has made a gradient for
    for position in range(start, len(ops)):
        if position in run_at:
            k = run_at[position]
            if any(id(p) in seen for v in runs[k][2] for p in node_parameters[v]) or \
                    read_twice.get(k, set()) & with_gradient:
                broken.add(k)
        op = ops[position]
        if isinstance(op, Backward):
            seen.update(id(p) for p in node_parameters[op.node])
            with_gradient.update(cost_inputs[op.node])
    return ({first: end for k, (first, end, _) in enumerate(runs) if k not in broken},
            {p: frozenset(us) for p, us in connections.items() if tape_run[p] not in broken})
