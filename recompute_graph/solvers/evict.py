"""``evict``: a fast heuristic for joint graphs (explicit backward nodes): run the nodes in order and,
when the next computation would exceed the budget, drop the live value whose next reader is farthest
away (Belady's rule), recomputing dropped values on demand from their inputs.

Model: the simulator's for a forward-only schedule (a running node holds its inputs and its output; a
value lives from its computation to its last reader). Complexity: O(n · live values) per computation,
plus recomputations. It gives no optimality guarantee; it gives the ``ilp`` solver a feasible starting
point on graphs where CP-SAT alone finds none in its time limit, and is a DTR-like baseline.
"""
from __future__ import annotations

from ..errors import SolverError
from ..graph import CostGraph
from ..schedule import Forward, insert_frees
from . import Solution, register

__all__ = ["evict", "evict_schedule"]


def evict_schedule(graph: CostGraph, budget_bytes: int) -> list[int] | None:
    """The order of computations (node indices, recomputations included), or None when the heuristic
    cannot keep the working set of some node within ``budget_bytes``."""
    n = len(graph)
    memory = [node.output_bytes for node in graph.nodes]
    inputs = [node.predecessors for node in graph.nodes]
    readers = [sorted(node.successors) for node in graph.nodes]
    live: dict[int, None] = {}
    used = 0
    order: list[int] = []
    frontier = 0

    def next_use(u: int) -> int:
        for j in readers[u]:
            if j >= frontier:
                return j
        return n + 1  # no future reader: drop first

    def make_room(size: int, pinned: set[int]) -> bool:
        nonlocal used
        while used + size > budget_bytes:
            candidates = [u for u in live if u not in pinned]
            if not candidates:
                return False
            victim = max(candidates, key=lambda u: (next_use(u), memory[u]))
            del live[victim]
            used -= memory[victim]
        return True

    def materialize(v: int, pinned: set[int], depth: int = 0) -> bool:
        """Make v live (computing its missing inputs first), keeping ``pinned`` values."""
        nonlocal used
        if v in live:
            return True
        if depth > n:
            return False
        held = set(pinned)
        for u in inputs[v]:
            if not materialize(u, held, depth + 1):
                return False
            held.add(u)
        if not make_room(memory[v], held):
            return False
        live[v] = None
        used += memory[v]
        order.append(v)
        return True

    for v in range(n):
        frontier = v
        if not materialize(v, set()):
            return None
        frontier = v + 1
        for u in [u for u in live if next_use(u) > n]:  # nothing will read it again
            del live[u]
            used -= memory[u]
    return order


@register("evict", graphs=("joint",))
def evict(graph: CostGraph, budget_bytes: int | None = None) -> Solution:
    """The heuristic in the registry's signature (joint graphs only; without a budget, none binds)."""
    if graph.implicit_backward:
        raise SolverError(f"evict works on joint graphs (explicit backward nodes); {graph.name!r} has an "
                          "implicit backward")
    budget = budget_bytes if budget_bytes is not None else sum(node.output_bytes for node in graph.nodes)
    order = evict_schedule(graph, budget)
    if order is None:
        raise SolverError(f"evict could not keep {graph.name!r} within {budget} bytes")
    schedule = insert_frees(graph, [Forward(v, tape=False) for v in order], [], outputs=())
    recomputed = len(order) - len(graph)
    return Solution.of("evict", graph, schedule, f"{recomputed} recomputations")
