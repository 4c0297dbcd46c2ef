"""Inductor compiling the generated graphs: ``rg.backend(budget, graph_compiler="inductor")``."""
from __future__ import annotations

import copy
import dataclasses
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from recompute_graph.joint_capture import RANDOM_TARGETS, op_name
from recompute_graph.compile_backend import budget_backend
from recompute_graph.joint_lowering import Lowered, last_lowering
from recompute_graph.measure import allocator_peak_memory

pytestmark = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                reason="inductor's CPU code needs a C++ compiler")


class _DropoutBatchNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(6)])
        self.norm = nn.BatchNorm1d(64)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = self.dropout(torch.tanh(layer(x)))
            if i == 2:
                x = self.norm(x)
        return x


def test_inductor_runs_a_plan_with_replayed_dropouts_and_batch_norm_to_eagers_gradients_within_its_budget():
    """The plan recomputes dropouts (replayed from their snapshots, as custom ops inductor calls) and a
    training BatchNorm (without its statistics); inductor's code trains to eager's gradients up to its
    rounding (a different mask would be off by the gradient's size), updates the running statistics
    once, and the allocator's peak stays within the budget, near the prediction."""
    torch.manual_seed(0)
    model, x = _DropoutBatchNormMLP(), torch.randn(512, 64)
    reference = copy.deepcopy(model)

    def step(module, forward):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        forward(x).square().mean().backward()
    step(reference, reference)
    torch._dynamo.reset()
    # FLOP-estimated times: the plan does not move with the machine's timings (a measured run planned no
    # recomputed dropout on one machine)
    compiled = torch.compile(model, backend=budget_backend(0.6, graph_compiler="inductor", timing="flops"))
    step(model, compiled)
    lowered = last_lowering()
    replayed = [n for n in lowered.backward_graph.graph.nodes if "replay_random" in str(n.target)]
    assert replayed and len(lowered.recomputed) > len(replayed)
    assert not [n for n in lowered.backward_graph.graph.nodes
                if n.op == "call_function" and op_name(n.target) in RANDOM_TARGETS]
    error = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
                for p, q in zip(model.parameters(), reference.parameters()))
    assert error < 1e-4
    assert all(torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)
               for a, b in zip(model.buffers(), reference.buffers()))
    measured = allocator_peak_memory(lambda: step(model, compiled))
    assert measured <= lowered.plan.budget_bytes
    assert 0.95 <= lowered.plan.predicted_step_peak_bytes / measured <= 1.05
    # inductor's code was measured beside the generated graphs, the same way
    assert isinstance(lowered.inductor_excess_bytes, int) and "inductor's code" in repr(lowered)
    assert lowered.plan.predicted_step_peak_bytes + max(0, lowered.inductor_excess_bytes) <= lowered.plan.budget_bytes


@dataclasses.dataclass(frozen=True)
class _FakeLowered:
    """What ``fit_plan_to_inductor`` reads of a lowering: the plan, the graphs' ``meta``, the excess."""
    plan: SimpleNamespace
    forward_graph: SimpleNamespace
    backward_graph: SimpleNamespace
    inductor_excess_bytes: int | None = None
    predicted_step_peak_bytes = Lowered.predicted_step_peak_bytes
    planned_backward_graph = property(lambda self: self.backward_graph)


def lowering(step: int, schedule: str) -> _FakeLowered:
    """A plan predicted at ``step`` bytes, fitting a budget of ``step``, named ``schedule``."""
    return _FakeLowered(SimpleNamespace(predicted_step_peak_bytes=step, min_budget_bytes=step, schedule=schedule),
                        SimpleNamespace(meta={}), SimpleNamespace(meta={}))


