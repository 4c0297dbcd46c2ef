"""The CP-SAT solver for the general problem on joint graphs: exact against brute force, simulator-exact
memory accounting, hints, limits and errors."""
from __future__ import annotations

import heapq
import random

import pytest

from recompute_graph import SolverError
from recompute_graph.benchmark_graphs import benchmark_dir, load_graph
from recompute_graph.cli import main as cli_main
from recompute_graph.graph import CostGraph, CostNode
from recompute_graph.simulate import simulate
from recompute_graph.solvers import get_solver
from recompute_graph.solvers.evict import working_sets
from recompute_graph.solvers.ilp import schedule_from_stages, solve_ilp

pytest.importorskip("ortools")


def random_joint_graph(rng: random.Random, n: int) -> CostGraph:
    nodes = []
    for i in range(n):
        predecessors = tuple(p for p in range(i) if rng.random() < 0.4) or ((i - 1,) if i else ())
        nodes.append(CostNode(index=i, name=f"n{i}", kind="loaded", target="x", predecessors=predecessors,
                              output_bytes=rng.randint(1, 9), forward_cost=float(rng.randint(1, 9)),
                              requires_grad=False))
    return CostGraph(name="random", nodes=tuple(nodes), implicit_backward=False, cost_unit="test")


def random_budgeted_graphs(seed: int, count: int):
    """``count`` random joint graphs of 3 to 7 nodes, each with a budget between its largest working set
    and its no-recomputation peak."""
    rng = random.Random(seed)
    for _ in range(count):
        graph = random_joint_graph(rng, rng.randint(3, 7))
        peak = get_solver("store_all")(graph, None).peak_bytes
        yield graph, rng.randint(max(working_sets(graph)), peak)


def brute_force(graph: CostGraph, budget: int) -> float | None:
    """Least total compute over every schedule whose first computations follow node order: any value may
    be computed (needs its inputs live, inputs + output + live values within the budget), freed and
    recomputed, any number of times, in any order (Dijkstra over (computed prefix, live set))."""
    n = len(graph)
    memory = [node.output_bytes for node in graph.nodes]
    cost = [node.forward_cost for node in graph.nodes]
    inputs = [set(node.predecessors) for node in graph.nodes]
    best = {(0, frozenset()): 0.0}
    heap = [(0.0, 0, frozenset())]
    while heap:
        spent, prefix, live = heapq.heappop(heap)
        if best.get((prefix, live), float("inf")) < spent:
            continue
        if prefix == n:
            return spent
        used = sum(memory[v] for v in live)
        moves = []
        for v in [u for u in range(prefix) if u not in live] + [prefix]:
            if inputs[v] <= live and used + memory[v] <= budget:
                moves.append((spent + cost[v], prefix + (v == prefix), live | {v}))
        moves += [(spent, prefix, live - {v}) for v in live]
        for state in moves:
            if state[0] < best.get(state[1:], float("inf")):
                best[state[1:]] = state[0]
                heapq.heappush(heap, state)
    return None


def test_one_pass_misses_a_schedule_that_recomputes_a_node_twice_between_first_computations():
    # 5 reads 1 and 3; 3 reads 0 and 2; 2 reads 1; 1 reads 0. At 19 bytes, reaching 5 needs two
    # node-ordered sweeps of recomputation after 4's first computation (found by brute force).
    sizes, costs = [4, 8, 5, 4, 9, 1], [8, 4, 8, 2, 8, 5]
    inputs = [(), (0,), (1,), (0, 2), (0, 2), (1, 3)]
    graph = CostGraph(name="two sweeps", implicit_backward=False, cost_unit="test", nodes=tuple(
        CostNode(index=i, name=f"n{i}", kind="loaded", target="x", predecessors=inputs[i],
                 output_bytes=sizes[i], forward_cost=float(costs[i]), requires_grad=False) for i in range(6)))
    assert brute_force(graph, 19) == 41
    assert solve_ilp(graph, 19, passes=1).status == "INFEASIBLE"
    two = solve_ilp(graph, 19, passes=2)
    assert two.status == "OPTIMAL" and two.objective == 41
    assert simulate(graph, two.schedule).peak_bytes <= 19


def test_ilp_equals_brute_force_on_random_dags_and_its_accounting_is_the_simulators():
    rng = random.Random(2026)
    checked = recomputing = 0
    for _ in range(250):
        graph = random_joint_graph(rng, rng.randint(2, 7))
        store_all = get_solver("store_all")(graph, None)
        floor = max(working_sets(graph))
        budget = rng.randint(max(1, floor - 1), store_all.peak_bytes)
        expected = brute_force(graph, budget)
        result = solve_ilp(graph, budget, time_limit=20, passes=2)
        one_pass = solve_ilp(graph, budget, time_limit=20, passes=1)  # Checkmate's space: never better
        assert one_pass.objective is None or expected is not None and one_pass.objective >= expected - 1e-9
        if expected is None:
            assert result.status == "INFEASIBLE"
            continue
        assert result.status == "OPTIMAL"
        assert result.objective == pytest.approx(expected)
        simulation = simulate(graph, result.schedule)
        assert simulation.peak_bytes == result.model_peak_units * result.memory_unit_bytes <= budget
        assert simulation.compute_cost == pytest.approx(expected)
        checked += 1
        recomputing += simulation.recompute_cost > 0
    assert checked >= 100 and recomputing >= 20, (checked, recomputing)


