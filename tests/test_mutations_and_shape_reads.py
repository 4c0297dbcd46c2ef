"""Writes through views and shape reads, the patterns that broke third-party models (T5's ``_shift_right``,
EfficientNet's in-place dropout on a flattened view, ViT's class token sized by ``x.shape[0]``):
functionalized exactly where possible, otherwise planned from ``torch.export``'s functional graph, or
refused with the node and the user's source line; never run wrong."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import recompute_graph as rg
from recompute_graph import TraceError
from recompute_graph.costs import profile_model
from recompute_graph.losses import default_training_loss
from recompute_graph.trace import trace


class InPlaceDropoutOnView(nn.Module):
    """EfficientNet's classifier: ``flatten`` then ``Dropout(inplace=True)`` on the view (linear layers:
    a CPU convolution's backward workspace would set the floor of so small a model)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 64)
        self.b = nn.Linear(64, 64)
        self.drop = nn.Dropout(0.5, inplace=True)
        self.fc = nn.Linear(16 * 64, 4)

    def forward(self, x):  # x: (batch, 16, 8)
        h = self.b(self.a(x).relu())
        return self.fc(self.drop(torch.flatten(h, 1)))


class BaseReadAfterViewWrite(nn.Module):
    """A write through a view, then the base is read (T5's ``_shift_right``, in float). (``h[:, :3] = 0``
    is the same in torch.export's eyes.)"""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 128)
        self.b = nn.Linear(128, 128)
        self.c = nn.Linear(128, 16)

    def forward(self, x):
        h = self.a(x) * 2
        h.narrow(1, 0, 3).zero_()         # written through a view of h
        return self.c(self.b(h.tanh()).relu())  # h read after the write


class ClassToken(nn.Module):
    """ViT: the class token expanded to ``x.shape[0]`` read after a permute."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Conv2d(3, 16, 4, stride=4)
        self.token = nn.Parameter(torch.randn(1, 1, 16))
        self.mlp = nn.Linear(16, 256)
        self.out = nn.Linear(256, 16)

    def forward(self, x):
        x = self.proj(x).flatten(2).permute(0, 2, 1)
        n = x.shape[0]
        x = torch.cat([self.token.expand(n, -1, -1), x], dim=1)
        return self.out(self.mlp(x).tanh()).tanh()


class IdentityThenInPlaceAdd(nn.Module):
    """timm's RepVGG block: ``drop_path`` is an ``nn.Identity``, which hands its input on as its output,
    and the identity branch is then added into it in place (``x += identity``)."""

    def __init__(self, width: int = 32, depth: int = 4):
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.b = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.drop_path = nn.Identity()

    def forward(self, x):
        for a, b, norm in zip(self.a, self.b, self.norms):
            identity = norm(x)
            x = a(x) + b(x)
            x = self.drop_path(x)
            x += identity
            x = x.relu()
        return x


def trains_exactly(model, x, budget=0.7, **options):
    reference = copy.deepcopy(model)
    optimized = rg.optimize(model, budget, example_inputs=(x,), timing="flops", **options)
    for module, seed in ((reference, 3), (optimized, 3)):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        default_training_loss(module(x)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    return optimized


def test_in_place_dropout_on_a_view_is_functionalized_and_trains_at_store_all_and_below():
    model = InPlaceDropoutOnView().train()
    result = trace(model)
    assert result.unsafe_mutations == () and any("drop" in name for name in result.functionalized)
    assert model.drop.inplace  # the user's module is not changed
    x = torch.randn(64, 16, 8)
    for budget in (1.0, 0.8):
        optimized = trains_exactly(model, x, budget)
    assert optimized.recompute_plan.recomputed_nodes  # at 0.8, something is recomputed


def test_an_identity_module_handing_its_input_on_keeps_it_when_the_producer_is_freed():
    """The schedule executor empties a freed value's ``.data`` while its tape lives on; the tensor an
    ``nn.Identity`` handed on is the same object, still read (timm's RepVGG failed with a size-0
    tensor in its in-place add)."""
    model = IdentityThenInPlaceAdd()
    x = torch.randn(256, 32)
    for budget in (1.0, 0.8, 0.7):  # chain_dp's plans at 0.8 and 0.7 free the sum before the add reads it
        optimized = trains_exactly(model, x, budget, compiler=False, solver="chain_dp")
        assert budget == 1.0 or optimized.recompute_plan.recomputed_nodes


def test_a_base_read_after_a_write_through_its_view_goes_to_export_or_is_refused_with_its_line():
    model = BaseReadAfterViewWrite()
    result = trace(model)
    assert len(result.unsafe_mutations) == 1
    assert "zero_" in result.unsafe_mutations[0] and "test_mutations_and_shape_reads.py" in result.unsafe_mutations[0]
    x = torch.randn(256, 16)
    with pytest.raises(TraceError, match=r"h\.narrow\(1, 0, 3\)\.zero_\(\)"):
        rg.optimize(model, 0.8, example_inputs=(x,), tracer="fx", timing="flops")
    optimized = trains_exactly(model, x, 0.95)  # auto: the functional graph of torch.export
    assert any("aten" in node.target for node in optimized.recompute_plan.graph)


class AssignsIntoActivations(nn.Module):
    """transformers' ``shift_tokens_right`` (``shifted[:, 1:] = ids[:, :-1]``) and writes into activations
    that require grad (``h[:, 0] = 0``), each written tensor read (directly, or through a view taken
    from it then) only after the write."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 32)
        self.a = nn.Linear(32, 128)
        self.b = nn.Linear(128, 32)
        self.c = nn.Linear(32, 32)

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 2
        h = self.a(self.embed(shifted)) * 2
        h[:, 0] = 0.0
        g = self.b(h.tanh())
        g[:, :, :4] = h[:, :, :4]
        return self.c(g).tanh()


