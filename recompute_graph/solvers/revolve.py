"""``revolve``: Griewank's binomial checkpointing on the graph's chain of stages (Griewank 1992;
Griewank & Walther 2000), the homogeneous special case of rotor and the exact optimum of Gruslys et al.
2016's BPTT-HSM.

Model: the chain of :func:`~recompute_graph.solvers.chain_dp.chain_of` (one stage per split candidate,
no coarsening), every stage costing one forward step. With ``s`` snapshot slots (the stage input kept
at the start counts as one), the least number of extra forward steps to reverse ``l`` stages is::

    p(1, s) = 0,   p(l, 1) = l(l - 1) / 2,   p(l, s) = min_{1 <= i < l} [ i + p(i, s) + p(l - i, s - 1) ]

and the optimal schedule advances ``i*`` stages without tape, stores a snapshot, reverses the rest with
``s - 1`` slots and then the first ``i*`` stages with ``s`` slots. The solver takes the most slots the
budget allows (each slot costs the largest stage input), builds the schedule, and lets the simulator
decide, lowering the slot count until the simulated plan fits, down to ``ceil(log2 L)`` slots (where
recomputation is still ``O(L log L)``; one slot on chains of at most ``SHORT_CHAIN`` stages); without a
budget it returns the lowest simulated peak among the fewest slot counts. Time
``O(L² · s)`` with numpy.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import SolverError
from ..graph import CostGraph
from . import Solution, register
from .chain_dp import chain_of, lower_chain_ops

__all__ = ["extra_forward_steps", "revolve_schedule", "revolve", "SHORT_CHAIN"]

#: Chains up to this many stages may use a single snapshot slot (quadratic recomputation).
SHORT_CHAIN = 64


def extra_forward_steps(length: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Tables ``p[l, s]`` (extra forward steps, ``l <= length``, ``s <= slots``) and the optimal first
    advance ``split[l, s]``."""
    p = np.zeros((length + 1, slots + 1))
    split = np.zeros((length + 1, slots + 1), dtype=np.int64)
    ls = np.arange(length + 1)
    p[:, 1] = ls * (ls - 1) / 2
    p[:, 0] = np.inf
    p[0, :] = 0
    for s in range(2, slots + 1):
        for l in range(2, length + 1):
            i = np.arange(1, l)
            costs = i + p[i, s] + p[l - i, s - 1]
            best = int(np.argmin(costs))
            p[l, s], split[l, s] = costs[best], best + 1
    return p, split


def revolve_schedule(length: int, slots: int) -> list[tuple[str, int]]:
    """Stage operations (``Fn``, ``Fe``, ``B``) of the optimal schedule for ``length`` stages."""
    if slots < 1:
        raise ValueError("revolve needs at least one snapshot slot")
    _, split = extra_forward_steps(length, slots)
    ops: list[tuple[str, int]] = []

    def reverse(first: int, last: int, s: int) -> None:
        count = last - first + 1
        if count == 1:
            ops.extend([("Fe", first), ("B", first)])
            return
        if s == 1:
            for k in range(last, first - 1, -1):
                ops.extend([("Fn", j) for j in range(first, k)] + [("Fe", k), ("B", k)])
            return
        advance = int(split[count, s])
        ops.extend(("Fn", j) for j in range(first, first + advance))
        reverse(first + advance, last, s - 1)
        reverse(first, first + advance - 1, s)

    reverse(0, length - 1, min(slots, length))
    return ops


@register("revolve")
def revolve(graph: CostGraph, budget_bytes: int | None = None, *, max_slots: int = 64) -> Solution:
    """Binomial checkpointing with as many slots as fit the budget (the least peak without a budget)."""
    if not graph.implicit_backward:
        raise SolverError(f"revolve needs a graph with implicit backward; {graph.name!r} has explicit "
                          "backward nodes (a Checkmate joint graph)")
    chain = chain_of(graph, max_stages=len(graph) + 1)
    length = len(chain.stages)
    slot_bytes = max(chain.cw[:length], default=0) or 1
    tape_bytes = max(chain.cbw[1:], default=0) + chain.cw[-1]
    most = min(max_slots, length)
    if budget_bytes is not None:
        most = max(1, min(most, int((budget_bytes - chain.fixed_bytes - sum(chain.pg) - tape_bytes) // slot_bytes)))

    def plan(slots: int) -> Solution:
        stage_ops = revolve_schedule(length, slots)
        extra = sum(1 for kind, _ in stage_ops if kind != "B") - length
        return Solution.of("revolve", graph, lower_chain_ops(graph, chain, stage_ops),
                           f"{length} stages, {slots} slots, {extra} extra stage forwards")

    # one slot recomputes O(L²) stages: allow it on short chains only
    fewest = 1 if length <= SHORT_CHAIN else min(most, math.ceil(math.log2(length)))
    if budget_bytes is None:
        return min((plan(s) for s in range(fewest, min(most, fewest + 3) + 1)),
                   key=lambda solution: (solution.peak_bytes, solution.recompute_cost))
    slots = most
    while True:
        solution = plan(slots)
        if solution.fits(budget_bytes) or slots <= fewest:
            return solution
        slots = max(fewest, slots * 3 // 4)