@pytest.mark.parametrize("backend", ["scip", "highs"])
def test_mip_backends_equal_brute_force_on_random_dags(backend):
    rng = random.Random(7 + len(backend))
    checked = recomputing = 0
    for _ in range(60):
        graph = random_joint_graph(rng, rng.randint(2, 7))
        store_all = get_solver("store_all")(graph, None)
        budget = rng.randint(max(1, max(working_sets(graph)) - 1), store_all.peak_bytes)
        expected = brute_force(graph, budget)
        result = solve_ilp(graph, budget, time_limit=20, passes=2, backend=backend)
        assert result.backend == backend
        if expected is None:
            assert result.status == "INFEASIBLE"
            continue
        assert result.status == "OPTIMAL" and result.gap == 0
        assert result.objective == pytest.approx(expected)
        simulation = simulate(graph, result.schedule)
        assert simulation.peak_bytes == result.model_peak_units * result.memory_unit_bytes <= budget
        checked += 1
        recomputing += simulation.recompute_cost > 0
    assert checked >= 25 and recomputing >= 5, (checked, recomputing)


def test_an_unknown_backend_is_a_solver_error_naming_the_choices():
    graph = random_joint_graph(random.Random(1), 4)
    with pytest.raises(SolverError, match="cp-sat, scip, highs, cbc"):
        solve_ilp(graph, 100, backend="gurobi")


def test_one_computation_per_stage_is_store_all_and_the_ilp_keeps_it_when_it_fits():
    rng = random.Random(5)
    graph = random_joint_graph(rng, 7)
    store_all = get_solver("store_all")(graph, None)
    stages = [[t] for t in range(7)]
    assert simulate(graph, schedule_from_stages(graph, stages)).peak_bytes == store_all.peak_bytes
    solution = get_solver("ilp")(graph, store_all.peak_bytes)
    assert solution.simulation.compute_cost == store_all.simulation.compute_cost
    assert "OPTIMAL" in solution.description


def test_a_recomputing_hint_is_used_and_never_beaten_by_a_worse_answer():
    rng = random.Random(11)
    graph = random_joint_graph(rng, 7)
    store_all = get_solver("store_all")(graph, None)
    budget = store_all.peak_bytes - 1
    optimum = solve_ilp(graph, budget, time_limit=20)
    if optimum.schedule is None:
        pytest.skip("no schedule at this budget")
    hinted = solve_ilp(graph, budget, time_limit=20, hint=optimum.schedule)
    assert hinted.status == "OPTIMAL" and hinted.objective == optimum.objective


def test_ilp_proves_the_checkmate_vgg16_optimum_at_90_percent():
    graph = load_graph(benchmark_dir() / "checkmate2020" / "VGG16_256_224x224_train.json")
    store_all = get_solver("store_all")(graph, None)
    budget = int(0.9 * store_all.peak_bytes)
    result = solve_ilp(graph, budget, time_limit=120)
    assert result.status == "OPTIMAL"
    simulation = simulate(graph, result.schedule)
    assert simulation.peak_bytes <= budget
    assert result.objective >= store_all.simulation.compute_cost
    assert result.objective <= 1.05 * store_all.simulation.compute_cost


def test_the_stage_model_refuses_implicit_backward_graphs_with_a_pointer():
    graph = load_graph(benchmark_dir() / "kusumoto2019" / "cg_vgg19.txt")
    with pytest.raises(SolverError, match="joint view"):
        solve_ilp(graph, 10**12)


