"""Relaxing a plan (``schedule_relaxation``): fewer recomputations within the same limit, the simulator's
word on every result; and the planner's pool of a joint cost graph holding the relaxed plans."""
import dataclasses

from hypothesis import given, settings, strategies as st

from recompute_graph import planner
from recompute_graph.errors import InfeasibleBudgetError, SolverError
from recompute_graph.graph import JOINT_COST_SOURCE, CostGraph, CostNode
from recompute_graph.schedule import Forward
from recompute_graph.schedule_relaxation import relax_recomputations
from recompute_graph.simulate import simulate
from recompute_graph.solvers import SOLVERS

from strategies import cost_graphs


def _recomputations(schedule):
    seen, count = set(), 0
    for op in (*schedule.forward_ops, *schedule.backward_ops):
        if isinstance(op, Forward):
            count += op.node in seen
            seen.add(op.node)
    return count


def blocks(count: int = 8, width: int = 10) -> CostGraph:
    """Blocks of ``width`` nodes, each node of a block reading the one before it and the block's input
    (a residual network's shape), every node's backward reading its inputs; as a joint cost graph."""
    nodes = []
    for v in range(count * width):
        reads = () if v == 0 else (v - 1,) if v % width in (0, 1) else (v - 1, v - v % width)
        nodes.append(CostNode(v, f"n{v}", predecessors=reads, output_bytes=100 + 37 * (v % 3), grad_bytes=100,
                              backward_needs=reads, forward_cost=1.0 + v % 4, backward_cost=2.0))
    return CostGraph("blocks", tuple(nodes), cost_source=JOINT_COST_SOURCE)


def _plan_and_limit(graph, fraction, room):
    """chain_dp's plan at ``fraction`` of store-all's peak and a limit ``room`` times its peak; None when
    chain_dp has none."""
    budget = int(fraction * SOLVERS["store_all"](graph, None).peak_bytes)
    try:
        plan = SOLVERS["chain_dp"](graph, budget)
    except (InfeasibleBudgetError, SolverError):
        return None
    return plan, int(plan.peak_bytes * room)


@settings(max_examples=60, deadline=None)
@given(cost_graphs(max_nodes=24), st.floats(0.3, 0.9), st.floats(1.0, 1.5))
def test_a_relaxed_plan_is_valid_the_simulators_within_the_limit_and_recomputes_less(graph, fraction, room):
    """Whatever the plan and the room above its peak, a relaxed plan runs (the simulator replays it),
    its simulation is the one returned, it fits the limit and costs less compute than the plan."""
    planned = _plan_and_limit(graph, fraction, room)
    if planned is None:
        return
    plan, limit = planned
    found = relax_recomputations(graph, plan.schedule, plan.simulation, lambda s: s.peak_bytes <= limit, limit)
    if found is None:
        return
    schedule, simulation = found
    assert simulate(graph, schedule) == simulation
    assert simulation.peak_bytes <= limit
    assert simulation.compute_cost < plan.simulation.compute_cost
    assert _recomputations(schedule) < _recomputations(plan.schedule)


def _recomputed_nodes(schedule):
    seen, again = set(), set()
    for op in (*schedule.forward_ops, *schedule.backward_ops):
        if isinstance(op, Forward):
            if op.node in seen:
                again.add(op.node)
            seen.add(op.node)
    return again


def test_relaxation_keeps_what_the_room_above_a_chain_plan_holds():
    """chain_dp's plan of eight residual blocks at 40 % recomputes whole stages; with 20 % more room
    the relaxed plan keeps some of those values (and tapes) instead: fewer recomputations, of nodes the
    plan recomputed, at less compute and within the room."""
    graph = blocks()
    budget = int(0.4 * SOLVERS["store_all"](graph, None).peak_bytes)
    plan = SOLVERS["chain_dp"](graph, budget)
    limit = int(plan.peak_bytes * 1.2)
    found = relax_recomputations(graph, plan.schedule, plan.simulation, lambda s: s.peak_bytes <= limit, limit)
    assert found is not None
    schedule, simulation = found
    assert simulation.compute_cost < plan.simulation.compute_cost and simulation.peak_bytes <= limit
    assert _recomputations(schedule) < _recomputations(plan.schedule)
    assert _recomputed_nodes(schedule) < _recomputed_nodes(plan.schedule)


def test_a_round_whose_drops_save_no_compute_ends_the_search_after_one_simulation(monkeypatch):
    """Recomputations of free nodes: dropping all of them fits the room but saves nothing, and no half
    of them could save more, so the search stops at that one simulation (it had tried four halvings,
    each a simulation of the whole schedule: most of a 48-layer decoder's relaxation time)."""
    graph = blocks()
    graph = dataclasses.replace(graph, nodes=tuple(dataclasses.replace(n, forward_cost=0.0) for n in graph.nodes))
    budget = int(0.4 * SOLVERS["store_all"](graph, None).peak_bytes)
    plan = SOLVERS["chain_dp"](graph, budget)
    assert _recomputations(plan.schedule) > 0
    calls = []
    from recompute_graph import schedule_relaxation

    def counted(*args):
        calls.append(1)
        return simulate(*args)
    monkeypatch.setattr(schedule_relaxation, "simulate", counted)
    limit = 10 * plan.peak_bytes
    assert relax_recomputations(graph, plan.schedule, plan.simulation, lambda s: s.peak_bytes <= limit, limit) is None
    assert len(calls) == 1


