"""chain_dp (rotor): optimal in its model against brute force; valid multi-recompute schedules; the chain cut at
narrow positions where no split candidate is."""
import dataclasses
import math

import pytest
from hypothesis import given, settings, strategies as st

from recompute_graph.graph import JOINT_COST_SOURCE, CostGraph, CostNode
from recompute_graph import InfeasibleBudgetError, SolverError
from recompute_graph.schedule import Forward
from recompute_graph.simulate import simulate
from recompute_graph.solvers import SOLVERS
from recompute_graph.solvers.chain_dp import (Chain, boundary_bytes, chain_cuts, chain_of, discretize,
                                              gradient_slots, lower_chain_ops, optimal_time, solve_chain)
from recompute_graph.solvers.chen import split_candidates

from strategies import cost_graphs
from test_schedule import chain as chain_graph


@st.composite
def chains(draw):
    length = draw(st.integers(1, 5))
    sizes = st.integers(1, 60)
    return Chain(stages=tuple((s,) for s in range(length)),
                 fw=tuple(float(draw(st.integers(1, 9))) for _ in range(length)),
                 bw=tuple(float(draw(st.integers(1, 9))) for _ in range(length)),
                 cw=(0,) + tuple(draw(sizes) for _ in range(length)),
                 cbw=(0,) + tuple(draw(sizes) for _ in range(length)), fixed_bytes=0,
                 pg=tuple(draw(st.sampled_from((0, 0, 5, 30))) for _ in range(length)))


def brute_force(chain, cw, cbw, grads, slots):
    """Minimum time over every recursive strategy (tape stage i, or keep x_j for i < j <= l), by
    exhaustive recursion without tables; the parameter gradients of the stages already run backward
    (``grads[a, b]``: stages a..b-1, in slots) held while the rest runs."""
    def best(i, l, m):
        def single(m):
            need = max(cw[i + 1] + cbw[i + 1], cw[i] + cw[i + 1] + cbw[i + 1]) + grads[i, i + 1]
            return chain.fw[i] + chain.bw[i] if m >= need else math.inf
        if i == l:
            return single(m)
        options = [single(m - grads[i + 1, l + 1]) + best(i + 1, l, m - cbw[i + 1])
                   if m >= cbw[i + 1] else math.inf]
        for j in range(i + 1, l + 1):
            if m >= cw[j]:
                options.append(sum(chain.fw[i:j]) + best(j, l, m - cw[j]) + best(i, j - 1, m - grads[j, l + 1]))
        return min(options)
    return best(0, len(chain.stages) - 1, slots)


@settings(max_examples=150, deadline=None)
@given(chains(), st.integers(20, 200))
def test_chain_dp_equals_brute_force_on_random_chains(chain, budget):
    slots = 40
    cw, cbw = discretize(chain, budget, slots)
    grads = gradient_slots(chain, budget, slots)
    assert optimal_time(chain, budget, slots) == pytest.approx(brute_force(chain, cw, cbw, grads, slots))


def test_parameter_gradients_are_charged_from_the_backward_of_their_stage_on():
    """Charged up front (as before), parameter gradients took room from the whole schedule; charged from
    B(s) on, 40 bytes of them in the first stage (whose backward runs last, after every tape is freed)
    cost nothing at a budget of 80, and in the last stage less than up front at a budget of 100."""
    stages = dict(stages=((0,), (1,), (2,)), fw=(1.0,) * 3, bw=(1.0,) * 3, cw=(0, 10, 10, 10),
                  cbw=(0, 20, 20, 20), fixed_bytes=0)
    none, first, last = (Chain(**stages, pg=pg) for pg in ((0, 0, 0), (40, 0, 0), (0, 0, 40)))
    up_front = Chain(**{**stages, "fixed_bytes": 40})
    assert optimal_time(first, 80, 80) == optimal_time(none, 80, 80) == 6.0  # store-all: no recomputation
    assert optimal_time(up_front, 80, 80) == math.inf
    assert optimal_time(last, 80, 80) == math.inf  # B(1) and B(0) run beside B(2)'s 40 bytes
    assert optimal_time(last, 100, 100) == 8.0 < optimal_time(up_front, 100, 100) == 9.0
    assert solve_chain(last, 100, 100)[:3] == [("Fn", 0), ("Fn", 1), ("Fe", 2)]


