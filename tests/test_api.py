"""optimize(model, budget): the public entry point, end to end on small models; the tests taking
``path_options`` run on both of its paths (the schedule executor and the compiler path)."""
import contextlib
import copy
import re
import warnings

import pytest
import torch
from torch import nn

import models_zoo
import recompute_graph as rg
from recompute_graph import format_bytes
from recompute_graph.measure import default_loss, make_training_step, peak_memory

from test_trace import UntraceableRoot, snapshot, assert_unchanged


def train_steps(model, inputs, steps=3, seed=0):
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = default_loss(model(*inputs))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_optimized_model_trains_like_the_original_for_several_steps(path_options):
    original, inputs = models_zoo.get_model("resnet18", "tiny")
    twin, _ = models_zoo.get_model("resnet18", "tiny")
    optimized = rg.optimize(twin, 0.95, example_inputs=inputs, **path_options)
    assert optimized.recompute_plan.recomputed_nodes
    assert train_steps(optimized, inputs) == pytest.approx(train_steps(original, inputs), rel=1e-5)
    for (name, a), b in zip(original.state_dict().items(), optimized.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_plan_fields_and_summary(path_options):
    model, inputs = models_zoo.get_model("gpt2", "tiny")
    # the step below trains with measure.default_loss: plan for that loss
    optimized = rg.optimize(model, "400KiB", example_inputs=inputs, loss_fn=default_loss, **path_options)
    plan = optimized.recompute_plan
    assert plan.budget_bytes == 400 * 1024
    assert plan.predicted_peak_bytes * 1.05 <= plan.budget_bytes < plan.store_all_peak_bytes
    assert 0 < plan.predicted_compute_overhead < 1
    text = str(plan)
    for field in ("solver", "budget", "predicted peak", "store-all peak", "compute overhead"):
        assert field in text
    # the step's peak, the loss with it, is what a user measures: shown where it is not the graph's peak
    step = format_bytes(plan.predicted_step_peak_bytes)
    assert (f"the step {step}" in text) == (plan.predicted_step_peak_bytes != plan.predicted_peak_bytes)
    assert plan.solver in repr(optimized) and "400 KiB" in repr(optimized)
    assert peak_memory(make_training_step(optimized, inputs)) <= plan.budget_bytes


def test_state_dict_keys_and_parameters_are_the_originals(path_options):
    model, inputs = models_zoo.get_model("gpt2", "tiny")
    optimized = rg.optimize(model, 1.0, example_inputs=inputs, **path_options)
    assert list(optimized.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(optimized.parameters(), model.parameters()))
    optimized.load_state_dict(model.state_dict())


def test_plans_lazily_on_the_first_call_and_again_when_shapes_change(path_options):
    model, (x,) = models_zoo.get_model("mlp", "tiny")
    optimized = rg.optimize(model, 0.9, **path_options)
    assert optimized.recompute_plan is None and "on first" in repr(optimized)
    default_loss(optimized(x)).backward()
    first = optimized.recompute_plan
    assert first is not None
    default_loss(optimized(x[:48])).backward()
    second = optimized.recompute_plan
    assert second is not first and second.store_all_peak_bytes < first.store_all_peak_bytes
    default_loss(optimized(x)).backward()
    assert optimized.recompute_plan is first  # each signature keeps its plan
    default_loss(optimized(x[:48])).backward()
    assert optimized.recompute_plan is second


def test_eval_and_no_grad_run_the_plain_forward():
    model, inputs = models_zoo.get_model("resnet18", "tiny")
    optimized = rg.optimize(model, 0.95, example_inputs=inputs, timing="flops")
    calls = []
    executor = next(iter(optimized._plans.values()))[0]
    executor.observer = lambda *a: calls.append(a)
    model.eval()
    with torch.no_grad():
        expected = model(*inputs)
    optimized.eval()
    torch.testing.assert_close(optimized(*inputs), expected)
    optimized.train()
    with torch.no_grad():
        optimized(*inputs)
    assert calls == []
    optimized(*inputs).sum().backward()
    assert calls


def test_inputs_that_require_grad_get_the_original_gradient(path_options):
    model, (x,) = models_zoo.get_model("mlp", "tiny")
    x = x.clone().requires_grad_(True)
    default_loss(model(x)).backward()
    expected = x.grad.clone()
    x.grad = None
    optimized = rg.optimize(model, 0.9, example_inputs=(x,), **path_options)
    default_loss(optimized(x)).backward()
    torch.testing.assert_close(x.grad, expected)


def test_a_double_backward_is_refused_with_an_error_that_says_so(path_options):
    """A gradient penalty differentiates the gradients: the schedule executor's backward refuses it with
    a RewriteError (its gradients had no graph: autograd said only that they do not require grad);
    AOTAutograd's backward, on the compiler path, refuses it itself."""
    model, (x,) = models_zoo.get_model("mlp", "tiny")
    optimized = rg.optimize(model, 0.9, example_inputs=(x,), **path_options)
    x = x.clone().requires_grad_(True)
    error = rg.RewriteError if isinstance(optimized, rg.RecomputedModule) else RuntimeError
    with pytest.raises(error, match="double backward"):
        (gradient,) = torch.autograd.grad(default_loss(optimized(x)), x, create_graph=True)
        gradient.square().sum().backward()
    default_loss(optimized(x)).backward()  # a plain step still runs
    assert x.grad is not None


class _DropoutBatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.drop, self.fc = nn.Dropout(0.3), nn.Linear(16 * 256, 10)

    def forward(self, x):
        h = self.drop(torch.relu(self.b1(self.c1(x))))
        h = torch.relu(self.b2(self.c2(h)))
        return self.fc((torch.tanh(h) * h).flatten(1))


def test_two_losses_backpropagated_with_retain_graph_give_the_original_gradients(path_options):
    """``l1.backward(retain_graph=True); l2.backward()`` (a loss per head, a GAN's two terms): the
    second backward runs through the same step. The executor kept the forward's values through the first
    backward only when autograd retains the graph; it freed them before (the second backward failed)."""
    torch.manual_seed(0)
    reference, x = _DropoutBatchNormNet(), torch.randn(16, 3, 16, 16)
    model = copy.deepcopy(reference)
    optimized = rg.optimize(model, 0.6, example_inputs=(x,), **path_options)
    if isinstance(optimized, rg.RecomputedModule):
        assert optimized.recompute_plan.recomputed_nodes
    for step in range(2):
        for module in (optimized, reference):
            module.zero_grad()
            torch.manual_seed(step)
            y = module(x)
            y.square().mean().backward(retain_graph=True)
            y.abs().mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
        for a, b in zip(model.buffers(), reference.buffers()):
            torch.testing.assert_close(a, b)
    torch.manual_seed(5)
    default_loss(optimized(x)).backward()  # a step without retain_graph after them frees as planned
    with pytest.raises(RuntimeError, match="second time"):
        y = optimized(x)
        y.sum().backward()
        y.sum().backward()


def test_keyword_arguments_and_defaults_are_bound_like_the_original(path_options):
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, scale: float = 2.0):
            return self.b(torch.relu(self.a(x))) * scale

    model, x = Scaled(), torch.randn(16, 8)
    optimized = rg.optimize(model, 1.0, **path_options)
    torch.testing.assert_close(optimized(x=x), model(x))
    torch.testing.assert_close(optimized(x, scale=3.0), model(x, 3.0))
    with pytest.raises(TypeError, match="Scaled.forward"):
        optimized(x, 1.0, 3)