@settings(max_examples=25, deadline=None)
@given(cost_graphs(max_nodes=20))
def test_the_pool_of_a_joint_cost_graph_stays_undominated_and_auto_monotone_with_relaxed_plans(graph):
    """Relaxed plans join the pool of a joint cost graph; the pool stays a staircase (more budget, less
    recomputation) and ``auto``'s peak never grows as the budget shrinks."""
    joint = dataclasses.replace(graph, cost_source=JOINT_COST_SOURCE)
    pool = planner.candidate_pool(joint)
    budgets = [planner.min_budget_for_step(joint, s.simulation) for s in pool]
    assert budgets == sorted(budgets)
    assert all(a.recompute_cost > b.recompute_cost for a, b in zip(pool, pool[1:]))
    peaks = auto_peaks_as_the_budget_shrinks(joint)
    assert peaks == sorted(peaks, reverse=True)


def auto_peaks_as_the_budget_shrinks(graph: CostGraph) -> list[int]:
    """``auto``'s predicted peak at 100 %, 90 %, ... of the store-all budget, down to the first that
    has no plan."""
    peaks = []
    for fraction in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4):
        try:
            peaks.append(planner.make_plan(graph, fraction).predicted_peak_bytes)
        except InfeasibleBudgetError:
            break
    return peaks


def test_the_pool_of_residual_blocks_holds_relaxed_plans_that_beat_their_solvers():
    graph = blocks()
    pool = planner.candidate_pool(graph)
    relaxed = [s for s in pool if s.description.endswith("relaxed")]
    assert relaxed
    for plan in relaxed:
        assert simulate(graph, plan.schedule) == plan.simulation


def test_the_relaxed_pool_built_in_two_processes_is_the_one_process_pool(monkeypatch):
    """Relaxations run in forked processes as they take them come back in job order: the same pool, plan
    for plan."""
    import sys

    import pytest
    if not sys.platform.startswith("linux"):
        pytest.skip("forked pool workers: Linux only")
    pools = []
    for workers in (1, 2):
        from recompute_graph import forked_work
        monkeypatch.setattr(forked_work, "available_workers", lambda workers=workers: workers)
        graph = blocks(count=12)  # 120 nodes: forked at two workers (POOL_FORK_NODES)
        assert len(graph) >= planner.POOL_FORK_NODES
        pools.append([(s.solver, s.description, s.schedule, s.simulation.peak_bytes, s.simulation.compute_cost)
                      for s in planner.candidate_pool(graph)])
    assert pools[0] == pools[1] and any(description.endswith("relaxed") for _, description, *_ in pools[0])


def _dense_choice(graph, schedule, simulation, sequence, limit):
    """The round's choice index by index (the rule of ``schedule_relaxation._choose``, as it was
    written before its runs of constant bytes): each recomputation's kept bytes at every program
    index of its window, taken when no index with bytes added goes over the limit."""
    import numpy as np

    from recompute_graph.schedule_relaxation import _candidates, _held, _op_peaks
    program = [*schedule.forward_ops, None, *schedule.backward_ops]
    peaks = np.array(_op_peaks(schedule, simulation, 0), dtype=np.int64)
    held = _held(graph, program)

    def outside(storage, start, stop):
        free = np.ones(max(0, stop - start), dtype=bool)
        if storage in held:
            for begin, end in zip(held[storage].begins, held[storage].ends):
                free[max(begin, start) - start:max(0, min(end + 1, stop) - start)] = False
        return free
    added, chosen, touched = np.zeros(len(program), dtype=np.int64), [], set()
    for position, before, index in _candidates(graph, program, sequence):
        op = sequence[position][1]
        if op.node in touched:
            continue
        node = graph.nodes[op.node]
        delta = np.zeros(index + 1 - before, dtype=np.int64)
        delta[1:] += outside(op.node, before + 1, index + 1) * node.output_bytes
        if op.tape:
            delta += node.saved_buffer_bytes
            for owner in {graph.storage_owner(q) for q in node.backward_needs} - {op.node}:
                delta += outside(owner, before, index + 1) * graph.nodes[owner].output_bytes
        window = slice(before, index + 1)
        if np.any((peaks[window] + added[window] + delta > limit) & (delta > 0)):
            continue
        added[window] += delta
        chosen.append(position)
        touched.add(op.node)
    return chosen


@settings(max_examples=80, deadline=None)
@given(cost_graphs(max_nodes=24), st.floats(0.2, 0.9), st.floats(1.0, 1.6))
def test_each_rounds_choice_by_runs_of_constant_bytes_is_the_choice_index_by_index(graph, fraction, room):
    from recompute_graph.schedule_relaxation import _choose, _sequence
    planned = _plan_and_limit(graph, fraction, room)
    if planned is None:
        return
    plan, limit = planned
    sequence = _sequence(plan.schedule)
    assert (_choose(graph, plan.schedule, plan.simulation, sequence, limit, 0)
            == _dense_choice(graph, plan.schedule, plan.simulation, sequence, limit))


def test_the_choice_by_runs_takes_recomputations_of_a_residual_chain_as_the_dense_rule_does():
    from recompute_graph.schedule_relaxation import _choose, _sequence
    graph = blocks(30, 10)
    plan = SOLVERS["chain_dp"](graph, int(0.5 * SOLVERS["store_all"](graph, None).peak_bytes))
    for room in (1.0, 1.1, 1.3):
        limit = int(plan.peak_bytes * room)
        sequence = _sequence(plan.schedule)
        chosen = _choose(graph, plan.schedule, plan.simulation, sequence, limit, 0)
        assert chosen == _dense_choice(graph, plan.schedule, plan.simulation, sequence, limit)
        assert chosen or room == 1.0
