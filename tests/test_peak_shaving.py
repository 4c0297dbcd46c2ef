"""The ``shave`` heuristic for joint graphs, and the ILP's use of it (hint, model not built)."""
from __future__ import annotations

import random

import pytest

from recompute_graph import SolverError
from recompute_graph.benchmark_graphs import benchmark_dir, load_graph
from recompute_graph.planner import auto_solvers
from recompute_graph.schedule import Forward, insert_frees
from recompute_graph.simulate import simulate
from recompute_graph.solvers import get_solver
from recompute_graph.solvers.evict import working_sets
from recompute_graph.solvers.ilp import recomputation_lower_bound, solve_ilp
from recompute_graph.solvers.peak_shaving import memory_profile

from test_ilp import brute_force, random_budgeted_graphs, random_joint_graph


def first_computations(schedule) -> list[int]:
    seen: list[int] = []
    for op in schedule.ops:
        if isinstance(op, Forward) and op.node not in seen:
            seen.append(op.node)
    return seen


def test_the_memory_profile_peaks_where_the_simulator_does():
    rng = random.Random(5)
    for _ in range(30):
        graph = random_joint_graph(rng, rng.randint(2, 9))
        order = list(range(len(graph)))
        for _ in range(3):  # add recomputations whose inputs exist at that point
            position = rng.randint(1, len(order))
            node = rng.choice(order[:position])
            if all(p in order[:position] for p in graph.nodes[node].predecessors):
                order.insert(position, node)
        schedule = insert_frees(graph, [Forward(v, tape=False) for v in order], [], outputs=())
        assert max(memory_profile(graph, order)) == simulate(graph, schedule).peak_bytes


def test_shave_fits_its_budget_keeps_node_order_and_never_beats_the_optimum():
    found = 0
    for graph, budget in random_budgeted_graphs(11, 80):
        try:
            solution = get_solver("shave")(graph, budget)
        except SolverError:
            continue
        found += 1
        assert solution.peak_bytes <= budget
        assert first_computations(solution.schedule) == list(range(len(graph)))
        assert brute_force(graph, budget) <= solution.simulation.compute_cost + 1e-9
    assert found >= 40


def test_shave_fits_the_random_layered_graph_where_it_beats_evict():
    graph = load_graph(next((benchmark_dir() / "checkmate2020").glob("random_layered_n100_*.json")))
    peak = get_solver("store_all")(graph, None).peak_bytes
    for fraction in (0.9, 0.8):
        budget = int(fraction * peak)
        shaved = get_solver("shave")(graph, budget)
        evicted = get_solver("evict")(graph, budget)
        assert shaved.peak_bytes <= budget
        assert shaved.simulation.compute_cost < evicted.simulation.compute_cost


def test_without_a_budget_shave_lowers_the_peak_and_auto_offers_it():
    graph = random_joint_graph(random.Random(2), 9)
    lowest = get_solver("shave")(graph, None)
    assert lowest.peak_bytes < get_solver("store_all")(graph, None).peak_bytes
    assert "shave" in auto_solvers(graph)
    with pytest.raises(SolverError, match="joint"):
        get_solver("shave")(load_graph(benchmark_dir() / "kusumoto2019" / "cg_vgg19.txt"), None)


def test_a_model_too_large_to_build_returns_the_hint_with_its_gap():
    graph = random_joint_graph(random.Random(3), 8)
    peak = get_solver("store_all")(graph, None).peak_bytes
    budget = max(max(working_sets(graph)), int(0.8 * peak))
    hint = get_solver("shave")(graph, budget)
    for options in ({"max_variables": 10}, {"time_limit": 1e-9}):
        result = solve_ilp(graph, budget, hint=hint.schedule, **options)
        assert result.status == "FEASIBLE" and result.schedule == hint.schedule and "not built" in result.note
        assert result.start == hint.schedule
        assert result.objective == hint.simulation.compute_cost
        assert sum(node.forward_cost for node in graph.nodes) <= result.bound <= result.objective
        assert result.gap == pytest.approx((result.objective - result.bound) / result.objective)
    with pytest.raises(SolverError, match="time limit"):
        solve_ilp(graph, budget, time_limit=1e-9)


def test_a_budget_shave_cannot_meet_is_an_infeasible_budget_naming_the_smallest_it_meets():
    from recompute_graph import InfeasibleBudgetError
    from recompute_graph.planner import make_plan
    graph = load_graph(next((benchmark_dir() / "checkmate2020").glob("random_layered_n250_*.json")))
    with pytest.raises(InfeasibleBudgetError) as raised:
        make_plan(graph, 0.9, "shave")
    smallest = raised.value.min_budget_bytes
    assert raised.value.budget_bytes < smallest
    assert make_plan(graph, smallest, "shave").predicted_peak_bytes <= smallest


def test_the_recomputation_lower_bound_never_exceeds_the_optimum():
    tight = 0
    for graph, budget in random_budgeted_graphs(17, 120):
        optimum = brute_force(graph, budget)
        bound = recomputation_lower_bound(graph, budget) + sum(node.forward_cost for node in graph.nodes)
        if optimum is None:
            continue
        assert bound <= optimum + 1e-9
        tight += bound > sum(node.forward_cost for node in graph.nodes)
    assert tight >= 10  # the bound says something beyond "every node once"
