"""``evict``: a fast heuristic for joint graphs (explicit backward nodes): run the nodes in order and,
when the next computation would exceed the budget, drop a live value (the one whose next reader is
farthest away, Belady's rule, or the cheapest to rebuild per byte and per step of distance, DTR's, with
the rebuild priced one level or all levels deep), and recompute dropped values on demand from their
inputs; the cheapest of the schedules wins.

Model: the simulator's for a forward-only schedule (a running node holds its inputs and its output; a
value lives from its computation to its last reader). Complexity: O(n · live values) per computation,
plus recomputations. It gives no optimality guarantee; it gives the ``ilp`` solver a feasible starting
point on graphs where CP-SAT alone finds none in its time limit, and is a DTR-like baseline.
"""
from __future__ import annotations

import math
import time
from typing import Callable

from ..errors import SolverError
from ..graph import CostGraph
from ..schedule import Forward, insert_frees
from . import Solution, register

__all__ = ["evict", "evict_schedule", "working_sets", "lowest_peak", "RULES"]

#: The eviction rules ``evict`` tries (it keeps the cheapest feasible schedule).
RULES = ("belady", "dtr", "dtr_deep")
#: ``dtr_deep`` follows dropped ancestors this many levels deep (deeper: treated as unaffordable).
DEEP_LEVELS = 30
#: A schedule longer than this many computations per node is abandoned (recomputation cascades).
WORK_PER_NODE = 20
#: Seconds ``evict`` may take when the caller gives no limit.
DEFAULT_TIME_LIMIT = 60.0


def evict_schedule(graph: CostGraph, budget_bytes: int, rule: str = "belady",
                   deadline: float = math.inf) -> list[int] | None:
    """The order of computations (node indices, recomputations included), or None when the heuristic
    cannot keep the working set of some node within ``budget_bytes``. ``rule``: which live value to
    drop: "belady" (the farthest next reader), "dtr" (the least estimated recomputation cost per byte
    and per step of distance to its next reader, as DTR does, counting the missing inputs' own costs) or
    "dtr_deep" (the same with the cost of every dropped ancestor its rebuild needs, DTR's evicted
    neighbourhood)."""
    if rule not in RULES:
        raise ValueError(f"unknown eviction rule {rule!r}; use one of {', '.join(RULES)}")
    cost = [node.recomputation_cost for node in graph.nodes]
    rebuild_memory = working_sets(graph)
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
            if rule == "belady":
                victim = max(candidates, key=lambda u: (next_use(u), memory[u]))
            else:
                rebuild_cost = _deep_rebuild_cost(cost, inputs, live) if rule == "dtr_deep" else \
                    (lambda p: 0.0 if p in live else cost[p])

                def score(u: int) -> float:
                    rebuild = cost[u] + sum(rebuild_cost(p) for p in inputs[u])
                    return rebuild / (max(memory[u], 1) * (next_use(u) - frontier + 1))
                victim = min(candidates, key=score)
            del live[victim]
            used -= memory[victim]
        return True

    work_limit = WORK_PER_NODE * n

    def materialize(v: int, pinned: set[int], depth: int = 0) -> bool:
        """Make v live (computing its missing inputs first), keeping ``pinned`` values."""
        nonlocal used
        if v in live:
            return True
        if depth > n or len(order) > work_limit or time.perf_counter() > deadline:
            return False  # on-demand recomputation is running away (or out of time): give up
        held = set(pinned)
        # live inputs first (pinned at once), then the missing ones, the costliest to rebuild first while
        # fewer values are pinned
        missing = sorted((u for u in inputs[v] if u not in live), key=lambda u: -rebuild_memory[u])
        held |= {u for u in inputs[v] if u in live}
        for u in missing:
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


def _deep_rebuild_cost(cost: list[float], inputs: list, live: dict):
    """``p -> cost of making p live again``: p's cost plus that of its dropped ancestors, each counted
    once per query, up to ``DEEP_LEVELS`` levels (memoized for one eviction decision)."""
    memo: dict[int, float] = {}

    def rebuild_cost(p: int, level: int = 0) -> float:
        if p in live:
            return 0.0
        if p not in memo:
            if level > DEEP_LEVELS:
                return float("inf")
            memo[p] = 0.0  # a shared ancestor counts once
            memo[p] = cost[p] + sum(rebuild_cost(q, level + 1) for q in inputs[p])
        return memo[p]
    return rebuild_cost


def working_sets(graph: CostGraph) -> list[int]:
    """Per node, the bytes live while it runs from live inputs: its inputs and its output."""
    return [sum(graph.nodes[p].output_bytes for p in node.predecessors) + node.output_bytes
            for node in graph.nodes]


def lowest_peak(graph: CostGraph, attempt: Callable[[int], Solution]) -> Solution:
    """The schedule at the smallest budget a heuristic meets: bisection, to 0.1 %, between the largest
    single-node working set and the no-recomputation peak. ``attempt(budget_bytes)`` returns a schedule
    within the budget or raises SolverError. (Heuristics are not monotone in the budget: this is the
    smallest budget the bisection meets, not a proven floor.)"""
    from .store_all import store_all
    high_solution = store_all(graph, None)
    low = max(working_sets(graph)) - 1
    high, best = high_solution.peak_bytes, None
    while high - low > max(1, high // 1000):
        middle = (low + high) // 2
        try:
            best, high = attempt(middle), middle
        except SolverError:
            low = middle
    if best is not None:
        return best
    try:
        return attempt(high)
    except SolverError:  # out of time even at the no-recomputation peak
        return high_solution


def _lowest_peak(graph: CostGraph, deadline: float) -> Solution:
    return lowest_peak(graph, lambda budget_bytes: evict(graph, budget_bytes, fallback=False,
                                                         time_limit=max(0.0, deadline - time.perf_counter())))


@register("evict", graphs=("joint",))
def evict(graph: CostGraph, budget_bytes: int | None = None, *, fallback: bool = True,
          time_limit: float | None = None) -> Solution:
    """The heuristic in the registry's signature (joint graphs only; without a budget, the schedule with
    the lowest peak it finds). ``fallback``: when no rule fits the budget, try the lowest-peak schedule
    (a bisection of a dozen runs: the heuristic is not monotone in the budget). ``time_limit``: seconds
    for all of it (``DEFAULT_TIME_LIMIT`` when None); a rule still running then gives up (``dtr_deep``
    can take minutes on RL1000)."""
    if graph.implicit_backward:
        raise SolverError(f"evict works on joint graphs (explicit backward nodes); {graph.name!r} has an "
                          "implicit backward")
    deadline = time.perf_counter() + (DEFAULT_TIME_LIMIT if time_limit is None else time_limit)
    if budget_bytes is None:
        return _lowest_peak(graph, deadline)
    found = []
    for rule in RULES:
        order = evict_schedule(graph, budget_bytes, rule, deadline)
        if order is not None:
            schedule = insert_frees(graph, [Forward(v, tape=False) for v in order], [], outputs=())
            found.append(Solution.of("evict", graph, schedule, f"{rule}, {len(order) - len(graph)} recomputations"))
    if not found and fallback:
        lowest = _lowest_peak(graph, deadline)
        if lowest.fits(budget_bytes):
            return lowest
    if not found:
        raise SolverError(f"evict could not keep {graph.name!r} within {budget_bytes} bytes")
    return min(found, key=lambda solution: (solution.simulation.compute_cost, solution.peak_bytes))
