"""The executor's fast paths: a taped ``value[k]`` on a tuple or list of tensors becomes a detached leaf
with an identity tape, whose backward hands the gradient on without an autograd call. Gradients and
memory must be those of the general path (the original model's gradients; the simulator's peak)."""
import pytest
import torch
from torch import nn

from recompute_graph.costs import profile_model
from recompute_graph.optimized_module import run_schedule
from recompute_graph.planner import make_plan
from recompute_graph.rewrite import ScheduleExecutor
from recompute_graph.schedule import Backward

from conftest import profiled_tiny
from test_executor import SEED, relative_error, run_step


class Chunks(nn.Module):
    """Reads the parts of tuples (``torch.chunk`` and ``torch.split``: views) with positive and negative
    indices, several times each."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(12, 24)
        self.second = nn.Linear(8, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.chunk(self.first(x), 3, dim=1)
        mixed = (parts[0] * parts[-1] + parts[1].sin()).exp().cos()
        pieces = torch.split(self.second(mixed), [4, 8], dim=1)
        return torch.cat([pieces[1].tanh(), pieces[-2] * parts[2][:, :4]], dim=1)


def count_autograd_calls(monkeypatch) -> list[int]:
    calls = [0]
    original = torch.autograd.grad

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)
    monkeypatch.setattr(torch.autograd, "grad", counted)
    return calls


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("solver", ["store_all", "chen_sqrt"])
def test_items_of_tuples_train_exactly(fuse, solver):
    """Without recomputation, and with Chen's √n segments (which recompute the items)."""
    torch.manual_seed(0)
    model, inputs = Chunks(), (torch.randn(64, 12),)
    traced, graph = profile_model(model, inputs, timing="flops")
    assert any(n.name.startswith("getitem") for n in graph)
    _, expected, _ = run_step(model, lambda x: model(*x), inputs)
    plan = make_plan(graph, 1.0, solver)
    if solver != "store_all":
        assert plan.schedule.recomputed_nodes(), "the plan should recompute something"
    executor = ScheduleExecutor(traced.graph_module, graph, plan.schedule, fuse=fuse)
    measured, grads, _ = run_step(model, lambda x: run_schedule(executor, list(x)), inputs)
    assert relative_error(grads, expected) <= 1e-5
    assert measured <= plan.budget_bytes
    # within 10 %, or one activation (64 x 24 floats): on this tiny model, one run in the whole suite
    # measured one activation less than predicted (not reproduced alone; see the closing note of
    # issue 15's session: a storage address reused inside a step can change a gradient sum's buffer)
    assert abs(plan.predicted_peak_bytes - measured) <= max(0.10 * measured, 64 * 24 * 4)


def test_taped_items_need_no_autograd_call_in_backward(monkeypatch):
    """Node by node, the LSTM's ``h, c = cell(...)`` items are identity tapes: only the cells and the
    head call autograd (one call per Backward op otherwise)."""
    model, inputs, traced, graph = profiled_tiny("rnn")
    _, expected, _ = run_step(model, lambda x: model(*x), inputs)
    plan = make_plan(graph, 1.0, "store_all")
    executor = ScheduleExecutor(traced.graph_module, graph, plan.schedule, fuse=False)
    calls = count_autograd_calls(monkeypatch)
    torch.manual_seed(SEED)
    _, grads, _ = run_step(model, lambda x: run_schedule(executor, list(x)), inputs)
    backward_nodes = [graph.nodes[op.node].name for op in plan.schedule.backward_ops if isinstance(op, Backward)]
    items = [name for name in backward_nodes if name.startswith("getitem")]
    assert items, "the LSTM graph has no taped items"
    assert calls[0] == len(backward_nodes) - len(items)
    assert relative_error(grads, expected) <= 1e-5
