"""A user's torch.compile with a graph break: the step's graphs share the byte budget from the second step
(compile_backend, step_graphs), measured by the allocator."""
import pytest
import torch
from torch import nn

from models_zoo.mlp import BrokenHalves
from recompute_graph.compile_backend import budget_backend
from recompute_graph.errors import GraphBreakWarning, InfeasibleBudgetError
from recompute_graph.joint_lowering import InfeasibleBudgetWarning
from recompute_graph.measure import allocator_peak_memory


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def _setup(model: "nn.Module | None" = None, x: "torch.Tensor | None" = None):
    """The model (BrokenHalves by default), its step, its eager peak and its eager gradients."""
    torch.manual_seed(0)
    if model is None:
        model, x = BrokenHalves(width=128, layers=4), torch.randn(1024, 128)

    def step(module: nn.Module) -> None:
        module.zero_grad(set_to_none=True)
        _loss(module(x)).backward()
    eager_bytes = allocator_peak_memory(lambda: step(model))
    reference = [p.grad.clone() for p in model.parameters()]
    torch._dynamo.reset()
    return model, step, eager_bytes, reference


def test_a_broken_steps_graphs_share_a_byte_budget_from_the_second_step():
    """Planned one graph at a time, this step measured 1.22 of the budget (session 33); planned
    together, the allocator's peak stays within it and is the prediction to 10 %."""
    model, step, eager_bytes, reference = _setup()
    budget = int(0.75 * eager_bytes)
    backend = budget_backend(budget, loss_fn=_loss)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with pytest.warns(GraphBreakWarning, match="from the second step on"):
        step(compiled)  # learns the graphs; each runs at its smallest-memory plan
    assert backend.step_plan is None and len(backend.graphs) == 2 and all(g.shared for g in backend.graphs)
    measured = allocator_peak_memory(lambda: step(compiled))
    plan = backend.step_plan
    assert plan is not None and plan.calls == (0, 1) and plan.budget_bytes == budget
    assert measured <= budget
    assert 0.9 <= measured / plan.predicted_step_peak_bytes <= 1.1
    assert plan.recompute_cost > 0  # the budget is below store-all's step: something is recomputed
    for key in plan.calls:  # each graph runs the plan chosen for it
        assert backend.graphs[key].lowered.plan.schedule == plan.plans[key].schedule
    largest = max(r.abs().max() for r in reference)
    assert max((p.grad - r).abs().max() for p, r in zip(model.parameters(), reference)) / largest < 1e-6
    lowerings = backend.lowerings
    compiled(torch.randn(1024, 128))  # a forward under grad whose output is dropped: no backward, no step
    assert allocator_peak_memory(lambda: step(compiled)) == measured  # a third step: nothing planned again
    assert backend.lowerings == lowerings and backend.step_plan.calls == (0, 1)
    assert not backend._calls  # the dropped forward was forgotten when the step's backward pass ended
    assert "2 graphs, 2 of them sharing the budget" in repr(backend)


def test_a_budget_no_choice_of_plans_fits_is_refused_at_every_step_before_it_runs():
    model, step, eager_bytes, _ = _setup()
    compiled = torch.compile(model, backend=budget_backend(int(0.1 * eager_bytes), loss_fn=_loss), dynamic=False)
    with pytest.warns(GraphBreakWarning):
        step(compiled)
    for _ in range(2):  # refused again: the graphs keep their floor plans, and the next step is refused too
        with pytest.raises(InfeasibleBudgetError, match="smallest feasible budget") as raised:
            step(compiled)
        assert raised.value.min_budget_bytes > raised.value.budget_bytes
        assert all(p.grad is None for p in model.parameters())  # refused before any graph ran
    torch._dynamo.reset()
    backend = budget_backend(int(0.1 * eager_bytes), loss_fn=_loss, on_infeasible="floor")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with pytest.warns(GraphBreakWarning):
        step(compiled)
    with pytest.warns(InfeasibleBudgetWarning, match="smallest feasible budget"):
        step(compiled)
    assert backend.step_plan.budget_bytes == raised.value.min_budget_bytes
    assert all(p.grad is not None for p in model.parameters())


def test_hugging_face_gpt2_split_at_its_loss_shares_the_budget_exactly():
    """transformers' GPT-2 given labels breaks the graph at its loss function (a logging call inside
    it) under a user's own torch.compile: two graphs, the model's and the loss's, planned together."""
    import copy

    from models_zoo import third_party
    from recompute_graph.verification import parameter_gradient_error
    if not third_party.available("hf_gpt2"):
        pytest.skip("transformers is not installed")
    model, call = third_party.build("hf_gpt2")
    reference = copy.deepcopy(model)

    def step(module: nn.Module) -> None:
        module.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss = module(**call).loss  # the outputs are dropped before the backward, as in a training loop
        loss.backward()
    budget = int(0.8 * allocator_peak_memory(lambda: step(reference)))
    backend = budget_backend(budget)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with pytest.warns(GraphBreakWarning, match="modeling_gpt2.py"):
        step(compiled)
    measured = allocator_peak_memory(lambda: step(compiled))
    assert len(backend.graphs) == 2 and backend.step_plan is not None
    assert measured <= budget
    assert 0.9 <= measured / backend.step_plan.predicted_step_peak_bytes <= 1.1
    step(reference)
    assert parameter_gradient_error(model, reference) < 1e-5


def test_a_named_solvers_plans_are_the_candidates_of_a_broken_step():
    model, step, eager_bytes, _ = _setup()
    budget = int(0.75 * eager_bytes)
    backend = budget_backend(budget, solver="chain_dp", loss_fn=_loss)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with pytest.warns(GraphBreakWarning):
        step(compiled)
    measured = allocator_peak_memory(lambda: step(compiled))
    assert {plan.solver for plan in backend.step_plan.plans.values()} == {"chain_dp"}
    assert measured <= budget
    assert 0.9 <= measured / backend.step_plan.predicted_step_peak_bytes <= 1.1


class _CheckedForNaNs(nn.Module):
    """A forward that raises when its activations hold a NaN: a branch on a tensor's value."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(*(nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(4)))
        self.second = nn.Sequential(*(nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(4)))

    def forward(self, x):
        h = self.first(x)
        if torch.isnan(h).any():
            raise FloatingPointError("NaN in the activations")
        return self.second(h)


def test_a_check_for_nans_is_refused_by_optimize_and_planned_by_the_backend_it_names():
    """Neither of optimize()'s paths can capture a branch on a tensor's value; its error now names the
    backend, under which the graphs on either side of the branch share the budget, exactly."""
    import recompute_graph as rg
    torch.manual_seed(0)
    model, x = _CheckedForNaNs(), torch.randn(1024, 128)
    with pytest.warns(rg.CompilerFallbackWarning), \
            pytest.raises(rg.TraceError, match=r"check for NaNs.*backend=rg\.backend\(budget\), dynamic=False"):
        rg.optimize(model, 0.7, example_inputs=(x,))
    model, step, eager_bytes, reference = _setup(model, x)
    backend = budget_backend(int(0.75 * eager_bytes), loss_fn=_loss)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with pytest.warns(GraphBreakWarning):
        step(compiled)
    measured = allocator_peak_memory(lambda: step(compiled))
    assert backend.step_plan is not None and measured <= backend.step_plan.budget_bytes
    assert backend.step_plan.recompute_cost > 0
    largest = max(r.abs().max() for r in reference)
    assert max((p.grad - r).abs().max() for p, r in zip(model.parameters(), reference)) / largest < 1e-6