def test_infeasible_budget_names_the_smallest_feasible_one_and_changes_nothing(path_options):
    model, inputs = models_zoo.get_model("vgg19", "tiny")
    before = snapshot(model)
    with pytest.raises(rg.InfeasibleBudgetError) as info:
        rg.optimize(model, 1000, example_inputs=inputs, **path_options)
    error = info.value
    assert error.budget_bytes == 1000 and error.min_budget_bytes > 1000
    assert str(error.min_budget_bytes) in str(error)
    assert_unchanged(model, before)
    optimized = rg.optimize(model, error.min_budget_bytes, example_inputs=inputs, **path_options)
    assert peak_memory(make_training_step(optimized, inputs)) <= error.min_budget_bytes
    # the fraction the message names is a budget that fits, and a slightly smaller one does not
    fraction = float(re.search(r"the fraction ([0-9.]+) of what a store-all step needs", str(error)).group(1))
    assert rg.optimize(model, fraction, example_inputs=inputs, **path_options).recompute_plan is not None
    with pytest.raises(rg.InfeasibleBudgetError):
        rg.optimize(model, fraction - 0.01, example_inputs=inputs, **path_options)


@pytest.mark.parametrize("budget", [0, -1, float("nan"), 1.5, "plenty", None])
def test_bad_budgets_raise_value_error_before_any_work(budget):
    model, inputs = models_zoo.get_model("mlp", "tiny")
    with pytest.raises(ValueError, match="1.5GiB"):
        rg.optimize(model, budget, example_inputs=inputs)


def test_unknown_solver_and_option_are_rejected():
    model, inputs = models_zoo.get_model("mlp", "tiny")
    with pytest.raises(ValueError, match="available: chain_dp, chain_dp_fine, chen_greedy"):
        rg.optimize(model, 0.5, solver="magic")
    with pytest.raises(TypeError, match="unknown options \\['colour'\\]"):
        rg.optimize(model, 0.5, colour="red")


def test_untraceable_model_raises_trace_error_and_stays_intact():
    model = UntraceableRoot()
    before = snapshot(model)
    x = torch.randn(3, 4)
    with pytest.raises(rg.TraceError, match="UntraceableRoot") as info:
        rg.optimize(model, 0.5, example_inputs=(x,))
    message = str(info.value)
    assert "torch.fx" in message and "torch.export" in message and "test_trace.py" in message
    assert_unchanged(model, before)
    # without an example call, fx fails now and export is tried (and fails) on the first training call
    optimized = rg.optimize(model, 0.5)
    with pytest.raises(rg.TraceError, match="UntraceableRoot"):
        optimized(x)
    assert_unchanged(model, before)
    with pytest.raises(rg.TraceError, match="UntraceableRoot"):
        rg.optimize(model, 0.5, tracer="fx")
    with pytest.raises(ValueError, match="unknown tracer 'jit'"):
        rg.optimize(model, 0.5, tracer="jit")


@pytest.mark.parametrize("solver", ["store_all", "chen_sqrt", "chen_greedy"])
def test_each_solver_can_be_chosen_by_name(solver, path_options):
    model, inputs = models_zoo.get_model("unet", "tiny")
    optimized = rg.optimize(model, 1.0, example_inputs=inputs, solver=solver, **path_options)
    assert optimized.recompute_plan.solver == solver


def test_a_module_called_several_times_trains_exactly_when_its_calls_are_recomputed(path_options):
    from test_trace import SharedModule
    torch.manual_seed(0)
    model, x = SharedModule(), torch.randn(64, 5)
    default_loss(model(x)).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    optimized = rg.optimize(model, 1.0, example_inputs=(x,), solver="chen_sqrt", **path_options)
    assert optimized.recompute_plan.recomputed_nodes
    default_loss(optimized(x)).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("factory", ["WithOpaquePart", "TupleAndDict", "InPlace", "ShapeConstructors", "TiedWeights"])
