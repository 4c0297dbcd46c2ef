"""Planning: a cost graph and a budget -> the best schedule that fits, as a :class:`RecomputePlan`.

Pure Python (no torch). Budgets (see docs/concepts.md): an ``int`` number of bytes, a size string
(``"1.5GiB"``, ``"800MB"``) or a ``float`` in (0, 1], a fraction of the budget store-all needs (its
predicted peak plus the planning margin), so that ``1.0`` always fits.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Iterator

from .collector import full_collections_deferred
from .errors import InfeasibleBudgetError, SolverError
from .forked_work import run_queued
from .graph import CostGraph, is_joint_cost_graph
from .graph_memo import memoized
from .schedule import Schedule
from .schedule_passes import keep_free_tapes
from .simulate import SimulationResult
from .solvers import SOLVERS, Solution, collecting_plans, get_solver, solvers_for
from .solvers.chain_dp import FINE_MAX_STAGES, FINE_REFINE_ABOVE, chain_of
from .solvers.lower_set_dp import dp_for
from .step_budget import (PLANNING_MARGIN, budget_with_loss_allowance, loss_allowance_bytes, loss_peak_bytes,
                          min_budget_for_peak, min_budget_for_step, planning_margin, step_peak_bytes,
                          usable_bytes_of)
from .units import Budget, format_bytes, parse_budget

__all__ = ["Budget", "parse_budget", "RecomputePlan", "make_plan", "make_plan_for_call", "AUTO_SOLVERS",
           "auto_solvers",
           "min_feasible_budget", "reproducible_floor_bytes", "replan_schedule", "plan_from_solution",
           "loss_allowance_bytes", "usable_bytes_of", "PLANNING_MARGIN", "min_budget_for_peak", "loss_peak_bytes",
           "planning_margin", "step_peak_bytes", "min_budget_for_step", "candidate_pool", "POOL_FRACTIONS",
           "steady_plans", "TIME_INDEPENDENT_SOLVERS",
           "POOL_FRACTIONS_LARGE", "LARGE_GRAPH_NODES", "pool_fractions", "LOWER_SET_DP_MAX_NODES"]

#: The baselines ``solver="auto"`` always runs besides a lower-set DP (the best feasible answer wins).
AUTO_SOLVERS = ("store_all", "chen_greedy", "chen_sqrt")
#: ``solver="auto"`` chooses from a pool of plans fixed per graph (``candidate_pool``): each of its
#: solvers at these fractions of the store-all budget, and at its lowest peak. A budget on the grid
#: gets every plan a solver makes for it; one between grid points, the plans of the points below it.
POOL_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
#: The grid for graphs of more than ``LARGE_GRAPH_NODES`` nodes, where one lower-set DP run takes seconds
#: (a 48-layer GPT-2-XL-wide decoder, 1,591 nodes: 2-4 s per run, two runs per budget). 0.3 is on it: without
#: it, the decoder's compiler-path pool jumped from 27.6 GiB (+32.7 %) to 54 GiB (+24.4 %), which
#: relaxation does not bridge (``python scripts/scale_meta.py --compiler --layers 48 --budget 0.3``,
#: docs/benchmarks.md; planning about 6 s longer).
POOL_FRACTIONS_LARGE = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2)
LARGE_GRAPH_NODES = 1000
#: Below the grid the pool goes on geometrically, by this ratio, down to this fraction (``pool_fractions``).
POOL_BELOW_GRID_RATIO = 0.7
#: Budgets just above each solver's floor the pool also plans at (fractions above it): the grid's points
#: can be far apart there, where a little memory buys the most (ResNet-50's joint graph: the chain_dp floor
#: at 250 MiB and +51 % compute, the next grid point's plan at 275 MiB; at 260 MiB, +42 %)
POOL_ABOVE_FLOOR = (0.04,)
POOL_LOWEST_FRACTION = 0.01
#: Above this many nodes ``solver="auto"`` leaves dp_approx out when chain_dp can plan the graph (an LSTM
#: unrolled over 1,000 steps has a joint graph of 17,000 units; dp_approx did not finish in 30 minutes).
LOWER_SET_DP_MAX_NODES = 5000


def _fits_step(graph: CostGraph, solution: Solution, budget_bytes: int) -> bool:
    return min_budget_for_step(graph, solution.simulation) <= budget_bytes


def auto_solvers(graph: CostGraph) -> tuple[str, ...]:
    """``solver="auto"``: the baselines, plus dp_exact when the graph has at most
    ``lower_set_dp.AUTO_EXACT_LIMIT`` lower sets (else dp_approx, left out above
    ``LOWER_SET_DP_MAX_NODES`` nodes when chain_dp runs), plus chain_dp when the graph linearizes into at
    least three stages (``chain_dp.chain_of``, made once and reused by chain_dp), plus chain_dp_fine on a
    joint cost graph whose finer chain differs from chain_dp's (those whose split candidates leave wide stages,
    such as ResNet-50's or GPT-2's; neither chain's plans dominate the other's). The baselines stay
    because the DPs' cost models for traced graphs are estimates: the simulator picks the best plan.
    Checkmate joint graphs (explicit backward nodes): store_all and the two heuristics, evict and shave."""
    if not graph.implicit_backward:
        return ("store_all", "evict", "shave")
    dp = dp_for(graph)
    chain = ("chain_dp",) if dp and len(chain_of(graph).stages) >= 3 else ()
    if (chain and is_joint_cost_graph(graph)
            and chain_of(graph, FINE_MAX_STAGES, FINE_REFINE_ABOVE).stages != chain_of(graph).stages):
        chain += ("chain_dp_fine",)
    if chain and dp == "dp_approx" and len(graph) > LOWER_SET_DP_MAX_NODES:
        dp = None  # O(n²) per run, a dozen runs: half an hour at 17,000 nodes, where chain_dp takes seconds
    return AUTO_SOLVERS + ((dp,) if dp else ()) + chain

@dataclass(frozen=True)
class RecomputePlan:
    """The chosen schedule and what the simulator predicts for it.

    ``predicted_compute_overhead`` = recomputation time / store-all compute time (0.25 = 25 % more).
    """

    solver: str
    budget_bytes: int
    predicted_peak_bytes: int
    store_all_peak_bytes: int
    predicted_compute_overhead: float
    schedule: Schedule = field(repr=False)
    simulation: SimulationResult = field(repr=False)
    graph: CostGraph = field(repr=False)
    description: str = ""

    @property
    def recomputed_nodes(self) -> tuple[int, ...]:
        return self.schedule.recomputed_nodes()

    @property
    def predicted_step_peak_bytes(self) -> int:
        """The peak of a whole step, the loss included at its moment: the simulator's peak, or the
        loss's transient bytes (``loss_allowance_bytes``) on top of what is live when the output
        gradients arrive, whichever is higher (``step_peak_bytes``): at most ``predicted_peak_bytes``
        plus the allowance, and lower when the step's peak lies inside the backward."""
        return step_peak_bytes(self.graph, self.simulation)

    @property
    def min_budget_bytes(self) -> int:
        """The smallest budget this plan fits (``min_budget_for_step``)."""
        return min_budget_for_step(self.graph, self.simulation)

    def save(self, path: str) -> None:
        """Write the plan as JSON, with the cost graph and its structure fingerprint (saved_plans.py);
        ``optimize(model, budget, plan=path)`` reuses it when the model still matches."""
        from .saved_plans import save_plan
        save_plan(self, path)

    @classmethod
    def load(cls, path: str) -> "RecomputePlan":
        """A plan written by ``save``; PlanFileError when the file is missing or not a valid plan."""
        from .saved_plans import load_plan
        return load_plan(path)

    def one_line(self) -> str:
        return (f"{self.solver}: peak {format_bytes(self.predicted_peak_bytes)} of budget "
                f"{format_bytes(self.budget_bytes)} (store-all {format_bytes(self.store_all_peak_bytes)}), "
                f"+{self.predicted_compute_overhead:.1%} compute")

    def __str__(self) -> str:
        change = self.predicted_peak_bytes / self.store_all_peak_bytes - 1 if self.store_all_peak_bytes else 0.0
        rows = [
            ("solver", f"{self.solver} ({self.description})" if self.description else self.solver),
            ("budget", format_bytes(self.budget_bytes)),
            ("predicted peak", f"{format_bytes(self.predicted_peak_bytes)} ({change:+.1%} vs store-all)"
                               + (f"; the step {format_bytes(step)}, the loss at its moment"
                                  if (step := self.predicted_step_peak_bytes) != self.predicted_peak_bytes else "")),
            ("store-all peak", format_bytes(self.store_all_peak_bytes)),
            ("compute overhead", f"+{self.predicted_compute_overhead:.1%}"),
            ("recomputed nodes", f"{len(self.recomputed_nodes)} of {len(self.graph)}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "RecomputePlan\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def run_solver(name: str, graph: CostGraph, budget_bytes: int | None, variant: str = "time") -> Solution:
    """Call solver ``name``; ``variant`` ("time" or "memory") reaches the solvers that have one.

    When the schedule does not fit ``budget_bytes`` (or there is no budget: the lowest peak is asked
    for), ``schedule_passes.keep_free_tapes`` gets a try, and its schedule is returned when its peak is
    lower. A schedule that fits is returned as the solver made it: the pass would also save some
    recomputation, but it takes tapes out of the executor's fused backward runs, which cost more time
    than it saved on the small ResNet-50 (6–12 % slower, ``scripts/free_tapes_timing.py``)."""
    function = get_solver(name)
    if variant != "time" and "variant" in inspect.signature(function).parameters:
        solution = function(graph, budget_bytes, variant=variant)
    else:
        solution = function(graph, budget_bytes)
    if budget_bytes is not None and solution.fits(budget_bytes):
        return solution
    improved = keep_free_tapes(graph, solution.schedule)
    if improved is solution.schedule:
        return solution
    candidate = Solution.of(solution.solver, graph, improved,
                            f"{solution.description}; free tapes kept" if solution.description else
                            "free tapes kept")
    return candidate if candidate.peak_bytes < solution.peak_bytes else solution


def make_plan(graph: CostGraph, budget: Budget, solver: str = "auto", *, variant: str = "time") -> RecomputePlan:
    """The best schedule for ``graph`` within ``budget``; InfeasibleBudgetError (with the smallest
    feasible budget) when none fits. ``variant`` is passed to the lower-set DPs.

    A named solver plans for ``budget`` itself. ``"auto"`` takes the plan that recomputes least among
    those of ``candidate_pool(graph)`` whose step fits ``budget`` (``min_budget_for_step``; ties: the
    lower step peak, then the pool's order). The pool does not depend on the budget, so the chosen
    plan's predicted peak never grows as the budget shrinks: a plan chosen at a budget that still fits a
    smaller one is chosen there too, and any other plan chosen there fits the smaller budget. (Choosing
    among each solver's plans for the budget itself is not monotone: the small U-Net compiled, 80 % of
    store-all gave 732.9 KB, 70 % gave 744.5 KB.)"""
    if solver == "auto":
        return _plan_from_pool(graph, budget, variant)
    parse_budget(budget)
    get_solver(solver)  # unknown names fail before any work
    if solver not in solvers_for(graph):
        kind_name = "an implicit backward" if graph.implicit_backward else "explicit backward nodes"
        raise SolverError(f"solver {solver!r} does not take graph {graph.name!r}, which has {kind_name}; "
                          f"use one of: {', '.join(solvers_for(graph))}")
    store_all, budget_bytes = _store_all_and_budget(graph, budget)
    store_all_cost = store_all.simulation.compute_cost
    usable_bytes = usable_bytes_of(budget_bytes, loss_allowance_bytes(graph), planning_margin(graph))
    chosen, failure = None, None
    try:
        chosen = store_all if solver == "store_all" else run_solver(solver, graph, usable_bytes, variant)
    except SolverError as error:  # e.g. a heuristic that finds nothing at this budget (evict, shave)
        failure = error
    if (chosen is None or not chosen.fits(usable_bytes)) and loss_allowance_bytes(graph) > 0:
        chosen = _plan_for_the_step(graph, solver, budget_bytes, variant) or chosen
    if chosen is None or not _fits_step(graph, chosen, budget_bytes):
        try:
            smallest = min_feasible_budget(graph, solver, variant=variant)
        except SolverError:
            if failure is None:
                raise
            raise failure from None  # the solver cannot plan this graph at all: its own message
        raise _infeasible(graph, solver, budget_bytes, smallest, store_all) from None
    return _plan(chosen, graph, budget_bytes, store_all, store_all_cost)


def candidate_pool(graph: CostGraph, variant: str = "time") -> tuple[Solution, ...]:
    """The plans ``solver="auto"`` chooses from, made once per graph (``graph_memo``): store-all, and
    each other solver of ``auto_solvers(graph)`` at its lowest peak and at every fraction of
    ``pool_fractions`` of the store-all budget down to its floor. At each fraction a solver plans for the
    budget less the loss allowance and the margin (``usable_bytes_of``), and, when that plan does not fit it,
    for the budget less the margin only (its step may still fit: a language model's loss on its logits
    is held at the end of the forward, the step's peak lies in the backward). Each solver also plans
    at ``POOL_ABOVE_FLOOR`` budgets just above its floor. Every plan the model-based solvers simulate on
    the way (``solvers.collecting_plans``) joins the pool, and only the plans no other beats in both least
    budget and recomputation are kept (``_undominated``), each schedule once. A graph with measured
    times and ``estimated_costs`` also gets the plans of ``ESTIMATED_TIMES_SOLVERS`` made on the
    estimated times (``estimated_times_graph``), priced with the measured ones. On a joint cost graph each
    kept plan is then relaxed (``_relaxed_pool``) and the undominated of both kept."""
    return memoized(graph, ("planner.candidate_pool", variant), lambda: _build_pool(graph, variant))


def store_all_plan(graph: CostGraph) -> Solution:
    """The store-all plan of ``graph``, solved and simulated once per graph (every solver's grid, the pool
    and the budget's parsing ask for it; forked pool workers inherit it)."""
    return memoized(graph, ("planner.store_all",), lambda: SOLVERS["store_all"](graph, None))


def _build_pool(graph: CostGraph, variant: str) -> tuple[Solution, ...]:
    """The pool, each solver a task for ``forked_work.run_queued`` when the graph is large (heaviest
    first, ``POOL_SOLVER_WEIGHTS``); the same plans as one process makes, in the same order: each
    solver's task keeps what no plan of its own beats (``_solver_pool``), and what a task drops no plan of
    the whole pool would keep either."""
    store_all = store_all_plan(graph)
    names = [name for name in auto_solvers(graph) if name != "store_all"]
    order = sorted(names, key=lambda n: -POOL_SOLVER_WEIGHTS.get(n, 0.5))
    estimated = estimated_times_graph(graph)
    second = [name for name in order if name in ESTIMATED_TIMES_SOLVERS] if estimated is not None else []
    tasks = [functools.partial(_solver_pool, graph, name, variant) for name in order]
    tasks += [functools.partial(_estimated_times_plans, graph, estimated, name, variant) for name in second]
    with full_collections_deferred():
        results = _run_tasks(graph, tasks)
    by_solver = dict(zip(order, results))
    pool = {store_all.schedule: store_all}
    for index in (0, 1):  # each solver's plans at the grid's budgets, then those simulated on the way
        for name in names:
            for solution in by_solver[name][index]:
                pool.setdefault(solution.schedule, solution)
    for plans in results[len(order):]:  # then those planned on the estimated times
        for solution in plans:
            pool.setdefault(solution.schedule, solution)
    if second:  # the plans the measured times do not decide (``steady_plans``)
        steady = [s for name in names if name in TIME_INDEPENDENT_SOLVERS for s in by_solver[name][0]]
        steady += [solution for plans in results[len(order):] for solution in plans]
        memoized(graph, ("planner.steady_plans", variant), lambda: _undominated(graph, [store_all, *steady]))
    return _relaxed_pool(graph, _undominated(graph, list(pool.values())))


#: The solvers whose plans do not depend on the nodes' times (chen_greedy's candidates are cut by bytes)
TIME_INDEPENDENT_SOLVERS = ("store_all", "chen_sqrt", "chen_greedy")


def reproducible_floor_bytes(graph: CostGraph, variant: str = "time") -> int:
    """The least budget of the pool's plans that the nodes' measured times do not decide: those of
    ``TIME_INDEPENDENT_SOLVERS`` and those made on the estimated times (``estimated_times_graph``). A
    capture measures the times anew, and a plan made on them can be missing from the next pool (a fuzzed
    network's floor went from 239,106 to 256,310 B between two plannings), so this is the floor an
    ``InfeasibleBudgetError`` names: planning the same model at it again always finds a plan. At or above
    ``min_feasible_budget(graph)``, by about 1 % on the conformance models; the same on a graph without
    estimated times (times from FLOPs, or a file), whose plans all repeat."""
    return min(min_budget_for_step(graph, s.simulation) for s in steady_plans(graph, variant))


def steady_plans(graph: CostGraph, variant: str = "time") -> tuple[Solution, ...]:
    """The plans of ``candidate_pool`` making that the nodes' measured times do not decide, the undominated
    of them: store-all, those of ``TIME_INDEPENDENT_SOLVERS`` and those made on the estimated times
    (``estimated_times_graph``). A new capture makes them again, schedule for schedule. On a graph without
    estimated times (times from FLOPs, or a file) every plan repeats: the pool itself. A broken step
    (``step_graphs.choose_step_plans``) adds them to each graph's candidates for the same reason."""
    pool = candidate_pool(graph, variant)  # builds the steady plans where the times are measured
    return memoized(graph, ("planner.steady_plans", variant), lambda: pool)


#: The solvers the pool also runs on the estimated times (``estimated_times_graph``): those whose plans
#: follow the times. BLOOM's joint graph (``models_zoo.third_party``) with measured times: chain_dp's and
#: chain_dp_fine's lowest plans need 207,258 and 215,591 B, on the estimated times 192,327 B both, priced
#: with the measured ones (the same schedule simulates to the same bytes on either).
ESTIMATED_TIMES_SOLVERS = ("chain_dp", "chain_dp_fine", "dp_exact", "dp_approx")


def estimated_times_graph(graph: CostGraph) -> CostGraph | None:
    """``graph`` with the FLOP roofline's times (``CostGraph.estimated_costs``) in place of the measured
    ones, made once per graph; None when it has none. Its plans are schedules of ``graph`` too (same
    nodes, same bytes), and the pool prices them on ``graph``: a second opinion on which recomputations
    pay, steadier between captures than times measured on a busy machine."""
    if not graph.estimated_costs:
        return None

    def build() -> CostGraph:
        nodes = tuple(dataclasses.replace(node, forward_cost=costs[0], backward_cost=costs[1],
                                          recompute_cost=costs[2] if len(costs) > 2 else None)
                      for node, costs in zip(graph.nodes, graph.estimated_costs))
        return dataclasses.replace(graph, nodes=nodes, estimated_costs=(),
                                   cost_source=f"flop-estimate beside {graph.cost_source}")
    return memoized(graph, ("planner.estimated_times_graph",), build)


def _estimated_times_plans(graph: CostGraph, estimated: CostGraph, name: str, variant: str) -> list[Solution]:
    """Solver ``name``'s plans on ``estimated`` (``_solver_grid``), each simulated on ``graph``."""
    plans = _solver_grid(estimated, name, variant).values()
    return [Solution.of(p.solver, graph, p.schedule, f"{p.description}; planned on estimated times".lstrip("; "))
            for p in plans]


def _run_tasks(graph: CostGraph, tasks: list) -> list:
    """The tasks' results, over the cores (``forked_work.run_queued``) from ``POOL_FORK_NODES`` nodes on."""
    return run_queued(tasks) if len(graph) >= POOL_FORK_NODES else [task() for task in tasks]


#: ``_relaxed_pool`` relaxes each plan up to this fraction above its own least budget too (a plan at
#: 255.4 MiB on ResNet-50's joint graph: 259.4 MiB at +31.0 % within 2 %, 260.9 at +30.5 % within 5 %)
RELAX_STEP = 0.02


def _relaxed_pool(graph: CostGraph, pool: tuple[Solution, ...]) -> tuple[Solution, ...]:
    """On a joint cost graph (the compiler path), ``pool`` with each plan relaxed
    (``schedule_relaxation``) up to the least budget of the next plan, which recomputes less, and up to
    ``RELAX_STEP`` above its own when that is less; split between processes as the solvers are; the
    plans no other beats. ``auto`` picks the least recomputing plan that fits, so each relaxed plan takes
    the budgets between its own plan's and the next one's."""
    if not (is_joint_cost_graph(graph) and graph.implicit_backward) or len(pool) < 2:
        return pool
    budgets = [min_budget_for_step(graph, plan.simulation) for plan in pool]
    jobs = [(plan, target) for index, plan in enumerate(pool[:-1]) if plan.recompute_cost > 0
            for target in sorted({min(int(budgets[index] * (1 + RELAX_STEP)), budgets[index + 1] - 1),
                                  budgets[index + 1] - 1})]
    if not jobs:
        return pool
    with full_collections_deferred():
        relaxed = _run_tasks(graph, [functools.partial(_relax_plan, graph, plan, budget) for plan, budget in jobs])
    return _undominated(graph, list(pool) + [plan for plan in relaxed if plan is not None])


def _relax_plan(graph: CostGraph, plan: Solution, budget_bytes: int) -> Solution | None:
    """``plan`` relaxed within ``budget_bytes`` (``min_budget_for_step``), or None."""
    from .schedule_relaxation import relax_recomputations
    found = relax_recomputations(graph, plan.schedule, plan.simulation,
                                 lambda simulation: min_budget_for_step(graph, simulation) <= budget_bytes,
                                 usable_bytes_of(budget_bytes, 0, planning_margin(graph)),
                                 loss_allowance_bytes=loss_allowance_bytes(graph))
    return None if found is None else Solution(plan.solver, found[0], found[1],
                                               f"{plan.description}; relaxed".lstrip("; "))


#: Rough relative seconds of a solver's share of a large graph's pool (others: 0.5): the pool's tasks run
#: heaviest first (joint graphs, one process each: the 48-layer decoder's dp_approx 8.5 s, chain_dp 3.2,
#: chen_greedy 1.5, chen_sqrt 0.8; GPT-2 small's chain_dp_fine 3.8, chain_dp 1.1, dp_approx 0.7)
POOL_SOLVER_WEIGHTS = {"dp_exact": 3.0, "dp_approx": 3.0, "chain_dp": 2.0, "chain_dp_fine": 4.0, "chen_greedy": 1.0}
#: Graphs of fewer nodes build their pool in one process (a fork and the plans' pickling cost more than
#: the solvers take)
POOL_FORK_NODES = 100


def _solver_pool(graph: CostGraph, name: str, variant: str) -> tuple[list[Solution], list[Solution]]:
    """Solver ``name``'s plans at the grid's budgets (``_solver_grid``) and those it simulated on the way
    (``collecting_plans``), less the plans another of them beats (``_undominated``): a plan its own
    solver beats is beaten in the whole pool."""
    with collecting_plans() as seen:
        grid = list(_solver_grid(graph, name, variant).values())
    merged: dict[Schedule, Solution] = {}
    for solution in grid + seen:
        merged.setdefault(solution.schedule, solution)
    kept = {solution.schedule for solution in _undominated(graph, list(merged.values()))}
    return [s for s in grid if s.schedule in kept], [s for s in seen if s.schedule in kept]


def _undominated(graph: CostGraph, plans: list[Solution]) -> tuple[Solution, ...]:
    """The plans no other beats: each recomputes less than every plan of a smaller or equal least budget
    (``min_budget_for_step``, the test ``auto`` applies; not the step peak alone, which a plan of lower
    step peak but higher simulated peak can lose on). ``auto`` picks the least recomputing plan that fits,
    so only these are ever picked."""
    kept: list[Solution] = []
    for plan in sorted(plans, key=lambda s: (min_budget_for_step(graph, s.simulation), s.recompute_cost)):
        if not kept or plan.recompute_cost < kept[-1].recompute_cost:
            kept.append(plan)
    return tuple(kept)


def _solver_grid(graph: CostGraph, name: str, variant: str) -> dict[Schedule, Solution]:
    """Solver ``name``'s plans at its floor and at the grid's budgets down to it (``candidate_pool``)."""
    store_all = store_all_plan(graph)
    allowance, margin = loss_allowance_bytes(graph), planning_margin(graph)
    store_all_budget = budget_with_loss_allowance(graph, store_all.simulation)
    pool: dict[Schedule, Solution] = {}
    try:
        floor = run_solver(name, graph, None, variant)
    except SolverError:  # a heuristic that finds nothing without a budget: try each budget
        floor_budget = 0
    else:
        pool.setdefault(floor.schedule, floor)
        floor_budget = min_budget_for_step(graph, floor.simulation)
    above_floor = [int(floor_budget * (1 + step)) for step in POOL_ABOVE_FLOOR] if floor_budget else []
    budgets = sorted({int(f * store_all_budget) for f in pool_fractions(graph)}.union(above_floor),
                     reverse=True)
    for budget_bytes in budgets:
        if budget_bytes < floor_budget:
            break
        usable = usable_bytes_of(budget_bytes, allowance, margin)
        for solver_budget in dict.fromkeys((usable, usable_bytes_of(budget_bytes, 0, margin))):
            try:
                solution = run_solver(name, graph, solver_budget, variant)
            except SolverError:
                break
            pool.setdefault(solution.schedule, solution)
            if solution.fits(usable):
                break
    return pool


def pool_fractions(graph: CostGraph) -> Iterator[float]:
    """The fractions of the store-all budget the pool plans at: ``POOL_FRACTIONS`` (``POOL_FRACTIONS_LARGE``
    above ``LARGE_GRAPH_NODES`` nodes), then on down by ``POOL_BELOW_GRID_RATIO`` to ``POOL_LOWEST_FRACTION``
    (the pool stops at each solver's floor). Without the tail, a budget under the grid's last point got
    the floor plan only: an LSTM over 1,000 steps at 5 % of its activations ran the floor's 260 stage
    recomputations, where a plan for 5 % needs about 60."""
    grid = POOL_FRACTIONS if len(graph) <= LARGE_GRAPH_NODES else POOL_FRACTIONS_LARGE
    yield from grid
    fraction = grid[-1] * POOL_BELOW_GRID_RATIO
    while fraction >= POOL_LOWEST_FRACTION:
        yield fraction
        fraction *= POOL_BELOW_GRID_RATIO


def _plan_from_pool(graph: CostGraph, budget: Budget, variant: str) -> RecomputePlan:
    """``make_plan(graph, budget, "auto")``: the least recomputing plan of the pool whose step fits."""
    store_all, budget_bytes = _store_all_and_budget(graph, budget)
    pool = candidate_pool(graph, variant)
    fitting = [s for s in pool if _fits_step(graph, s, budget_bytes)]
    if not fitting:
        lowest = min(min_budget_for_step(graph, s.simulation) for s in pool)
        raise _infeasible(graph, "auto", budget_bytes, reproducible_floor_bytes(graph, variant), store_all, lowest)
    chosen = min(fitting, key=lambda s: (s.recompute_cost, step_peak_bytes(graph, s.simulation)))
    return _plan(chosen, graph, budget_bytes, store_all, store_all.simulation.compute_cost)


def make_plan_for_call(graph: CostGraph, budget: Budget, solver: str = "auto", *,
                       earlier_bytes: int = 0) -> RecomputePlan:
    """:func:`make_plan` for one call signature (input shapes) of a module whose earlier signatures were
    planned at up to ``earlier_bytes`` (0 for its first). A fraction is of this signature's own store-all
    step. Where that fraction is below this graph's smallest feasible budget and the smallest fits
    ``earlier_bytes`` (the last, smaller batch of an epoch: its parameters and gradients outweigh its
    activations, and half its store-all step is below any plan), the plan is made at ``earlier_bytes``
    instead: the memory the module was already planned to use. So a smaller call never fails where a
    larger one ran. A byte budget is the same for every signature."""
    try:
        return make_plan(graph, budget, solver)
    except InfeasibleBudgetError as error:
        floor = error.min_budget_bytes
        if parse_budget(budget)[0] != "fraction" or floor is None or not 0 < floor <= earlier_bytes:
            raise
        return make_plan(graph, earlier_bytes, solver)


def _infeasible(graph: CostGraph, solver: str, budget_bytes: int, smallest: int, store_all: Solution,
                lowest: int | None = None) -> InfeasibleBudgetError:
    """The error naming ``smallest``, and ``lowest`` where this planning's plans reach below it."""
    store_all_budget = budget_with_loss_allowance(graph, store_all.simulation)
    below = (f"; this planning's plans, on node times measured now, go down to {lowest} bytes, which can move "
             "when they are measured again" if lowest is not None and lowest < smallest else "")
    return InfeasibleBudgetError(
        f"no plan of {'any solver' if solver == 'auto' else repr(solver)} fits a budget of "
        f"{format_bytes(budget_bytes)} ({budget_bytes} bytes) for {graph.name!r}; the smallest feasible "
        f"budget is {format_bytes(smallest)} ({smallest} bytes, the fraction "
        f"{math.ceil(smallest / store_all_budget * 1000) / 1000:g} of what a store-all step needs{below}). "
        "Raise the budget or try another solver.",
        budget_bytes=budget_bytes, min_budget_bytes=smallest)


def _plan_for_the_step(graph: CostGraph, name: str, budget_bytes: int, variant: str) -> Solution | None:
    """A plan of solver ``name`` whose step peak, the loss at its moment, fits ``budget_bytes``
    (``min_budget_for_step``): the solver's plan at the budget less the margin only, else its lowest-peak
    plan; None when neither fits."""
    relaxed = usable_bytes_of(budget_bytes, 0, planning_margin(graph))
    for solver_budget in (relaxed, None):
        try:
            solution = run_solver(name, graph, solver_budget, variant)
        except SolverError:
            return None
        if _fits_step(graph, solution, budget_bytes):
            return solution
    return None


def _store_all_and_budget(graph: CostGraph, budget: Budget) -> tuple[Solution, int]:
    """The store-all solution and ``budget`` in bytes (a fraction is of the store-all budget)."""
    kind, value = parse_budget(budget)
    store_all = store_all_plan(graph)
    budget_bytes = (int(value * budget_with_loss_allowance(graph, store_all.simulation))
                    if kind == "fraction" else int(value))
    return store_all, budget_bytes


def replan_schedule(saved: RecomputePlan, graph: CostGraph, budget: Budget) -> RecomputePlan:
    """``saved``'s schedule priced on ``graph`` (same structure, possibly other times) at ``budget``;
    whether it fits is for the caller to check (``min_budget_for_peak``). A node the saved schedule
    recomputes that cannot be recomputed on ``graph`` is computed once (``Solution.of``)."""
    store_all, budget_bytes = _store_all_and_budget(graph, budget)
    description = f"reused saved plan: {saved.description}" if saved.description else "reused saved plan"
    chosen = Solution.of(saved.solver, graph, saved.schedule, description)
    return _plan(chosen, graph, budget_bytes, store_all, store_all.simulation.compute_cost)


def plan_from_solution(graph: CostGraph, chosen: Solution, budget_bytes: int) -> RecomputePlan:
    """``chosen`` (a plan of ``graph``) as a :class:`RecomputePlan` at ``budget_bytes`` (``step_graphs``:
    a graph's share of a step planned as a whole)."""
    store_all = store_all_plan(graph)
    return _plan(chosen, graph, budget_bytes, store_all, store_all.simulation.compute_cost)


def _plan(chosen: Solution, graph: CostGraph, budget_bytes: int, store_all: Solution,
          store_all_cost: float) -> RecomputePlan:
    return RecomputePlan(
        solver=chosen.solver, budget_bytes=budget_bytes, predicted_peak_bytes=chosen.peak_bytes,
        store_all_peak_bytes=store_all.peak_bytes,
        predicted_compute_overhead=chosen.simulation.overhead(store_all_cost),
        schedule=chosen.schedule, simulation=chosen.simulation, graph=graph, description=chosen.description)


def min_feasible_budget(graph: CostGraph, solver: str = "auto", *, variant: str = "time") -> int:
    """The smallest budget ``make_plan(graph, budget, solver)`` accepts: that of the lowest-peak plan
    of the solver (``min_budget_for_step``), or of ``candidate_pool`` for ``"auto"``."""
    if solver == "auto":
        return min(min_budget_for_step(graph, s.simulation) for s in candidate_pool(graph, variant))
    return min_budget_for_step(graph, run_solver(solver, graph, None, variant).simulation)