@settings(max_examples=60, deadline=None)
@given(chains(), st.integers(20, 200))
def test_the_rebuilt_sequence_costs_what_the_dp_says(chain, budget):
    ops = solve_chain(chain, budget, 40)
    if ops is None:
        assert optimal_time(chain, budget, 40) == math.inf
        return
    time = sum(chain.fw[s] for kind, s in ops if kind != "B") + sum(chain.bw[s] for kind, s in ops if kind == "B")
    assert time == pytest.approx(optimal_time(chain, budget, 40))
    assert [s for kind, s in ops if kind == "B"] == list(reversed(range(len(chain.stages))))


def test_tight_budgets_recompute_stages_several_times_and_the_schedule_is_valid():
    graph = chain_graph(12)
    loose = SOLVERS["chain_dp"](graph, None)
    counts = loose.schedule.computation_counts()
    assert max(counts.values()) >= 3  # the smallest peak needs multi-level recomputation
    assert simulate(graph, loose.schedule) == loose.simulation
    store_all = SOLVERS["store_all"](graph, None)
    assert loose.peak_bytes < store_all.peak_bytes
    generous = SOLVERS["chain_dp"](graph, store_all.peak_bytes)
    assert generous.recompute_cost <= loose.recompute_cost


def test_stage_operations_lower_to_node_operations():
    graph = chain_graph(3)
    chain = Chain(((0,), (1,), (2,)), (1.0,) * 3, (1.0,) * 3, (0, 100, 100, 100), (0, 200, 200, 200), 0)
    ops = [("Fn", 0), ("Fe", 1), ("Fe", 2), ("B", 2), ("B", 1), ("Fe", 0), ("B", 0)]
    schedule = lower_chain_ops(graph, chain, ops)
    assert Forward(0, tape=False) in schedule.forward_ops and Forward(0) in schedule.backward_ops
    simulate(graph, schedule)


def test_revolve_recurrence_equals_griewanks_closed_form():
    from math import comb
    from recompute_graph.solvers.revolve import extra_forward_steps
    p, _ = extra_forward_steps(120, 8)

    def closed(length, slots):
        r = 0
        while comb(slots + r, slots) < length:
            r += 1
        return r * length - comb(slots + r, slots + 1)
    assert all(p[l, s] == closed(l, s) for l in range(1, 121) for s in range(1, 9))


@pytest.mark.parametrize("length, slots", [(1, 1), (5, 1), (10, 3), (37, 4), (64, 6)])
def test_revolve_schedule_reverses_every_stage_once_with_the_optimal_number_of_forwards(length, slots):
    from recompute_graph.solvers.revolve import extra_forward_steps, revolve_schedule
    ops = revolve_schedule(length, slots)
    assert [s for kind, s in ops if kind == "B"] == list(reversed(range(length)))
    extra = sum(1 for kind, _ in ops if kind != "B") - length
    assert extra == extra_forward_steps(length, slots)[0][length, slots]


def test_revolve_on_a_chain_graph_is_valid_and_fits_its_budget():
    graph = chain_graph(30)
    store_all = SOLVERS["store_all"](graph, None)
    smallest = SOLVERS["revolve"](graph, None)
    assert smallest.peak_bytes < store_all.peak_bytes
    assert max(smallest.schedule.computation_counts().values()) >= 3
    budget = (smallest.peak_bytes + store_all.peak_bytes) // 2
    planned = SOLVERS["revolve"](graph, budget)
    assert planned.fits(budget) and planned.recompute_cost <= smallest.recompute_cost


