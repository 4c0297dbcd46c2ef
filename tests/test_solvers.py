"""Every registered solver on random graphs: valid, judged by the simulator, monotone, deterministic."""
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from recompute_graph.planner import make_plan
from recompute_graph.schedule import lower_segments, prefix_lower_sets
from recompute_graph.simulate import simulate
from recompute_graph.solvers import SOLVERS, get_solver, solvers_for
from recompute_graph.solvers.chen import greedy_cuts, split_candidates
from recompute_graph import InfeasibleBudgetError, SolverError

from strategies import cost_graphs
from test_schedule import chain


@settings(max_examples=50, deadline=None)
@given(cost_graphs(), st.floats(0.3, 1.0))
def test_every_solver_returns_a_valid_schedule_whose_claim_is_the_simulation(graph, fraction):
    store_all = SOLVERS["store_all"](graph, None)
    budget = int(fraction * store_all.peak_bytes)
    for name in solvers_for(graph):
        solver = SOLVERS[name]
        solution, minimal = solved(solver, graph, budget), solved(solver, graph, None)
        if solution is None or minimal is None:
            continue
        again = simulate(graph, solution.schedule)
        assert solution.simulation == again
        assert solution.solver == name
        assert minimal.peak_bytes <= solution.peak_bytes or solution.fits(budget)
        if solution.fits(budget):
            assert again.peak_bytes <= budget


def solved(solver, graph, budget):
    """``solver(graph, budget)``; None when the ILP's wall-clock guard refused to build its model (its
    build took over half the suite's shortened time limit: a loaded machine, not a wrong answer)."""
    try:
        return solver(graph, budget)
    except SolverError as error:
        if "took over half the time limit" in str(error):
            return None
        raise


@settings(max_examples=60, deadline=None)
@given(cost_graphs())
def test_chen_greedy_overhead_does_not_increase_with_the_budget(graph):
    peak = SOLVERS["store_all"](graph, None).peak_bytes
    overheads = []
    for fraction in (0.4, 0.6, 0.8, 1.0):
        solution = SOLVERS["chen_greedy"](graph, int(fraction * peak))
        if solution.fits(int(fraction * peak)):
            overheads.append(solution.recompute_cost)
    assert overheads == sorted(overheads, reverse=True)


@settings(max_examples=30, deadline=None)
@given(cost_graphs())
def test_solvers_are_deterministic(graph):
    # ilp is left out: CP-SAT under a wall-clock limit with several workers may stop at different
    # incumbents from run to run (on a loaded machine this test then fails while shrinking, slowly)
    for name in solvers_for(graph):
        if name == "ilp":
            continue
        assert SOLVERS[name](graph, None) == SOLVERS[name](graph, None)


def test_split_candidates_of_a_chain_are_all_but_the_last_and_skips_block_them():
    assert split_candidates(chain(5)) == [0, 1, 2, 3]
    from recompute_graph import CostGraph, CostNode
    skip = CostGraph("skip", (CostNode(0, "a"), CostNode(1, "b", predecessors=(0,)),
                              CostNode(2, "c", predecessors=(1,)), CostNode(3, "d", predecessors=(0, 2))))
    assert split_candidates(skip) == [0]


def test_chen_sqrt_checkpoints_every_sqrt_n_th_node_of_a_chain():
    g = chain(17)  # 16 candidates -> every 4th
    solution = SOLVERS["chen_sqrt"](g, None)
    expected = lower_segments(g, prefix_lower_sets(g, [3, 7, 11, 15]))
    assert solution.schedule == expected


def test_greedy_rule_cuts_when_the_running_sum_exceeds_the_segment_budget():
    g = chain(6)  # each node keeps 100 B (stored) and outputs 100 B: 200 B per node
    assert greedy_cuts(g, 350) == [1, 3]
    assert greedy_cuts(g, 10_000) == []


def test_unknown_solver_lists_the_registered_ones():
    with pytest.raises(ValueError, match="available: chain_dp, chain_dp_fine, chen_greedy, chen_sqrt, dp_approx, dp_exact, evict, ilp, revolve, shave, store_all"):
        get_solver("magic")


def test_make_plan_reports_the_smallest_feasible_budget_which_then_works():
    g = chain(9)
    with pytest.raises(InfeasibleBudgetError) as info:
        make_plan(g, 10)
    smallest = info.value.min_budget_bytes
    assert info.value.budget_bytes == 10 and "smallest feasible budget" in str(info.value)
    plan = make_plan(g, smallest)
    assert plan.predicted_peak_bytes <= smallest
    with pytest.raises(InfeasibleBudgetError):
        make_plan(g, smallest - 2)