def test_tracing_patterns_train_exactly_through_optimize(factory, path_options):
    import test_trace
    torch.manual_seed(0)
    model = getattr(test_trace, factory)()
    x = torch.randint(0, 11, (4, 7)) if factory == "TiedWeights" else torch.randn(8, 6 if factory == "ShapeConstructors" else 4)
    default_loss(model(x)).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    expected_warning = contextlib.nullcontext()
    if factory == "WithOpaquePart" and path_options.get("compiler"):  # a data-dependent branch: Dynamo
        path_options["compiler"] = "auto"                             # refuses it, the default falls back
        expected_warning = pytest.warns(rg.CompilerFallbackWarning, match="Data-dependent branching")
    with expected_warning:
        optimized = rg.optimize(model, "1GiB", example_inputs=(x,), solver="chen_sqrt", **path_options)
    out = optimized(x)
    torch.testing.assert_close(out, model(x))
    default_loss(out).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.layers(x))


def _gradients(model):
    return [p.grad.clone() for p in model.parameters()]


def test_a_copy_of_an_optimized_module_trains_its_own_parameters(path_options):
    """``copy.deepcopy`` (an EMA of the model) and ``torch.save`` of the whole module give a module
    optimized again, on a copy of the original model, with the same arguments: it trains its own
    parameters, exactly. Before, the executor's copy kept the original's executor and failed on its
    first step (``KeyError``), and the compiler path's module could not be copied (fake tensors)."""
    import copy
    import io
    torch.manual_seed(0)
    model, x = _Mlp(), torch.randn(256, 8)
    reference = copy.deepcopy(model)
    optimized = rg.optimize(model, 0.9, example_inputs=(x,), **path_options)
    assert optimized.recompute_plan.recomputed_nodes
    buffer = io.BytesIO()
    torch.save(optimized, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(optimized), torch.load(buffer, weights_only=False)):
        assert type(twin) is type(optimized) and twin.training
        assert list(twin.state_dict()) == list(optimized.state_dict())
        assert all(a is not b and torch.equal(a, b) for a, b in zip(twin.parameters(), model.parameters()))
        default_loss(twin(x)).backward()
        assert all(p.grad is None for p in model.parameters())  # the original is untouched
        expected = copy.deepcopy(reference)
        default_loss(expected(x)).backward()
        assert all(torch.equal(a, b) for a, b in zip(_gradients(twin), _gradients(expected)))
        assert all(torch.equal(a, b) for a, b in zip(twin.buffers(), expected.buffers()))


def test_torch_compile_around_an_optimized_module_runs_its_plan(path_options):
    """``torch.compile(rg.optimize(model, ...))``, as training scripts compile whatever model they hold:
    the optimized module's forward is left to itself (a graph break), and the step trains as planned.
    Before, dynamo failed inside the module's own code (``NameError: name 'torch' is not defined``)."""
    import copy
    torch.manual_seed(0)
    model, x = _Mlp(), torch.randn(256, 8)
    expected = copy.deepcopy(model)
    optimized = rg.optimize(model, 0.9, example_inputs=(x,), **path_options)
    torch._dynamo.reset()
    compiled = torch.compile(optimized)
    default_loss(compiled(x)).backward()
    default_loss(expected(x)).backward()
    assert all(torch.equal(a, b) for a, b in zip(_gradients(model), _gradients(expected)))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), expected.buffers()))
    compiled.eval()
    with torch.no_grad():
        assert torch.equal(compiled(x), expected.eval()(x))


def _hooked(model, kind, log):
    """Registers one hook of ``kind`` on ``model``: parameter hooks doubling every gradient, or a forward
    hook / pre-hook scaling a block's output / input, or a module backward hook."""
    block = model.layers[2]
    if kind == "parameter":
        for p in model.parameters():
            p.register_hook(lambda g: log.append("p") or g * 2)
    elif kind == "forward":
        block.register_forward_hook(lambda module, args, out: log.append("f") or out * 0.5)
    elif kind == "pre":
        block.register_forward_pre_hook(lambda module, args: log.append("f") or (args[0] * 0.5,))
    else:
        block.register_full_backward_hook(lambda module, gin, gout: log.append("b") or (gin[0] * 3,))


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("kind", ["parameter", "forward", "pre", "backward"])
def test_hooks_run_as_in_eager_or_are_refused(path_options, kind, when):
    """Parameter hooks run once per step on both paths (the executor ran them inside its own gradient
    runs as well: a doubling hook quadrupled the gradients). Forward hooks and pre-hooks run as
    registered when the model was captured; registered after planning, the compiler path captures and
    plans again, and the executor, whose graph is traced once, refuses the step (before, both ignored
    them: wrong gradients). Module backward hooks, which neither path can run, are refused."""
    import copy
    from recompute_graph.errors import RewriteError
    torch.manual_seed(0)
    model, x = _Mlp(), torch.randn(2048, 8)
    expected, expected_log, log = copy.deepcopy(model), [], []
    _hooked(expected, kind, expected_log)
    default_loss(expected(x)).backward()
    if when == "before":
        _hooked(model, kind, log)
    refused = kind == "backward" or (when == "after" and kind != "parameter" and not path_options["compiler"])
    with pytest.raises(RewriteError, match="hook") if refused else contextlib.nullcontext():
        try:
            optimized = rg.optimize(model, 0.9, example_inputs=(x,), **path_options)
        except rg.InfeasibleBudgetError as error:  # the executor plans no recomputation around a hooked block
            optimized = rg.optimize(model, error.min_budget_bytes, example_inputs=(x,), **path_options)
        assert optimized.recompute_plan.recomputed_nodes or (kind in ("forward", "pre") and when == "before"
                                                              and not path_options["compiler"])
        if when == "after":
            _hooked(model, kind, log)
        log.clear()
        default_loss(optimized(x)).backward()
    if refused:
        return
    assert all(torch.equal(a, b) for a, b in zip(_gradients(model), _gradients(expected)))
    if kind == "parameter" or when == "before":  # (a new capture runs the forward hooks once more)
        assert len(log) == len(expected_log)


