"""Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost") on the linearized graph.

Model: the nodes in topological order form a chain of segments; a segment boundary may only be placed at
a *split candidate*, a node ``v`` such that no other node before it (inclusive) has a consumer after it
(the prefix ending at ``v`` has boundary ``{v}``: the articulation points of the linearized graph).
Forward keeps only segment boundaries; backward recomputes one segment at a time (one extra forward of
everything but the last segment). Both variants are lowered with the shared
:func:`~recompute_graph.schedule.lower_segments`. Not exact in any space: baselines.

* ``chen_sqrt``: checkpoint every ``k``-th candidate, ``k = floor(sqrt(#candidates))`` (Checkmate's
  ``solve_chen_sqrtn``).
* ``chen_greedy``: Chen's budgeted greedy rule: walk the order summing the bytes each node keeps
  (``CostGraph.stored_bytes_per_node``); at a candidate whose running sum exceeds the segment budget
  ``b``, cut and restart the sum. ``b`` is searched over a geometric grid (Chen's own search tries a few
  guesses around ``sqrt(x*y)``); the best plan per the simulator is returned.
"""
from __future__ import annotations

import math

from ..graph import CostGraph
from ..graph_memo import memoized
from ..schedule import lower_segments, prefix_lower_sets
from . import Solution, best_of, register

GREEDY_GRID_POINTS = 40


def open_after(graph: CostGraph) -> tuple[list[int], list[int]]:
    """Per position ``i``: how many of the nodes at ``0..i`` a node after ``i`` reads (the prefix's
    boundary), and their output bytes."""
    counts: list[int] = []
    sizes: list[int] = []
    open_nodes = open_bytes = 0
    ending: dict[int, tuple[int, int]] = {}  # position -> (nodes, bytes) that stop being open after it
    for i, node in enumerate(graph.nodes):
        nodes_done, bytes_done = ending.pop(i, (0, 0))
        open_nodes, open_bytes = open_nodes - nodes_done, open_bytes - bytes_done
        last_use = max(node.successors, default=-1)
        if last_use > i:
            open_nodes, open_bytes = open_nodes + 1, open_bytes + node.output_bytes
            done = ending.get(last_use, (0, 0))
            ending[last_use] = (done[0] + 1, done[1] + node.output_bytes)
        counts.append(open_nodes)
        sizes.append(open_bytes)
    return counts, sizes


def split_candidates(graph: CostGraph) -> list[int]:
    """Positions ``i`` (not the last) whose prefix ``0..i`` has exactly ``{i}`` as its boundary."""
    counts, _ = open_after(graph)
    return [i for i, node in enumerate(graph.nodes[:-1])
            if counts[i] == 1 and max(node.successors, default=-1) > i]


def _segments_solution(name: str, graph: CostGraph, cuts: list[int], description: str) -> Solution:
    return Solution.of(name, graph, lower_segments(graph, prefix_lower_sets(graph, cuts)), description)


@register("chen_sqrt")
def chen_sqrt(graph: CostGraph, budget_bytes: int | None = None) -> Solution:
    """Every ``floor(sqrt(n))``-th split candidate is a checkpoint; ignores the budget."""
    candidates = split_candidates(graph)
    k = max(1, math.isqrt(len(candidates)))
    cuts = [c for j, c in enumerate(candidates) if (j + 1) % k == 0]
    return _segments_solution("chen_sqrt", graph, cuts, f"{len(cuts)} checkpoints of {len(candidates)} candidates")


def greedy_cuts(graph: CostGraph, segment_budget_bytes: float) -> list[int]:
    """Chen's greedy rule for one segment budget (see the module docstring)."""
    candidates = set(split_candidates(graph))
    stored = graph.stored_bytes_per_node()
    cuts, running = [], 0
    for i in range(len(graph)):
        running += stored[i] + graph.nodes[i].output_bytes
        if i in candidates and running > segment_budget_bytes:
            cuts.append(i)
            running = 0
    return cuts


@register("chen_greedy")
def chen_greedy(graph: CostGraph, budget_bytes: int | None = None) -> Solution:
    """Best greedy plan over a grid of segment budgets (least recomputation that fits ``budget_bytes``).
    The candidates do not depend on ``budget_bytes``: they are made and simulated once per graph."""
    return best_of(memoized(graph, "chen_greedy.candidates", lambda: _greedy_candidates(graph)), budget_bytes)


def _greedy_candidates(graph: CostGraph) -> list[Solution]:
    """Chen's greedy plan for each segment budget of the grid, one per distinct set of cuts."""
    stored = [s + n.output_bytes for s, n in zip(graph.stored_bytes_per_node(), graph.nodes)]
    low, high = max(1, min((s for s in stored if s > 0), default=1)), max(2, sum(stored))
    tried: dict[tuple[int, ...], float] = {}
    for k in range(GREEDY_GRID_POINTS + 1):
        segment_budget = low * (high / low) ** (k / GREEDY_GRID_POINTS)
        tried.setdefault(tuple(greedy_cuts(graph, segment_budget)), segment_budget)
    return [_segments_solution("chen_greedy", graph, list(cuts), f"{len(cuts)} checkpoints, segment budget {int(b)} B")
            for cuts, b in tried.items()]
