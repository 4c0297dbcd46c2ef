"""A model changed by its user after optimize(): replaced or frozen parameters and dtype conversions keep
training exactly, on both paths: the plan is made again for the tensors in use (FSDP2's unsharded parameters are the
same mechanism: tests/test_distributed.py)."""
from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

import models_zoo
from recompute_graph import optimize
from recompute_graph.measure import default_loss


def step_gradients(module, inputs):
    torch.manual_seed(0)
    module.zero_grad(set_to_none=True)
    default_loss(module(*inputs)).backward()
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def assert_same(a, b, atol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=atol)


@pytest.fixture
def unet(path_options):
    model, inputs = models_zoo.get_model("unet", "tiny")
    reference = copy.deepcopy(model)
    optimized = optimize(model, 0.7, example_inputs=inputs, loss_fn=default_loss, **path_options)
    return model, reference, optimized, inputs


def test_a_replaced_parameter_gets_its_gradient(unet):
    model, reference, optimized, inputs = unet
    weight = torch.randn_like(model.head.weight)
    model.head.weight = torch.nn.Parameter(weight.clone())
    reference.head.weight = torch.nn.Parameter(weight.clone())
    assert_same(step_gradients(reference, inputs), step_gradients(optimized, inputs))
    assert model.head.weight.grad is not None


def test_a_frozen_parameter_gets_no_gradient_and_the_rest_stay_exact(unet):
    model, reference, optimized, inputs = unet
    model.head.weight.requires_grad_(False)
    reference.head.weight.requires_grad_(False)
    assert_same(step_gradients(reference, inputs), step_gradients(optimized, inputs))
    assert model.head.weight.grad is None


def test_a_dtype_conversion_plans_again_for_the_new_dtype(unet):
    model, reference, optimized, inputs = unet
    before = optimized.recompute_plan
    optimized.double(), reference.double()
    doubled = tuple(t.double() for t in inputs)
    assert_same(step_gradients(reference, doubled), step_gradients(optimized, doubled), atol=1e-9)
    assert optimized.recompute_plan is not before
    assert optimized.recompute_plan.store_all_peak_bytes > 1.5 * before.store_all_peak_bytes


def test_functional_call_trains_the_parameters_it_is_given(unet):
    """``torch.func.functional_call(optimized, params, inputs)`` (meta-learning, per-sample gradients):
    the parameters are swapped in for the forward only, and put back before backward. The executor's
    recomputations in backward read the module's own parameters back then: gradients went to nothing
    for the recomputed nodes' parameters, and the others were off. The recomputations now run on the
    forward's parameters."""
    model, reference, optimized, inputs = unet
    assert optimized.recompute_plan.recomputed_nodes

    def gradients(module, source):
        given = {name: (p.detach() * 1.1).requires_grad_() for name, p in source.named_parameters()}
        torch.manual_seed(0)
        default_loss(torch.func.functional_call(module, given, inputs)).backward()
        return [p.grad for p in given.values()]
    for _ in range(2):
        assert_same(gradients(reference, reference), gradients(optimized, model))
    assert all(p.grad is None for p in model.parameters())
    assert_same(step_gradients(reference, inputs), step_gradients(optimized, inputs))  # its own again
    assert len(optimized._planning_seconds) == 1  # planned again for new tensors: no new call signature