def test_an_assignment_into_an_activation_becomes_a_write_into_a_copy_and_trains_exactly():
    model = AssignsIntoActivations()
    result = trace(model)
    assert result.unsafe_mutations == ()
    code = result.graph_module.code
    assert code.count("setitem_into_copy(") == 4
    ids = torch.randint(0, 40, (16, 24))
    for budget in (1.0, 0.85):
        optimized = trains_exactly(model, ids, budget, tracer="fx", compiler=False)
    assert optimized.recompute_plan.recomputed_nodes


def test_a_write_into_a_whole_activation_without_an_out_of_place_twin_is_written_into_a_copy():
    class ZeroesItsActivation(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            h = self.a(x)
            kept = h * 3
            h.zero_()
            return self.b(kept + h)

    result = trace(ZeroesItsActivation())
    assert result.unsafe_mutations == () and "method_into_copy" in result.graph_module.code
    trains_exactly(ZeroesItsActivation(), torch.randn(8, 16), 1.0, tracer="fx", compiler=False)


def test_an_assignment_whose_base_is_read_later_through_another_view_is_unsafe():
    class ReadsAnotherView(nn.Module):
        def forward(self, x):
            h = x * 2
            top = h[:, :4]
            h[:, 4:] = 0.0  # h read after the write through ``top``, a view taken before it
            return top.sum() + h.sum()

    result = trace(ReadsAnotherView())
    assert len(result.unsafe_mutations) == 1 and "setitem" in result.unsafe_mutations[0]


def test_a_shape_read_is_an_edge_so_no_solver_schedules_the_reader_first():
    model = ClassToken()
    x = torch.randn(16, 3, 32, 32)
    _, graph = profile_model(model, (x,), timing="flops")
    expand = next(node for node in graph if node.target == "expand")
    assert graph.index_of("permute") in expand.predecessors
    for solver in ("dp_exact", "ilp", "chen_greedy"):  # any order they choose must run
        trains_exactly(model, x, 1.0, solver=solver)


def test_an_auxiliary_scalar_output_is_not_taken_for_the_loss():
    class WithAuxiliary(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x):
            h = self.a(x).relu()
            return self.b(h), h.mean()

    model = WithAuxiliary()
    x = torch.randn(32, 16)
    optimized = rg.optimize(model, 1.0, example_inputs=(x,), timing="flops")
    graph = optimized.recompute_plan.graph
    # the README loss reads both outputs, so both get gradients, and the logits' loss temporaries count
    assert len(graph.loss_gradient_outputs) == 2 and graph.loss_bytes >= 32 * 16 * 4
    from recompute_graph.measure import make_training_step, peak_memory
    measured = peak_memory(make_training_step(optimized, (x,), default_training_loss))
    assert measured <= optimized.recompute_plan.budget_bytes


class WritesIntoItsInput(nn.Module):
    """``x.mul_(2)`` on the model's input, then residual blocks: a plan that recomputed the ``mul``
    read the input after the write (the compiler's backward was refused by autograd; the executor's
    gradients were off by 18)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        x.mul_(2)
        for block in self.blocks:
            x = torch.nn.functional.gelu(block(x)) + x
        return self.head(x)


@pytest.mark.parametrize("compiler", [True, False])
def test_a_model_writing_into_its_input_is_planned_without_recomputing_what_read_it(compiler):
    torch.manual_seed(0)
    model = WritesIntoItsInput()
    reference = copy.deepcopy(model)
    x = torch.randn(256, 64)
    optimized = rg.optimize(model, 0.6, example_inputs=(x.clone(),), compiler=compiler)
    plan = optimized.recompute_plan
    once = {n.index for n in plan.graph.nodes if n.reads_mutated_input}
    assert once and plan.recomputed_nodes and not once & set(plan.recomputed_nodes)
    inputs = []
    for module in (reference, optimized):
        module.zero_grad()
        inputs.append(x.clone())
        default_training_loss(module(inputs[-1])).backward()
    assert torch.equal(inputs[0], inputs[1]) and torch.equal(inputs[0], 2 * x)  # written once, as eager does
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)


class MomentumInForward(nn.Module):
    """A frozen parameter updated in place in ``forward`` by a chain of two writes."""

    def __init__(self):
        super().__init__()
        self.target = nn.Parameter(torch.zeros(8), requires_grad=False)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        self.target.mul_(0.9).add_(torch.ones(8))
        return self.fc(x) + self.target


@pytest.mark.parametrize("compiler", [True, False])
def test_a_chain_of_writes_into_a_parameter_stays_in_place_and_planning_undoes_it(compiler):
    """``functionalize`` took the second write for a write into an activation and made it out of place:
    the parameter got 0.9 w, not 0.9 w + 1. And planning's own runs of the forward wrote into it, four
    updates where the step made one (``model_state.preserved_state`` now puts parameters back)."""
    from recompute_graph.trace import mutated_input_constraints
    traced = trace(MomentumInForward())
    targets = {n.name: n.target for n in traced.graph_module.graph.nodes}
    assert targets["mul_"] == "mul_" and targets["add_"] == "add_"
    assert {"mul_", "add_"} <= mutated_input_constraints(traced.graph_module)[0]
    model, x = MomentumInForward(), torch.randn(4, 8)
    optimized = rg.optimize(model, 1.0, example_inputs=(x,), compiler=compiler)
    assert torch.equal(model.target, torch.zeros(8))
    optimized(x).sum().backward()
    assert torch.allclose(model.target, torch.ones(8))  # one update of zeros: 0.9 * 0 + 1


class StopGradient(nn.Module):
    """SimSiam's target branch: the same encoder under ``torch.no_grad()``."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.predictor = nn.Linear(32, 32)

    def forward(self, x):
        online = self.predictor(self.encoder(x))
        with torch.no_grad():
            target = self.encoder(x.flip(0))
        return (online - target).square().mean(1)


def test_a_no_grad_block_in_forward_is_refused_by_the_executor_and_trained_exactly_by_the_compiler():
    """Neither tracer's graph keeps a grad-mode switch: the executor ran the target branch with grad, and
    the encoder's gradients were off by 1e-3, silently."""
    torch.manual_seed(0)
    model, x = StopGradient(), torch.randn(64, 32)
    for tracer in ("fx", "export"):
        with pytest.raises(TraceError, match=r"switches autograd's grad mode at .*test_mutations.*no_grad"):
            rg.optimize(copy.deepcopy(model), 0.8, example_inputs=(x,), compiler=False, tracer=tracer)
    reference = copy.deepcopy(model)
    optimized = rg.optimize(model, 0.8, example_inputs=(x,))
    assert isinstance(optimized, rg.CompiledRecomputedModule)
    for module in (reference, optimized):
        module(x).mean().backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)


