"""Results computed from one :class:`~recompute_graph.graph.CostGraph`, kept while the graph lives.

A ``CostGraph`` is immutable, so anything derived from it alone (a DP's lower-set family and cost
tables, the planner's pool of candidate plans) can be computed once and reused for every budget. The
memo lives in the graph object itself (``MEMO_ATTRIBUTE``, outside its dataclass fields: equality,
``repr`` and pickling ignore it), so it goes when the graph goes. Pure Python: no torch.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, TypeVar

__all__ = ["memoized", "MEMO_ATTRIBUTE"]

MEMO_ATTRIBUTE = "_graph_memo"
T = TypeVar("T")


def memoized(graph: object, key: Hashable, build: Callable[[], T]) -> T:
    """``build()`` the first time ``(graph, key)`` is asked for, the same object afterwards."""
    memo: dict[Hashable, Any] = graph.__dict__.setdefault(MEMO_ATTRIBUTE, {})
    if key not in memo:
        memo[key] = build()
    return memo[key]
