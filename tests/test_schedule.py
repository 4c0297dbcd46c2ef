"""Schedules, the shared lowering, and the simulator as the judge (valid and invalid programs)."""
import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from recompute_graph import CostGraph, CostNode, GraphError
from recompute_graph.schedule import (Backward, Forward, FreeValue, Schedule, insert_frees, lower_segments,
                                      prefix_lower_sets, store_all_lower_sets)
from recompute_graph.simulate import ScheduleError, simulate

from strategies import cost_graphs


def chain(n: int = 4, output: int = 100, grad: int = 100, buffer: int = 0, params: int = 0) -> CostGraph:
    """n nodes in a chain; each saves its input (node 0 saves nothing: it reads the model input)."""
    return CostGraph("chain", tuple(
        CostNode(i, f"c{i}", predecessors=(i - 1,) if i else (), output_bytes=output, grad_bytes=grad,
                 backward_needs=(i - 1,) if i else (), saved_buffer_bytes=buffer, param_grad_bytes=params,
                 forward_cost=1.0, backward_cost=2.0)
        for i in range(n)))


def test_store_all_of_a_chain_keeps_every_input_and_peaks_at_the_start_of_backward():
    g = chain(4)
    schedule = lower_segments(g, store_all_lower_sets(g))
    # values are dropped after their last reader; the tapes keep what the backward needs
    assert schedule.forward_ops == (Forward(0), Forward(1), FreeValue(0), Forward(2), FreeValue(1), Forward(3),
                                    FreeValue(2))
    assert schedule.backward_ops == (FreeValue(3), Backward(3), Backward(2), Backward(1), Backward(0))
    result = simulate(g, schedule)
    # after forward: 4 outputs live (0..2 through tapes, 3 as the model output); then the output
    # gradient arrives while the loss still holds the output
    assert result.forward_peak_bytes == 400
    assert result.peak_bytes == 400 + 100
    assert result.recompute_cost == 0 and result.compute_cost == 4 * 1.0 + 4 * 2.0
    assert result.final_bytes == 100  # the output gradient, held by autograd to the end


def test_two_segments_recompute_the_first_and_keep_the_boundary():
    g = chain(6)
    schedule = lower_segments(g, prefix_lower_sets(g, [2]))
    assert schedule.recomputed_nodes() == (0, 1, 2)
    result = simulate(g, schedule)
    assert result.recompute_cost == 3.0
    assert result.forward_peak_bytes < simulate(g, lower_segments(g, store_all_lower_sets(g))).forward_peak_bytes


def test_parameter_gradients_and_buffers_are_charged():
    g = chain(3, buffer=10, params=1000)
    result = simulate(g, lower_segments(g, store_all_lower_sets(g)))
    assert result.final_bytes == 3 * 1000 + 100  # parameter gradients and the output gradient
    assert result.forward_peak_bytes == 3 * 100 + 3 * 10


def test_a_taped_forward_holds_its_saved_buffers_beside_its_workspace_while_it_runs():
    """A dropout's kernel makes its mask while its float noise (the workspace) is still live; the tape
    then keeps the mask. Counted only after the kernel, the replayed dropouts of DistilBERT and T5 were
    predicted under the allocator (0.986 and 0.997)."""
    node = CostNode(0, "dropout", output_bytes=100, grad_bytes=100, saved_buffer_bytes=25, workspace_bytes=100,
                    forward_cost=1.0, backward_cost=1.0)
    g = CostGraph("dropout", (node,))
    result = simulate(g, Schedule((Forward(0),), (Backward(0),)))
    assert result.forward_peak_bytes == 100 + 100 + 25  # output, workspace and mask at once
    # recomputed without a tape in backward, then with one: the mask is made both times
    result = simulate(g, Schedule((Forward(0, tape=False),), (Forward(0), Backward(0))))
    assert result.forward_peak_bytes == 100 + 100 + 25


