"""Solvers: pure Python over the cost graph (no torch), one signature, one registry.

``solver(graph, budget_bytes) -> Solution``: the best schedule the solver can find whose simulated peak
fits ``budget_bytes``; with ``budget_bytes=None`` (or when nothing fits) the one with the smallest peak
it can find. Every answer is judged by :func:`recompute_graph.simulate.simulate`; ``Solution.simulation``
holds that verdict. Callers check ``solution.fits(budget)``.
"""
from __future__ import annotations

from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..graph import CostGraph
from ..schedule import Backward, Forward, FreeValue, Op, Schedule
from ..schedule_passes import computed_once
from ..simulate import SimulationResult, TimelinePoint, simulate

__all__ = ["Solution", "SOLVERS", "GRAPH_KINDS", "get_solver", "register", "solvers_for", "best_of",
           "simulator_checked", "collecting_plans"]


@dataclass(frozen=True)
class Solution:
    """A solver's answer: its schedule, the simulator's verdict, and a one-line description."""

    solver: str
    schedule: Schedule
    simulation: SimulationResult = field(repr=False)
    description: str = ""

    @classmethod
    def of(cls, solver: str, graph: CostGraph, schedule: Schedule, description: str = "") -> "Solution":
        """``schedule`` and its simulation on ``graph``; while ``collecting_plans()`` is open, a schedule
        simulated before on the same graph reuses that simulation (the pool's solvers meet the same
        schedule at neighbouring budgets: 27 of ResNet-152's 110 simulations). Nodes that cannot be
        recomputed are computed once in it first (``schedule_passes.computed_once``)."""
        schedule = computed_once(graph, schedule)
        if not _SIMULATED:
            return cls(solver, schedule, simulate(graph, schedule), description)
        simulations = _SIMULATED[-1]
        key = (id(graph), schedule)
        if key not in simulations:
            simulations[key] = (graph, simulate(graph, schedule))  # the graph held: its id stays its own
        return cls(solver, schedule, simulations[key][1], description)

    @property
    def peak_bytes(self) -> int:
        return self.simulation.peak_bytes

    @property
    def recompute_cost(self) -> float:
        return self.simulation.recompute_cost

    def fits(self, budget_bytes: int | None) -> bool:
        return budget_bytes is None or self.simulation.peak_bytes <= budget_bytes

    def __reduce__(self) -> tuple:
        """Pickled compactly: the planner's pool sends its plans from one process to another
        (``forked_work``), and a generic pickle of a plan's thousands of ops and timeline points took
        0.4 s for ResNet-152's. The ops go as integer codes, the timeline as arrays of its numbers; when
        loaded, its points refer to the schedule's ops again, as the simulator made them."""
        simulation = self.simulation
        timeline = simulation.timeline
        numbers = (simulation.peak_bytes, simulation.forward_peak_bytes, simulation.compute_cost,
                   simulation.recompute_cost, simulation.final_bytes, simulation.outputs_dropped_bytes)
        return (_unpacked_solution, (self.solver, self.description, _packed_ops(self.schedule.forward_ops),
                                     _packed_ops(self.schedule.backward_ops), numbers,
                                     bytes(point.phase == "forward" for point in timeline),
                                     array("q", [point.position for point in timeline]),
                                     array("q", [point.live_bytes for point in timeline]),
                                     array("q", [point.peak_bytes for point in timeline])))


_OP_KINDS = 4  # an op's code: node * _OP_KINDS + (0 Forward, 1 Forward without tape, 2 FreeValue, 3 Backward)


def _packed_ops(ops: tuple[Op, ...]) -> array:
    return array("q", [op.node * _OP_KINDS + (2 if isinstance(op, FreeValue) else 3 if isinstance(op, Backward)
                                              else 0 if op.tape else 1) for op in ops])