def test_missing_ortools_says_how_to_install(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("ortools"):
            raise ImportError("no ortools")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    rng = random.Random(1)
    with pytest.raises(SolverError, match="pip install"):
        solve_ilp(random_joint_graph(rng, 3), 100)


def test_cli_reports_status_gap_and_overhead(capsys):
    path = benchmark_dir() / "checkmate2020" / "VGG16_256_224x224_train.json"
    code = cli_main(["solve", str(path), "--solver", "ilp", "--budget", "0.95", "--time-limit", "60", "--json"])
    import json
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert result["status"] == "OPTIMAL" and result["gap"] == 0.0
    assert result["peak_bytes"] <= result["budget_bytes"] == int(0.95 * result["store_all_peak_bytes"])
    assert result["overhead"] >= 0 and result["solve_seconds"] > 0


def test_cli_backend_option_runs_a_mip_solver(capsys):
    path = benchmark_dir() / "checkmate2020" / "VGG16_256_224x224_train.json"
    code = cli_main(["solve", str(path), "--solver", "ilp", "--budget", "0.9", "--backend", "scip", "--json"])
    import json
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["backend"] == "scip"
    assert result["status"] == "OPTIMAL" and result["peak_bytes"] <= result["budget_bytes"]


def test_evict_heuristic_is_feasible_and_never_beats_the_optimum():
    found = 0
    for graph, budget in random_budgeted_graphs(7, 80):
        try:
            heuristic = get_solver("evict")(graph, budget)
        except SolverError:
            continue
        found += 1
        assert heuristic.peak_bytes <= budget
        optimum = solve_ilp(graph, budget, passes=2, hint=heuristic.schedule)
        assert optimum.status == "OPTIMAL"
        assert optimum.objective <= heuristic.simulation.compute_cost + 1e-9
    assert found >= 20


def test_solvers_are_offered_by_graph_kind():
    from recompute_graph.solvers import solvers_for
    joint = random_joint_graph(random.Random(3), 4)
    implicit = load_graph(benchmark_dir() / "kusumoto2019" / "cg_vgg19.txt")
    assert {"ilp", "evict", "store_all"} <= set(solvers_for(joint)) and "dp_exact" not in solvers_for(joint)
    assert {"ilp", "dp_exact"} <= set(solvers_for(implicit)) and "evict" not in solvers_for(implicit)
    with pytest.raises(SolverError, match="joint"):
        get_solver("evict")(implicit, None)


def test_computed_once_nodes_are_never_recomputed():
    rng = random.Random(21)
    for _ in range(30):
        graph = random_joint_graph(rng, 7)
        peak = get_solver("store_all")(graph, None).peak_bytes
        free = solve_ilp(graph, peak * 3 // 4, passes=2)
        once = solve_ilp(graph, peak * 3 // 4, passes=2, computed_once=[0, 1])
        if once.schedule is None:
            continue
        counts = once.schedule.computation_counts()
        assert counts[0] == counts[1] == 1
        assert free.objective is not None and once.objective >= free.objective


@pytest.mark.parametrize("name", ["mlp", "unet"])
def test_ilp_plans_of_traced_models_train_exactly_and_are_never_worse_than_the_dp(name):
    import torch
    from conftest import profiled_tiny
    from recompute_graph.optimized_module import run_schedule
    from recompute_graph.rewrite import ScheduleExecutor
    from recompute_graph.solvers.ilp_backward import JointView
    from test_executor import SEED, relative_error, run_step
    model, inputs, traced, graph = profiled_tiny(name)
    view = JointView(graph)
    dp = get_solver("dp_exact")(graph, None)
    assert simulate(graph, view.from_joint(view.to_joint(dp.schedule))).peak_bytes == dp.peak_bytes  # round trip
    store_all = get_solver("store_all")(graph, None)
    budget = (dp.peak_bytes + store_all.peak_bytes) // 2
    seed = get_solver("dp_exact")(graph, budget)
    solution = get_solver("ilp")(graph, budget, time_limit=10)
    assert solution.fits(budget)
    assert solution.simulation.compute_cost <= seed.simulation.compute_cost + 1e-12
    torch.manual_seed(SEED)
    _, expected, _ = run_step(model, lambda x: model(*x), inputs)
    executor = ScheduleExecutor(traced.graph_module, graph, solution.schedule)
    torch.manual_seed(SEED)
    measured, grads, _ = run_step(model, lambda x: run_schedule(executor, list(x)), inputs)
    assert relative_error(grads, expected) <= 1e-5
    assert abs(solution.peak_bytes - measured) <= 0.10 * measured


def test_optimize_with_the_ilp_solver():
    import torch
    import models_zoo
    import recompute_graph as rg
    from recompute_graph.measure import default_loss
    model, inputs = models_zoo.get_model("mlp", "tiny")
    optimized = rg.optimize(model, 0.95, example_inputs=inputs, solver="ilp", timing="flops")
    torch.manual_seed(0)
    default_loss(model(*inputs)).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    default_loss(optimized(*inputs)).backward()
    assert optimized.recompute_plan.solver == "ilp"
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=0)


def test_without_a_budget_the_ilp_returns_a_low_peak_plan_of_a_joint_graph():
    graph = load_graph(benchmark_dir() / "checkmate2020" / "VGG16_256_224x224_train.json")
    store_all = get_solver("store_all")(graph, None)
    lowest = get_solver("evict")(graph, None)
    solution = get_solver("ilp")(graph, None, time_limit=20)
    assert solution.peak_bytes <= lowest.peak_bytes < store_all.peak_bytes
    assert solution.simulation.compute_cost <= lowest.simulation.compute_cost + 1e-9


def test_a_model_over_the_variable_limit_is_refused_before_it_is_built():
    graph = random_joint_graph(random.Random(3), 7)
    with pytest.raises(SolverError, match="variables.*evict"):
        solve_ilp(graph, 100, max_variables=10)


def test_evict_gives_up_at_its_time_limit():
    import time
    graph = load_graph(next((benchmark_dir() / "checkmate2020").glob("random_layered_n250_*.json")))
    store_all = get_solver("store_all")(graph, None)
    start = time.perf_counter()
    with pytest.raises(SolverError, match="could not keep"):
        get_solver("evict")(graph, int(0.9 * store_all.peak_bytes), time_limit=0.0)
    assert get_solver("evict")(graph, None, time_limit=0.0).peak_bytes == store_all.peak_bytes  # nothing lower in time
    assert time.perf_counter() - start < 5