class _FeatureLoss(nn.Module):
    """A model whose forward hook keeps a layer's features (``keep(output)``) for a loss beside the
    output, the way perceptual and distillation losses read intermediate layers: in a dict of the model
    (``self.features``) or in one the hook closes over (``store``)."""

    def __init__(self, hooked: int, keep, store=None) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Sequential(nn.Linear(64, 64), nn.Tanh()),
                                    nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        self.features: dict[str, torch.Tensor] = {}
        store = self.features if store is None else store
        self.layers[hooked].register_forward_hook(lambda module, args, out: store.update(mid=keep(out)))

    def forward(self, x):
        return self.layers(x)


@pytest.mark.parametrize("store", ["attribute", "closure"])
@pytest.mark.parametrize("keep", ["output", "derived"])
@pytest.mark.parametrize("hooked", [2, 3], ids=["inlined_block", "leaf_linear"])
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_forward_hook_keeping_features_is_exact_on_the_compiler_path_and_refused_by_the_executor(
        tracer, hooked, keep, store):
    """``features[name] = output`` in a forward hook, read by the loss. The compiler path makes the kept
    tensor a graph output (exact). The executor ran the hook at trace time (a proxy or fake tensor kept)
    or at each run of a leaf node on tensors outside the model's graph: the features' gradient was lost
    silently, or autograd failed. It now refuses the model, and puts the hooks and attributes back."""
    from recompute_graph.errors import RewriteError, TraceError
    keeper = (lambda out: out) if keep == "output" else (lambda out: out.mean(1))
    closure: dict = {}
    torch.manual_seed(0)
    model, x = _FeatureLoss(hooked, keeper, closure if store == "closure" else None), torch.randn(2048, 8)
    hooks = dict(model.layers[hooked]._forward_hooks)
    where = (rf"forward hook of module 'layers.{hooked}'.*keeps a tensor it received or made" if store == "closure"
             else rf"(keeps a tensor of the step in self.features\['mid'\]|module 'layers.{hooked}'.*keeps a tensor)")
    with pytest.raises((RewriteError, TraceError), match=where):
        rg.optimize(model, 0.8, example_inputs=(x,), compiler=False, tracer=tracer, timing="flops")
    assert dict(model.layers[hooked]._forward_hooks) == hooks and model.features == {}
    if tracer == "export" or hooked == 3 or store == "closure":
        return  # the compiler path's capture is one per model: checked once
    torch._dynamo.reset()
    torch.manual_seed(0)
    expected = _FeatureLoss(hooked, keeper)  # (a deep copy's hook would fill the original's dict)
    optimized = rg.optimize(model, 0.9, example_inputs=(x,), compiler=True)  # (the features stay: 0.81)
    assert optimized.recompute_plan.recomputed_nodes
    for got, want in zip(_feature_step(model, optimized, x), _feature_step(expected, expected, x)):
        assert torch.allclose(got, want, atol=1e-6)


def test_a_hook_feature_extractor_that_returns_its_features_runs_on_the_executor():
    """timm's ``features_only=True, feature_cls="hook"`` (``FeatureHookNet``): hooks store each stage's
    output in a dict keyed by ``x.device``, and ``forward`` returns and empties it. Under fx the key is a
    proxy, so the kept proxies stay, and the fx trace is refused; ``tracer="auto"`` then exports the
    model, whose hooks hand everything back, and the executor trains it exactly."""
    from models_zoo import third_party
    timm = third_party.import_timm()

    def build():
        torch.manual_seed(0)
        return timm.create_model("resnet18", features_only=True, feature_cls="hook", pretrained=False)

    def step(call, model):
        model.zero_grad(set_to_none=True)
        sum(f.square().mean() for f in call(x)).backward()
        return [p.grad.clone() for p in model.parameters()]
    model, expected, x = build(), build(), torch.randn(2, 3, 64, 64)
    optimized = rg.optimize(model, 1.0, example_inputs=(x,), compiler=False, timing="flops")
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(step(optimized, model), step(expected, expected)))


def _feature_step(model, call, x):
    loss = default_loss(call(x)) + model.features["mid"].square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


