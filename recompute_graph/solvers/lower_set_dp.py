"""The lower-set dynamic program of Kusumoto et al. 2019, exact (``dp_exact``) and approximate
(``dp_approx``).

Strategy space: increasing sequences of lower sets ``∅ = L_0 ⊊ L_1 ⊊ ... ⊊ L_k = V`` (a lower set is
closed under predecessors). Segment ``V_i = L_i \\ L_{i-1}``; what it keeps for later segments is
``K_i = ∂(L_i) \\ L_{i-1}``, where ``∂(L)`` are the nodes of ``L`` with a consumer outside ``L``.

Notation of the paper, as used here: ``M(S)`` bytes of the nodes in ``S``, ``T(S)`` their forward cost,
``δ⁺(L)`` the consumers just outside ``L``, ``δ⁻(X)`` the producers of ``X``. A strategy costs
``Σ_i overhead(L_{i-1}, L_i)`` and fits budget ``B`` when for every ``i``:
``Σ_{j<i} M(K_j) + peak(L_{i-1}, L_i) <= B``. Two cost models give ``overhead``, ``peak`` and ``M(K)``:

* :class:`PaperModel` (the paper's graphs, ``cost_unit`` of ``kusumoto2019``), exactly as the official
  code: ``peak = 2·M(V_i) + M(δ⁺(L_i)) + M(δ⁻(δ⁺(L_i)) \\ L_i)``, ``overhead = T(V_i \\ ∂(L_i))`` (the
  last segment is charged in full), ``M(v)`` = output bytes.
* :class:`ExecutionModel` (traced models): how :func:`~recompute_graph.schedule.lower_segments` runs a
  strategy. Every segment but the last is recomputed in full (``overhead = T(V_i)``, last: 0); the peak
  of a segment's backward is estimated from what its tapes keep, the gradients in flight and the
  parameter gradients accumulated so far (see the class). The model ranks strategies; the simulator
  decides: the solver simulates the DP's answer and tightens the DP budget until the simulated peak
  fits.

The DP keeps, per lower set, the Pareto front of (overhead so far, checkpoint bytes so far) and iterates
lower sets by cardinality (a linear extension of inclusion: the official code's discovery order skips
transitions). Time-centric: least overhead; memory-centric: least checkpoint memory on the final front
(coarse partitions, the lowest measured peak after liveness, at more compute). Exact in the strategy
space for the model used. Time ``O(#lowersets² · front)``; ``dp_approx`` uses only the principal lower
sets ``↓v`` (plus ``∅`` and ``V``), ``O(n² · front)``. Under the execution model every front but
``V``'s is one state (its overheads telescope), and the DP runs as a shortest path
(:mod:`.lower_set_search`, where the transition tables and the DP runs live).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from ..errors import SolverError
from ..graph import CostGraph
from ..graph_memo import memoized
from ..schedule import lower_segments
from . import Solution, best_of, register, simulator_checked
from .lower_set_search import minimal_model_budget, run_dp
from .lower_sets import (DEFAULT_MAX_LOWER_SETS, LowerSetFamily, _bit_matrix, enumerate_lower_sets,
                         free_sources, ordering_predecessors, principal_lower_sets)

__all__ = ["DEFAULT_MAX_LOWER_SETS", "free_sources", "ordering_predecessors", "PaperModel", "ExecutionModel", "LowerSetFamily", "enumerate_lower_sets",
           "principal_lower_sets", "run_dp", "strategy_cost", "minimal_model_budget", "dp_exact", "dp_approx",
           "model_for", "dp_for", "AUTO_EXACT_LIMIT"]

#: ``solver="auto"`` runs dp_exact up to this many lower sets, dp_approx above.
AUTO_EXACT_LIMIT = 1500
PAPER_UNIT_PREFIX = "kusumoto2019"


class PaperModel:
    """Kusumoto et al. 2019's cost model (module docstring); ``M`` = output bytes, ``T`` = forward cost."""

    name = "paper"
    overhead_telescopes = False  # T(V_i \ ∂(L_i)) depends on the boundary: a Pareto front per set

    def __init__(self, family: LowerSetFamily) -> None:
        g = family.graph
        self.family = family
        self.memory = [node.output_bytes for node in g.nodes]
        self.time = [node.recomputation_cost for node in g.nodes]
        self.set_memory = [family.total(self.memory, s) for s in family.sets]
        self.set_time = [family.total(self.time, s) for s in family.sets]
        self.outside = []
        for s in family.sets:
            consumers = family.out_neighbours(s)
            needed = family.in_neighbours(consumers) & ~s
            self.outside.append(family.total(self.memory, consumers) + family.total(self.memory, needed))

    def transition(self, a: int, b: int) -> tuple[float, float, float]:
        """(overhead, peak, kept bytes) of the step from lower set ``a`` to ``b`` (family indices)."""
        f = self.family
        lower = f.sets[a]
        kept_nodes = [v for v in f.boundary_nodes[b] if not lower >> v & 1]
        segment_memory = self.set_memory[b] - self.set_memory[a]
        peak = 2 * segment_memory + self.outside[b]
        kept_time = sum(self.time[v] for v in kept_nodes)
        overhead = self.set_time[b] - self.set_time[a] - kept_time
        kept = sum(self.memory[v] for v in kept_nodes)
        return overhead, peak, kept