class AutocastBlock(nn.Module):
    """Half of the layers in bfloat16 under an autocast block in forward, the rest in float32 with
    autocast turned off (transformers' rotary embeddings turn it off so)."""

    def __init__(self):
        super().__init__()
        self.low = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)))
        self.high = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.low(x)
        with torch.autocast("cpu", enabled=False):
            return self.high(h.float())


def test_an_autocast_block_in_forward_is_refused_by_fx_and_trained_exactly_from_export():
    """torch.fx's graph drops an autocast block (the tracer runs its ``__enter__``, which is no op): the
    executor ran the bfloat16 block in float32 (outputs 1e-3 off relative to their size, gradients 5e-5,
    silently). fx now refuses, and export's graph, which keeps the blocks, trains exactly. Under the
    caller's autocast, export's graph drops the ``h.float()`` into the block that turns autocast off
    (a no-op when traced), and the executor ran that block in bfloat16 (outputs 6e-4 off): refused."""
    torch.manual_seed(0)
    model, x = AutocastBlock(), torch.randn(512, 64)
    with pytest.raises(TraceError, match=r"enters an autocast block at .*test_mutations.*torch\.autocast"):
        rg.optimize(copy.deepcopy(model), 0.6, example_inputs=(x,), compiler=False, tracer="fx")
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(TraceError, match=r"runs under the caller's autocast.*drops the casts"):
        rg.optimize(copy.deepcopy(model), 0.7, example_inputs=(x,), compiler=False)
    reference = copy.deepcopy(model)
    optimized = rg.optimize(model, 0.6, example_inputs=(x,), compiler=False)
    assert optimized.recompute_plan.recomputed_nodes
    for module in (reference, optimized):
        module(x).square().mean().backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_an_assignment_to_a_parameters_data_in_forward_is_refused_by_both_paths():
    """``p.data = p.data * m + ...`` (MoCo's momentum update): fx recorded nothing, and the executor's
    steps never updated the parameter; Dynamo refuses the ``set_``. Both refuse, the executor naming the
    write."""

    class DataAssignment(MomentumInForward):
        def forward(self, x):
            self.target.data = self.target.data * 0.9 + 1
            return self.fc(x) + self.target
    x = torch.randn(4, 8)
    with pytest.raises(TraceError, match=r"assigns a tensor's \.data \(target\.data = \.\.\.\)"):
        rg.optimize(DataAssignment(), 1.0, example_inputs=(x,), compiler=False, tracer="fx")
    with pytest.warns(rg.CompilerFallbackWarning, match="set_"), \
            pytest.raises(TraceError, match=r"assigns a tensor's \.data"):  # Dynamo refuses, then fx does
        rg.optimize(DataAssignment(), 1.0, example_inputs=(x,))


