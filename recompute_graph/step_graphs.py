"""One budget for a training step made of several compiled graphs (a ``torch.compile`` graph break).

Pure Python over cost graphs and their plans (no torch). Under a user's ``torch.compile``, a graph
break splits the step: graph 1's forward, the Python code at the break, graph 2's forward, ..., then
the backwards in reverse order. Each graph's cost graph and simulator count bytes above what was live
when that graph began; this module puts the graphs of one step side by side.

The model of a step (``calls``: the graphs' keys in forward order, a key repeated where one compiled
graph runs several times; bytes above what was live before the step, as everywhere):

* while call ``i``'s forward runs, the earlier calls hold what they keep for their backward
  (``held_bytes``: live at the end of their forward, their outputs aside) and their outputs
  (``output_bytes``), each until the next call's backward has run (that call's input; most graphs
  save their input, a matmul's weight gradient reads it): ``S_i = sum(held + output for j < i)``.
  The forward's own peak is the plan's (``forward_peak_bytes``): step ``S_i + forward_peak``.
* while call ``i``'s backward runs, the later calls are done, and their graphs' parameter gradients
  (``kept_gradient_bytes``, each graph once, that of call ``i`` aside: its own plan counts it) stay:
  step ``S_i + later parameter gradients + backward_peak``. (A graph's cost graph prices the
  gradients of its inputs that are activations, the earlier graph's outputs, as its parameters'; the
  earlier graph's backward counts them as its output gradients, so the caller gives each graph's
  parameters' own, ``kept_gradient_bytes``; by default all of ``param_grad_bytes``, over, never
  under.) The last call's backward also has the loss at its outputs (``planner.step_peak_bytes``).

What runs at the break itself (eager code between graphs) is not counted. Parameters shared between
graphs have their gradients counted once per graph (over, never under).

``choose_step_plans`` picks one plan per graph from each graph's candidates (``planner.candidate_pool``)
for the least total recomputation (a graph's cost times its calls) whose step peak, with the planning
margin, fits the budget: exactly, by a dynamic program over the calls with Pareto states (held bytes so
far, peak so far, cost), when no graph runs twice; otherwise by trying every combination, each graph's
candidates thinned evenly when there are more than ``ENUMERATION_LIMIT`` combinations.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from .errors import InfeasibleBudgetError
from .graph import CostGraph
from .planner import (Budget, candidate_pool, min_budget_for_peak, parse_budget, planning_margin, steady_plans,
                      step_peak_bytes, store_all_plan, usable_bytes_of)
from .solvers import Solution
from .units import format_bytes

__all__ = ["PlanMemory", "StepPlan", "plan_memory", "output_bytes", "param_grad_bytes", "step_peak_of",
           "choose_step_plans", "ENUMERATION_LIMIT"]

#: Combinations of plans tried at most when one graph runs more than once per step
ENUMERATION_LIMIT = 20_000


@dataclass(frozen=True)
class PlanMemory:
    """What one plan of one graph means for the step around it (bytes above the graph's start)."""

    forward_peak_bytes: int
    held_bytes: int  # live at the end of its forward, its outputs aside: kept until its backward
    backward_peak_bytes: int
    last_backward_peak_bytes: int  # as the step's last graph: the loss at its outputs too
    recompute_cost: float


def plan_memory(graph: CostGraph, plan: Solution) -> PlanMemory:
    """``plan``'s :class:`PlanMemory` from its simulation's timeline."""
    simulation = plan.simulation
    forward = [p for p in simulation.timeline if p.phase == "forward"]
    backward = [p for p in simulation.timeline if p.phase != "forward"]
    end_of_forward = forward[-1].live_bytes if forward else 0
    return PlanMemory(
        forward_peak_bytes=simulation.forward_peak_bytes,
        held_bytes=max(0, end_of_forward - output_bytes(graph)),
        backward_peak_bytes=max((p.peak_bytes for p in backward), default=0),
        last_backward_peak_bytes=step_peak_bytes(graph, simulation),
        recompute_cost=plan.recompute_cost)


def output_bytes(graph: CostGraph) -> int:
    """The storage of the graph's outputs, each storage once: what the next graph takes as its input."""
    return sum(graph.nodes[i].output_bytes for i in {graph.storage_owner(i) for i in graph.output_indices})


def param_grad_bytes(graph: CostGraph) -> int:
    """The parameter gradients the graph's backward makes (they stay to the end of the step)."""
    return sum(node.param_grad_bytes for node in graph.nodes)


@dataclass(frozen=True)
class StepPlan:
    """The plans chosen for a step's graphs and the step they predict."""

    calls: tuple[Hashable, ...]  # the graphs' keys in forward order
    plans: Mapping[Hashable, Solution]  # key -> the plan its graph runs
    budget_bytes: int
    predicted_step_peak_bytes: int
    store_all_step_peak_bytes: int
    recompute_cost: float  # summed over the calls, in the graphs' cost unit
    #: each call's (forward peak, backward peak, bytes the calls so far hold after its forward) in the step
    call_peaks: tuple[tuple[int, int, int], ...] = ()

    def __str__(self) -> str:
        rows = [f"{self!r}", "  call  graph  plan              forward peak  backward peak  held after"]
        for i, (key, (forward, backward, held)) in enumerate(zip(self.calls, self.call_peaks)):
            plan = self.plans[key]
            rows.append(f"  {i:>4}  {str(key):>5}  {plan.solver:<16}  {format_bytes(forward):>12}  "
                        f"{format_bytes(backward):>13}  {format_bytes(held):>10}")
        return "\n".join(rows)

    def __repr__(self) -> str:
        graphs = len(set(self.calls))
        return (f"StepPlan({len(self.calls)} graph calls of {graphs} graphs: predicted step peak "
                f"{format_bytes(self.predicted_step_peak_bytes)} within {format_bytes(self.budget_bytes)} "
                f"(store-all {format_bytes(self.store_all_step_peak_bytes)}), recomputation "
                f"{self.recompute_cost:.4g})")


class _Step:
    """The calls' plan-independent terms (each graph's output bytes and kept gradient bytes, by key),
    and the step peak of a choice of plans."""

    def __init__(self, calls: Sequence[Hashable], outputs: Mapping[Hashable, int],
                 kept_gradients: Mapping[Hashable, int]) -> None:
        self.calls = tuple(calls)
        self.outputs = outputs
        self.later_grads = [sum(kept_gradients[key] for key in set(self.calls[i + 1:]) - {self.calls[i]})
                            for i in range(len(self.calls))]

    @classmethod
    def of(cls, calls: Sequence[Hashable], graphs: Mapping[Hashable, CostGraph],
           kept_gradient_bytes: Mapping[Hashable, int] | None) -> "_Step":
        keys = set(calls)
        return cls(calls, {key: output_bytes(graphs[key]) for key in keys},
                   {key: kept_gradient_bytes[key] if kept_gradient_bytes is not None else param_grad_bytes(graphs[key])
                    for key in keys})

    def call_peaks(self, i: int, before: int, memory: PlanMemory) -> tuple[int, int]:
        """Call ``i``'s forward and backward peaks in the step, ``before`` bytes held by the calls before it."""
        last = i == len(self.calls) - 1
        backward = memory.last_backward_peak_bytes if last else memory.backward_peak_bytes
        return before + memory.forward_peak_bytes, before + self.later_grads[i] + backward

    def call_peak(self, i: int, before: int, memory: PlanMemory) -> int:
        return max(self.call_peaks(i, before, memory))

    def timeline(self, memories: Mapping[Hashable, PlanMemory]) -> tuple[tuple[int, int, int], ...]:
        """Each call's (forward peak, backward peak, bytes held after its forward) in the step."""
        held, rows = 0, []
        for i, key in enumerate(self.calls):
            forward, backward = self.call_peaks(i, held, memories[key])
            held = self.after(i, held, memories[key])
            rows.append((forward, backward, held))
        return tuple(rows)

    def after(self, i: int, before: int, memory: PlanMemory) -> int:
        return before + memory.held_bytes + self.outputs[self.calls[i]]

    def peak(self, memories: Mapping[Hashable, PlanMemory]) -> int:
        held, peak = 0, 0
        for i, key in enumerate(self.calls):
            peak = max(peak, self.call_peak(i, held, memories[key]))
            held = self.after(i, held, memories[key])
        return peak


def step_peak_of(calls: Sequence[Hashable], graphs: Mapping[Hashable, CostGraph],
                 plans: Mapping[Hashable, Solution], kept_gradient_bytes: Mapping[Hashable, int] | None = None) -> int:
    """The predicted peak of a step whose graphs run ``plans`` (module docstring)."""
    memories = {key: plan_memory(graphs[key], plans[key]) for key in set(calls)}
    return _Step.of(calls, graphs, kept_gradient_bytes).peak(memories)


def choose_step_plans(calls: Sequence[Hashable], graphs: Mapping[Hashable, CostGraph], budget: Budget,
                      candidates: Mapping[Hashable, Sequence[Solution]] | None = None,
                      kept_gradient_bytes: Mapping[Hashable, int] | None = None,
                      steady: Mapping[Hashable, Sequence[Solution]] | None = None) -> StepPlan:
    """The plans of least total recomputation whose step fits ``budget`` (bytes, a size string, or a
    fraction of the store-all step's budget: its peak with the planning margin); ``candidates``:
    each graph's plans to choose from (default: ``planner.candidate_pool``, ``solver="auto"``'s);
    ``kept_gradient_bytes``: each graph's parameters' gradients (module docstring); ``steady``: each
    graph's plans that a new capture makes again (default with the default candidates:
    ``planner.steady_plans``; else none), added to its candidates and never thinned out.
    ``InfeasibleBudgetError`` when no choice fits, naming the smallest budget a choice of steady plans
    fits (with steady plans; else of any candidates): the budget at which the same model, captured and
    timed again, is planned for sure. Below it, the candidates' own smallest budget can move with the
    nodes' measured times, and the message says so."""
    if not calls:
        raise ValueError("a step of no graph calls: nothing to plan")
    step = _Step.of(calls, graphs, kept_gradient_bytes)
    keys = list(dict.fromkeys(calls))
    margin = max(planning_margin(graphs[key]) for key in keys)
    store_all = {key: store_all_plan(graphs[key]) for key in keys}
    store_all_peak = step.peak({key: plan_memory(graphs[key], store_all[key]) for key in keys})
    kind, value = parse_budget(budget)
    budget_bytes = (int(value * min_budget_for_peak(store_all_peak, 0, margin)) if kind == "fraction"
                    else int(value))
    usable = usable_bytes_of(budget_bytes, 0, margin)
    pools = {key: list(candidates[key]) if candidates is not None else list(candidate_pool(graphs[key]))
             for key in keys}
    if steady is None and candidates is None:
        steady = {key: steady_plans(graphs[key]) for key in keys}
    steady_at: dict[Hashable, set[int]] = {}
    for key in keys:
        for plan in [store_all[key], *(steady or {}).get(key, ())]:
            schedules = [candidate.schedule for candidate in pools[key]]
            if plan.schedule not in schedules:
                pools[key].append(plan)
            steady_at.setdefault(key, set()).add([candidate.schedule for candidate in pools[key]].index(plan.schedule))
    memories = {key: [plan_memory(graphs[key], plan) for plan in pools[key]] for key in keys}
    runs = {key: calls.count(key) for key in keys}
    if len(keys) == len(calls):
        chosen, lowest = _sequence_dp(step, memories, usable)
    else:
        chosen, lowest = _enumerate(step, memories, runs, usable, steady_at)
    if chosen is None:
        raise _infeasible(step, memories, runs, steady_at if steady else None, budget_bytes, lowest, margin)
    plans = {key: pools[key][index] for key, index in chosen.items()}
    chosen_memories = {key: memories[key][index] for key, index in chosen.items()}
    peak = step.peak(chosen_memories)
    cost = sum(plans[key].recompute_cost * runs[key] for key in keys)
    return StepPlan(tuple(calls), plans, budget_bytes, peak, store_all_peak, cost, step.timeline(chosen_memories))


def _infeasible(step: _Step, memories: Mapping[Hashable, list[PlanMemory]], runs: Mapping[Hashable, int],
                steady_at: Mapping[Hashable, set[int]] | None, budget_bytes: int, lowest: int,
                margin: float) -> InfeasibleBudgetError:
    """The error naming the smallest budget of a choice of steady plans (``steady_at``: their indices;
    None: of any candidates), and ``lowest``, the candidates' own, where it is below that."""
    keys = list(memories)
    named = lowest
    if steady_at is not None:
        only = {key: [memories[key][i] for i in sorted(steady_at[key])] for key in keys}
        _, named = (_sequence_dp(step, only, -1) if len(keys) == len(step.calls)
                    else _enumerate(step, only, runs, -1, {}))  # thinned as any enumeration: the same each time
    smallest = min_budget_for_peak(named, 0, margin)
    below = min_budget_for_peak(lowest, 0, margin)
    moving = (f"; this planning's plans, on node times measured now, go down to {below} bytes, which can move "
              "when they are measured again" if below < smallest else "")
    return InfeasibleBudgetError(
        f"no choice of plans for the {len(keys)} graphs of this step ({len(step.calls)} graph calls, a graph "
        f"break between each) fits a budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes); the "
        f"smallest feasible budget is {format_bytes(smallest)} ({smallest} bytes{moving}). Raise the budget, or "
        "remove the graph breaks (rg.optimize captures the model whole where it can).",
        budget_bytes=budget_bytes, min_budget_bytes=smallest)


def _sequence_dp(step: _Step, memories: Mapping[Hashable, list[PlanMemory]], usable: int
                 ) -> tuple[dict[Hashable, int] | None, int]:
    """Every graph runs once: states (held, peak, cost, choices) after each call, the dominated ones
    dropped; the cheapest state whose peak fits ``usable``, and the lowest peak of all."""
    states: list[tuple[int, int, float, tuple[int, ...]]] = [(0, 0, 0.0, ())]
    for i, key in enumerate(step.calls):
        grown = []
        for held, peak, cost, choices in states:
            for index, memory in enumerate(memories[key]):
                grown.append((step.after(i, held, memory), max(peak, step.call_peak(i, held, memory)),
                              cost + memory.recompute_cost, choices + (index,)))
        states = _pareto(grown)
    lowest = min(peak for _, peak, _, _ in states)
    fitting = [state for state in states if state[1] <= usable]
    if not fitting:
        return None, lowest
    best = min(fitting, key=lambda state: (state[2], state[1]))
    return dict(zip(step.calls, best[3])), lowest


def _pareto(states: list[tuple[int, int, float, tuple[int, ...]]]) -> list[tuple[int, int, float, tuple[int, ...]]]:
    """The states no other beats in held bytes, peak and cost alike (ties: the first kept)."""
    kept: list[tuple[int, int, float, tuple[int, ...]]] = []
    for state in sorted(states, key=lambda s: (s[0], s[1], s[2])):
        if not any(k[0] <= state[0] and k[1] <= state[1] and k[2] <= state[2] for k in kept):
            kept.append(state)
    return kept


def _enumerate(step: _Step, memories: Mapping[Hashable, list[PlanMemory]], runs: Mapping[Hashable, int],
               usable: int, kept: Mapping[Hashable, set[int]] | None = None) -> tuple[dict[Hashable, int] | None, int]:
    """A graph runs more than once: every combination of (evenly thinned) candidates, each judged; the
    indices of ``kept`` (store-all, the steady plans) are never thinned out."""
    keys = list(memories)
    indices = {key: list(range(len(memories[key]))) for key in keys}
    per_graph = max(2, int(ENUMERATION_LIMIT ** (1 / len(keys))))
    for key in keys:
        if math.prod(len(v) for v in indices.values()) <= ENUMERATION_LIMIT:
            break
        count = len(indices[key])
        if count > per_graph:  # evenly spaced, the first (store-all side) and last (floor side) kept
            spaced = {round(j * (count - 1) / (per_graph - 1)) for j in range(per_graph)}
            indices[key] = sorted(spaced | set((kept or {}).get(key, ())))
    best, best_key, lowest = None, None, math.inf
    for combination in itertools.product(*(indices[key] for key in keys)):
        choice = dict(zip(keys, combination))
        peak = step.peak({key: memories[key][index] for key, index in choice.items()})
        lowest = min(lowest, peak)
        if peak <= usable:
            rank = (sum(memories[key][index].recompute_cost * runs[key] for key, index in choice.items()), peak)
            if best_key is None or rank < best_key:
                best, best_key = choice, rank
    return best, int(lowest)