def test_a_plan_whose_inductor_code_holds_more_is_planned_again_with_that_taken_from_the_budget(monkeypatch):
    """``fit_plan_to_inductor``: the excess inductor's code holds over the generated graphs is taken from
    the budget and the graph planned again; the first plan that fits with its excess is kept, else the
    lowest, with a warning. A plan the planner could not fit either (store_all under its step) is not
    blamed on inductor when inductor adds nothing, and an excess as large as the budget is not planned
    again (the compiler path fell back to the executor on a negative budget, the LSTM of
    scripts/store_all_step.py --small --inductor)."""
    from recompute_graph import inductor_lowering
    from recompute_graph.inductor_lowering import InductorBudgetWarning, fit_plan_to_inductor
    excess = {"a": 300, "b": 100, "c": 250}
    limited_excess = {}  # with fusion limited (``FUSION_LIMITED`` in the graphs' meta); None: not measured

    def measured(lowered):
        if inductor_lowering.CONFIG_KEY in lowered.forward_graph.meta:
            assert lowered.backward_graph.meta[inductor_lowering.CONFIG_KEY] == inductor_lowering.FUSION_LIMITED
            return limited_excess.get(lowered.plan.schedule)
        return excess[lowered.plan.schedule]
    monkeypatch.setattr(inductor_lowering, "inductor_excess_bytes", measured)
    budgets = []

    def replan(budget_bytes):
        budgets.append(budget_bytes)
        return lowering(budget_bytes - 200, "b")
    fitted = fit_plan_to_inductor(lowering(900, "a"), 1000, replan)
    assert budgets == [700] and fitted.plan.schedule == "b" and fitted.inductor_excess_bytes == 100
    # nothing fits: the lowest predicted step with its excess is kept, with a warning
    budgets.clear()
    with pytest.warns(InductorBudgetWarning, match="after planning again with less budget"):
        fitted = fit_plan_to_inductor(lowering(900, "a"), 500, lambda b: (budgets.append(b), lowering(400, "c"))[1])
    assert budgets == [200, 200] and fitted.plan.schedule == "c"
    # inductor's code holds less (its fusions drop intermediates): kept, and predicted that much lower
    excess["d"] = -50
    budgets.clear()
    fitted = fit_plan_to_inductor(lowering(900, "d"), 1000, replan)
    assert budgets == [] and fitted.predicted_step_peak_bytes == 850
    # a plan over its budget by itself (store_all at a budget under its step), with nothing added
    excess["e"] = 0
    fitted = fit_plan_to_inductor(lowering(1100, "e"), 1000, replan)
    assert budgets == [] and fitted.inductor_excess_bytes == 0
    # an excess the budget cannot give up: warned, never planned at a budget of 0 or less
    excess["f"] = 1200
    with pytest.warns(InductorBudgetWarning, match="not planned again"):
        fitted = fit_plan_to_inductor(lowering(900, "f"), 1000, replan)
    assert budgets == [] and fitted.plan.schedule == "f"
    # no plan fits the budget less the excess (store_all's own budget on CUDA, where cuBLAS and cuDNN
    # took workspace): warned, and the plan measured is kept, not raised out of the compilation
    from recompute_graph.errors import InfeasibleBudgetError

    def infeasible(budget_bytes):
        raise InfeasibleBudgetError("no plan of 'store_all' fits; ...", budget_bytes=budget_bytes,
                                    min_budget_bytes=900)
    with pytest.warns(InductorBudgetWarning, match="planning again with less budget failed: no plan of 'store_all'"):
        fitted = fit_plan_to_inductor(lowering(900, "a"), 1000, infeasible)
    assert fitted.plan.schedule == "a" and fitted.inductor_excess_bytes == 300
    assert "recompute_graph_inductor_config" not in fitted.forward_graph.meta


def test_inductor_code_that_fits_only_with_fusion_limited_is_compiled_so(monkeypatch):
    """The unrolled LSTM's store-all plan: inductor's fused code held 5.6x the generated graphs, since it
    fuses ops of many time steps into one kernel whose outputs exist at once, an excess no plan can
    make room for. Where no plan fits with inductor's default fusion, each measured plan's code is
    measured again with fusion limited (``FUSION_LIMITED``, in the graphs' meta, which
    ``inductor_graph_compiler`` compiles with): the first that fits is kept, else the lowest of all,
    with a warning that says so; a plan whose fused code is lower keeps inductor's default fusion."""
    from recompute_graph import inductor_lowering
    from recompute_graph.inductor_lowering import (CONFIG_KEY, FUSION_LIMITED, InductorBudgetWarning,
                                                   fit_plan_to_inductor)
    fused, unfused = {"a": 5000, "b": 50, "c": 5000}, {"a": 50, "b": 500, "c": 150}
    monkeypatch.setattr(inductor_lowering, "inductor_excess_bytes", lambda lowered: (
        unfused if CONFIG_KEY in lowered.forward_graph.meta else fused)[lowered.plan.schedule])
    # the fused excess is over the whole budget: not planned again; unfused, the plan fits
    fits_unfused = r"fused code .* held 5000 .* holds 50 bytes more .* within the budget"
    with pytest.warns(InductorBudgetWarning, match=fits_unfused):
        fitted = fit_plan_to_inductor(lowering(900, "a"), 1000, lambda b: pytest.fail("planned again"))
    assert fitted.inductor_excess_bytes == 50 and fitted.predicted_step_peak_bytes == 950
    assert fitted.forward_graph.meta[CONFIG_KEY] == fitted.backward_graph.meta[CONFIG_KEY] == FUSION_LIMITED
    # nothing fits either way: the lowest step of all, here the unfused code of the budget's own plan
    with pytest.warns(InductorBudgetWarning, match=r"fused code .* held 5000 .* holds 150 bytes more"):
        fitted = fit_plan_to_inductor(lowering(900, "c"), 1000, lambda b: lowering(880, "c"))
    assert fitted.inductor_excess_bytes == 150 and fitted.forward_graph.meta[CONFIG_KEY] == FUSION_LIMITED
    # the fused code is the lower (1050 against 1500 unfused): it keeps inductor's default fusion
    with pytest.warns(InductorBudgetWarning, match="made the same plan") as caught:
        fitted = fit_plan_to_inductor(lowering(1000, "b"), 1000, lambda b: lowering(990, "b"))
    assert fitted.plan.schedule == "b" and fitted.inductor_excess_bytes == 50
    assert CONFIG_KEY not in fitted.forward_graph.meta and "fused code" not in str(caught[0].message)


