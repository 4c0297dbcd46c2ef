"""``ilp``: an exact solver for the general recomputation problem with OR-Tools CP-SAT.

The model (docs/ilp.md) works on graphs whose every node is one computation with one output: the joint
forward+backward graphs of Checkmate 2020 (``implicit_backward=False``). It is Checkmate's stage model,
with memory accounted the way the simulator accounts it:

* Stages ``t = 0..n-1``; stage ``t`` computes node ``t`` for the first time (``R[t][t] = 1``) after
  recomputing any earlier nodes it chooses (``R[t][i]``, ``i < t``), in node order. ``S[t][i]``: the value
  of ``i < t`` is live when stage ``t`` starts. Any value may be recomputed in any number of stages.
* Correctness: ``S[t+1][i] <= S[t][i] + R[t][i]``; ``R[t][j] <= R[t][i] + S[t][i]`` for every edge
  ``i -> j``. Tightness (no loss of optimality): a live value is never recomputed
  (``R[t][i] + S[t][i] <= 1``), a recomputed value is read in its stage or kept, and a kept value is read
  in the next stage or kept further, so live intervals are exactly those of eager freeing
  (``schedule.insert_frees``).
* Memory while stage ``t`` computes node ``k`` (inputs and output live, as in the simulator):
  ``U[t][k] = sum_i S[t][i] m_i + sum_{j<=k} R[t][j] m_j - sum_{j<k} sum_{i->j} m_i FREE[t][i->j] <= B``,
  where ``FREE[t][i->j]`` (i is freed right after j) is exactly ``R[t][j]`` and not kept and no later
  reader in the stage.
* Objective: ``sum_t sum_i c_i R[t][i]``, total compute (recomputation included).
* Extensions: ``passes`` stages per node (several recomputation sweeps between first computations);
  ``computed_once`` nodes; optional nodes with no stage of their own, computed only in a stage that
  computes their anchor (the tapes of ``ilp_backward``'s joint view). Each stage then ranges over its
  allowed nodes, and ``S`` over the nodes allowed in an earlier stage.

Memory is rounded up to units of ``max(1, B // MEMORY_UNITS)`` bytes and the budget down, so a schedule
feasible in the model fits the budget in bytes; costs are scaled to integers. The returned schedule's
simulated peak equals the model's ``max U`` (up to that rounding). Variables: ``n^2`` booleans for R and
S plus one per (stage, edge) for FREE (Checkmate's size, without its big-M hazards).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable

from ..errors import SolverError
from ..graph import CostGraph
from ..schedule import Forward, Schedule, insert_frees
from ..simulate import simulate
from . import Solution, register
from .ilp_backends import BACKENDS, make_backend

__all__ = ["ILPResult", "ilp", "solve_ilp", "solve_from_start", "schedule_from_stages", "default_hint",
           "recomputation_lower_bound",
           "MEMORY_UNITS", "BACKENDS"]

#: The budget is divided into at most this many memory units.
MEMORY_UNITS = 1_000_000
#: Compute costs are scaled so that the largest node costs this many integer units.
COST_UNITS = 10_000
#: The least time CP-SAT gets after the model is built, even when building used up the time limit.
MIN_SOLVE_SECONDS = 1.0
#: The share of the time limit kept for reading the solution back (ResNet-50's 224 k variables: about
#: 2 s after a 300 s solve).
READBACK_SHARE = 0.02


@dataclass
class ILPResult:
    """What a solve returned (``backend``: which solver). ``status``: OPTIMAL (proven), FEASIBLE (a
    schedule, optimality not proven), INFEASIBLE (proven: nothing fits the budget in the model) or UNKNOWN (nothing found in the
    time limit; when a fitting hint was given, the result is that hint with status FEASIBLE instead).
    ``objective`` and ``bound`` are total compute in the graph's cost unit; ``gap`` is
    ``(objective - bound) / objective``."""

    status: str
    schedule: Schedule | None
    objective: float | None
    bound: float | None
    solve_seconds: float
    model_peak_units: int | None = None     # the model's max U, in memory units
    memory_unit_bytes: int = 1
    variables: int = 0
    constraints: int = 0
    improvements: list[tuple[float, float]] = field(default_factory=list)  # (seconds, objective)
    backend: str = "cp-sat"
    note: str = ""                          # why the model was not built, when it was not
    start: Schedule | None = None           # the hint the solve started from

    @property
    def gap(self) -> float | None:
        if self.objective is None or self.bound is None or self.objective == 0:
            return None
        return max(0.0, (self.objective - self.bound) / self.objective)


def schedule_from_stages(graph: CostGraph, computed: list[list[int]]) -> Schedule:
    """The schedule of a stage solution: stage by stage, the computed nodes in node order, eager frees."""
    ops = [Forward(k, tape=False) for stage in computed for k in sorted(stage)]
    return insert_frees(graph, ops, [], outputs=())


def solve_ilp(graph: CostGraph, budget_bytes: int, *, time_limit: float = 60.0, workers: int = 2,
              hint: Schedule | None = None, progress: bool = False, log=None, passes: int = 1,
              parameters: dict | None = None, computed_once: "Iterable[int] | None" = None,
              optional_nodes: "dict[int, int] | None" = None, backend: str = "cp-sat",
              max_variables: int = 600_000) -> ILPResult:
    """Solve the stage model at ``budget_bytes`` with CP-SAT (module docstring).

    ``time_limit`` in seconds, for building the model and solving it (when building takes over half of
    it, building stops: with a fitting hint, the hint is returned as FEASIBLE with the bound "every node
    once plus ``recomputation_lower_bound``" and a ``note``; without one, SolverError), ``workers``
    search threads,
    ``hint`` a feasible schedule to start from
    (its stage form becomes the solution hint; the result is never worse than a hint that fits),
    ``progress`` prints each improving solution to ``log`` (stderr by default). ``passes``: recomputation
    sweeps between two first computations (1 is Checkmate's frontier-advancing model; k allows a node
    to be recomputed k times between them, in k node-ordered sweeps). ``parameters``: CP-SAT parameters
    to set (``{"optimize_with_core": True}``, ...). ``computed_once``: nodes that must not be recomputed
    (the backward nodes of a joint view: a backward runs once). ``optional_nodes``: ``{node: anchor}``,
    nodes with no stage of their own, computed (at least once, as their readers require) only in a
    stage that also computes their anchor, after it (the tapes of a joint view). ``backend``: "cp-sat"
    (default) or a MIP solver through pywraplp, "scip", "highs" or "cbc" (``ilp_backends.py``);
    ``parameters`` are then solver-specific "name = value" settings. ``max_variables``: a model larger than
    this is not built either (RL500 has about 0.8 M variables: with a 300 s limit the call took about
    400 s here, and CP-SAT did not improve its hint).
    """
    if graph.implicit_backward:
        raise SolverError(f"solve_ilp works on graphs whose every node is a computation, with backward "
                          f"nodes explicit (Checkmate joint graphs); {graph.name!r} has an implicit backward: "
                          "use the ilp solver (it goes through the graph's joint view), or dp_exact")
    entered = time.perf_counter()  # the time limit covers building the model and solving it
    model = make_backend(backend)  # fails early when OR-Tools or the solver is missing
    n = len(graph)
    unit = max(1, budget_bytes // MEMORY_UNITS)
    memory = [math.ceil(node.output_bytes / unit) for node in graph.nodes]
    budget = budget_bytes // unit
    largest_cost = max((node.recomputation_cost for node in graph.nodes), default=0.0)
    integral = all(float(node.recomputation_cost).is_integer() for node in graph.nodes) and largest_cost <= 10**9
    scale = 1.0 if integral or largest_cost <= 0 else COST_UNITS / largest_cost
    cost = [int(round(node.recomputation_cost * scale)) for node in graph.nodes]
    successors = [sorted(node.successors) for node in graph.nodes]
    predecessors = [sorted(node.predecessors) for node in graph.nodes]

    passes = max(1, int(passes))
    optional = dict(optional_nodes or {})            # node -> anchor: computed only with its anchor
    once = set(computed_once or ())
    fronts = [i for i in range(n) if i not in optional]
    count = len(fronts) * passes
    frontier = [fronts[sigma // passes] for sigma in range(count)]
    first = [sigma % passes == passes - 1 for sigma in range(count)]
    allowed: list[list[int]] = []
    for sigma in range(count):
        f = frontier[sigma]
        allowed.append(sorted({i for i in fronts if i < f or (i == f and first[sigma])}
                              | {o for o, anchor in optional.items() if anchor < f or (anchor == f and first[sigma])}))
    before: list[list[int]] = []
    seen: set[int] = set()
    for sigma in range(count):
        before.append(sorted(seen))
        seen |= set(allowed[sigma])
    size = sum(len(allowed[sigma]) + len(before[sigma]) + sum(len(predecessors[k]) for k in allowed[sigma])
               for sigma in range(count))

    def drop_bound() -> float:
        """``recomputation_lower_bound`` where it applies (every node has its own stage)."""
        return 0.0 if optional else recomputation_lower_bound(graph, budget_bytes, once)

    def unbuilt(reason: str) -> ILPResult:
        """The hint, with the every-node-once bound plus ``drop_bound``, when the model is not built
        (SolverError without a fitting hint)."""
        hinted = simulate(graph, hint) if hint is not None else None
        if hinted is None or hinted.peak_bytes > budget_bytes:
            raise SolverError(f"{reason}; use the evict or shave solver, or pass max_variables= or a longer "
                              "time_limit to solve_ilp")
        return ILPResult(status="FEASIBLE", schedule=hint, start=hint, objective=hinted.compute_cost,
                         bound=sum(graph.nodes[i].recomputation_cost for i in fronts) + drop_bound(),
                         solve_seconds=time.perf_counter() - entered, memory_unit_bytes=unit,
                         note=f"{reason}: not built, the hint is returned")

    if size > max_variables:
        return unbuilt(f"the stage model of {graph.name!r} would have about {size:,} variables (limit "
                       f"{max_variables:,}: building it alone takes minutes here)")
    one, zero = model.one, model.zero
    # R[sigma][i]: stage sigma computes i; S[sigma][i]: value i is live when stage sigma starts
    R = [{i: model.bool_var(f"R{sigma}_{i}") for i in allowed[sigma]
          if not (i == frontier[sigma] and first[sigma])} for sigma in range(count)]
    S = [{i: model.bool_var(f"S{sigma}_{i}") for i in before[sigma]} for sigma in range(count)]
    S.append({i: zero for i in range(n)})  # nothing survives the last stage

    def r(sigma: int, i: int):
        return one if i == frontier[sigma] and first[sigma] else R[sigma][i]

    def live(sigma: int, i: int):
        return S[sigma].get(i, zero)

    levels = []
    for sigma in range(count):
        if time.perf_counter() - entered > time_limit / 2:
            return unbuilt(f"building the stage model of {graph.name!r} ({size:,} variables) took over half "
                           f"the time limit of {time_limit:g} s (stage {sigma} of {count})")
        here, after = allowed[sigma], S[sigma + 1]
        members = set(here)
        if sigma + 1 < count:  # S of the end is the constant 0
            for i, kept in after.items():
                model.add(kept <= live(sigma, i) + (r(sigma, i) if i in members else 0))
        for i in R[sigma]:
            readers = [r(sigma, j) for j in successors[i] if j in members]
            model.add(R[sigma][i] + live(sigma, i) <= 1)  # a live value is not recomputed
            model.add(R[sigma][i] <= sum(readers) + after.get(i, zero))  # read in the stage or kept
            if i in once:
                model.add(R[sigma][i] == 0)
            if i in optional:
                model.add(R[sigma][i] <= r(sigma, optional[i]))
        for i in S[sigma]:
            readers = [r(sigma, j) for j in successors[i] if j in members]
            model.add(S[sigma][i] <= sum(readers) + after.get(i, zero))  # read or kept further
        for j in here:
            for i in predecessors[j]:
                model.add(r(sigma, j) <= (r(sigma, i) if i in members else 0) + live(sigma, i))
        # memory while computing k: live values (inputs included) and k's output; FREE[i->k]: i is
        # freed right after k (k reads it last in the stage and it is not kept)
        level = sum(memory[i] * S[sigma][i] for i in S[sigma])
        frees = 0
        for k in here:
            level = level + memory[k] * r(sigma, k)
            model.add(level - frees <= budget)
            levels.append(level - frees)
            for i in predecessors[k]:
                later = [r(sigma, j) for j in successors[i] if j > k and j in members]
                kept = after.get(i, zero)
                free = model.bool_var(f"F{sigma}_{i}_{k}")
                if k in R[sigma]:
                    model.add(free <= R[sigma][k])
                model.add(free + kept <= 1)
                for literal in later:
                    model.add(free + literal <= 1)
                model.add(free >= r(sigma, k) - kept - sum(later))
                frees = frees + memory[i] * free
    model.minimize(sum(cost[i] * r(sigma, i) for sigma in range(count) for i in allowed[sigma]))

    if hint is not None:
        _add_hint(model, hint, R, frontier, first)

    improvements: list[tuple[float, float]] = []
    start = time.perf_counter()
    stream = log if log is not None else sys.stderr

    def on_solution(objective_units: float, bound_units: float) -> None:
        objective, bound = objective_units / scale, bound_units / scale
        elapsed = time.perf_counter() - start
        improvements.append((elapsed, objective))
        if progress:
            gap = (objective - bound) / objective if objective else 0.0
            print(f"  ilp {elapsed:7.1f} s  objective {objective:.6g}  bound {bound:.6g}  gap {gap:.2%}",
                  file=stream, flush=True)

    remaining = max(MIN_SOLVE_SECONDS, time_limit * (1 - READBACK_SHARE) - (start - entered))
    status = model.solve(remaining, workers, on_solution, parameters=parameters, progress=progress, log=log)
    # every node but the optional ones is computed at least once: a bound whatever the solver proved (a MIP
    # solver stopped before its first LP reports none)
    trivial_bound = sum(graph.nodes[i].recomputation_cost for i in fronts) + drop_bound()
    seconds = time.perf_counter() - start
    variables, constraints = model.size()
    result = ILPResult(status=status, schedule=None, start=hint, objective=None, bound=None, solve_seconds=seconds,
                       memory_unit_bytes=unit, variables=variables, constraints=constraints,
                       improvements=improvements, backend=model.name)
    if status in ("OPTIMAL", "FEASIBLE"):
        stages = [[i for i in allowed[sigma] if (i == frontier[sigma] and first[sigma]) or model.value(R[sigma][i])]
                  for sigma in range(count)]
        result.schedule = schedule_from_stages(graph, stages)
        result.objective = sum(graph.nodes[i].recomputation_cost for stage in stages for i in stage)
        result.bound = max(model.bound() / scale, trivial_bound)
        result.model_peak_units = max(model.value(level) for level in levels)
        if status == "OPTIMAL":
            result.bound = result.objective
    if hint is not None and status != "OPTIMAL":
        # never worse than a hint that fits (CP-SAT may not have found it, or only something worse)
        hinted = simulate(graph, hint)
        if hinted.peak_bytes <= budget_bytes and (result.objective is None or hinted.compute_cost < result.objective):
            if result.schedule is None:  # nothing found in the time limit
                result.status = "FEASIBLE"
                result.bound = max(model.bound() / scale, trivial_bound)
            result.schedule, result.objective, result.model_peak_units = hint, hinted.compute_cost, None
    return result


def recomputation_lower_bound(graph: CostGraph, budget_bytes: int, computed_once: "Iterable[int]" = ()) -> float:
    """A lower bound on the recomputation any schedule of the stage model needs (first computations in
    node order) to fit ``budget_bytes``, in the graph's cost unit.

    When node ``t`` is first computed, its output, its inputs and every earlier value read after ``t``
    either are live or must be computed again later (each such value at least once more). So the bytes
    of the values given up there must cover the no-recomputation memory at ``t`` above the budget, and
    the least cost of that cover (a fractional knapsack over the values not read at ``t``, cheapest per
    byte first) bounds the recomputation. The bound is the largest over ``t``; ``inf`` when some ``t``
    cannot fit at all."""
    once = set(computed_once)
    last_reader = [max(node.successors, default=-1) for node in graph.nodes]
    bound = 0.0
    for t, node in enumerate(graph.nodes):
        reads = set(node.predecessors)
        needed = [v for v in range(t) if last_reader[v] >= t]
        excess = node.output_bytes + sum(graph.nodes[v].output_bytes for v in needed) - budget_bytes
        if excess <= 0:
            continue
        items = sorted((graph.nodes[v].recomputation_cost / graph.nodes[v].output_bytes, graph.nodes[v].output_bytes)
                       for v in needed if v not in reads and v not in once and graph.nodes[v].output_bytes > 0)
        cost = 0.0
        for per_byte, size in items:
            taken = min(size, excess)
            cost += per_byte * taken
            excess -= taken
            if excess <= 0:
                break
        bound = max(bound, cost if excess <= 0 else math.inf)
    return bound


def _add_hint(model, hint: Schedule, R, frontier: list[int], first: list[bool]) -> None:
    """Hint R from a schedule: each computation goes to the last pass of the stage whose first
    computation follows it (CP-SAT completes the rest of the hint)."""
    count = len(frontier)
    last_pass = [sigma for sigma in range(count) if first[sigma]]
    stage_of_front = {frontier[sigma]: sigma for sigma in last_pass}
    chosen: list[set[int]] = [set() for _ in range(count)]
    pending: list[int] = []
    reached: set[int] = set()
    for op in hint.ops:
        if not isinstance(op, Forward):
            continue
        pending.append(op.node)
        if op.node in stage_of_front and op.node not in reached:
            reached.add(op.node)
            chosen[stage_of_front[op.node]] = set(pending)
            pending = []
    if pending and last_pass:
        chosen[last_pass[-1]] |= set(pending)
    for sigma in range(count):
        for i, variable in R[sigma].items():
            model.hint(variable, 1 if i in chosen[sigma] else 0)


def default_hint(graph: CostGraph, budget_bytes: int) -> Schedule | None:
    """A feasible start for CP-SAT: the no-recomputation schedule if it fits, else the cheaper of the
    ``evict`` and ``shave`` heuristics' schedules (None when neither finds one)."""
    from .store_all import store_all
    baseline = store_all(graph, None)
    if baseline.fits(budget_bytes):
        return baseline.schedule
    from . import SOLVERS
    found = []
    for name in HINT_HEURISTICS:
        try:  # evict without its lowest-peak fallback (minutes on RL500 when no rule fits)
            found.append(SOLVERS[name](graph, budget_bytes, **({"fallback": False} if name == "evict" else {})))
        except SolverError:
            pass
    return min(found, key=lambda solution: solution.recompute_cost).schedule if found else None


def solve_from_start(graph: CostGraph, budget_bytes: int, *, time_limit: float, hint: Schedule | None = None,
                     started_at: float | None = None, **options) -> ILPResult:
    """``solve_ilp`` from ``hint``, or from ``default_hint`` when None, within ``time_limit`` seconds
    counted from ``started_at`` (now when None): the time spent finding the start comes off the
    solve's share. ``options`` go to ``solve_ilp``."""
    started_at = time.perf_counter() if started_at is None else started_at
    if hint is None:
        hint = default_hint(graph, budget_bytes)
    remaining = max(MIN_SOLVE_SECONDS, time_limit - (time.perf_counter() - started_at))
    return solve_ilp(graph, budget_bytes, time_limit=remaining, hint=hint, **options)


#: The heuristics whose cheapest schedule seeds CP-SAT on joint graphs (``default_hint``).
HINT_HEURISTICS = ("evict", "shave")
#: Seconds a solve may take when the caller gives no limit (``optimize(..., solver="ilp")``, the CLI).
DEFAULT_TIME_LIMIT = 60.0
#: The back end used when the caller names none (see ``ilp_backends.BACKENDS``).
DEFAULT_BACKEND = "cp-sat"


@register("ilp", graphs=("implicit", "joint"))
def ilp(graph: CostGraph, budget_bytes: int | None = None, *, time_limit: float | None = None, workers: int = 2,
        hint: Schedule | None = None, progress: bool = False, backend: str | None = None) -> Solution:
    """The ilp solver in the registry's signature. Joint graphs: the stage model; without a budget, the
    least compute at the lowest peak ``evict`` finds (the registry's "smallest peak it can find").
    Graphs with an implicit backward: through their joint view with tapes, seeded with the lower-set DP
    (``ilp_backward.py``). SolverError when nothing fits in the time limit
    (``DEFAULT_TIME_LIMIT`` when not given). ``backend``: see ``solve_ilp`` (``DEFAULT_BACKEND`` when not given)."""
    if time_limit is None:
        time_limit = DEFAULT_TIME_LIMIT
    backend = backend or DEFAULT_BACKEND
    if graph.implicit_backward:
        from .ilp_backward import solve_implicit
        return solve_implicit(graph, budget_bytes, time_limit=time_limit, workers=workers, progress=progress,
                              backend=backend)
    from . import SOLVERS
    start = time.perf_counter()  # the time limit covers finding the hint too
    lowest = None
    if budget_bytes is None:
        # the registry's contract: the lowest peak known (evict's search), at the least compute there
        lowest = SOLVERS["evict"](graph, None)
        budget_bytes, hint = lowest.peak_bytes, lowest.schedule
    result = solve_from_start(graph, budget_bytes, time_limit=time_limit, hint=hint, started_at=start,
                              workers=workers, progress=progress, backend=backend)
    if result.schedule is None:
        if lowest is not None:
            return Solution("ilp", lowest.schedule, lowest.simulation, f"evict's lowest-peak plan ({result.status})")
        raise SolverError(f"ilp found no schedule of {graph.name!r} within {budget_bytes} bytes in "
                          f"{time_limit:g} s (status {result.status})")
    gap = result.gap
    description = (f"{result.status}, objective {result.objective:.6g}"
                   + (f", gap {gap:.2%}" if gap is not None else "") + f", {result.solve_seconds:.1f} s"
                   + (" (model not built: the heuristics' schedule)" if result.note else ""))
    solution = Solution.of("ilp", graph, result.schedule, description)
    object.__setattr__(solution, "ilp_result", result)
    return solution
