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

__all__ = ["Solution", "SOLVERS", "GRAPH_KINDS", "get_solver", "register", "solvers_for", "best_of",
           "simulator_checked"]


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
#: Which graphs each solver takes: "implicit" (forward graphs whose backward is implicit: traced models,
#: Kusumoto's graphs) and/or "joint" (every node a computation, backward explicit: Checkmate's graphs).
GRAPH_KINDS: dict[str, tuple[str, ...]] = {}


def register(name: str, graphs: tuple[str, ...] = ("implicit",)) -> Callable[[SolverFunction], SolverFunction]:
    def add(function: SolverFunction) -> SolverFunction:
        SOLVERS[name] = function
        GRAPH_KINDS[name] = graphs
        return function
    return add


def solvers_for(graph: CostGraph) -> list[str]:
    """The registered solvers that take ``graph`` (by its kind, see ``GRAPH_KINDS``)."""
    kind = "implicit" if graph.implicit_backward else "joint"
    return [name for name in SOLVERS if kind in GRAPH_KINDS[name]]


def get_solver(name: str) -> SolverFunction:
    """The registered solver ``name``; ValueError listing the names otherwise."""
    if name not in SOLVERS:
        raise ValueError(f"unknown solver {name!r}; available: {', '.join(sorted(SOLVERS))}")
    return SOLVERS[name]


def best_of(solutions: list[Solution], budget_bytes: int | None) -> Solution:
    """Least recomputation among those that fit (then the lower peak); the lowest peak if none fits or
    if there is no budget."""
    fitting = [s for s in solutions if s.fits(budget_bytes)]
    if fitting and budget_bytes is not None:
        return min(fitting, key=lambda s: (s.recompute_cost, s.peak_bytes))
    return min(solutions, key=lambda s: (s.peak_bytes, s.recompute_cost))


#: Multiples of a model's minimal budget whose plans are simulated to find the least simulated peak.
MIN_PEAK_SEARCH = (1.0, 1.15, 1.35)


def simulator_checked(plan: Callable[[float], "Solution | None"], budget_bytes: int | None,
                      minimal_model_budget: Callable[[], float], graph: CostGraph | None = None) -> Solution:
    """The bridge from a solver's own cost model to the simulator, for the model-based DPs.

    ``plan(model_budget)`` solves in the model and returns the simulated plan (None if the model finds
    nothing). With a budget, the plan at the budget itself is tried first; if its simulated peak does not
    fit, the model budget is bisected down to the largest one whose simulated plan fits. Without a budget
    (or when nothing fits) the lowest simulated peak among the plans at ``MIN_PEAK_SEARCH`` multiples of
    the model's minimal budget is returned; with ``graph``, those plans with
    ``schedule_passes.keep_free_tapes`` applied compete too.
    """
    if budget_bytes is not None:
        candidate = plan(float(budget_bytes))
        if candidate is not None and candidate.fits(budget_bytes):
            return candidate
    minimal = minimal_model_budget()
    tried = [p for p in (plan(minimal * factor) for factor in MIN_PEAK_SEARCH) if p is not None]
    smallest = min(tried, key=lambda s: (s.peak_bytes, s.recompute_cost))
    if graph is not None and (budget_bytes is None or not smallest.fits(budget_bytes)):
        # plans of equal peak can differ in what keeping free tapes saves them (the small ResNet-50's
        # chain_dp floor: 52.7 MB for the plan recomputing least, 47.8 MB for another): the pass decides
        tried += [s for s in (_with_free_tapes(graph, p) for p in tried) if s is not None]
        smallest = min(tried, key=lambda s: (s.peak_bytes, s.recompute_cost))
    if budget_bytes is None or not smallest.fits(budget_bytes):
        return smallest
    best, low, high = smallest, minimal, float(budget_bytes)
    while high - low > max(1.0, high * 1e-3):
        middle = (low + high) / 2
        candidate = plan(middle)
        if candidate is not None and candidate.fits(budget_bytes):
            best, low = candidate, middle
        else:
            high = middle
    return best


def _with_free_tapes(graph: CostGraph, solution: Solution) -> "Solution | None":
    """``solution`` with ``schedule_passes.keep_free_tapes`` applied, None when the pass changes nothing."""
    from ..schedule_passes import keep_free_tapes
    improved = keep_free_tapes(graph, solution.schedule)
    if improved is solution.schedule:
        return None
    return Solution.of(solution.solver, graph, improved,
                       f"{solution.description}; free tapes kept" if solution.description else "free tapes kept")


from . import chain_dp, chen, evict, ilp, lower_set_dp, peak_shaving, revolve, store_all  # noqa: E402,F401  (registers the solvers)
