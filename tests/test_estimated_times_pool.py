"""The planner's second opinion: on a graph whose node times are measured, the pool also holds the plans
the solvers make on the FLOP roofline's times (``CostGraph.estimated_costs``,
``planner.estimated_times_graph``), each priced with the measured times."""
import dataclasses
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

from recompute_graph import planner
from recompute_graph.errors import GraphError
from recompute_graph.graph import JOINT_COST_SOURCE, CostGraph
from recompute_graph.saved_plans import structure_fingerprint
from recompute_graph.simulate import simulate

from strategies import cost_graphs
from test_schedule_relaxation import auto_peaks_as_the_budget_shrinks, blocks


@st.composite
def measured_joint_graphs(draw):
    """A random joint cost graph with random estimated times beside its own."""
    graph = draw(cost_graphs(max_nodes=16))
    estimates = tuple((float(draw(st.integers(1, 10))), float(draw(st.integers(1, 20)))) for _ in graph.nodes)
    return dataclasses.replace(graph, cost_source=f"measured, {JOINT_COST_SOURCE}", estimated_costs=estimates)


def _floor(graph: CostGraph) -> int:
    return planner.min_feasible_budget(graph)


@settings(max_examples=30, deadline=None)
@given(measured_joint_graphs())
def test_plans_made_on_the_estimates_are_priced_on_the_measured_times_and_only_lower_the_floor(graph):
    without = dataclasses.replace(graph, estimated_costs=())
    pool = planner.candidate_pool(graph)
    for plan in pool:
        assert plan.simulation == simulate(graph, plan.schedule)  # the measured times, not the estimates
    budgets = [planner.min_budget_for_step(graph, plan.simulation) for plan in pool]
    assert budgets == sorted(budgets)
    assert all(a.recompute_cost > b.recompute_cost for a, b in zip(pool, pool[1:]))
    assert _floor(graph) <= _floor(without)
    peaks = auto_peaks_as_the_budget_shrinks(graph)
    assert peaks == sorted(peaks, reverse=True)


@settings(max_examples=15, deadline=None)
@given(measured_joint_graphs())
def test_estimates_equal_to_the_measured_times_add_no_plan(graph):
    same = dataclasses.replace(graph, estimated_costs=tuple((n.forward_cost, n.backward_cost) for n in graph.nodes))
    without = dataclasses.replace(graph, estimated_costs=())
    assert [p.schedule for p in planner.candidate_pool(same)] == [p.schedule for p in planner.candidate_pool(without)]


def test_the_estimated_times_graph_swaps_the_times_and_keeps_the_rest():
    graph = dataclasses.replace(CostGraph("g", ()), cost_source=JOINT_COST_SOURCE)
    assert planner.estimated_times_graph(graph) is None
    graph = _example_graph()
    twin = planner.estimated_times_graph(graph)
    assert twin is planner.estimated_times_graph(graph)  # made once per graph
    assert [(n.forward_cost, n.backward_cost) for n in twin.nodes] == list(graph.estimated_costs)
    assert [dataclasses.replace(n, forward_cost=0.0, backward_cost=0.0) for n in twin.nodes] == \
        [dataclasses.replace(n, forward_cost=0.0, backward_cost=0.0) for n in graph.nodes]
    assert twin.estimated_costs == () and twin.cost_source.startswith("flop-estimate beside")


def _example_graph() -> CostGraph:
    graph = blocks(count=3, width=4)
    return dataclasses.replace(graph, estimated_costs=tuple((0.5 * i, 2.0) for i in range(len(graph))))


def test_estimated_costs_survive_saving_are_not_structure_and_must_match_the_nodes():
    graph = _example_graph()
    loaded = CostGraph.from_dict(graph.to_dict())
    assert loaded.estimated_costs == graph.estimated_costs
    assert structure_fingerprint(graph) == structure_fingerprint(dataclasses.replace(graph, estimated_costs=()))
    with pytest.raises(GraphError, match="estimated costs for"):
        dataclasses.replace(graph, estimated_costs=graph.estimated_costs[:-1])


def test_blooms_floor_with_plans_made_on_the_estimated_times_is_no_higher_and_priced_on_the_measured():
    """BLOOM's joint graph with measured times: chain_dp's and chain_dp_fine's lowest plans needed 207-216
    KB; the same solvers on the roofline's times found a plan of the same graph that needs 176-192 KB.
    Since session 47's changes to the joint graph (its unreached outputs' zero gradients folded away,
    copies read as their inputs) the measured times' plans reach that floor too (179,857 B both ways): the pool with the estimated times' plans is no higher, and its
    plan at the floor is priced on the measured times."""
    import recompute_graph as rg
    from models_zoo import third_party
    from models_zoo.conformance import call_of
    from recompute_graph.losses import default_training_loss
    torch.manual_seed(0)
    model, call = third_party.build("hf_bloom")
    args, kwargs = call_of(call)
    compiled = torch.compile(model, backend=rg.backend(1.0, solver="store_all"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default_training_loss(compiled(*args, **kwargs)).backward()
    graph = rg.last_lowering().graph
    assert graph.cost_source.startswith("measured") and len(graph.estimated_costs) == len(graph)
    assert any(measured != estimated for measured, estimated in
               zip(((n.forward_cost, n.backward_cost) for n in graph.nodes), graph.estimated_costs))
    floor = _floor(graph)
    assert floor <= _floor(dataclasses.replace(graph, estimated_costs=()))
    plan = planner.make_plan(graph, floor)
    assert plan.simulation == simulate(graph, plan.schedule) and plan.simulation.peak_bytes <= floor


@settings(max_examples=25, deadline=None)
@given(measured_joint_graphs(), st.randoms(use_true_random=False))
def test_the_floor_an_error_names_does_not_move_with_the_measured_times(graph, rnd):
    """A capture measures the node times anew. The floor an ``InfeasibleBudgetError`` names is that of
    the plans the measured times do not decide (``reproducible_floor_bytes``): the same for the graph
    with other measured times, and planning it there finds a plan."""
    remeasured = dataclasses.replace(graph, nodes=tuple(
        dataclasses.replace(n, forward_cost=n.forward_cost * rnd.uniform(0.2, 5),
                            backward_cost=n.backward_cost * rnd.uniform(0.2, 5)) for n in graph.nodes))
    floor = planner.reproducible_floor_bytes(graph)
    assert floor == planner.reproducible_floor_bytes(remeasured)
    for candidate in (graph, remeasured):
        assert floor >= _floor(candidate)
        assert planner.make_plan(candidate, floor).min_budget_bytes <= floor
        if floor > 1:
            with pytest.raises(planner.InfeasibleBudgetError) as error:
                planner.make_plan(candidate, _floor(candidate) - 1)
            assert error.value.min_budget_bytes == floor
            lower = _floor(candidate) < floor
            assert (f"go down to {_floor(candidate)} bytes" in str(error.value)) == lower


@settings(max_examples=10, deadline=None)
@given(cost_graphs(max_nodes=12))
def test_without_estimated_times_the_named_floor_is_the_pools(graph):
    """Times from FLOPs or a file repeat at every planning: every plan of the pool counts."""
    assert planner.reproducible_floor_bytes(graph) == _floor(graph)