class _BayesianLinear(nn.Module):
    """A Bayesian layer that keeps its KL term on itself (``self.kl``) for the loss to add."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.mean = nn.Parameter(torch.randn(outputs, inputs) * 0.1)
        self.log_sigma = nn.Parameter(torch.full((outputs, inputs), -3.0))

    def forward(self, x):
        weight = self.mean + self.log_sigma.exp() * torch.randn_like(self.mean)
        self.kl = 0.5 * (self.log_sigma.exp().square() + self.mean.square() - 2 * self.log_sigma - 1).sum()
        return torch.tanh(x @ weight.t())


@pytest.mark.parametrize("tracer", ["fx", "export", "auto"])
def test_a_kl_term_kept_on_a_module_is_refused_by_the_executor_and_exact_on_the_compiler_path(tracer):
    """``self.kl = ...`` in forward, summed into the loss after the call. Export's graph left the
    attribute as it was before the trace (a stale tensor: the KL gradient lost, 1e-3 off, silently); fx's
    proxy was dropped (``AttributeError`` in the loss). The executor now refuses it on both tracers; the
    compiler path keeps it."""
    from recompute_graph.errors import TraceError

    def build():
        torch.manual_seed(0)
        return nn.Sequential(_BayesianLinear(8, 128), _BayesianLinear(128, 128), _BayesianLinear(128, 128),
                             nn.Linear(128, 4))

    def step(model, call):
        torch.manual_seed(3)
        loss = default_loss(call(x)) + 1e-3 * sum(m.kl for m in model if isinstance(m, _BayesianLinear))
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    from recompute_graph.call_graphs import CallGraphs
    recurrent = nn.Sequential(nn.LSTM(8, 16))  # its _flat_weights list holds export's fake weights: not kept
    CallGraphs(recurrent, tracer).graph_for((torch.randn(5, 3, 8),), {})
    model, x = build(), torch.randn(1024, 8)
    import warnings
    with pytest.raises(TraceError, match=r"keeps a tensor of the step in self\.0\.kl") as refused, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rg.optimize(model, 0.8, example_inputs=(x,), compiler=False, tracer=tracer, timing="flops")
    assert not hasattr(model[0], "kl")
    assert str(refused.value).count("keeps a tensor") == 1  # fx's and export's refusals, said once
    assert not [w for w in caught if "assigned during export" in str(w.message)]  # (export's own warning)
    if tracer != "fx":
        return
    torch._dynamo.reset()
    optimized, expected = rg.optimize(model, 0.8, example_inputs=(x,), compiler=True), build()
    assert optimized.recompute_plan.recomputed_nodes
    for got, want in zip(step(model, optimized), step(expected, expected)):
        assert torch.allclose(got, want, atol=1e-6)


def test_hooks_that_keep_nothing_of_the_graph_run_on_the_executor(path_options):
    """No refusal for what a hook may keep: a logged number or detached copy, pruning, old-style weight
    and spectral norm (torch's own pre-hooks), and ``output.requires_grad_()`` on a frozen embedding
    (transformers' ``enable_input_require_grads``), whose node has no input or parameter to differentiate:
    the executor's pricing failed on it (``grad()`` with no inputs) and dynamo refuses it."""
    import warnings
    from torch.nn.utils import prune

    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(50, 16)
            self.layers = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                                        nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))
            self.embedding.weight.requires_grad_(False)
            self.embedding.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
            self.logged: list = []
            self.layers[0].register_forward_hook(
                lambda module, args, out: self.logged.append((out.detach(), out.abs().mean().item())))
            prune.l1_unstructured(self.layers[2], "weight", amount=0.3)
            nn.utils.weight_norm(self.layers[4])
            nn.utils.spectral_norm(self.layers[6])

        def forward(self, tokens):
            return self.layers(self.embedding(tokens))

    torch.manual_seed(0)
    model, tokens = Hooked(), torch.randint(0, 50, (1024,))
    torch.manual_seed(0)
    expected = Hooked()  # (weight_norm's module cannot be deep-copied)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rg.CompilerFallbackWarning)
        optimized = rg.optimize(model, 0.8, example_inputs=(tokens,), **{**path_options, "compiler": (
            False if not path_options["compiler"] else "auto")})
    assert optimized.recompute_plan.recomputed_nodes
    for _ in range(2):
        torch.manual_seed(1)
        default_loss(optimized(tokens)).backward()
        torch.manual_seed(1)
        default_loss(expected(tokens)).backward()
    for got, want in zip(model.parameters(), expected.parameters()):
        assert (got.grad is None) == (want.grad is None)
        if got.grad is not None:
            assert torch.allclose(got.grad, want.grad, atol=1e-6)
    assert torch.allclose(model.layers[0](model.embedding(tokens)).detach(), model.logged[-1][0])


def test_a_call_in_eval_mode_with_grad_warns_once_that_it_is_not_planned(path_options):
    """Training in ``eval()`` mode (BatchNorm frozen the blunt way) runs the plain forward: exact, but
    outside the plan and its budget. Silent before; now an ``EvalModeGradientWarning`` says so once and
    what to do. A validation call under ``torch.no_grad()`` does not warn. The warning names the
    caller's line (it named a line of the library's)."""
    import copy
    import warnings
    torch.manual_seed(0)
    model, x = _Mlp(), torch.randn(256, 8)
    expected = copy.deepcopy(model).eval()
    optimized = rg.optimize(model, 0.9, example_inputs=(x,), **path_options).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            optimized(x)
    with pytest.warns(rg.EvalModeGradientWarning, match="no_grad") as caught:
        default_loss(optimized(x)).backward()
    assert caught[0].filename == __file__  # the user's line, not the library's (errors.user_stacklevel)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default_loss(optimized(x)).backward()  # once per module
    default_loss(expected(x)).backward()
    default_loss(expected(x)).backward()
    assert all(torch.equal(a, b) for a, b in zip(_gradients(model), _gradients(expected)))


def test_uninitialized_lazy_modules_are_refused_with_what_to_do(path_options):
    """``nn.LazyLinear`` before its first forward: no shapes to plan with, and its first forward draws
    its parameters and removes its initializing hook. The compiler path fell back to the executor,
    which then refused the step over the removed hook. Refused up front now; once run, it trains exactly."""
    from recompute_graph.errors import TraceError
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(128), nn.Tanh(), nn.LazyLinear(128), nn.Tanh(), nn.LazyLinear(4))
    x = torch.randn(512, 16)
    with pytest.raises(TraceError, match=r"'0' \(LazyLinear\).*Run the model once"):
        rg.optimize(model, 0.9, example_inputs=(x,), **path_options)
    model(x)
    report = rg.verify(model, 0.9, example_inputs=(x,), **path_options)
    assert report.gradient_error == 0.0 and report.solver != "store_all"


class _StarredForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 128), nn.Linear(128, 4)

    def forward(self, x, scale=1.0, **extra):
        return self.b(torch.tanh(self.a(x * scale + extra.get("bias", 0))))


def test_a_forward_with_starred_parameters_trains_exactly(path_options):
    """``forward(self, x, scale=1.0, **extra)``: the executor's pricing passes gave the ``**extra``
    placeholder fx's list of the values left (``ProfileError: 'list' object has no attribute 'get'``)."""
    import copy
    torch.manual_seed(0)
    model, x = _StarredForward(), torch.randn(1024, 16)
    expected = copy.deepcopy(model)
    optimized = rg.optimize(model, 0.95, example_inputs=(x,), example_kwargs={"scale": 0.5, "bias": x},
                            **path_options)
    assert optimized.recompute_plan.recomputed_nodes
    default_loss(optimized(x, scale=0.5, bias=x)).backward()
    default_loss(expected(x, scale=0.5, bias=x)).backward()
    assert all(torch.equal(a, b) for a, b in zip(_gradients(model), _gradients(expected)))


