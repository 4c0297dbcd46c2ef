"""``shave``: peak shaving, a local search for joint graphs (explicit backward nodes) that splits the
lifetimes of values crossing the memory peak.

Model: the simulator's for a forward-only schedule (a running node holds its inputs and its output; a
value lives from its computation to its last reader, ``schedule.insert_frees``). Every node keeps its
first computation in node order (stage ``t`` computes node ``t``, as in the ``ilp`` stage model), so a
schedule found here is a valid hint for ``ilp``.

Search: start from the no-recomputation order. While some position of the order runs above the budget,
take the position ``P`` of highest memory and the values live across it but not read there. Splitting a
value's lifetime at ``P`` drops it after its last reader before ``P`` and recomputes it later, together
with those of its inputs not live there (recursively): right before its first reader after ``P``, or
right after the run of positions above the budget that contains ``P`` (where more of its inputs may
still be live). Splits are ranked by the memory they take off positions above the budget per unit of
recomputation cost. The best ``EVALUATED`` are simulated exactly and the one that most lowers the excess
(the bytes above the budget, summed over positions) per unit of cost is applied; when none of them
lowers it, every split at ``P`` is tried, then every split at every position above the budget. The
search fails when no split lowers the excess, or at the time limit. A feasible order is then pruned:
recomputations are dropped, the costliest first, where the earlier computation can serve their readers
within the budget.

Unlike ``evict``, which decides online and gives up when on-demand recomputation cascades, every step
here is checked against the whole memory profile, so long edges (values read again far later) are split
where they cross the peak. No optimality guarantee; the ``ilp`` solver uses the result as a hint.
"""
from __future__ import annotations

import time

from ..errors import SolverError
from ..graph import CostGraph
from ..schedule import Forward, insert_frees
from . import Solution, register
from .evict import lowest_peak

__all__ = ["shave", "shave_order", "memory_profile"]

#: Candidate splits simulated exactly per step (the best by estimated gain per cost).
EVALUATED = 6
#: Seconds the search may run when the caller gives no limit.
DEFAULT_TIME_LIMIT = 60.0
#: Seconds each search of the lowest-peak bisection may run.
BISECTION_TIME_LIMIT = 10.0


class _Profile:
    """Instances of values in an order of computations and the memory at every position.

    ``memory[k]``: bytes live while the computation at position ``k`` runs (its inputs, its output and
    every value computed earlier and read at ``k`` or later). An instance is one computation of a node:
    ``(node, start, reads)``, ``reads`` the positions reading that computation's value."""

    def __init__(self, graph: CostGraph, order: list[int]) -> None:
        size = [node.output_bytes for node in graph.nodes]
        current: dict[int, int] = {}
        self.nodes: list[int] = []
        self.starts: list[int] = []
        self.reads: list[list[int]] = []
        self.instances_of: dict[int, list[int]] = {}
        for position, v in enumerate(order):
            if v < 0:  # a hole (``_prune``): nothing runs there
                self.nodes.append(v)
                self.starts.append(position)
                self.reads.append([])
                continue
            for p in graph.nodes[v].predecessors:
                if p not in current:
                    raise SolverError(f"order reads node {p} before computing it (position {position})")
                self.reads[current[p]].append(position)
            current[v] = len(self.nodes)
            self.instances_of.setdefault(v, []).append(len(self.nodes))
            self.nodes.append(v)
            self.starts.append(position)
            self.reads.append([])
        change = [0] * (len(order) + 1)
        self.ends = [reads[-1] if reads else start for start, reads in zip(self.starts, self.reads)]
        for v, start, end in zip(self.nodes, self.starts, self.ends):
            if v < 0:
                continue
            change[start] += size[v]
            change[end + 1] -= size[v]
        self.memory: list[int] = []
        level = 0
        for position in range(len(order)):
            level += change[position]
            self.memory.append(level)

    def live_at(self, node: int, position: int) -> bool:
        """Whether a computation of ``node`` before ``position`` is read at ``position`` or later."""
        return any(self.starts[i] < position <= self.ends[i] for i in self.instances_of.get(node, ()))


def memory_profile(graph: CostGraph, order: list[int]) -> list[int]:
    """Bytes live at every position of ``order`` (a list of node computations), in the simulator's model."""
    return _Profile(graph, order).memory


def _excess(memory: list[int], budget_bytes: int) -> int:
    return sum(level - budget_bytes for level in memory if level > budget_bytes)


def _chain(graph: CostGraph, profile: _Profile, node: int, position: int) -> list[int]:
    """The nodes to recompute right before ``position`` to have ``node`` there: it and, recursively, its
    inputs not live there, in node (topological) order."""
    needed: set[int] = set()
    stack = [node]
    while stack:
        v = stack.pop()
        if v in needed:
            continue
        needed.add(v)
        stack.extend(p for p in graph.nodes[v].predecessors if p not in needed and not profile.live_at(p, position))
    return sorted(needed)


