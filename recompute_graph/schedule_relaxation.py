"""Relaxing a plan: keep values a schedule computes again, where the budget has room for them.

A solver's schedule often recomputes more than its budget needs. The chain DPs plan at the level of
stages and price a stage's values at every cut they stay open across, so between two of their plans
there is a gap of peak bytes that neither uses; the lower-set DPs plan whole lower sets. On ResNet-50's
joint graph (B=8, 224²) with FLOP-estimated times, ``auto`` at 37 % of the store-all budget picked
chain_dp_fine's plan at 256.6 MiB and +37.1 % of the store-all compute; with the pool's plans relaxed
(``planner._relaxed_pool``) it picks one at 256.4 MiB and +29.7 % (per-block checkpointing, simulated on
the same graph: 347.3 MiB at +35.4 %). With measured times the relaxed pool holds 260.9 MiB at +29.3 %
against per-block's +31.8 % (``python scripts/relaxed_plans.py``; docs/benchmarks.md).

Model. Ops as in :mod:`~recompute_graph.schedule`. A *recomputation* is a ``Forward`` of a node computed
earlier in the step. Dropping one keeps the node's previous value alive up to it instead:
- ``Forward(v, tape=False)``: the previous value of ``v`` lives on from where it was freed;
- ``Forward(v, tape=True)``, whose previous computation ran without a tape: that computation records the
  tape instead, which lives from there on.
The liveness pass (``schedule.insert_frees``) then frees every value after its new last reader, and
``schedule_passes.keep_free_tapes`` drops the recomputations that only fed the dropped one. Views (their
bytes are their owner's), random and stateful nodes are left as they are.

Search. In rounds: each recomputation, most expensive first, is priced from the current simulation's
timeline. The bytes it would keep (the value's output bytes; with a tape, also what the node's tape
saves) are added over the ops between where the value was freed (the tape: the previous computation)
and the recomputation. It is taken when every op's peak there, plus the bytes taken before it in this
round, stays within the limit. A round's choices are simulated once; if the plan does not fit, the first
half of them is tried, and so on; if it fits and saves no compute, the search ends (dropping fewer
recomputations never saves more). The result is the simulator's, never an estimate: a relaxed plan is
returned only when its simulation fits the limit (the step's peak with the loss at its moment,
``planner.min_budget_for_step``, at most the budget) and recomputes less. Pure Python, no torch.
"""
from __future__ import annotations

import bisect
from typing import Callable, Iterable

import numpy as np

from .graph import CostGraph
from .schedule import Backward, Forward, FreeValue, Op, Schedule
from .schedule_passes import keep_free_tapes
from .simulate import ScheduleError, SimulationResult, simulate

__all__ = ["relax_recomputations", "RELAXATION_ROUNDS"]

#: Rounds of relaxation (each one simulation, or a few when its choices overshoot)
RELAXATION_ROUNDS = 8
#: Halvings of a round's choices tried when the whole round does not fit
_HALVINGS = 4


