"""One budget over the graphs of a broken step (step_graphs): the step model and the choice of plans."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recompute_graph.errors import InfeasibleBudgetError
from recompute_graph.planner import candidate_pool, min_budget_for_peak, planning_margin, usable_bytes_of
from recompute_graph.step_graphs import (PlanMemory, _enumerate, _sequence_dp, _Step, choose_step_plans,
                                         output_bytes, param_grad_bytes, plan_memory, step_peak_of)
from recompute_graph import CostGraph, CostNode

from strategies import cost_graphs


def chain_graph(n: int, name: str) -> CostGraph:
    """n nodes in a chain, each saving its input and owning parameters."""
    return CostGraph(name, tuple(
        CostNode(i, f"c{i}", predecessors=(i - 1,) if i else (), output_bytes=100, grad_bytes=100,
                 backward_needs=(i - 1,) if i else (), param_grad_bytes=40, forward_cost=1.0, backward_cost=2.0)
        for i in range(n)))


def _brute_force(step, memories, usable):
    """Every combination judged by the step model: (least cost of those fitting, its choice), lowest peak."""
    keys = list(dict.fromkeys(step.calls))
    runs = {key: step.calls.count(key) for key in keys}
    best, lowest = None, None
    for combination in itertools.product(*(range(len(memories[key])) for key in keys)):
        chosen = {key: memories[key][i] for key, i in zip(keys, combination)}
        peak = step.peak(chosen)
        lowest = peak if lowest is None else min(lowest, peak)
        cost = sum(chosen[key].recompute_cost * runs[key] for key in keys)
        if peak <= usable and (best is None or cost < best):
            best = cost
    return best, lowest


def _memories(draw_lists):
    return [PlanMemory(forward_peak_bytes=f, held_bytes=h, backward_peak_bytes=b, last_backward_peak_bytes=b + extra,
                       recompute_cost=float(c)) for f, h, b, extra, c in draw_lists]


_plan_memory_lists = st.lists(st.tuples(st.integers(0, 100), st.integers(0, 60), st.integers(0, 120),
                                        st.integers(0, 30), st.integers(0, 9)), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(st.lists(_plan_memory_lists, min_size=1, max_size=4), st.lists(st.integers(0, 40), min_size=4, max_size=4),
       st.lists(st.integers(0, 40), min_size=4, max_size=4), st.integers(0, 400))
def test_the_dynamic_program_over_distinct_graphs_finds_what_trying_every_choice_finds(plans, outputs, grads, usable):
    keys = list(range(len(plans)))
    step = _Step(keys, dict(zip(keys, outputs)), dict(zip(keys, grads)))
    memories = {key: _memories(plans[key]) for key in keys}
    expected_cost, expected_lowest = _brute_force(step, memories, usable)
    chosen, lowest = _sequence_dp(step, memories, usable)
    assert lowest == expected_lowest
    if expected_cost is None:
        assert chosen is None
    else:
        picked = {key: memories[key][i] for key, i in chosen.items()}
        assert step.peak(picked) <= usable
        assert sum(m.recompute_cost for m in picked.values()) == expected_cost


@settings(max_examples=100, deadline=None)
@given(st.lists(_plan_memory_lists, min_size=1, max_size=3), st.lists(st.integers(0, 2), min_size=2, max_size=6),
       st.integers(0, 500))
def test_a_graph_called_several_times_gets_one_plan_for_all_its_calls(plans, order, usable):
    keys = list(range(len(plans)))
    calls = [key % len(keys) for key in order]
    step = _Step(calls, {key: 10 for key in keys}, {key: 5 for key in keys})
    memories = {key: _memories(plans[key]) for key in keys if key in calls}
    runs = {key: calls.count(key) for key in memories}
    expected_cost, expected_lowest = _brute_force(step, memories, usable)
    chosen, lowest = _enumerate(step, memories, runs, usable)
    assert lowest == expected_lowest
    assert (chosen is None) == (expected_cost is None)
    if chosen is not None:
        assert sum(memories[key][i].recompute_cost * runs[key] for key, i in chosen.items()) == expected_cost


def test_the_step_model_counts_what_earlier_calls_hold_and_later_gradients():
    small = PlanMemory(forward_peak_bytes=10, held_bytes=4, backward_peak_bytes=12, last_backward_peak_bytes=15,
                       recompute_cost=0.0)
    step = _Step(("a", "b", "c"), {"a": 3, "b": 2, "c": 1}, {"a": 7, "b": 5, "c": 100})
    rows = step.timeline({"a": small, "b": small, "c": small})
    # a: nothing before it, b's and c's gradients kept during its backward
    assert rows[0] == (10, 5 + 100 + 12, 4 + 3)
    # b: a's saved values and output before it; c's gradients during its backward
    assert rows[1] == (7 + 10, 7 + 100 + 12, 7 + 4 + 2)
    # c, the last: the loss at its outputs
    assert rows[2] == (13 + 10, 13 + 15, 13 + 4 + 1)
    assert step.peak({"a": small, "b": small, "c": small}) == 7 + 100 + 12  # b's backward


@settings(max_examples=25, deadline=None)
@given(cost_graphs(max_nodes=8), cost_graphs(max_nodes=8), st.floats(0.05, 1.0))
def test_the_chosen_plans_fit_and_a_smaller_budget_never_costs_less(first, second, fraction):
    graphs = {0: first, 1: second}
    calls = (0, 1)
    store_all = choose_step_plans(calls, graphs, 1.0)
    assert store_all.recompute_cost == 0
    budget = max(1, int(fraction * store_all.budget_bytes))
    try:
        chosen = choose_step_plans(calls, graphs, budget)
    except InfeasibleBudgetError as error:
        assert error.min_budget_bytes > budget
        at_floor = choose_step_plans(calls, graphs, error.min_budget_bytes)
        assert at_floor.predicted_step_peak_bytes <= usable_bytes_of(error.min_budget_bytes, 0,
                                                                      planning_margin(first))
        return
    margin = max(planning_margin(first), planning_margin(second))
    assert chosen.predicted_step_peak_bytes <= usable_bytes_of(budget, 0, margin)
    assert chosen.predicted_step_peak_bytes == step_peak_of(calls, graphs, chosen.plans)
    assert all(plan in candidate_pool(graphs[key]) for key, plan in chosen.plans.items())
    smaller = max(1, int(budget * 0.8))
    try:
        assert choose_step_plans(calls, graphs, smaller).recompute_cost >= chosen.recompute_cost
    except InfeasibleBudgetError:
        pass


def test_a_step_of_a_chain_split_in_two_at_a_byte_budget():
    """Two halves of a chain: each plan's memory from its simulation, the outputs handed on, and the
    parameter gradients of the second half beside the first half's backward."""
    first, second = chain_graph(6, "first half"), chain_graph(6, "second half")
    graphs = {"first": first, "second": second}
    plans = {"first": candidate_pool(first)[0], "second": candidate_pool(second)[0]}
    memory = {key: plan_memory(graphs[key], plans[key]) for key in graphs}
    expected = max(memory["first"].forward_peak_bytes,
                   param_grad_bytes(second) + memory["first"].backward_peak_bytes,
                   memory["first"].held_bytes + output_bytes(first) + max(memory["second"].forward_peak_bytes,
                                                                         memory["second"].last_backward_peak_bytes))
    assert step_peak_of(("first", "second"), graphs, plans) == expected
    store_all = choose_step_plans(("first", "second"), graphs, 1.0)
    with pytest.raises(InfeasibleBudgetError, match="smallest feasible budget") as raised:
        choose_step_plans(("first", "second"), graphs, 100)
    floor = raised.value.min_budget_bytes
    assert floor == min_budget_for_peak(
        min(step_peak_of(("first", "second"), graphs, {"first": a, "second": b})
            for a in candidate_pool(first) for b in candidate_pool(second)), 0, planning_margin(first))
    tight = choose_step_plans(("first", "second"), graphs, (floor + store_all.budget_bytes) // 2)
    assert tight.predicted_step_peak_bytes < store_all.predicted_step_peak_bytes
    assert tight.recompute_cost > 0
    assert "call  graph  plan" in str(tight) and "2 graph calls of 2 graphs" in repr(tight)
    assert choose_step_plans(("first", "second"), graphs, floor).predicted_step_peak_bytes <= floor


@pytest.mark.parametrize("calls", [("first", "second"), ("first", "second", "first")])
def test_the_floor_a_broken_step_names_is_planned_again_when_the_times_move(calls, monkeypatch):
    """A new capture measures the node times anew, and the plans made on them can differ: the floor the
    error names is that of the plans a new capture makes again (``steady``: store-all here), so that
    planning the step at it succeeds with whatever else the next pool holds. Before, it was the least
    of this pool's plans, which the next planning could miss. With a graph called twice the
    candidates are thinned (here to two per graph), and the steady plans stay."""
    import recompute_graph.step_graphs as step_graphs
    monkeypatch.setattr(step_graphs, "ENUMERATION_LIMIT", 4)
    first, second = chain_graph(12, "first"), chain_graph(12, "second")
    graphs = {"first": first, "second": second}
    pools = {key: list(candidate_pool(graph)) for key, graph in graphs.items()}  # least budget first
    assert all(len(pool) == 9 and pool[-1].recompute_cost == 0 for pool in pools.values())
    steady = {key: [pool[-1], pool[4]] for key, pool in pools.items()}  # store-all and one more
    with pytest.raises(InfeasibleBudgetError, match="go down to") as raised:
        choose_step_plans(calls, graphs, 100, pools, steady=steady)
    named = raised.value.min_budget_bytes
    lowest = min(step_peak_of(calls, graphs, {"first": a, "second": b})
                 for a in pools["first"] for b in pools["second"])
    assert named > min_budget_for_peak(lowest, 0, planning_margin(first))
    # the next capture's pools lack this one's lowest plans; the steady one is in their middle, where
    # thinning (two per graph: the first and the last) would drop it
    later = {key: [pool[5], pool[4], pool[6], pool[7], pool[8]] for key, pool in pools.items()}
    again = choose_step_plans(calls, graphs, named, later, steady=steady)
    assert again.predicted_step_peak_bytes <= usable_bytes_of(named, 0, planning_margin(first))
    # without steady plans, the floor named is the candidates' own, as before
    with pytest.raises(InfeasibleBudgetError) as raised:
        choose_step_plans(calls, graphs, 100, pools)
    assert "go down to" not in str(raised.value)
    assert raised.value.min_budget_bytes < named
