"""Times of the compiler path's cost graph: each node of the joint graph timed on real tensors
(``joint_allocations.node_seconds``), FLOP estimates where it cannot run (meta) or on request, and a
view or a tuple's item priced as the nothing it costs."""
import operator

import pytest
import torch
from torch import fx, nn

from recompute_graph.joint_allocations import node_seconds
from recompute_graph.joint_capture import op_name
from recompute_graph.joint_costs import VIEW_TARGETS, _moved_bytes, joint_cost_graph
from recompute_graph.compile_backend import budget_backend

from compiled_steps import square_loss


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def _captured(**options):
    """One compiled step of ``_ConvNet`` with ``budget_backend(1.0, **options)``: the joint graph and
    its inputs (``on_joint``), and the lowering."""
    seen, lowered = {}, []
    torch._dynamo.reset()
    model = _ConvNet()
    compiled = torch.compile(model, backend=budget_backend(
        1.0, on_lowered=lowered.append, on_joint=lambda joint, inputs: seen.update(joint=joint, inputs=inputs),
        **options))
    square_loss(compiled(torch.randn(2, 3, 8, 8))).backward()
    torch._dynamo.reset()
    return seen["joint"], seen["inputs"], lowered[-1]


def test_every_node_of_a_small_graph_is_timed_on_real_tensors_and_none_on_meta():
    graph_module = fx.symbolic_trace(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))
    seconds = node_seconds(graph_module, [torch.randn(8, 16)])
    calls = [n.name for n in graph_module.graph.nodes if n.op in ("call_function", "call_module")]
    functions = [n.name for n in graph_module.graph.nodes if n.op == "call_function"]
    assert set(seconds) == set(functions) and len(calls) == 3
    assert all(s > 0 for s in seconds.values())
    assert node_seconds(graph_module, [torch.randn(8, 16, device="meta")]) == {}


def test_a_graph_that_fails_on_random_values_is_not_timed():
    def fails(x):
        return torch.nn.functional.relu(x).view(3, -1)  # 8 * 16 elements do not split into 3 rows
    graph_module = fx.symbolic_trace(fails)
    assert node_seconds(graph_module, [torch.randn(8, 16)]) == {}


def test_the_compiler_path_prices_its_units_with_the_times_it_measured():
    joint, joint_inputs, lowered = _captured()
    # on_joint handed over the graph that was planned, with its primals and tangents: one per placeholder
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    assert sum(map(len, joint_inputs)) == len(placeholders) and lowered.units.units[0][0].graph is joint.graph
    graph = lowered.graph
    assert graph.cost_source.startswith("measured")
    # the cost graph's times are the measured ones, unit by unit: priced again from a known table
    units = lowered.units
    table = {n.name: 1.0 + i for i, n in enumerate(joint.graph.nodes) if n.op == "call_function"}
    priced = joint_cost_graph(joint, units, node_seconds=table)
    for node, members, backward in zip(priced.nodes, units.units, units.backward_of):
        assert node.forward_cost == pytest.approx(sum(table.get(n.name, 0.0) for n in members))
        assert node.backward_cost == pytest.approx(sum(table.get(b.name, 0.0) for b in backward))
    assert all(node.forward_cost > 0 for node in graph.nodes if node.target in ("convolution", "relu"))


def test_flop_timing_estimates_every_node_and_prices_views_and_items_at_nothing():
    joint, _, lowered = _captured(timing="flops")
    graph = lowered.graph
    assert graph.cost_source.startswith("flop-estimate (cpu)")
    costs = {n.name: n.forward_cost for n in graph.nodes}
    for members in lowered.units.units:
        if all(m.target is operator.getitem or op_name(m.target) in VIEW_TARGETS for m in members):
            assert costs[members[0].name] == 0.0
    assert any(n.target == "convolution" and n.forward_cost > 0 for n in graph.nodes)
    # BatchNorm's unit: its kernel moves bytes, the getitems of its tuple none
    norm = next(n for n in joint.graph.nodes if op_name(n.target) == "_native_batch_norm_legit_functional")
    items = [u for u in norm.users if u.target is operator.getitem]
    assert _moved_bytes(norm) > 0 and items and all(_moved_bytes(u) == 0 for u in items)


def test_an_unknown_timing_is_refused_before_anything_compiles():
    with pytest.raises(ValueError, match="timing='wall'"):
        budget_backend(0.5, timing="wall")


def test_nodes_doing_the_same_work_share_one_time():
    """The two BatchNorms (and ReLUs) of ``_ConvNet`` see tensors of one shape: they get the median of
    their times, so a slow spell during one of them does not make its layer dearer than its twin's."""
    joint, joint_inputs, _ = _captured()
    seconds = node_seconds(joint, joint_inputs)
    for target in ("_native_batch_norm_legit_functional", "relu"):
        nodes = [n.name for n in joint.graph.nodes if op_name(n.target) == target]
        assert len(nodes) == 2 and seconds[nodes[0]] == seconds[nodes[1]] > 0
    # the convolutions read 3 and 8 channels: other work, each its own time, both measured
    convolutions = [n.name for n in joint.graph.nodes if op_name(n.target) == "convolution"]
    assert len(convolutions) == 2 and all(seconds[c] > 0 for c in convolutions)


def test_a_step_compiled_inside_a_users_memory_profile_is_priced_without_ending_it_and_says_so():
    """A user's ``torch.profiler`` session around the first step: the allocator's events cannot be read
    without ending it. The loss is priced by its storages' liveness (it read 0 before, and the plan left
    the loss out), the kernels' temporaries are left out, a ``ProfilerActiveWarning`` says so, and the
    user's profile keeps its memory events."""
    from torch.profiler import ProfilerActivity, profile

    from recompute_graph.errors import ProfilerActiveWarning

    def loss_bytes(profiled: bool) -> tuple:
        torch._dynamo.reset()
        lowered = []
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        compiled = torch.compile(model, backend=budget_backend(1.0, on_lowered=lowered.append), dynamic=False)
        if not profiled:
            square_loss(compiled(torch.randn(256, 64))).backward()
            return lowered[-1].graph.loss_bytes, None
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as session:
            with pytest.warns(ProfilerActiveWarning, match="outside the profiler"):
                square_loss(compiled(torch.randn(256, 64))).backward()
        events = [e for e in session.events() if e.cpu_memory_usage]
        return lowered[-1].graph.loss_bytes, events

    plain, _ = loss_bytes(False)
    profiled, events = loss_bytes(True)
    assert plain > 0 and profiled == plain
    assert events  # the user's session still recorded the step's allocations