def test_insert_frees_frees_after_the_last_reader_and_handles_recomputation():
    g = chain(3)
    ops = [Forward(0, tape=False), Forward(1, tape=False), Forward(2, tape=False)]
    back = [Backward(2), Forward(0, tape=False), Forward(1), Backward(1), Forward(0), Backward(0)]
    schedule = insert_frees(g, ops, back)
    assert schedule.forward_ops == (Forward(0, tape=False), Forward(1, tape=False), FreeValue(0),
                                    Forward(2, tape=False), FreeValue(1))
    with pytest.raises(ScheduleError, match="no tape"):
        simulate(g, schedule)  # node 2 was computed without tape
    good = insert_frees(g, ops[:2] + [Forward(2)], back)
    assert good.computation_counts() == {0: 3, 1: 2, 2: 1}
    assert simulate(g, good).recompute_cost == 3.0


@pytest.mark.parametrize("forward, backward, message", [
    ((Forward(1),), (), "reads node 0"),
    ((Forward(0), FreeValue(0), FreeValue(0)), (), "not live"),
    ((Forward(0), Forward(1), FreeValue(0), Forward(2)), (Backward(1),), "before the backward of node 2"),
    ((Forward(0), Forward(1), Forward(2)), (Backward(2), Backward(2)), "already ran"),
    ((Forward(0), Forward(0)), (), "already holds a tape"),
    ((Forward(0), Forward(1), Forward(2)), (Backward(2),), "never propagated"),
    ((Forward(0), Forward(1), FreeValue(1)), (), "not live at the end"),
    ((Forward(7),), (), "not an op over this graph"),
])
def test_simulator_rejects_invalid_schedules_with_a_clear_error(forward, backward, message):
    g = chain(3)
    with pytest.raises(ScheduleError, match=message):
        simulate(g, Schedule(forward, backward))
    assert issubclass(ScheduleError, ValueError)


def test_lowering_rejects_sequences_that_are_not_increasing_lower_sets():
    g = chain(3)
    with pytest.raises(GraphError, match="end with"):
        lower_segments(g, [frozenset({0})])
    with pytest.raises(GraphError, match="not a lower set"):
        lower_segments(g, [frozenset({1}), frozenset({0, 1, 2})])
    with pytest.raises(GraphError, match="strictly"):
        lower_segments(g, [frozenset({0}), frozenset({0}), frozenset({0, 1, 2})])


def test_timeline_has_one_point_per_op_and_the_gradient_arrival():
    g = chain(3)
    schedule = lower_segments(g, store_all_lower_sets(g))
    result = simulate(g, schedule)
    assert len(result.timeline) == len(schedule.ops) + 1
    assert max(p.peak_bytes for p in result.timeline) == result.peak_bytes
    assert result.timeline[len(schedule.forward_ops)].op is None


def test_the_peak_counts_the_workspace_of_a_backward_no_gradient_reaches():
    """A joint graph's weight-transpose unit: no gradient reaches it, yet its backward makes parameter
    gradients, with a workspace. The op's peak counted the workspace and the step's peak did not (350
    bytes against the op's 10,200)."""
    nodes = (CostNode(0, "x", output_bytes=100, grad_bytes=100, forward_cost=1.0, backward_cost=1.0),
             CostNode(1, "y", predecessors=(0,), output_bytes=100, grad_bytes=100, backward_needs=(0,),
                      forward_cost=1.0, backward_cost=1.0),
             CostNode(2, "t", predecessors=(0,), output_bytes=100, grad_bytes=100, backward_needs=(0,),
                      param_grad_bytes=50, backward_workspace_bytes=10_000, forward_cost=1.0, backward_cost=1.0))
    graph = CostGraph("transpose", nodes, output_indices=(1,))
    result = simulate(graph, lower_segments(graph, [frozenset(range(3))]))
    assert result.peak_bytes == max(p.peak_bytes for p in result.timeline) > 10_000


@settings(max_examples=150, deadline=None)
@given(cost_graphs())
def test_every_prefix_strategy_of_a_random_graph_lowers_to_a_valid_schedule(graph):
    n = len(graph)
    full = simulate(graph, lower_segments(graph, store_all_lower_sets(graph)))
    for cut in range(n - 1):
        result = simulate(graph, lower_segments(graph, prefix_lower_sets(graph, [cut])))
        assert result.compute_cost >= full.compute_cost
        held = sum(graph.nodes[o].grad_bytes for o in graph.outputs if graph.nodes[o].requires_grad)
        assert result.final_bytes == full.final_bytes == sum(node.param_grad_bytes for node in graph) + held