def _verified_exactly_and_priced(model, x, loss_fn, path_options):
    """``rg.verify`` at 1.0 with ``loss_fn``: exact gradients, no warning (within the budget), and the
    predicted step peak within 1 % of the allocator's."""
    report = rg.verify(model, 1.0, example_inputs=(x,), loss_fn=loss_fn, **path_options)
    assert report.gradient_error == 0.0 and not report.warnings, report
    assert abs(report.predicted_peak_bytes / report.measured_peak_bytes - 1) < 0.01, report


class _ReturnsItsInput(nn.Module):
    """An autoencoder returning its input beside the reconstruction, for the loss to compare the two."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(512, 64), nn.Linear(64, 512)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))), x


@pytest.mark.parametrize("loss", ["default", "mse"])
def test_a_model_returning_its_input_is_planned_within_its_budget(path_options, loss):
    """The loss holds the reconstruction and its gradient at once, more than the simulator's peak: the
    budget of a fraction (and whether a plan fits) set the loss beside the simulator's peak, so the
    store-all step measured 21.5 MB against an 18.2 MB budget. And the executor returned the input as
    a differentiable output: the loss's gradient for it, 4 MB, was not in the plan (0.76-0.84 of the
    allocator)."""
    torch.manual_seed(0)
    model, x = _ReturnsItsInput(), torch.randn(2048, 512)
    loss_fn = (lambda out: nn.functional.mse_loss(out[0], out[1])) if loss == "mse" else None
    _verified_exactly_and_priced(model, x, loss_fn, path_options)


class _LogitsAndHidden(nn.Module):
    """A dictionary output: the logits and the hidden values, the hidden values shaped like the input."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(512, 512), nn.Linear(512, 512)

    def forward(self, x):
        h = self.a(x)
        return {"logits": self.b(torch.tanh(h)), "hidden": h}


@pytest.mark.parametrize("reads", ["both", "logits"])
def test_a_loss_reading_the_outputs_by_name_is_priced_on_them(path_options, reads):
    """The compiled graph's outputs are flat: a loss reading ``out["logits"]`` failed on them and was
    left unpriced. And the hidden values, made from the input and shaped like it, were taken for a
    buffer's new value (``joint_costs.buffer_updates``): the step measured 24 MiB against 16 MiB
    predicted, over its budget. Now the loss runs on the output as the model's own forward built it
    (``output_structure.OutputStructure``). A loss reading the logits alone leaves the hidden values'
    gradient to AOTAutograd's zeros when the backward starts, not while the loss runs
    (``CostGraph.loss_unreached_gradient_bytes``; counted there, 1.17 of the allocator)."""
    torch.manual_seed(0)
    model, x = _LogitsAndHidden(), torch.randn(2048, 512)

    def loss_fn(out):
        return (out["logits"] - out["hidden"] if reads == "both" else out["logits"]).square().mean()
    _verified_exactly_and_priced(model, x, loss_fn, path_options)


class _CarriesMemory(nn.Module):
    """Transformer-XL's memory: the last call's output, detached, added to the next call's input."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                                    nn.Linear(256, 16))
        self.memory = None

    def forward(self, x):
        out = self.layers(x if self.memory is None else x + self.memory)
        self.memory = out.detach()
        return out


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_state_for_the_next_call_kept_on_a_module_is_refused_by_the_executor(tracer):
    """``self.memory = out.detach()``: export's graph froze the branch and value of its trace, so the
    executor's steps never used the memory (outputs 3e-3 off from the second step, silently); fx kept a
    proxy. The executor refuses it on both tracers; the compiler path carries it as eager does."""
    from recompute_graph.errors import TraceError
    torch.manual_seed(0)
    model, x = _CarriesMemory(), torch.randn(1024, 16)
    with pytest.raises(TraceError, match=r"keeps a tensor of the step in self\.memory .*register_buffer"):
        rg.optimize(model, 0.9, example_inputs=(x,), compiler=False, tracer=tracer, timing="flops")
    assert model.memory is None
    if tracer == "export":
        return
    torch._dynamo.reset()
    torch.manual_seed(0)
    expected = _CarriesMemory()
    optimized = rg.optimize(model, 0.9, example_inputs=(x,), compiler=True)
    _three_steps_alike(optimized, model, expected, x, "memory", atol=1e-6)


class _ScalesItsInput(nn.Module):
    """Normalizes its input in place (``x /= 255``), as image models written for uint8 batches do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                                    nn.Linear(256, 4))

    def forward(self, x):
        x /= 255
        return self.layers(x)


def test_planning_leaves_the_example_inputs_as_they_were(path_options):
    """Planning runs the forward several times; a model writing into its input divided the user's example
    batch by 255 on each run (8 runs on the executor, 4 on the compiler path), so a loop that trained on
    that batch first trained on a batch near 0. Planning now runs on copies; training calls still write
    into their inputs as the model does, and one input passed twice stays one tensor."""
    import copy
    torch.manual_seed(0)
    model, x = _ScalesItsInput(), torch.rand(2048, 16) * 255
    expected, original = copy.deepcopy(model), x.clone()
    optimized = rg.optimize(model, 0.9, example_inputs=(x,), **path_options)
    assert torch.equal(x, original)
    mine, theirs = x.clone(), x.clone()
    default_loss(optimized(mine)).backward()
    default_loss(expected(theirs)).backward()
    assert torch.equal(mine, theirs) and not torch.equal(mine, original)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(_gradients(model), _gradients(expected)))
    from recompute_graph.api import _planning_copies
    (first, second), _ = _planning_copies((x, x), {})
    assert first is second and first is not x