def _unpacked_ops(codes: array) -> tuple[Op, ...]:
    makers = (Forward, lambda node: Forward(node, tape=False), FreeValue, Backward)
    return tuple(makers[code % _OP_KINDS](code // _OP_KINDS) for code in codes)


def _unpacked_solution(solver: str, description: str, forward_codes: array, backward_codes: array,
                       numbers: tuple, forward_phase: bytes, positions: array, live: array, peaks: array
                       ) -> Solution:
    schedule = Schedule(_unpacked_ops(forward_codes), _unpacked_ops(backward_codes))
    timeline = tuple(TimelinePoint("forward", position, schedule.forward_ops[position], live_bytes, peak)
                     if forward else
                     TimelinePoint("backward", position, schedule.backward_ops[position] if position >= 0 else None,
                                   live_bytes, peak)
                     for forward, position, live_bytes, peak in zip(forward_phase, positions, live, peaks))
    peak_bytes, forward_peak_bytes, compute_cost, recompute_cost, final_bytes, dropped = numbers
    simulation = SimulationResult(peak_bytes=peak_bytes, forward_peak_bytes=forward_peak_bytes,
                                  compute_cost=compute_cost, recompute_cost=recompute_cost,
                                  final_bytes=final_bytes, timeline=timeline, outputs_dropped_bytes=dropped)
    return Solution(solver, schedule, simulation, description)


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


#: While ``collecting_plans()`` is open: every plan ``simulator_checked`` simulates, for the planner's pool
_COLLECTED: list[list["Solution"]] = []
#: ... and the simulations made, by graph and schedule (``Solution.of``)
_SIMULATED: list[dict[tuple[int, Schedule], tuple[CostGraph, SimulationResult]]] = []


@contextmanager
def collecting_plans() -> Iterator[list["Solution"]]:
    """Gather every plan the model-based solvers simulate on their way to an answer (the plans at the
    model budgets they try) into the yielded list: ``auto``'s pool keeps those that no other plan beats
    in both peak and recomputation. A schedule simulated twice in the block is simulated once
    (``Solution.of``)."""
    collected: list[Solution] = []
    _COLLECTED.append(collected)
    _SIMULATED.append({})
    try:
        yield collected
    finally:
        _COLLECTED.pop()
        _SIMULATED.pop()


def _collected(plan: Callable[[float], "Solution | None"]) -> Callable[[float], "Solution | None"]:
    if not _COLLECTED:
        return plan
    into = _COLLECTED[-1]

    def collecting(model_budget: float) -> "Solution | None":
        solution = plan(model_budget)
        if solution is not None:
            into.append(solution)
        return solution
    return collecting


def simulator_checked(plan: Callable[[float], "Solution | None"], budget_bytes: int | None,
                      minimal_model_budget: Callable[[], float], graph: CostGraph | None = None,
                      loosen: bool = False) -> Solution:
    """The bridge from a solver's own cost model to the simulator, for the model-based DPs.

    ``plan(model_budget)`` solves in the model and returns the simulated plan (None if the model finds
    nothing). With a budget, the plan at the budget itself is tried first; if its simulated peak does not
    fit, the model budget is bisected down to the largest one whose simulated plan fits. Without a budget
    (or when nothing fits) the lowest simulated peak among the plans at ``MIN_PEAK_SEARCH`` multiples of
    the model's minimal budget is returned; with ``graph``, those plans with
    ``schedule_passes.keep_free_tapes`` applied compete too.

    With ``loosen``, for a model that over-prices (chain_dp's charges a value open across several cuts
    at each), a plan at the budget that fits with room to spare is not the answer yet: :func:`_loosened`
    tries larger model budgets and keeps the least recomputing plan that still fits.
    """
    plan = _collected(plan)
    if budget_bytes is not None:
        candidate = plan(float(budget_bytes))
        if candidate is not None and candidate.fits(budget_bytes):
            return _loosened(plan, candidate, budget_bytes) if loosen else candidate
    minimal = minimal_model_budget()
    at_model = [(minimal * factor, plan(minimal * factor)) for factor in MIN_PEAK_SEARCH]
    tried = [p for _, p in at_model if p is not None]
    smallest = min(tried, key=lambda s: (s.peak_bytes, s.recompute_cost))
    if graph is not None and (budget_bytes is None or not smallest.fits(budget_bytes)):
        # plans of equal peak can differ in what keeping free tapes saves them (the small ResNet-50's
        # chain_dp floor: 52.7 MB for the plan recomputing least, 47.8 MB for another): the pass decides
        tried += [s for s in (_with_free_tapes(graph, p) for p in tried) if s is not None]
        smallest = min(tried, key=lambda s: (s.peak_bytes, s.recompute_cost))
    if budget_bytes is None or not smallest.fits(budget_bytes):
        return smallest
    if loosen and budget_bytes <= minimal:  # the model's floor lies above the budget, its plans fit
        model = next((m for m, p in at_model if p is smallest), None)  # None: the free-tapes pass's plan
        return smallest if model is None else _loosened(plan, smallest, budget_bytes, model)
    best, low, high = smallest, minimal, float(budget_bytes)
    while high - low > max(1.0, high * 1e-3):
        middle = (low + high) / 2
        candidate = plan(middle)
        if candidate is not None and candidate.fits(budget_bytes):
            best, low = candidate, middle
        else:
            high = middle
    return best


#: At most this many larger model budgets are tried for a plan that fits its budget with room to spare
LOOSEN_STEPS = 3
#: ... and none while its simulated peak is within this fraction of the budget
LOOSEN_SLACK = 0.01
#: The least growth of the first larger model budget, doubled at each step while plans fit
LOOSEN_FIRST_STEP = 0.04


def _loosened(plan: Callable[[float], "Solution | None"], fitting: Solution, budget_bytes: int,
              model_budget: float | None = None) -> Solution:
    """The least recomputing plan that fits ``budget_bytes`` among ``fitting`` (the model's plan at
    ``model_budget``, by default the budget) and those at up to ``LOOSEN_STEPS`` larger model budgets:
    each step scales the largest model budget whose plan fits by the room its simulated peak left
    (budget / peak), by at least ``LOOSEN_FIRST_STEP`` doubled at each step (a model's plans keep the same
    simulated peak over wide ranges of its budget: ResNet-50's chain_dp floor from 200 to 322 MiB of model
    budget, at +51 % down to +42 % compute), and, once a step does not fit, bisects between the two."""
    best, low, high = fitting, float(budget_bytes if model_budget is None else model_budget), None
    peak = fitting.peak_bytes
    for step in range(LOOSEN_STEPS):
        if high is None:
            if peak >= budget_bytes * (1 - LOOSEN_SLACK):
                break
            model = low * max(budget_bytes / max(peak, 1), 1 + LOOSEN_FIRST_STEP * 2 ** step)
        else:
            if high - low <= low * LOOSEN_SLACK:
                break
            model = (low + high) / 2
        candidate = plan(model)
        if candidate is not None and candidate.fits(budget_bytes):
            low, peak = model, candidate.peak_bytes
            if (candidate.recompute_cost, candidate.peak_bytes) < (best.recompute_cost, best.peak_bytes):
                best = candidate
        else:
            high = model
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