@pytest.mark.parametrize("budget", [0, -5, float("nan"), 1.5, 0.0, "lots", True, None, [1]])
def test_bad_budgets_are_value_errors_listing_the_accepted_forms(budget):
    with pytest.raises(ValueError, match="size string"):
        make_plan(chain(3), budget)


def test_solvers_do_not_import_torch():
    code = ("import sys; import recompute_graph.solvers, recompute_graph.planner, recompute_graph.simulate;"
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_plan_fits_when_the_loss_and_the_backward_peak_never_coincide():
    """A language model's loss on its logits is held at the end of the forward; the step's peak lies in
    the backward, among the parameter gradients. Planning on their sum found no plan for GPT-2 small at
    half its store-all budget; the planner now also accepts a plan whose step peak, the loss at its
    moment, fits."""
    from recompute_graph import CostGraph, CostNode
    from recompute_graph.planner import (auto_solvers, loss_allowance_bytes, make_plan, min_budget_for_peak,
                                         min_feasible_budget, planning_margin, run_solver)
    n = 8
    nodes = tuple(CostNode(i, f"n{i}", predecessors=(i - 1,) if i else (), output_bytes=100, grad_bytes=100,
                           backward_needs=(i - 1,) if i else (), forward_cost=1.0, backward_cost=1.0,
                           param_grad_bytes=1000) for i in range(n))
    graph = CostGraph("lm", nodes, output_indices=(n - 1,), source="traced", loss_bytes=3000)
    smallest = min_feasible_budget(graph)
    on_the_sum = min(min_budget_for_peak(run_solver(name, graph, None).peak_bytes, loss_allowance_bytes(graph),
                                         planning_margin(graph)) for name in auto_solvers(graph))
    assert smallest < on_the_sum
    plan = make_plan(graph, smallest)
    assert plan.min_budget_bytes <= plan.budget_bytes == smallest
    assert plan.predicted_step_peak_bytes * (1 + planning_margin(graph)) <= smallest + 1
    with pytest.raises(InfeasibleBudgetError):
        make_plan(graph, smallest - 2)


@settings(max_examples=40, deadline=None)
@given(cost_graphs(max_nodes=10), st.none() | st.integers(0, 3000),
       st.lists(st.floats(0.05, 1.0), min_size=2, max_size=6))
def test_the_auto_plans_peak_never_grows_as_the_budget_shrinks(graph, loss_bytes, fractions):
    """``solver="auto"`` chooses from a pool fixed per graph, so a smaller budget never gets a plan with
    a higher peak (choosing among each solver's plans for the budget itself did: the small U-Net
    compiled, 732.9 KB at 80 %, 744.5 KB at 70 %), and once a budget is infeasible every smaller one is."""
    import dataclasses
    from recompute_graph.planner import loss_allowance_bytes
    if loss_bytes is not None:  # a traced model: planning margin and loss allowance
        graph = dataclasses.replace(graph, source="traced", loss_bytes=loss_bytes)
    previous = None
    for fraction in sorted({1.0, *fractions}, reverse=True):
        try:
            plan = make_plan(graph, fraction)
        except InfeasibleBudgetError:
            previous = "infeasible"
            continue
        assert previous != "infeasible", f"feasible at {fraction} after a larger budget was not"
        assert plan.min_budget_bytes <= plan.budget_bytes
        if previous is not None:
            assert plan.min_budget_bytes <= previous.min_budget_bytes
            if loss_allowance_bytes(graph) == 0:
                assert plan.predicted_peak_bytes <= previous.predicted_peak_bytes
            assert plan.predicted_compute_overhead >= previous.predicted_compute_overhead
        previous = plan


def _fake_solution(peak_bytes: int, recompute_cost: float):
    from recompute_graph.simulate import SimulationResult
    from recompute_graph.solvers import Solution
    return Solution("model", None, SimulationResult(peak_bytes, 0, 10.0 + recompute_cost, recompute_cost, 0, ()))


def test_a_plan_that_fits_with_room_to_spare_is_loosened_to_a_cheaper_one_that_still_fits():
    """A model that over-prices by a quarter: its plan at the budget fits with a fifth to spare. With
    ``loosen`` (chain_dp's), larger model budgets are tried and the cheapest plan that still fits wins;
    without it, the plan at the budget is the answer."""
    from recompute_graph.solvers import LOOSEN_STEPS, simulator_checked
    tried = []

    def plan(model_budget: float):
        tried.append(model_budget)
        return _fake_solution(int(model_budget * 0.8), 1000.0 / model_budget)

    budget = 1000
    at_budget = simulator_checked(plan, budget, lambda: 100.0)
    assert at_budget.peak_bytes == 800 and tried == [1000.0]
    loosened = simulator_checked(plan, budget, lambda: 100.0, loosen=True)
    assert loosened.fits(budget) and loosened.peak_bytes >= 0.98 * budget
    assert loosened.recompute_cost < at_budget.recompute_cost
    assert len(tried) <= 1 + LOOSEN_STEPS  # the plan at the budget, then at most LOOSEN_STEPS more


def test_a_model_floor_above_the_budget_is_loosened_from_its_own_plan():
    """The model finds nothing at the budget (its floor, 1,300, lies above it) but its floor plan fits
    (peak 650): larger model budgets are tried from the floor's up, not from the budget's."""
    from recompute_graph.solvers import simulator_checked

    def plan(model_budget: float):
        if model_budget < 1300:
            return None
        return _fake_solution(int(model_budget / 2), 1.0 if model_budget >= 1800 else 5.0)

    assert simulator_checked(plan, 1000, lambda: 1300.0).recompute_cost == 5.0
    loosened = simulator_checked(plan, 1000, lambda: 1300.0, loosen=True)
    assert loosened.recompute_cost == 1.0 and loosened.fits(1000)


@settings(max_examples=20, deadline=None)
@given(cost_graphs(max_nodes=12))
def test_the_pool_holds_only_plans_no_other_beats_and_keeps_the_lowest_peak(graph):
    """``auto``'s pool keeps every plan the solvers simulated on the way (``collecting_plans``) that no
    other plan beats in both least budget (``min_budget_for_step``) and recomputation: along rising
    budgets, falling recomputation, from the lowest any solver found to store-all."""
    from recompute_graph.planner import _solver_grid, auto_solvers, candidate_pool, min_budget_for_step
    pool = candidate_pool(graph)
    peaks = [min_budget_for_step(graph, s.simulation) for s in pool]  # what auto's fit test compares
    costs = [s.recompute_cost for s in pool]
    assert peaks == sorted(peaks) and all(a > b for a, b in zip(costs, costs[1:]))
    assert costs[-1] == 0  # store-all, or a plan of lower peak that recomputes nothing either
    grid = [solution for name in auto_solvers(graph) if name != "store_all"
            for solution in _solver_grid(graph, name, "time").values()]
    assert peaks[0] <= min(min_budget_for_step(graph, s.simulation) for s in grid)
    for solution in grid:  # every grid plan is in the pool or beaten by one there
        peak = min_budget_for_step(graph, solution.simulation)
        assert any(p <= peak and c <= solution.recompute_cost for p, c in zip(peaks, costs))


def test_the_pool_leaves_the_collector_as_it_found_it(monkeypatch):
    """The pool is built with the older objects frozen out of the collector's passes (``gc.freeze``) and
    full collections held back (``threshold2`` raised), then hands both back, also after an error;
    objects a caller froze before stay frozen, and a nested block changes nothing."""
    import gc
    from recompute_graph import planner
    from recompute_graph.collector import DEFERRED_FULL_COLLECTION_THRESHOLD, full_collections_deferred
    from test_schedule import chain
    assert gc.get_freeze_count() == 0
    thresholds = gc.get_threshold()
    assert thresholds[2] < DEFERRED_FULL_COLLECTION_THRESHOLD
    while_planning = []
    solver_pool = planner._solver_pool

    def watched(graph, name, variant):
        while_planning.append((gc.get_freeze_count(), gc.get_threshold()))
        return solver_pool(graph, name, variant)
    monkeypatch.setattr(planner, "_solver_pool", watched)
    planner._build_pool(chain(8), "time")
    frozen, during = while_planning[0]
    assert frozen > 0 and during == (*thresholds[:2], DEFERRED_FULL_COLLECTION_THRESHOLD)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds  # handed back
    with pytest.raises(RuntimeError), full_collections_deferred():
        raise RuntimeError("a failure while planning")
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
    gc.freeze()
    try:
        frozen, first_nested = gc.get_freeze_count(), len(while_planning)
        with full_collections_deferred():
            planner._build_pool(chain(8), "time")  # nested: the inner block leaves the outer's settings
            assert gc.get_threshold()[2] == DEFERRED_FULL_COLLECTION_THRESHOLD
        # the caller's stay frozen (a frozen object freed on the way, e.g. from a cache, leaves the count: a few)
        during_nested = while_planning[first_nested][0]  # no second freeze: it would add every object made since
        assert frozen - 100 <= during_nested <= frozen and frozen - 100 <= gc.get_freeze_count() <= during_nested
        assert gc.get_threshold() == thresholds
    finally:
        gc.unfreeze()
