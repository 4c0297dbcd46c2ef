"""``store_all``: recompute nothing (what plain autograd does). The baseline every plan is compared to."""
from __future__ import annotations

from ..graph import CostGraph
from ..schedule import Forward, insert_frees, lower_segments, store_all_lower_sets
from . import Solution, register


@register("store_all", graphs=("implicit", "joint"))
def store_all(graph: CostGraph, budget_bytes: int | None = None) -> Solution:
    """One segment, every node taped once; ignores the budget (callers check ``fits``). On a joint
    graph (explicit backward nodes): every node once in topological order, each value freed after its
    last reader (Checkmate's "checkpoint all", Moccasin's topological peak)."""
    if not graph.implicit_backward:
        schedule = insert_frees(graph, [Forward(v, tape=False) for v in range(len(graph))], [], outputs=())
        return Solution.of("store_all", graph, schedule, "no recomputation")
    return Solution.of("store_all", graph, lower_segments(graph, store_all_lower_sets(graph)),
                       "no recomputation")