class SpectrallyNormalized(nn.Module):
    """Linear layers under ``parametrizations.spectral_norm``: each training call runs a power iteration
    from the vectors the last call left (buffers) and writes them back."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.utils.parametrizations.spectral_norm(nn.Linear(64, 64)) for _ in range(6))
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x)) + x
        return self.head(x)


@pytest.mark.parametrize("compiler", [True, False])
def test_a_recomputed_node_whose_output_reads_its_buffers_runs_from_their_values_before_the_step(compiler):
    """The executor put a stateful node's buffers back after each recomputation, but ran it from the
    values its first computation left: spectral norm's power iteration made another weight, gradients
    off by 4e-4 (``executor_state.recomputed_state``)."""
    torch.manual_seed(0)
    model = SpectrallyNormalized()
    reference = copy.deepcopy(model)
    x = torch.randn(256, 64)
    optimized = rg.optimize(model, 0.6, example_inputs=(x,), compiler=compiler)
    assert optimized.recompute_plan.recomputed_nodes
    for _ in range(2):
        for module in (reference, optimized):
            module.zero_grad()
            default_training_loss(module(x)).backward()
        for a, b in zip(model.parameters(), reference.parameters()):
            assert torch.equal(a.grad, b.grad)
        for a, b in zip(model.buffers(), reference.buffers()):
            assert torch.equal(a, b)


def _quantization_aware() -> nn.Module:
    """``torch.ao.quantization.prepare_qat``: each module's fake quantizer observes (moving averages of
    the weights' and outputs' ranges, per channel sized on the first call) with a fused kernel that
    writes its buffers without bumping their versions."""
    import torch.ao.quantization as quantization
    model = nn.Sequential(quantization.QuantStub(), nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 16 * 16, 10),
                          quantization.DeQuantStub())
    model.qconfig = quantization.get_default_qat_qconfig("x86")
    return quantization.prepare_qat(model.train())


def test_quantization_aware_training_observes_once_per_step():
    """A recomputed QAT convolution observed its weights twice per step (its node was not marked
    stateful), and planning failed at once: putting back a per-channel observer's empty ``min_val``
    after the first call sized it ("size of tensor a (16) must match ... b (0)"). Dynamo skips the
    observers' code, so ``optimize()`` takes the executor either way."""
    torch.manual_seed(0)
    model = _quantization_aware()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 3, 16, 16)
    optimized = rg.optimize(model, 0.9, example_inputs=(x,), compiler=False)
    assert "_1" in [optimized.recompute_plan.graph[i].name for i in optimized.recompute_plan.recomputed_nodes]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, reference)]
    for _ in range(3):
        for module, optimizer in zip((optimized, reference), optimizers):
            optimizer.zero_grad()
            default_training_loss(module(x)).backward()
            optimizer.step()
        for a, b in zip(model.parameters(), reference.parameters()):
            assert torch.equal(a.grad, b.grad)
        for (name, a), b in zip(model.named_buffers(), reference.buffers()):
            assert torch.equal(a, b), name