class _Scaled(torch.nn.Module):
    """Its output scaled by a plain attribute (a temperature, a gradient reversal's lambda a schedule
    changes between steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                          torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh())
        self.head = torch.nn.Linear(256, 4)
        self.scale = 1.0
        self.mask = torch.ones(4)  # a plain tensor attribute, not a buffer

    def forward(self, x):
        return self.head(self.layers(x)) * self.scale * self.mask


@pytest.mark.parametrize("where", ["optimized", "model"])
def test_an_attribute_or_submodule_set_after_optimize_is_the_one_the_step_uses(path_options, where):
    """``optimized.scale = 3.0`` was set on the optimized module alone, and both paths kept training with
    the model's 1.0; set on the model, the executor's traced graph kept the value of its trace (and the
    old submodule, and the old tensor of a plain tensor attribute). Now an
    attribute or submodule set on the optimized module is set on the model, and the executor traces and
    plans again when a plain attribute changed (the compiler path's guards recompile)."""
    torch.manual_seed(0)
    model, x = _Scaled(), (torch.randn(1024, 16),)
    reference = copy.deepcopy(model)
    optimized = optimize(model, 0.8, example_inputs=x, **path_options)
    assert_same(step_gradients(optimized, x), step_gradients(reference, x))
    setattr(optimized if where == "optimized" else model, "scale", 3.0)
    reference.scale = 3.0
    assert model.scale == 3.0 and optimized.scale == 3.0
    assert_same(step_gradients(optimized, x), step_gradients(reference, x))
    head = torch.nn.Linear(256, 4)
    reference.head = copy.deepcopy(head)
    setattr(optimized if where == "optimized" else model, "head", head)
    assert model.head is head and optimized.head is head
    assert_same(step_gradients(optimized, x), step_gradients(reference, x))
    reference.mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    setattr(optimized if where == "optimized" else model, "mask", reference.mask.clone())
    assert_same(step_gradients(optimized, x), step_gradients(reference, x))
    assert optimized.recompute_plan.recomputed_nodes


class _Counting(torch.nn.Module):
    """A forward that counts its training calls in a plain int and fades a residual in with it (a
    warm-up): each call changes ``self.step``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
        self.step = 0

    def forward(self, x):
        if self.training:
            self.step += 1
        alpha = min(1.0, self.step / 10)
        for layer in self.layers:
            x = torch.tanh(layer(x)) * alpha + x * (1 - alpha)
        return x


@pytest.mark.parametrize("compiler", [False, True, "auto"])
def test_a_value_the_forward_changes_at_each_call_is_refused(compiler):
    """``self.step += 1`` in forward: the executor's traced graph kept the value of its trace, so the
    counter never moved and the warm-up trained silently wrong (gradients off by the largest one from
    the second step); the compiler path compiled and planned again at each new value and failed at the
    ninth step with Dynamo's ``FailOnRecompileLimitHit``. Both now refuse it when planning, naming the
    attribute, and leave it as it was."""
    from recompute_graph import ChangingStateError, CompilerFallbackWarning
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Counting(), torch.randn(256, 64)
    with pytest.warns(CompilerFallbackWarning, match=r"self\.step") if compiler == "auto" else \
            contextlib.nullcontext():
        with pytest.raises(ChangingStateError, match=r"self\.step.*register_buffer"):
            optimize(model, 0.6, example_inputs=(x,), compiler=compiler)
    assert model.step == 0


class _SparseBlock(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return torch.tanh(self.linear(x)) * 0.5


class _FullBlock(_SparseBlock):
    def forward(self, x):
        return torch.tanh(self.linear(x))


class _SwitchesItsBlockOnShortInputs(torch.nn.Module):
    """transformers' BigBird: on a short sequence its forward replaces its attention module with another
    class sharing the projections (``set_attention_type("original_full")``). Planning's runs put the plain
    values back and not the modules, leaving the model half switched; its steps switched it again under a
    plan of the old modules (gradients 1e-2 off, 3.6x the predicted peak)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(64, 64)
        self.block = _SparseBlock(torch.nn.Linear(64, 64))
        self.kind = "sparse"

    def forward(self, x):
        if self.kind == "sparse" and x.shape[0] <= 512:
            self.block, self.kind = _FullBlock(self.block.linear), "full"
        return self.block(torch.relu(self.first(x)))


@pytest.mark.parametrize("compiler", [False, "auto"])
def test_a_forward_that_replaces_a_submodule_is_refused_and_the_model_left_as_it_was(compiler):
    from recompute_graph import ChangingStateError, CompilerFallbackWarning, verify
    torch._dynamo.reset()
    model, x = _SwitchesItsBlockOnShortInputs(), torch.randn(256, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompilerFallbackWarning)
        with pytest.raises(ChangingStateError, match=r"replaces submodule block \(_SparseBlock -> _FullBlock\)"):
            optimize(model, 0.8, example_inputs=(x,), compiler=compiler)
    assert type(model.block) is _SparseBlock and model.kind == "sparse"
    model(x)  # (what the message advises: one forward, and the model keeps the modules it switched to)
    report = verify(model, 0.8, example_inputs=(x,), compiler=compiler)
    assert report.gradient_error < 1e-6 and report.measured_peak_bytes <= report.budget_bytes


class _SetUpOnce(torch.nn.Module):
    """A forward that sets attributes on its first call and leaves them alike later (transformers' Funnel
    and SegFormer do): not state that changes at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(6)))
        self.seq_len = None

    def forward(self, x):
        self.seq_len = x.shape[0]
        if not getattr(self, "_installed", False):
            self._installed = True
        return torch.tanh(self.layers(x))


def test_values_a_forward_sets_once_are_planned(path_options):
    torch.manual_seed(0)
    model, x = _SetUpOnce(), (torch.randn(256, 64),)
    reference = copy.deepcopy(model)
    optimized = optimize(model, 0.7, example_inputs=x, **path_options)
    for _ in range(2):
        assert_same(step_gradients(optimized, x), step_gradients(reference, x))
    if path_options["compiler"]:  # (Dynamo replays the forward's attribute writes; the executor's graph has none)
        assert model.seq_len == 256


def test_a_value_changed_between_steps_warns_of_recompilation_then_falls_back_to_the_executor():
    """A temperature annealed from the training loop (``model.scale = ...`` before each step) on the
    compiler path: Dynamo's guard on the number fails at each new value, so the call is compiled and
    planned again, and past ``recompile_limit`` the compiled call failed with ``FailOnRecompileLimitHit``
    in the middle of training. Now the first recompilation warns, saying which value and what to do, and
    at the limit the schedule executor takes over (it traces and plans again per value), exactly."""
    from recompute_graph import CompilerFallbackWarning, RecompilationWarning
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Scaled(), (torch.randn(1024, 16),)
    reference = copy.deepcopy(model)
    optimized = optimize(model, 0.8, example_inputs=x, compiler="auto")
    with torch._dynamo.config.patch(recompile_limit=3), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            model.scale = reference.scale = 1.0 + 0.25 * step
            assert_same(step_gradients(optimized, x), step_gradients(reference, x))
    recompiled = [w for w in caught if w.category is RecompilationWarning]
    assert len(recompiled) == 1 and "scale" in str(recompiled[0].message)
    fallen = [w for w in caught if w.category is CompilerFallbackWarning]
    assert len(fallen) == 1 and "recompile_limit" in str(fallen[0].message)
    assert optimized.delegate is not None and optimized.recompute_plan.recomputed_nodes


class _Tempered(torch.nn.Module):
    """A temperature passed to forward (``model(x, tau=...)``), annealed by the training loop."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))

    def forward(self, x, tau=1.0):
        for layer in self.layers:
            x = torch.tanh(layer(x) / tau)
        return x


def test_a_number_passed_to_forward_that_changes_warns_and_a_tensor_plans_once(path_options):
    """Each new value of a Python number passed to forward is a new call signature, captured and planned
    again (seconds a step on this model): silent before, now a ``RecompilationWarning`` names the argument
    once. Passed as a tensor, the value is an input of one plan."""
    from recompute_graph import RecompilationWarning
    torch.manual_seed(0)
    model, x = _Tempered(), torch.randn(512, 64)
    reference = copy.deepcopy(model)
    optimized = optimize(model, 0.6, example_inputs=(x,), example_kwargs=dict(tau=1.0), **path_options)

    def gradients(module, tau):
        module.zero_grad(set_to_none=True)
        module(x, tau=tau).square().mean().backward()
        return [p.grad.clone() for p in module.parameters()]
    with pytest.warns(RecompilationWarning, match=r"tau=0\.75 differs.*torch\.tensor\(value\)"):
        assert_same(gradients(optimized, 0.75), gradients(reference, 0.75))
    planned = len(optimized._planning_seconds)
    for tau in (0.5, 0.25):
        tensor = torch.tensor(tau)
        assert_same(gradients(optimized, tensor), gradients(reference, tensor))
    assert len(optimized._planning_seconds) == planned + 1  # one plan for every tensor value


def test_plain_values_name_what_changed_and_a_nan_is_not_a_change():
    from recompute_graph.model_state import PlainValues
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].step, model.nan, model.tau = 0, float("nan"), 1.0
    before = PlainValues(model)
    model[0].step, model.nan, model.tau, model.mode = 1, float("nan"), 1.0 * 1, "warm"
    assert PlainValues(model).changed_since(before) == ["self.mode: (not set) -> 'warm'", "self.0.step: 0 -> 1"]


class _BufferTempered(_Tempered):
    """The temperature kept in a buffer, which the training loop fills."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("tau", torch.ones(()))

    def forward(self, x):
        return super().forward(x, self.tau)


def test_a_value_kept_in_a_buffer_changes_between_steps_with_no_planning(path_options):
    """What the warnings advise: ``model.tau.fill_(value)`` between steps trains exactly on one plan."""
    torch.manual_seed(0)
    model, x = _BufferTempered(), (torch.randn(512, 64),)
    reference = copy.deepcopy(model)
    optimized = optimize(model, 0.6, example_inputs=x, **path_options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for tau in (0.9, 0.7, 0.5):
            model.tau.fill_(tau), reference.tau.fill_(tau)
            assert_same(step_gradients(optimized, x), step_gradients(reference, x))
    assert len(optimized._planning_seconds) == 1 and optimized.recompute_plan.recomputed_nodes