def _splits(graph: CostGraph, profile: _Profile, position: int, above: list[int]) -> list[tuple[float, int, list[int]]]:
    """Lifetime splits at ``position``: ``(estimated gain per cost, insertion position, chain)`` for every
    value live across it and not read there, best first."""
    nodes = graph.nodes
    ranked = []
    for i, (v, start, reads) in enumerate(zip(profile.nodes, profile.starts, profile.reads)):
        if not (start < position < profile.ends[i]) or position in reads:
            continue
        before = max([start] + [r for r in reads if r < position])
        first_read = min(r for r in reads if r > position)
        # recompute right before the next reader, or earlier, right after the run of positions above
        # the budget that contains ``position`` (where other inputs may still be live)
        calm = next((q for q in range(position + 1, first_read) if not above[q]), first_read)
        for after in {first_read, calm}:
            chain = _chain(graph, profile, v, after)
            gain = sum(min(nodes[v].output_bytes, a) for a in above[before + 1:after])
            ranked.append((gain / sum(max(nodes[u].recomputation_cost, 1e-12) for u in chain), after, chain))
    ranked.sort(key=lambda item: -item[0])
    return ranked


def shave_order(graph: CostGraph, budget_bytes: int, *, time_limit: float = DEFAULT_TIME_LIMIT) -> list[int] | None:
    """An order of computations (node indices, recomputations included) whose memory stays within
    ``budget_bytes`` everywhere, or None when the search finds none (module docstring)."""
    cost = [max(node.recomputation_cost, 1e-12) for node in graph.nodes]
    order = list(range(len(graph)))
    profile = _Profile(graph, order)
    excess = _excess(profile.memory, budget_bytes)
    deadline = time.perf_counter() + time_limit

    def best_of(splits) -> tuple[float, list[int], _Profile] | None:
        best = None
        for _, after, chain in splits:
            if time.perf_counter() > deadline:
                break
            candidate = order[:after] + chain + order[after:]
            candidate_profile = _Profile(graph, candidate)
            lowered = excess - _excess(candidate_profile.memory, budget_bytes)
            if lowered > 0:
                value = lowered / sum(cost[u] for u in chain)
                if best is None or value > best[0]:
                    best = (value, candidate, candidate_profile)
        return best

    while excess > 0 and time.perf_counter() < deadline:
        memory = profile.memory
        above = [max(0, level - budget_bytes) for level in memory]
        peak = max(range(len(memory)), key=memory.__getitem__)
        splits = _splits(graph, profile, peak, above)
        # the best few at the peak; when none lowers the excess, all of them; then those at every
        # position above the budget
        best = best_of(splits[:EVALUATED]) or best_of(splits[EVALUATED:])
        if best is None:
            tried = {(after, tuple(chain)) for _, after, chain in splits}
            others: dict[tuple, tuple[float, int, list[int]]] = {}
            for position in (q for q, level in enumerate(above) if level and q != peak):
                for split in _splits(graph, profile, position, above):
                    key = (split[1], tuple(split[2]))
                    if key not in tried and (key not in others or split[0] > others[key][0]):
                        others[key] = split
            best = best_of(sorted(others.values(), key=lambda item: -item[0]))
        if best is None:
            return None
        _, order, profile = best
        excess = _excess(profile.memory, budget_bytes)
    return _prune(graph, order, budget_bytes, deadline) if excess == 0 else None


def _prune(graph: CostGraph, order: list[int], budget_bytes: int, deadline: float) -> list[int]:
    """Drop recomputations, the costliest first, whose readers can read the earlier computation of the
    same value instead while the memory stays within the budget (splits made early in the search may
    be unnecessary once later ones are in place)."""
    seen: set[int] = set()
    recomputations = []
    for position, v in enumerate(order):
        if v in seen:
            recomputations.append(position)
        seen.add(v)
    for position in sorted(recomputations, key=lambda q: -graph.nodes[order[q]].recomputation_cost):
        if time.perf_counter() > deadline:
            break
        candidate = order[:position] + [-1] + order[position + 1:]  # -1: a hole, keeps later positions
        if max(_Profile(graph, candidate).memory) <= budget_bytes:
            order = candidate
    return [v for v in order if v >= 0]


@register("shave", graphs=("joint",))
def shave(graph: CostGraph, budget_bytes: int | None = None, *, time_limit: float | None = None) -> Solution:
    """The peak-shaving search in the registry's signature (joint graphs only). Without a budget: the
    schedule at the smallest budget a bisection meets (``evict.lowest_peak``), each search limited to
    ``BISECTION_TIME_LIMIT`` seconds."""
    if graph.implicit_backward:
        raise SolverError(f"shave works on joint graphs (explicit backward nodes); {graph.name!r} has an "
                          "implicit backward")
    if budget_bytes is None:
        return lowest_peak(graph, lambda budget: shave(graph, budget, time_limit=BISECTION_TIME_LIMIT))
    order = shave_order(graph, budget_bytes, time_limit=DEFAULT_TIME_LIMIT if time_limit is None else time_limit)
    if order is None:
        raise SolverError(f"shave found no schedule of {graph.name!r} within {budget_bytes} bytes")
    schedule = insert_frees(graph, [Forward(v, tape=False) for v in order], [], outputs=())
    return Solution.of("shave", graph, schedule, f"{len(order) - len(graph)} recomputations")