def test_a_graph_compiler_name_other_than_inductor_is_a_value_error():
    with pytest.raises(ValueError, match="inductor"):
        budget_backend(0.5, graph_compiler="tvm")


def test_a_graph_replaying_another_random_op_runs_uncompiled_with_a_warning_and_replays_it():
    """Only ``native_dropout`` is replayed under inductor; a graph replaying another random op runs as
    generated, with an ``InductorFallbackWarning`` naming it, and still draws what the snapshot says."""
    from torch import fx
    from recompute_graph.inductor_lowering import InductorFallbackWarning, inductor_graph_compiler
    from recompute_graph.joint_lowering import replay_random, rng_snapshot
    graph = fx.Graph()
    x = graph.placeholder("x")
    snapshot = graph.call_function(rng_snapshot, (x,))
    replayed = graph.call_function(replay_random, (snapshot, x, torch.ops.aten.bernoulli.default, x))
    graph.output((replayed,))
    with pytest.warns(InductorFallbackWarning, match="bernoulli"):
        run = inductor_graph_compiler(fx.GraphModule(nn.Module(), graph), [torch.rand(64)])
    probabilities = torch.rand(64)
    torch.manual_seed(0)
    (drawn,) = run([probabilities])
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.bernoulli(probabilities))
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(1))  # the generator is left as it was


def test_hf_gpt2_compiles_under_inductor_to_eagers_gradients():
    """The graphs are retraced with inductor's decompositions after planning, and a decomposition may
    lay a result out otherwise than the op a ``view`` of it was traced against: HF GPT-2's attention
    failed in inductor ("Cannot view a tensor with shape [2, 4, 8, 16] and strides (512, 8, 1, 32)").
    Its ``view``s are retraced as ``reshape``s, a view wherever one exists."""
    from models_zoo import third_party
    from models_zoo.conformance import call_of
    from recompute_graph.losses import default_training_loss
    from recompute_graph.verification import model_gradient_error
    if not third_party.available("hf_gpt2"):
        pytest.skip("transformers is not installed")
    model, call = third_party.build("hf_gpt2")
    args, kwargs = call_of(call)
    reference = copy.deepcopy(model)
    torch.manual_seed(0)  # the same dropout masks
    default_training_loss(reference(*args, **kwargs)).backward()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=budget_backend(0.8, graph_compiler="inductor", on_infeasible="floor"))
    torch.manual_seed(0)
    default_training_loss(compiled(*args, **kwargs)).backward()
    assert all(p.grad is not None for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None)
    assert model_gradient_error(model, reference) <= 1e-4


def test_optimize_compiles_the_generated_graphs_with_inductor_on_request():
    """``optimize(..., graph_compiler="inductor")``: the module ``optimize`` returns trains through
    inductor's code for the plan (its excess measured at planning time) to eager's gradients within
    inductor's rounding, the BatchNorm statistics updated once, within the budget; the executor has
    no graph compiler, and another name is refused."""
    import recompute_graph as rg
    torch.manual_seed(0)
    model, x = _DropoutBatchNormMLP(), torch.randn(512, 64)
    reference = copy.deepcopy(model)

    def step(module):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        module(x).square().mean().backward()
    step(reference)
    optimized = rg.optimize(model, 0.6, example_inputs=(x,), graph_compiler="inductor", compiler=True)
    assert isinstance(optimized, rg.CompiledRecomputedModule)
    step(optimized)
    (lowered,) = optimized.lowerings
    assert isinstance(lowered.inductor_excess_bytes, int) and lowered.recomputed
    error = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
                for p, q in zip(model.parameters(), reference.parameters()))
    assert error < 1e-4
    assert torch.equal(model.norm.num_batches_tracked, reference.norm.num_batches_tracked)
    assert torch.allclose(model.norm.running_mean, reference.norm.running_mean, rtol=1e-5, atol=1e-6)
    assert allocator_peak_memory(lambda: step(optimized)) <= optimized.recompute_plan.budget_bytes
    with pytest.raises(ValueError, match="compiler path"):
        rg.optimize(model, 0.6, example_inputs=(x,), graph_compiler="inductor", compiler=False)
    with pytest.raises(ValueError, match="graph_compiler='tvm'"):
        rg.optimize(model, 0.6, graph_compiler="tvm")