def recurrence(steps: int) -> CostGraph:
    """An RNN whose state is two tensors (marked as priced from a joint graph: chain_cuts cuts at narrow
    positions on those only): step t's gates ``g`` (400 B) read ``h[t-1]``; ``c`` reads ``g`` and
    ``c[t-1]``; ``h`` reads ``g`` and ``c``. After ``h[t]`` the values read later are ``c[t]`` and ``h[t]``
    (200 B), so no node has everything flowing through it."""
    nodes, h, c = [], None, None
    for t in range(steps):
        g = len(nodes)
        step = [(f"g{t}", (h,) if h is not None else (), 400, 4.0),
                (f"c{t}", (g, c) if c is not None else (g,), 100, 1.0),
                (f"h{t}", (g, g + 1), 100, 1.0)]
        for offset, (name, reads, size, cost) in enumerate(step):
            nodes.append(CostNode(g + offset, name, predecessors=reads, output_bytes=size, grad_bytes=size,
                                  backward_needs=reads, forward_cost=cost, backward_cost=2 * cost))
        h, c = g + 2, g + 1
    return CostGraph("recurrence", tuple(nodes), cost_source=f"by hand, as a {JOINT_COST_SOURCE}")


def test_a_state_of_two_tensors_is_cut_at_its_narrowest_positions_and_recomputed():
    """Split candidates leave an RNN of two-tensor state one stage; chain_cuts cuts it after every
    ``h[t]``, where only ``(c[t], h[t])`` is open, and chain_dp then plans recomputation under budgets
    that store-all cannot meet, the schedule valid and its claim the simulator's."""
    graph = recurrence(12)
    assert len(split_candidates(graph)) <= 1
    assert boundary_bytes(graph)[2::3][:-1] == [200] * 11
    assert chain_cuts(graph, max_stages=12) == [0] + [3 * t + 2 for t in range(11)]
    chain = chain_of(graph, max_stages=12)
    assert chain.cw[1:-1] == (400,) + (200,) * 11
    store_all = SOLVERS["store_all"](graph, None)
    tight = SOLVERS["chain_dp"](graph, int(0.6 * store_all.peak_bytes))
    assert tight.peak_bytes <= 0.6 * store_all.peak_bytes
    assert max(tight.schedule.computation_counts().values()) >= 2
    assert simulate(graph, tight.schedule) == tight.simulation


def test_graphs_with_enough_split_candidates_or_priced_by_the_executor_keep_them_as_cuts():
    graph = chain_graph(12)
    assert chain_cuts(graph) == split_candidates(graph)
    assert boundary_bytes(graph)[:-1] == [100] * 11
    executors = dataclasses.replace(recurrence(12), cost_source="traced")
    assert chain_cuts(executors, max_stages=12) == split_candidates(executors)