@pytest.mark.parametrize("b_is_an_output", [False, True])
def test_a_second_gradient_into_an_existing_buffer_is_charged_while_it_is_summed(b_is_an_output):
    # 0 feeds 1 and 2, both feed 3: node 0's buffer gets a second gradient from node 1's backward
    g = CostGraph("diamond", (
        CostNode(0, "a", output_bytes=100, grad_bytes=100, forward_cost=1.0),
        CostNode(1, "b", predecessors=(0,), output_bytes=100, grad_bytes=100, backward_needs=(0,)),
        CostNode(2, "c", predecessors=(0,), output_bytes=100, grad_bytes=100, backward_needs=(0,)),
        CostNode(3, "d", predecessors=(1, 2), output_bytes=100, grad_bytes=100, backward_needs=(1, 2)),
    ), output_indices=(1, 3) if b_is_an_output else ())
    result = simulate(g, lower_segments(g, store_all_lower_sets(g)))
    backward_1 = next(p for p in result.timeline if p.op == Backward(1))
    before = result.timeline[result.timeline.index(backward_1) - 1].live_bytes
    if b_is_an_output:
        # autograd holds an output's gradient to the end: incoming gradient and new sum on top
        assert backward_1.peak_bytes == before + 100 + 100
    else:
        # the incoming gradient on top; node 1's own gradient is released before the sum is made
        assert backward_1.peak_bytes == before + 100


def test_an_additions_two_inputs_share_its_gradient_buffer_until_both_have_used_it():
    """autograd hands an addition's output gradient to both inputs without a copy: one buffer, alive
    until the second input's backward has run; the first sum into a shared buffer is a new buffer."""
    g = CostGraph("residual", (
        CostNode(0, "x", output_bytes=100, grad_bytes=100),
        CostNode(1, "branch", predecessors=(0,), output_bytes=100, grad_bytes=100, backward_needs=(0,)),
        CostNode(2, "add", predecessors=(0, 1), output_bytes=100, grad_bytes=100, backward_aliases_grad=True),
        CostNode(3, "head", predecessors=(2,), output_bytes=10, grad_bytes=10, backward_needs=(2,)),
    ), source="traced")
    result = simulate(g, lower_segments(g, store_all_lower_sets(g)))
    timeline = list(result.timeline)
    before = {p.op: timeline[k - 1] for k, p in enumerate(timeline) if p.op is not None}
    after = {p.op: p for p in timeline if p.op is not None}
    # head's backward makes the add's gradient (100) and frees the add's value (its tape)
    assert after[Backward(3)].live_bytes == before[Backward(3)].live_bytes + 100 - 100
    # the add hands its buffer to x and branch: no new bytes, and the add's tape held nothing
    assert after[Backward(2)].live_bytes == before[Backward(2)].live_bytes
    # branch sums a second gradient into x's shared buffer: incoming and a new sum on top while it runs;
    # then the shared buffer (branch's last user) and branch's tape (x's value) are released
    assert after[Backward(1)].peak_bytes == before[Backward(1)].live_bytes + 100 + 100
    assert after[Backward(1)].live_bytes == before[Backward(1)].live_bytes + 100 - 100 - 100
    assert result.final_bytes == 10  # the output's gradient, held by autograd to the end


def _product(steps: bool) -> CostGraph:
    """``p = a * b`` read by a head: p's backward makes b's gradient from a, lets go of a, then makes
    a's gradient from b (``backward_steps``), or makes both beside both saved factors (no steps)."""
    stepped = dict(backward_steps=(1, 0), backward_step_workspace_bytes=(0, 0), tape_release_steps=(0, 1))
    return CostGraph("product", (
        CostNode(0, "a", output_bytes=100, grad_bytes=100),
        CostNode(1, "b", output_bytes=100, grad_bytes=100),
        CostNode(2, "p", predecessors=(0, 1), output_bytes=100, grad_bytes=100, backward_needs=(0, 1),
                 **(stepped if steps else {})),
        CostNode(3, "head", predecessors=(2,), output_bytes=10, grad_bytes=10, backward_needs=(2,)),
    ), source="traced")