class _CentersItsOutput(nn.Module):
    """Keeps a running center of its outputs in a buffer assigned anew each call (``self.center = 0.9 *
    self.center + ...``, DINO's centering), not written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                                    nn.Linear(256, 8))
        self.register_buffer("center", torch.zeros(8))

    def forward(self, x):
        out = self.layers(x)
        self.center = 0.9 * self.center + 0.1 * out.detach().mean(0)
        return out - self.center


@pytest.mark.parametrize("tracer", ["fx", "export", None])
def test_a_buffer_assigned_anew_in_forward_is_updated_once_per_step(tracer):
    """fx recorded the new value of ``self.center`` but no write, so the executor's steps never updated
    the buffer (gradients 0.2 off after 3 steps, silently); planning on the compiler path ran the forward
    twice and left the buffer assigned twice (off from the first step). The fx graph now writes the value
    into the buffer (``trace.assign_buffer``), and planning puts the buffer itself back."""
    import copy
    torch.manual_seed(0)
    model, x = _CentersItsOutput(), torch.randn(2048, 16)
    expected = copy.deepcopy(model)
    options = {"compiler": True} if tracer is None else {"compiler": False, "tracer": tracer, "timing": "flops"}
    optimized = rg.optimize(model, 0.9, example_inputs=(x,), **options)
    assert torch.equal(model.center, torch.zeros(8))
    _three_steps_alike(optimized, model, expected, x, "center", atol=1e-7)


def _three_steps_alike(optimized, model, expected, x, state: str, atol: float) -> None:
    """Three steps of ``optimized`` and ``expected``: the same gradients and the same ``state`` after each."""
    for _ in range(3):
        for m in (optimized, expected):
            m.zero_grad(set_to_none=True)
            default_loss(m(x)).backward()
        assert torch.allclose(getattr(model, state), getattr(expected, state), atol=atol)
        assert all(torch.allclose(a, b, atol=atol) for a, b in zip(_gradients(model), _gradients(expected)))


class _CountsItsCalls(nn.Module):
    """A step counter in a buffer (``self.steps += 1``, used in the forward). (One in a Python int is
    refused: tests/test_model_mutation.py -k changes_at_each_call.)"""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 256), nn.Linear(256, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps += 1
        return self.b(torch.tanh(self.a(x)) / self.steps.float())


def test_a_counter_the_forward_updates_counts_training_calls_only(path_options):
    """``self.steps += 1`` on a buffer: tracing assigned the fx proxy to the buffer itself, the executor's
    pricing then ran the model on it (``KeyError: add``, the graph growing nodes after its output), and
    the user's model kept the proxy. Now both count the training calls, and planning counts none."""
    import copy
    torch.manual_seed(0)
    model, x = _CountsItsCalls(), torch.randn(1024, 16)
    expected = copy.deepcopy(model)
    optimized = rg.optimize(model, 1.0, example_inputs=(x,), **path_options)
    assert isinstance(model._buffers["steps"], torch.Tensor) and int(model.steps) == 0
    for _ in range(3):
        for m in (optimized, expected):
            m.zero_grad(set_to_none=True)
            default_loss(m(x)).backward()
    assert int(model.steps) == int(expected.steps) == 3
    assert all(torch.equal(a, b) for a, b in zip(_gradients(model), _gradients(expected)))


class _WithLossMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))

    def forward(self, x):
        return self.layers(x)

    def compute_loss(self, x):
        return self(x).square().mean()