def quantized_times(graph: CostGraph, steps_per_node: int = 4) -> list[float]:
    """Recomputation costs rounded up to a grid ``w`` with ``sum(T) / w = steps_per_node * n`` (as in Kusumoto's
    chainer-compiler policy): measured times are all distinct, and distinct overheads would make the
    Pareto fronts as long as the number of strategies. The simulator prices the final plan exactly."""
    total = sum(node.recomputation_cost for node in graph.nodes)
    if total <= 0:
        return [0.0] * len(graph)
    width = total / (steps_per_node * len(graph))
    return [float(math.ceil(node.recomputation_cost / width - 1e-9)) if node.recomputation_cost > 0 else 0.0
            for node in graph.nodes]


class ExecutionModel:
    r"""How the executor runs a lowered strategy (module docstring); checked by the simulator.

    While segment ``D = L' \ L`` runs its backward, live are: the tapes of ``D`` (what each node keeps
    for its backward, ``CostGraph.stored_bytes_per_node``), the gradients that arrived from later
    segments into the nodes of ``D`` read outside ``L'``, two gradients in flight (twice the largest
    gradient of ``D``'s nodes), the parameter gradients of every node outside ``L``, the held output
    gradients and the largest workspace. All terms but the first two are bounds. All but the gradients
    in flight are additive over nodes, so a transition costs O(|∂(L')|); the largest gradient of every
    ``D = L' \ L`` for one ``L`` is one vectorized pass over the family. (The largest gradient of the
    whole graph, the bound this model used before, is a transformer's logits: on GPT-2 small's joint
    graph it made every segment pay for them, and dp_approx's lowest peak was 0.73 of store-all where
    chen_greedy's prefix plan, which its family contains, reaches 0.53.) ``in_flight="graph"`` keeps that
    bound: neither model ranks plans as the simulator does on every graph (the small U-Net's lowest
    peak: 0.53 with the graph's bound, 0.60 with the segment's), so the DPs solve in both and the
    simulator picks (:func:`solve_lower_sets`).
    """

    name = "execution"
    #: Every step costs ``T(b) - T(a)`` (``V``: 0) in integer quantized times, exact in float64: a strategy
    #: reaching ``b`` has spent ``T(b)``, whatever its path (``lower_set_search._run_least_checkpoints``).
    overhead_telescopes = True

    def __init__(self, family: LowerSetFamily, in_flight: str = "segment") -> None:
        g = family.graph
        self.family = family
        self.in_flight_bound = in_flight
        self.kept_weight = [node.output_bytes for node in g.nodes]
        self.grad = [node.grad_bytes if node.requires_grad else 0 for node in g.nodes]
        stored = g.stored_bytes_per_node()
        self.time = quantized_times(g)
        self.set_stored = family.totals(stored).tolist()
        self.set_time = family.totals(self.time).tolist()
        params = [node.param_grad_bytes for node in g.nodes]
        self.params_after = (sum(params) - family.totals(params)).tolist()
        held = sum(g.nodes[o].grad_bytes for o in g.gradient_outputs)
        workspace = max((max(n.workspace_bytes, n.backward_workspace_bytes) for n in g.nodes), default=0)
        self.constant = held + workspace
        self._members = family.members if in_flight == "segment" else None
        self._arrays: tuple | None = None  # numpy views of the family for transitions_from
        self._grad_array = np.array(self.grad, dtype=np.float64)

    def in_flight(self, a: int, b: int) -> float:
        """Twice the largest gradient of the nodes in ``sets[b] \\ sets[a]`` (``in_flight="segment"``),
        or of the whole graph (``"graph"``)."""
        return float(self._in_flight(a, np.array([b]))[0])

    def _in_flight(self, a: int, later: np.ndarray) -> np.ndarray:
        """:meth:`in_flight` from ``a`` to each set of ``later``."""
        if self.in_flight_bound == "graph":
            return np.full(len(later), 2.0 * float(self._grad_array.max(initial=0.0)))
        # the largest gradient of b \ a is that of its first node in the order of decreasing gradients:
        # the lowest bit of the first nonzero word of b's words less a's, the nodes packed in that order
        words, grads = self._words_by_gradient()
        segments = words[later] & ~words[a]
        nonzero = segments != 0
        word = nonzero.argmax(axis=1)
        found = nonzero[np.arange(len(later)), word]
        chosen = segments[np.arange(len(later)), word]
        lowest = chosen & (~chosen + np.uint64(1))  # the lowest set bit (0 where none)
        bit = np.zeros(len(later), dtype=np.int64)
        for shift in (32, 16, 8, 4, 2, 1):  # its index, by halving
            upper = lowest >= (np.uint64(1) << np.uint64(shift))
            bit += np.where(upper, shift, 0)
            lowest = np.where(upper, lowest >> np.uint64(shift), lowest)
        first = np.minimum(word * 64 + bit, len(grads) - 1)
        return 2 * np.where(found, grads[first], 0.0)

    def _words_by_gradient(self) -> tuple[np.ndarray, np.ndarray]:
        """The family's sets as rows of 64-bit words with the nodes in the order of decreasing gradient
        bytes (node ``order[k]`` at bit ``k % 64`` of word ``k // 64``), and the gradients in that order
        (built once)."""
        if getattr(self, "_by_gradient", None) is None:
            order = np.argsort(-self._grad_array, kind="stable")
            members = self._members[:, order]
            width = (members.shape[1] + 63) // 64
            padded = np.zeros((members.shape[0], width * 64), dtype=bool)
            padded[:, :members.shape[1]] = members
            packed = np.packbits(padded, axis=1, bitorder="little")
            self._by_gradient = (np.ascontiguousarray(packed).view("<u8").reshape(members.shape[0], width),
                                 self._grad_array[order])
        return self._by_gradient

    def transitions_from(self, a: int) -> list[tuple[float, int, float, float]]:
        """``(peak, b, overhead, kept)`` of every step from lower set ``a`` to a strict superset ``b``, in
        the order of ``b``: :meth:`transition` for all of them at once. A node of ``∂(b)`` inside ``a``
        is in ``∂(a)``, so the sums over ``∂(b)`` minus ``a`` are those over ``∂(b)`` less those over
        ``∂(b) ∩ ∂(a)`` (numpy; byte sums of integers are exact in float64, so the values are
        :meth:`transition`'s)."""
        later, peak, overhead, kept = self.transition_arrays_from(a)
        return list(zip(peak.tolist(), later.tolist(), overhead.tolist(), kept.tolist()))

    def transition_arrays_from(self, a: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`transitions_from` as arrays: targets ``b`` (ascending), peaks, overheads, kept bytes."""
        f = self.family
        boundary, boundary_grad, boundary_kept, set_stored, set_time, kept_weight = self._family_arrays()
        later = f.supersets_after(a)
        if not len(later):
            return later, np.zeros(0), np.zeros(0), np.zeros(0)
        inside = np.asarray(f.boundary_nodes[a], dtype=np.int64)
        shared = boundary[np.ix_(later, inside)].astype(np.float64)
        arrived = boundary_grad[later] - shared @ self._grad_array[inside]
        kept = boundary_kept[later] - shared @ kept_weight[inside]
        peak = (set_stored[later] - set_stored[a] + arrived + self.params_after[a] + self.constant
                + self._in_flight(a, later))
        overhead = np.where(later == len(f.sets) - 1, 0.0, set_time[later] - set_time[a])
        return later, peak, overhead, kept

    def _family_arrays(self) -> tuple[np.ndarray, ...]:
        if self._arrays is None:
            f = self.family
            boundary = _bit_matrix(f.boundary, f.n)
            self._arrays = (boundary, boundary @ self._grad_array, boundary @ np.asarray(self.kept_weight, float),
                            np.array(self.set_stored, dtype=np.float64), np.array(self.set_time, dtype=np.float64),
                            np.asarray(self.kept_weight, dtype=np.float64))
        return self._arrays

    def transition(self, a: int, b: int) -> tuple[float, float, float]:
        f = self.family
        lower = f.sets[a]
        is_last = f.sets[b] == (1 << f.n) - 1
        overhead = 0.0 if is_last else self.set_time[b] - self.set_time[a]
        boundary = [v for v in f.boundary_nodes[b] if not lower >> v & 1]
        arrived = sum(self.grad[v] for v in boundary)
        peak = (self.set_stored[b] - self.set_stored[a] + arrived + self.params_after[a] + self.constant
                + self.in_flight(a, b))
        kept = sum(self.kept_weight[v] for v in boundary)
        return overhead, peak, kept


def model_for(graph: CostGraph) -> Callable[[LowerSetFamily], PaperModel | ExecutionModel]:
    """The paper's model for the paper's graphs, the execution model otherwise."""
    return PaperModel if graph.cost_unit.startswith(PAPER_UNIT_PREFIX) else ExecutionModel


def strategy_cost(model: PaperModel | ExecutionModel, lower_sets: Sequence[frozenset[int]]) -> tuple[float, float]:
    """(overhead, peak) of any lower-set sequence ending in V under ``model`` (sets must be in its family)."""
    f = model.family
    index = {s: i for i, s in enumerate(f.sets)}
    a, checkpoints, overhead, peak = 0, 0.0, 0.0, 0.0
    for lower in lower_sets:
        b = index[sum(1 << v for v in lower)]
        step_overhead, step_peak, kept = model.transition(a, b)
        overhead += step_overhead
        peak = max(peak, checkpoints + step_peak)
        checkpoints += kept
        a = b
    return overhead, peak


def solve_lower_sets(name: str, graph: CostGraph, budget_bytes: int | None,
                     family: LowerSetFamily | Callable[[], LowerSetFamily], variant: str = "time") -> Solution:
    """Run the DP on ``family`` and return the simulated plan (the DP works in its model; the simulator
    has the last word, see :func:`~recompute_graph.solvers.simulator_checked`). ``family`` may be a
    function that builds it: then the family, its cost models and their transition tables are built
    once per graph and ``name`` (``graph_memo``) and reused for every budget (most of a DP's time on a
    large graph: 80 % of dp_exact's on ResNet-152)."""
    if not graph.implicit_backward:
        raise SolverError(f"{name} needs a graph with implicit backward; {graph.name!r} has explicit "
                          "backward nodes (a Checkmate joint graph)")
    if callable(family):
        models = memoized(graph, ("lower_set_dp.models", name), lambda: _models(graph, family()))
    else:
        models = _models(graph, family)
    solutions = []
    for model in models:
        def plan(model_budget: float, model: PaperModel | ExecutionModel = model) -> Solution | None:
            return _answers(model, name, variant).plan(graph, model_budget)

        solutions.append(simulator_checked(plan, budget_bytes, lambda model=model: _minimal_budget(model),
                                           graph))
    return best_of(solutions, budget_bytes)


class _Answers:
    """The DP's answers in one model for one variant, with their simulated plans, kept across budgets.

    The DP is exact in its model: its answer at budget ``B`` has model peak ``p <= B`` and is optimal
    among the strategies of peak at most ``B``, so it is an optimal answer at every budget in
    ``[p, B]`` too (the strategies feasible there are a subset that still contains it). Below a budget
    where the DP found nothing, it finds nothing (feasibility is monotone). So the bisections of
    ``simulator_checked`` and the planner's pool, which ask for many nearby budgets, run the DP once per
    distinct answer and simulate each answer once."""

    def __init__(self, model: PaperModel | ExecutionModel, name: str, variant: str) -> None:
        self.model, self.name, self.variant = model, name, variant
        self.known: list[list] = []  # [model peak, largest budget asked, lower sets, plan]
        self.infeasible_up_to = -math.inf  # the largest budget where the DP found nothing

    def plan(self, graph: CostGraph, model_budget: float) -> Solution | None:
        """The simulated plan of the DP's answer at ``model_budget`` (None when the model has none)."""
        if model_budget <= self.infeasible_up_to:
            return None
        for peak, asked, _, solution in self.known:
            if peak <= model_budget <= asked:
                return solution
        result = run_dp(self.model, model_budget, self.variant)
        if result is None:
            self.infeasible_up_to = max(self.infeasible_up_to, model_budget)
            return None
        for entry in self.known:
            if entry[2] == result.lower_sets:
                entry[1] = max(entry[1], model_budget)
                return entry[3]
        solution = Solution.of(self.name, graph, lower_segments(graph, result.lower_sets),
                               f"{len(result.lower_sets)} segments, {self.model.name} model, {self.variant}-centric")
        self.known.append([result.peak, model_budget, result.lower_sets, solution])
        return solution


def _answers(model: PaperModel | ExecutionModel, name: str, variant: str) -> _Answers:
    """The answer cache of ``model`` for ``(name, variant)``, kept on the model (memoized per graph by
    ``solve_lower_sets`` when the family comes from a factory)."""
    caches = model.__dict__.setdefault("_answers", {})
    if (name, variant) not in caches:
        caches[name, variant] = _Answers(model, name, variant)
    return caches[name, variant]


def _models(graph: CostGraph, family: LowerSetFamily) -> list[PaperModel | ExecutionModel]:
    """The cost models the DP solves in: the paper's, or the execution model with both bounds on the
    gradients in flight (the simulator picks between their answers)."""
    kind = model_for(graph)
    return [kind(family)] if kind is PaperModel else [kind(family, "segment"), kind(family, "graph")]


def _minimal_budget(model: PaperModel | ExecutionModel) -> float:
    """``minimal_model_budget`` of ``model``, computed once per model (the same for both variants)."""
    cached = getattr(model, "_minimal_budget", None)
    if cached is None:
        cached = model._minimal_budget = minimal_model_budget(model)
    return cached


@register("dp_exact")
def dp_exact(graph: CostGraph, budget_bytes: int | None = None, *, variant: str = "time",
             max_lower_sets: int = DEFAULT_MAX_LOWER_SETS) -> Solution:
    """Exact lower-set DP over all lower sets (SolverError above ``max_lower_sets`` of them)."""
    if max_lower_sets != DEFAULT_MAX_LOWER_SETS:
        return solve_lower_sets("dp_exact", graph, budget_bytes, enumerate_lower_sets(graph, max_lower_sets),
                                variant)
    return solve_lower_sets("dp_exact", graph, budget_bytes, lambda: _all_lower_sets(graph), variant)


def _all_lower_sets(graph: CostGraph) -> LowerSetFamily:
    """``enumerate_lower_sets(graph)``, or its SolverError, once per graph (counting the lower sets of a
    graph over the limit takes seconds: 87,473 of them in the small Hugging Face GPT-2, 2.5 s)."""
    def build() -> LowerSetFamily | SolverError:
        try:
            return enumerate_lower_sets(graph)
        except SolverError as error:
            return error
    family = memoized(graph, "lower_set_dp.all_lower_sets", build)
    if isinstance(family, SolverError):
        raise SolverError(str(family))
    return family


@register("dp_approx")
def dp_approx(graph: CostGraph, budget_bytes: int | None = None, *, variant: str = "time") -> Solution:
    """Approximate lower-set DP over the principal lower sets (one per node, plus ∅ and V)."""
    return solve_lower_sets("dp_approx", graph, budget_bytes, lambda: principal_lower_sets(graph), variant)


def dp_for(graph: CostGraph) -> str | None:
    """Which lower-set DP ``solver="auto"`` runs: dp_exact when the graph has at most
    ``AUTO_EXACT_LIMIT`` lower sets, else dp_approx; None for graphs with explicit backward nodes."""
    if not graph.implicit_backward:
        return None
    return memoized(graph, "lower_set_dp.dp_for", lambda: _dp_for(graph))


def _dp_for(graph: CostGraph) -> str:
    try:
        enumerate_lower_sets(graph, AUTO_EXACT_LIMIT, count_up_to=AUTO_EXACT_LIMIT)
    except SolverError:
        return "dp_approx"
    return "dp_exact"