def test_a_backward_in_steps_lets_go_of_a_saved_value_before_its_next_gradient():
    graphs = {steps: _product(steps) for steps in (False, True)}
    results = {steps: simulate(g, lower_segments(g, store_all_lower_sets(g))) for steps, g in graphs.items()}
    points = {steps: {p.op: (k, p) for k, p in enumerate(r.timeline) if p.op is not None}
              for steps, r in results.items()}
    for steps, result in results.items():
        k, point = points[steps][Backward(2)]
        before = result.timeline[k - 1].live_bytes
        # both gradients beside both factors, or b's gradient, a let go of, then a's gradient
        assert point.peak_bytes == before + (100 if steps else 200)
        # afterwards the same: both gradients made, both factors and p's gradient released
        assert point.live_bytes == before + 200 - 100 - 100 - 100
    assert results[True].final_bytes == results[False].final_bytes


def test_a_steps_workspace_counts_beside_what_is_live_at_that_step():
    g = CostGraph("product", tuple(
        dataclasses.replace(n, backward_step_workspace_bytes=(0, 70)) if n.index == 2 else n
        for n in _product(True).nodes), source="traced")
    result = simulate(g, lower_segments(g, store_all_lower_sets(g)))
    k, point = next((k, p) for k, p in enumerate(result.timeline) if p.op == Backward(2))
    # step 1: p's gradient, the factor b, both gradients, and 70 bytes of the step's own
    assert point.peak_bytes == result.timeline[k - 1].live_bytes + 100 - 100 + 100 + 70
    with pytest.raises(GraphError, match="backward_steps"):
        CostGraph("bad", (CostNode(0, "a"), CostNode(1, "b", predecessors=(0,), backward_steps=(0,))))


@pytest.mark.parametrize("loss_bytes", [0, 50])
def test_on_the_compiler_path_the_outputs_are_dropped_before_their_gradients_arrive(loss_bytes):
    """The generated backward takes the output gradients after the loop dropped the outputs; a loss
    with a transient holds them while it makes their gradients (``planner.step_peak_bytes``)."""
    from recompute_graph.planner import step_peak_bytes
    g = dataclasses.replace(chain(4), output_gradients_held=False, loss_bytes=loss_bytes, source="traced")
    result = simulate(g, lower_segments(g, store_all_lower_sets(g)))
    arrival = next(p for p in result.timeline if p.op is None)
    assert result.outputs_dropped_bytes == 100  # node 3's value, freed first in the backward
    assert arrival.live_bytes == 300 + 100  # the inputs the tapes keep, and the output's gradient
    assert result.peak_bytes == 500  # node 3's backward makes node 2's gradient
    assert step_peak_bytes(g, result) == (400 + 100 + loss_bytes if loss_bytes else 500)
    held = simulate(chain(4), lower_segments(chain(4), store_all_lower_sets(chain(4))))
    assert next(p for p in held.timeline if p.op is None).live_bytes == 500 and held.outputs_dropped_bytes == 0


def _joint(graph):
    """``graph`` as a joint graph's cost graph (dead recomputations exist only there), no node saving a
    buffer of its own (a recomputation whose backward reads none of what it makes is dead)."""
    from recompute_graph.graph import JOINT_COST_SOURCE
    return dataclasses.replace(graph, cost_source=f"measured, {JOINT_COST_SOURCE}",
                               nodes=tuple(dataclasses.replace(v, saved_buffer_bytes=0) for v in graph.nodes))


def _recorded_dead_is_found_dead(joint, schedule):
    from recompute_graph.schedule import DEAD_POSITIONS, dead_recomputations
    recorded = schedule.__dict__[DEAD_POSITIONS]
    assert recorded == dead_recomputations(joint, (*schedule.forward_ops, None, *schedule.backward_ops))
    assert simulate(joint, schedule) == simulate(joint, Schedule(schedule.forward_ops, schedule.backward_ops))
    return recorded


