"""Solvers: pure Python over the cost graph (no torch), one signature, one registry.

``solver(graph, budget_bytes) -> Solution``: the best schedule the solver can find whose simulated peak
fits ``budget_bytes``; with ``budget_bytes=None`` (or when nothing fits) the one with the smallest peak
it can find. Every answer is judged by :func:`recompute_graph.simulate.simulate`; ``Solution.simulation``
holds that verdict. Callers check ``solution.fits(budget)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..graph import CostGraph
from ..schedule import Schedule
from ..simulate import SimulationResult, simulate

__all__ = ["Solution", "SOLVERS", "get_solver", "register", "solve"]


@dataclass(frozen=True)
class Solution:
    """A solver's answer: its schedule, the simulator's verdict, and a one-line description."""

    solver: str
    schedule: Schedule
    simulation: SimulationResult = field(repr=False)
    description: str = ""

    @classmethod
    def of(cls, solver: str, graph: CostGraph, schedule: Schedule, description: str = "") -> "Solution":
        return cls(solver, schedule, simulate(graph, schedule), description)

    @property
    def peak_bytes(self) -> int:
        return self.simulation.peak_bytes

    @property
    def recompute_cost(self) -> float:
        return self.simulation.recompute_cost

    def fits(self, budget_bytes: int | None) -> bool:
        return budget_bytes is None or self.simulation.peak_bytes <= budget_bytes


SolverFunction = Callable[[CostGraph, "int | None"], Solution]
SOLVERS: dict[str, SolverFunction] = {}


def register(name: str) -> Callable[[SolverFunction], SolverFunction]:
    def add(function: SolverFunction) -> SolverFunction:
        SOLVERS[name] = function
        return function
    return add


def get_solver(name: str) -> SolverFunction:
    """The registered solver ``name``; ValueError listing the names otherwise."""
    if name not in SOLVERS:
        raise ValueError(f"unknown solver {name!r}; available: {', '.join(sorted(SOLVERS))}")
    return SOLVERS[name]


def solve(graph: CostGraph, budget_bytes: int | None, solver: str) -> Solution:
    return get_solver(solver)(graph, budget_bytes)


def best_of(solutions: list[Solution], budget_bytes: int | None) -> Solution:
    """Least recomputation among those that fit (then the lower peak); the lowest peak if none fits or
    if there is no budget."""
    fitting = [s for s in solutions if s.fits(budget_bytes)]
    if fitting and budget_bytes is not None:
        return min(fitting, key=lambda s: (s.recompute_cost, s.peak_bytes))
    return min(solutions, key=lambda s: (s.peak_bytes, s.recompute_cost))


from . import chain_dp, chen, lower_set_dp, revolve, store_all  # noqa: E402,F401  (registers the solvers)