def test_auto_leaves_the_quadratic_dp_out_of_very_long_chains():
    from recompute_graph.planner import LOWER_SET_DP_MAX_NODES, auto_solvers
    assert {"dp_approx", "chain_dp"} <= set(auto_solvers(recurrence(1000)))  # more lower sets than dp_exact takes
    long = recurrence(LOWER_SET_DP_MAX_NODES // 3 + 1)
    assert "chain_dp" in auto_solvers(long) and "dp_approx" not in auto_solvers(long)


def test_auto_plans_budgets_under_its_grid_with_less_than_the_floors_recomputation():
    """The pool goes on below its grid (``pool_fractions``): at 8 % of the store-all budget, under the
    grid's last point (10 %), auto's plan is not the floor plan but one that recomputes less."""
    from recompute_graph.planner import candidate_pool, make_plan, pool_fractions
    graph = recurrence(120)
    assert [f for f in pool_fractions(graph) if f < 0.1][:2] == pytest.approx([0.07, 0.049])
    floor = min(candidate_pool(graph), key=lambda s: (s.peak_bytes, s.recompute_cost))
    plan = make_plan(graph, 0.08, "auto")
    assert floor.peak_bytes < plan.predicted_peak_bytes and plan.schedule != floor.schedule
    assert plan.simulation.recompute_cost < floor.recompute_cost


@settings(max_examples=40, deadline=None)
@given(cost_graphs(max_nodes=30), st.integers(2, 12), st.floats(0.3, 1.0))
def test_narrow_cuts_of_random_joint_graphs_keep_the_split_candidates_and_plan_validly(graph, stages, fraction):
    """On any graph priced as a joint graph: the cuts are sorted positions before the last node that keep
    every split candidate (when there are few enough), the chain's stages cover the graph in order, and
    chain_dp's plan is valid, its claim the simulator's, within the budget when it says it fits."""
    joint = dataclasses.replace(graph, cost_source=JOINT_COST_SOURCE)
    cuts, candidates = chain_cuts(joint, stages), split_candidates(joint)
    assert cuts == sorted(set(cuts)) and all(0 <= c < len(joint) - 1 for c in cuts)
    if len(candidates) + 1 <= stages:
        assert set(candidates) <= set(cuts)
    chain = chain_of(joint, stages)
    assert [v for stage in chain.stages for v in stage] == list(range(len(joint)))
    budget = int(fraction * SOLVERS["store_all"](joint, None).peak_bytes)
    try:
        solution = SOLVERS["chain_dp"](joint, budget, max_stages=stages)
    except (InfeasibleBudgetError, SolverError):
        return
    assert simulate(joint, solution.schedule) == solution.simulation
    if solution.fits(budget):
        assert solution.peak_bytes <= budget


@settings(max_examples=25, deadline=None)
@given(cost_graphs(max_nodes=30), st.floats(0.3, 1.0))
def test_the_finer_chain_cuts_at_every_split_candidate_and_more_and_plans_validly(graph, fraction):
    """chain_dp_fine cuts a joint graph at every split candidate when there are few enough, and at narrow
    positions inside every stage wider than a twentieth of the graph (a quarter for chain_dp); its plan is
    valid and the simulator's."""
    from recompute_graph.solvers.chain_dp import FINE_MAX_STAGES, FINE_REFINE_ABOVE
    joint = dataclasses.replace(graph, cost_source=JOINT_COST_SOURCE)
    fine = chain_of(joint, FINE_MAX_STAGES, FINE_REFINE_ABOVE)
    assert [v for stage in fine.stages for v in stage] == list(range(len(joint)))
    if len(split_candidates(joint)) + 1 <= FINE_MAX_STAGES:
        assert set(split_candidates(joint)) <= {stage[-1] for stage in fine.stages}
    budget = int(fraction * SOLVERS["store_all"](joint, None).peak_bytes)
    try:
        solution = SOLVERS["chain_dp_fine"](joint, budget)
    except (InfeasibleBudgetError, SolverError):
        return
    assert solution.solver == "chain_dp_fine" and f"{len(fine.stages)} stages" in solution.description
    assert simulate(joint, solution.schedule) == solution.simulation
    if solution.fits(budget):
        assert solution.peak_bytes <= budget


def test_auto_runs_the_finer_chain_on_joint_graphs_where_it_differs_from_chain_dps():
    """``auto`` adds chain_dp_fine on a joint cost graph whose finer chain has other stages than
    chain_dp's (a recurrence without split candidates), not where the two chains are the same stages (a
    plain chain: every node a split candidate) nor on graphs priced from a trace."""
    from recompute_graph.planner import auto_solvers
    from recompute_graph.solvers.chain_dp import FINE_MAX_STAGES, FINE_REFINE_ABOVE
    nodes = []  # eight blocks of ten nodes, nine of them reading the block's input
    for v in range(80):
        reads = () if v == 0 else (v - 1,) if v % 10 in (0, 1) else (v - 1, v - v % 10)
        nodes.append(CostNode(v, f"n{v}", predecessors=reads, output_bytes=100, grad_bytes=100,
                              backward_needs=reads, forward_cost=1.0, backward_cost=2.0))
    joint = CostGraph("blocks", tuple(nodes), cost_source=JOINT_COST_SOURCE)
    assert len(chain_of(joint).stages) == 16  # split candidates only: no stage wider than a quarter
    assert chain_of(joint, FINE_MAX_STAGES, FINE_REFINE_ABOVE).stages != chain_of(joint).stages
    assert auto_solvers(joint)[-2:] == ("chain_dp", "chain_dp_fine")
    traced = dataclasses.replace(joint, cost_source="traced")
    assert "chain_dp" in auto_solvers(traced) and "chain_dp_fine" not in auto_solvers(traced)
    plain = dataclasses.replace(chain_graph(8), cost_source=JOINT_COST_SOURCE)
    assert chain_of(plain, FINE_MAX_STAGES, FINE_REFINE_ABOVE).stages == chain_of(plain).stages
    assert "chain_dp" in auto_solvers(plain) and "chain_dp_fine" not in auto_solvers(plain)