def test_a_method_of_the_model_that_calls_it_in_training_warns_that_the_call_is_not_planned(path_options):
    """``optimized.compute_loss(x)`` is the model's method: its ``self`` is the model, so ``self(x)`` ran
    the plain forward, outside the plan and its budget, silently. An ``UnplannedCallWarning`` now says so,
    once; under ``torch.no_grad()`` it does not, and the optimized module itself is planned."""
    import warnings
    torch.manual_seed(0)
    model, x = _WithLossMethod(), torch.randn(512, 16)
    optimized = rg.optimize(model, 0.9, example_inputs=(x,), **path_options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            optimized.compute_loss(x)
        default_loss(optimized(x)).backward()
        assert not [w for w in caught if issubclass(w.category, rg.UnplannedCallWarning)]
        for _ in range(2):
            optimized.compute_loss(x).backward()
    found = [w for w in caught if issubclass(w.category, rg.UnplannedCallWarning)]
    assert len(found) == 1 and "compute_loss" in str(found[0].message) and found[0].filename == __file__
    assert not model._forward_pre_hooks


class _CheckpointsItsBlocks(nn.Module):
    """A model that already checkpoints its blocks (``torch.utils.checkpoint``, as transformers'
    ``gradient_checkpointing_enable()`` and timm's ``set_grad_checkpointing()`` do), with a dropout in each."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64))
                                    for _ in range(4))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return x


def test_a_model_that_checkpoints_its_own_blocks_trains_exactly(path_options):
    """Both paths trace through the user's checkpoint calls and plan the whole step themselves; the
    dropout masks of the checkpointed blocks are drawn as eager PyTorch draws them."""
    import copy
    torch.manual_seed(0)
    model, x = _CheckpointsItsBlocks(), torch.randn(512, 64)
    expected = copy.deepcopy(model)
    optimized = rg.optimize(model, 0.6, example_inputs=(x,), **path_options)
    assert optimized.recompute_plan.recomputed_nodes
    for step in range(2):
        for m in (optimized, expected):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            default_loss(m(x)).backward()
        assert all(torch.equal(a, b) for a, b in zip(_gradients(model), _gradients(expected)))


_FEATURES: list = []  # filled by _FillsAGlobalList's forward, read and cleared by the loss


class _FillsAGlobalList(nn.Module):
    """A forward that appends a feature map to a list outside the model for the loss to read (a
    perceptual or deep-supervision term), or stores it in a dict of a closure."""

    def __init__(self, store=None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6))
        self.store = (lambda h: _FEATURES.append(h)) if store is None else store

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 2:
                self.store(x)
        return x


@pytest.mark.parametrize("container", ["global list", "closure dict"])
def test_a_tensor_kept_in_a_container_outside_the_model_is_refused_by_the_executor(container):
    """torch.fx left a proxy of its trace in the list, and the executor's steps never filled it: the
    loss's feature term was a proxy on the first step (its ``backward()`` did nothing) and missing from
    the second, silently. Refused now, and not by export either (its fake tensor would be left there);
    the proxy is taken out."""
    closure: dict = {}
    store = None if container == "global list" else (lambda h: closure.__setitem__("mid", h))
    with pytest.raises(rg.TraceError, match=r"keeps a tensor of the step in a (list|dict \(at key 'mid'\)) "
                                            r"outside the model \(a global or a closure variable\)"):
        rg.optimize(_FillsAGlobalList(store), 0.6, example_inputs=(torch.randn(256, 64),), compiler=False)
    assert _FEATURES == [] and closure == {}


def test_a_tensor_kept_in_a_global_list_trains_exactly_on_the_compiler_path():
    """Dynamo replays the append after its graph, so the compiler path trains it as eager PyTorch does.
    But planning's runs of the forward appended too: the first step's loss read two stale feature maps
    besides its own (gradients twice the largest one off), and the list's length, a guard, made Dynamo
    compile again. Planning now takes out what its runs put there."""
    import copy

    def loss(out):
        total = out.square().mean() + sum(f.abs().mean() for f in _FEATURES)
        _FEATURES.clear()
        return total
    torch.manual_seed(0)
    model, x = _FillsAGlobalList(), torch.randn(256, 64)
    expected = copy.deepcopy(model)
    optimized = rg.optimize(model, 0.6, example_inputs=(x,), compiler=True)
    assert _FEATURES == [] and optimized.recompute_plan.recomputed_nodes
    for _ in range(2):
        for m in (optimized, expected):
            m.zero_grad(set_to_none=True)
            loss(m(x)).backward()
        assert all(torch.equal(a, b) for a, b in zip(_gradients(model), _gradients(expected)))
    assert len(optimized.lowerings) == 1  # compiled once


def test_optimizing_an_optimized_module_plans_its_model_again_at_the_new_budget(path_options):
    """``optimize(optimized, 0.8)`` (a user trying another budget): the compiler path could not compile
    the optimized module and fell back, the executor failed to trace it (``Proxy object cannot be
    iterated``). The original model is now planned again; the first module keeps its own plan."""
    model, (x,) = models_zoo.get_model("mlp", "tiny")
    first = rg.optimize(model, 0.8, example_inputs=(x,), **path_options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", rg.CompilerFallbackWarning)  # the compiler path takes it
        second = rg.optimize(first, 0.95, example_inputs=(x,), **path_options)
    assert type(second) is type(first)
    assert second.recompute_plan.budget_bytes > first.recompute_plan.budget_bytes
    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    default_loss(second(x)).backward()
    default_loss(reference(x)).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_module_optimize_returned_inside_another_model_is_refused_naming_it(path_options):
    """Optimizing a model that holds an optimized submodule planned the submodule twice over (the
    executor failed in its pricing, saying hooks had changed). optimize() plans a whole model at once:
    it refuses, naming the submodule, and changes nothing."""
    model, (x,) = models_zoo.get_model("mlp", "tiny")
    parent = nn.Sequential(rg.optimize(model, 0.8, example_inputs=(x,), **path_options), nn.Tanh())
    before = {name: p.detach().clone() for name, p in parent.named_parameters()}
    with pytest.raises(rg.TraceError, match=r"Sequential\.0 is a module optimize\(\) returned"):
        rg.optimize(parent, 0.8, example_inputs=(x,), **path_options)
    for name, p in parent.named_parameters():
        assert torch.equal(p, before[name]) and p.grad is None


@pytest.mark.parametrize("last", ["sigmoid", "linear"])
def test_an_output_written_in_place_before_backward_is_refused_when_the_backward_reads_it(path_options, last):
    """``out = model(x); out.mul_(2)``: autograd refuses when the backward reads ``out`` (a sigmoid's
    output), and lets a linear layer's output be written. The executor saves its tensors through hooks
    autograd does not check, so its backward read the written sigmoid output, silently."""
    torch.manual_seed(0)
    layers = [nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32)]
    model = nn.Sequential(*layers, *([nn.Sigmoid()] if last == "sigmoid" else []))
    reference, x = copy.deepcopy(model), torch.randn(64, 32)
    optimized = rg.optimize(model, 0.9, example_inputs=(x,), **path_options)
    outputs = []
    for module in (optimized, reference):
        out = module(x)
        out.mul_(2)
        outputs.append(out)
    if last == "sigmoid":
        for out in outputs:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.square().mean().backward()
        return
    for out in outputs:
        out.square().mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_an_input_written_in_place_before_backward_is_refused_as_autograd_refuses_it(path_options):
    """``out = model(x); x.add_(1)`` before ``backward()``: the first linear layer saved ``x`` for its
    weight's gradient, so autograd refuses. The executor's tapes save through hooks autograd does not
    check: its weight gradient was computed from the written ``x``, silently. Its hooks now keep the
    version each tensor had when saved and refuse as autograd does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    reference = copy.deepcopy(model)
    optimized = rg.optimize(model, 0.9, example_inputs=(torch.randn(64, 32),), **path_options)
    for module in (optimized, reference):
        x = torch.randn(64, 32)
        out = module(x)
        x.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.square().mean().backward()
    x = torch.randn(64, 32)
    default_loss(optimized(x)).backward()  # the next step runs
    assert all(p.grad is not None for p in model.parameters())