@settings(max_examples=100, deadline=None)
@given(cost_graphs(max_nodes=10), st.lists(st.integers(0, 9), max_size=4))
def test_the_liveness_pass_leaves_the_dead_recomputations_the_simulator_would_find(graph, cuts):
    """``insert_frees`` records the dead recomputations of the schedule it makes (a joint graph's), at
    the positions ``dead_recomputations`` finds on it, frees included; the simulation is the same
    without the record."""
    from recompute_graph.schedule import prefix_lower_sets
    joint = _joint(graph)
    _recorded_dead_is_found_dead(joint, lower_segments(joint, prefix_lower_sets(joint, cuts)))


def test_a_segments_last_recomputation_is_recorded_dead():
    """A chain whose backwards read only their inputs, cut after node 2: the recomputed node 2 is read by
    nothing (its backward reads node 1), so its copy is dead, in the backward ops after the frees."""
    nodes = tuple(CostNode(i, f"n{i}", predecessors=(i - 1,) if i else (), output_bytes=100, grad_bytes=100,
                           backward_needs=(i - 1,) if i else (), forward_cost=1.0, backward_cost=1.0)
                  for i in range(6))
    joint = _joint(CostGraph("chain", nodes))
    schedule = lower_segments(joint, [frozenset(range(3)), frozenset(range(6))])
    recorded = _recorded_dead_is_found_dead(joint, schedule)
    sequence = (*schedule.forward_ops, None, *schedule.backward_ops)
    assert [sequence[at] for at in recorded] == [Forward(2)]


def test_random_nodes_first_computed_out_of_the_models_order_are_refused():
    """Two dropouts draw from one stream: computed the other way round, each would draw the other's
    mask (the fuzz test's dropout on the model input, moved into its reader's segment)."""
    nodes = tuple(CostNode(i, f"dropout{i}", successors=(2,), output_bytes=100, grad_bytes=100, random=True,
                           forward_cost=1.0) for i in range(2))
    g = CostGraph("dropouts", nodes + (CostNode(2, "add", predecessors=(0, 1), output_bytes=100, grad_bytes=100,
                                                forward_cost=1.0),))
    backward = [Backward(2), Backward(1), Backward(0)]
    assert simulate(g, insert_frees(g, [Forward(0), Forward(1), Forward(2)], backward)).recompute_cost == 0
    with pytest.raises(ScheduleError, match="random node first computed after random node 1"):
        simulate(g, insert_frees(g, [Forward(1), Forward(0), Forward(2)], backward))
    # a recomputation replays its snapshot, in any order
    recomputing = insert_frees(g, [Forward(0, tape=False), Forward(1), Forward(2)],
                               [Backward(2), Backward(1), Forward(0), Backward(0)])
    assert simulate(g, recomputing).recompute_cost == 1.0


def test_a_random_source_stays_in_its_segment():
    """A dropout on the model input has no predecessor; moved into the segment of its first reader (as
    other sources are), it was computed after the dropout of an earlier segment."""
    nodes = (CostNode(0, "conv", successors=(2,), output_bytes=100, grad_bytes=100, forward_cost=1.0),
             CostNode(1, "dropout_input", successors=(3,), output_bytes=100, grad_bytes=100, random=True,
                      forward_cost=1.0),
             CostNode(2, "dropout_conv", predecessors=(0,), output_bytes=100, grad_bytes=100, random=True,
                      forward_cost=1.0),
             CostNode(3, "add", predecessors=(1, 2), output_bytes=100, grad_bytes=100, forward_cost=1.0))
    g = CostGraph("random source", nodes)
    schedule = lower_segments(g, [{0, 1, 2}, {0, 1, 2, 3}])
    firsts = [op.node for op in schedule.forward_ops if isinstance(op, Forward)]
    assert firsts.index(1) < firsts.index(2)
    simulate(g, schedule)
