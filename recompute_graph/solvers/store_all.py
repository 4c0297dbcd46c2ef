"""``store_all``: recompute nothing (what plain autograd does). The baseline every plan is compared to."""
from __future__ import annotations

from ..graph import CostGraph
from ..schedule import lower_segments, store_all_lower_sets
from . import Solution, register


@register("store_all")
def store_all(graph: CostGraph, budget_bytes: int | None = None) -> Solution:
    """One segment, every node taped once; ignores the budget (callers check ``fits``)."""
    return Solution.of("store_all", graph, lower_segments(graph, store_all_lower_sets(graph)),
                       "no recomputation")