def relax_recomputations(graph: CostGraph, schedule: Schedule, simulation: SimulationResult,
                         fits: Callable[[SimulationResult], bool], peak_limit_bytes: int,
                         rounds: int = RELAXATION_ROUNDS, loss_allowance_bytes: int = 0
                         ) -> tuple[Schedule, SimulationResult] | None:
    """``schedule`` with fewer recomputations, and its simulation, when one is found whose simulation
    ``fits`` and costs less compute than ``simulation``; else None (module docstring).
    ``peak_limit_bytes``: the simulator's peak the search aims under (``fits`` has the last word);
    ``loss_allowance_bytes``: the loss's transient the step adds at the gradients' arrival
    (``planner.loss_allowance_bytes``; 0: none)."""
    if not graph.implicit_backward:
        return None
    best: tuple[Schedule, SimulationResult] | None = None
    current, current_simulation = schedule, simulation
    for _ in range(rounds):
        sequence = _sequence(current)
        chosen = _choose(graph, current, current_simulation, sequence, peak_limit_bytes, loss_allowance_bytes)
        found = None
        for _ in range(_HALVINGS + 1):
            if not chosen:
                break
            candidate = _without(graph, sequence, chosen)
            try:
                candidate_simulation = simulate(graph, candidate)
            except ScheduleError:
                candidate_simulation = None
            if candidate_simulation is not None and fits(candidate_simulation):
                if candidate_simulation.compute_cost < current_simulation.compute_cost:
                    found = candidate, candidate_simulation
                # else: these recomputations cost nothing (dead code, free ops, or their previous
                # computation runs instead), nor would any half of them: dropping fewer never saves more
                break
            chosen = chosen[:len(chosen) // 2]
        if found is None:
            break
        current, current_simulation = best = found
    return best


def _sequence(schedule: Schedule) -> list[tuple[int, Op | None]]:
    """The schedule's ops other than frees, each with its index in the whole program (forward ops, the
    arrival of the output gradients as None, backward ops)."""
    program = [*schedule.forward_ops, None, *schedule.backward_ops]
    return [(index, op) for index, op in enumerate(program) if not isinstance(op, FreeValue)]


def _op_peaks(schedule: Schedule, simulation: SimulationResult, allowance: int, unreached_bytes: int = 0
              ) -> list[int]:
    """Each program index's peak while its op ran; the arrival's, the loss's transient (``allowance``)
    on what is live then, the outputs with it and the zero gradients of those it does not reach
    (``unreached_bytes``) without (``planner.step_peak_bytes``)."""
    forward = len(schedule.forward_ops)
    peaks = [0] * (forward + 1 + len(schedule.backward_ops))
    for point in simulation.timeline:
        if point.op is None:
            peaks[forward] = point.live_bytes + (simulation.outputs_dropped_bytes - unreached_bytes + allowance
                                                 if allowance else 0)
        else:
            peaks[point.position if point.phase == "forward" else forward + 1 + point.position] = point.peak_bytes
    return peaks


def _held(graph: CostGraph, program: list[Op | None]) -> dict[int, "_Intervals"]:
    """Each storage's program indices during which something holds it: a value (a ``Forward`` starts its
    node's value, the next ``Forward`` of the node or a ``FreeValue`` ends it) or a tape (from a
    ``Forward`` with a tape to the node's ``Backward``, the storages its backward reads)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    started: dict[int, int] = {}
    taped: dict[int, int] = {}

    def hold(storages: "Iterable[int]", begin: int, end: int) -> None:
        for owner in storages:
            spans.setdefault(owner, []).append((begin, end))

    def tape_storages(node: int) -> set[int]:
        return {graph.storage_owner(q) for q in graph.nodes[node].backward_needs}
    for index, op in enumerate(program):
        if isinstance(op, (Forward, FreeValue)) and op.node in started:
            hold((graph.storage_owner(op.node),), started.pop(op.node), index)
        if isinstance(op, Forward):
            started[op.node] = index
            if op.tape:
                taped[op.node] = index
        elif isinstance(op, Backward) and op.node in taped:
            hold(tape_storages(op.node), taped.pop(op.node), index)
    for node, begin in started.items():
        hold((graph.storage_owner(node),), begin, len(program) - 1)
    for node, begin in taped.items():
        hold(tape_storages(node), begin, len(program) - 1)
    return {owner: _Intervals(held) for owner, held in spans.items()}


class _Intervals:
    """Program indices as disjoint sorted runs ``[begin, end]`` (inclusive): what :func:`_held` finds for
    one storage. (A boolean row per storage over the whole program, as before, allocated and let go of
    tens of megabytes per round on a 3,000-unit graph.)"""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self.begins: list[int] = []
        self.ends: list[int] = []
        for begin, end in sorted(spans):
            if self.ends and begin <= self.ends[-1] + 1:
                self.ends[-1] = max(self.ends[-1], end)
            else:
                self.begins.append(begin)
                self.ends.append(end)

    def free_runs(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The runs ``[lo, hi)`` of ``range(start, stop)`` outside every run of this storage."""
        free, position = [], start
        run = bisect.bisect_left(self.ends, start)
        while run < len(self.begins) and self.begins[run] < stop:
            if self.begins[run] > position:
                free.append((position, self.begins[run]))
            position = max(position, self.ends[run] + 1)
            run += 1
        if position < stop:
            free.append((position, stop))
        return free


def _choose(graph: CostGraph, schedule: Schedule, simulation: SimulationResult,
            sequence: list[tuple[int, Op | None]], peak_limit_bytes: int, loss_allowance_bytes: int) -> list[int]:
    """Positions in ``sequence`` of the recomputations to drop this round, most expensive first, each
    priced on the timeline with those before it (at most one per node). What one would keep is constant
    over runs of its window (``_constant_pieces``): each run is checked against, and added to, one
    array of each op's level, at most two passes over the run. (Per-index arrays for every candidate,
    as before, took 56 s of the 300 s that planning an LSTM over 100 steps took.)"""
    program = [*schedule.forward_ops, None, *schedule.backward_ops]
    held = _held(graph, program)
    # each op's peak, with what this round's choices keep on top
    level = np.array(_op_peaks(schedule, simulation, loss_allowance_bytes, graph.loss_unreached_gradient_bytes),
                     dtype=np.int64)
    chosen: list[int] = []
    touched: set[int] = set()
    for position, before, index in _candidates(graph, program, sequence):
        op = sequence[position][1]
        assert isinstance(op, Forward)
        if op.node in touched:
            continue
        node = graph.nodes[op.node]
        # what keeping it adds, as runs [lo, hi) of program indices, each with its bytes:
        # the previous value lives on up to the recomputation
        terms = [(lo, hi, node.output_bytes) for lo, hi in _free_runs(held, op.node, before + 1, index + 1)]
        if op.tape:  # what the tape saves, recorded at the previous computation instead
            terms.append((before, index + 1, node.saved_buffer_bytes))
            for owner in {graph.storage_owner(q) for q in node.backward_needs} - {op.node}:
                terms += [(lo, hi, graph.nodes[owner].output_bytes)
                          for lo, hi in _free_runs(held, owner, before, index + 1)]
        pieces = _constant_pieces(terms)
        if any(level[lo:hi].max() + added > peak_limit_bytes for lo, hi, added in pieces):
            continue
        for lo, hi, added in pieces:
            level[lo:hi] += added
        chosen.append(position)
        touched.add(op.node)
    return chosen


def _candidates(graph: CostGraph, program: list[Op | None], sequence: list[tuple[int, Op | None]]
                ) -> list[tuple[int, int, int]]:
    """The recomputations a round may drop, most expensive first: ``(position in sequence, program index
    of the node's computation before it, its own program index)``; not views, random or stateful nodes,
    nor a taped recomputation of a node whose computation before it was taped too."""
    previous: dict[int, int] = {}   # node -> program index of its latest computation so far
    candidates: list[tuple[float, int, int, int]] = []  # (-cost, position, previous computation, index)
    for position, (index, op) in enumerate(sequence):
        if not isinstance(op, Forward):
            continue
        node = graph.nodes[op.node]
        before = previous.get(op.node)
        previous[op.node] = index
        if before is None or node.alias_of is not None or node.random or node.stateful:
            continue
        if op.tape and program[before].tape:  # type: ignore[union-attr]
            continue
        candidates.append((-node.recomputation_cost, position, before, index))
    return [(position, before, index) for _, position, before, index in sorted(candidates)]


def _free_runs(held: dict[int, _Intervals], storage: int, start: int, stop: int) -> list[tuple[int, int]]:
    """The runs of ``range(start, stop)`` at which nothing holds ``storage``."""
    if start >= stop:
        return []
    return held[storage].free_runs(start, stop) if storage in held else [(start, stop)]


def _constant_pieces(terms: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The sum of ``terms`` (``(lo, hi, bytes)``: ``bytes`` over ``[lo, hi)``) as runs of one positive
    value each, ``(lo, hi, bytes)``."""
    changes: dict[int, int] = {}
    for lo, hi, nbytes in terms:
        if nbytes and lo < hi:
            changes[lo] = changes.get(lo, 0) + nbytes
            changes[hi] = changes.get(hi, 0) - nbytes
    pieces, total, previous = [], 0, None
    for point in sorted(changes):
        if previous is not None and total > 0 and point > previous:
            pieces.append((previous, point, total))
        total += changes[point]
        previous = point
    return pieces


def _without(graph: CostGraph, sequence: list[tuple[int, Op | None]], dropped: list[int]) -> Schedule:
    """The schedule of ``sequence`` less the recomputations at ``dropped``; a dropped tape is recorded by
    the node's previous computation instead."""
    ops: list[Op | None] = [op for _, op in sequence]
    previous: dict[int, int] = {}  # position of a Forward -> that of its node's Forward before it
    latest: dict[int, int] = {}
    for position, op in enumerate(ops):
        if isinstance(op, Forward):
            if op.node in latest:
                previous[position] = latest[op.node]
            latest[op.node] = position
    for position in dropped:  # at most one per node (``_choose``): the previous one is never dropped
        op = ops[position]
        assert isinstance(op, Forward)
        if op.tape:
            ops[previous[position]] = Forward(op.node, tape=True)
        ops[position] = FreeValue(-1)  # a placeholder, removed below
    kept = [op for op in ops if not (isinstance(op, FreeValue) and op.node == -1)]
    boundary = kept.index(None)
    # keep_free_tapes derives the frees itself (``insert_frees``), from the ops less any frees
    return keep_free_tapes(graph, Schedule(tuple(kept[:boundary]), tuple(kept[boundary + 1:])))
