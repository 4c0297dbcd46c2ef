"""Lower sets of a cost graph, the strategy space of the lower-set DP (``lower_set_dp``).

A lower set is a set of nodes closed under predecessors, held as a bitmask over node indices. A
:class:`LowerSetFamily` is a list of them sorted by cardinality, with the per-set sums the DP's cost
models need. ``enumerate_lower_sets`` gives all of them (the exact DP's family, refused above a limit),
``principal_lower_sets`` one per node (the approximate DP's). Free sources (parameters and inputs that
cost nothing to keep) are joined to their consumers, and random nodes are ordered
(``ordering_predecessors``), so no family splits what cannot be split. Pure Python and numpy: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import SolverError
from ..graph import CostGraph

__all__ = ["DEFAULT_MAX_LOWER_SETS", "COUNT_CAP", "LowerSetFamily", "free_sources", "ordering_predecessors",
           "enumerate_lower_sets", "principal_lower_sets"]

DEFAULT_MAX_LOWER_SETS = 3000
#: Lower sets counted, at most, to say how many a graph over the limit has.
COUNT_CAP = 200_000


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _bit_matrix(masks: Sequence[int], n: int) -> np.ndarray:
    """``[i, v]``: bit ``v`` of ``masks[i]``, as a boolean matrix."""
    width = max(1, (n + 7) // 8)
    raw = np.frombuffer(b"".join(m.to_bytes(width, "little") for m in masks), dtype=np.uint8)
    return np.unpackbits(raw.reshape(len(masks), width), axis=1, bitorder="little")[:, :n].astype(bool)


@dataclass
class LowerSetFamily:
    """Lower sets as bitmasks, sorted by cardinality, with the per-set sums the models need."""

    graph: CostGraph
    sets: list[int]

    def __post_init__(self) -> None:
        g = self.graph
        self.n = len(g)
        self.succ = [sum(1 << s for s in node.successors) for node in g.nodes]
        self.pred = [sum(1 << p for p in node.predecessors) for node in g.nodes]
        self.sets.sort(key=lambda s: (bin(s).count("1"), s))
        self.size = [bin(s).count("1") for s in self.sets]
        self.boundary = self._boundaries()
        self.boundary_nodes = [_bits(mask) for mask in self.boundary]

    def _boundaries(self) -> list[int]:
        """``_boundary`` of every set, from the membership matrix: a node is on a set's boundary when
        one of its edges leaves the set (bit operations on each set's every node took seconds on
        3,000 sets of a 3,000-node graph)."""
        edges = [(v, s) for v, node in enumerate(self.graph.nodes) for s in node.successors]
        if not edges or not self.sets:
            return [0] * len(self.sets)
        sources = np.array([v for v, _ in edges], dtype=np.int64)
        targets = np.array([s for _, s in edges], dtype=np.int64)
        members = self.members
        leaving = members[:, sources] & ~members[:, targets]  # [set, edge], edges grouped by source
        starts = np.flatnonzero(np.r_[True, sources[1:] != sources[:-1]])
        on_boundary = np.zeros((len(self.sets), self.n + (-self.n) % 8), dtype=bool)
        on_boundary[:, sources[starts]] = np.logical_or.reduceat(leaving, starts, axis=1)
        packed = np.packbits(on_boundary, axis=1, bitorder="little")
        return [int.from_bytes(row.tobytes(), "little") for row in packed]

    def _boundary(self, lower: int) -> int:
        return sum(1 << v for v in _bits(lower) if self.succ[v] & ~lower)

    def out_neighbours(self, lower: int) -> int:
        mask = 0
        for v in _bits(lower):
            mask |= self.succ[v]
        return mask & ~lower

    def in_neighbours(self, nodes: int) -> int:
        mask = 0
        for v in _bits(nodes):
            mask |= self.pred[v]
        return mask

    def total(self, weights: Sequence[float], mask: int) -> float:
        return sum(weights[v] for v in _bits(mask))

    @property
    def members(self) -> np.ndarray:
        """``[i, v]``: whether node ``v`` is in lower set ``i`` (built once)."""
        if getattr(self, "_members", None) is None:
            self._members = _bit_matrix(self.sets, self.n)
        return self._members

    @property
    def words(self) -> np.ndarray:
        """The sets as rows of 64-bit words (bit ``v`` of the set is bit ``v % 64`` of word ``v // 64``)."""
        if getattr(self, "_words", None) is None:
            count = max(1, (self.n + 63) // 64)
            self._words = np.frombuffer(b"".join(s.to_bytes(8 * count, "little") for s in self.sets),
                                        dtype="<u8").reshape(len(self.sets), count)
        return self._words

    def supersets_after(self, a: int) -> np.ndarray:
        """Indices ``b > a`` of the strict supersets of set ``a`` (sets are sorted by size, then value)."""
        words = self.words
        later = np.arange(a + 1, len(self.sets))
        contains = ((words[a + 1:] & words[a]) == words[a]).all(axis=1)
        return later[contains & (np.asarray(self.size[a + 1:]) > self.size[a])]

    def totals(self, weights: Sequence[float]) -> np.ndarray:
        """``total(weights, s)`` of every set, as one product with ``members`` (exact for integer-valued
        weights, such as bytes and quantized times)."""
        return self.members @ np.asarray(weights, dtype=np.float64)


def free_sources(graph: CostGraph) -> int:
    """Nodes with no predecessor whose output needs no gradient (``torch.ones(...)`` masks, slices of a
    model input): computing one before its first consumer's segment only costs memory, so lower sets
    take such a node together with its first consumer (and V takes the unused ones). Random nodes are
    never free: their order is fixed (:func:`ordering_predecessors`)."""
    return sum(1 << n.index for n in graph.nodes if not n.predecessors and not n.requires_grad and not n.random)


def ordering_predecessors(graph: CostGraph) -> list[int]:
    """Per node, the bitmask of the nodes a lower set containing it must contain: its predecessors and,
    for a node that draws random numbers (dropout), the previous random node in program order. Random
    nodes are then first computed in program order, so they draw from the RNG stream in the order the
    original model does and produce the same masks (the executor replays them on recomputation)."""
    masks = []
    previous_random = None
    for node in graph.nodes:
        mask = sum(1 << p for p in node.predecessors)
        if node.random:
            if previous_random is not None:
                mask |= 1 << previous_random
            previous_random = node.index
        masks.append(mask)
    return masks


def enumerate_lower_sets(graph: CostGraph, limit: int = DEFAULT_MAX_LOWER_SETS,
                         count_up_to: int = COUNT_CAP) -> LowerSetFamily:
    """All lower sets (with ∅ and V) without duplicates, free sources joined to their consumers (see
    :func:`free_sources`). SolverError when there are more than ``limit``; the message says how many
    there are, counted up to ``count_up_to`` (pass ``limit`` to stop at once)."""
    free = free_sources(graph)
    pred = ordering_predecessors(graph)
    full = (1 << len(graph)) - 1
    candidates = [v for v in range(len(graph)) if not free >> v & 1]
    seen = {0, full}
    frontier = [0]
    cap = max(limit, count_up_to)
    while frontier and len(seen) <= cap:
        grown = []
        for lower in frontier:
            for v in candidates:
                bit = 1 << v
                if not lower & bit and pred[v] & ~(lower | free) == 0:
                    bigger = lower | bit | (pred[v] & free)
                    if bigger not in seen:
                        seen.add(bigger)
                        grown.append(bigger)
            if len(seen) > cap:
                break
        frontier = grown
    if len(seen) > limit:
        count = f"more than {cap:,}" if len(seen) > cap else f"{len(seen):,}"
        raise SolverError(f"graph {graph.name!r} has {count} lower sets, over the limit of {limit:,} for "
                          "dp_exact: use dp_approx (principal lower sets only) or raise max_lower_sets")
    return LowerSetFamily(graph, list(seen))


def principal_lower_sets(graph: CostGraph) -> LowerSetFamily:
    """``∅``, ``V`` and ``↓v = {v} ∪ ancestors(v)`` for every node that is not a free source (the
    approximate DP's family); ancestors include the earlier random nodes of a random node."""
    free = free_sources(graph)
    ordering = ordering_predecessors(graph)
    down = []
    for node in graph.nodes:
        mask = 1 << node.index
        for p in _bits(ordering[node.index]):
            mask |= down[p]
        down.append(mask)
    principal = [mask for v, mask in enumerate(down) if not free >> v & 1]
    return LowerSetFamily(graph, sorted({0, (1 << len(graph)) - 1, *principal}))
