"""A model's own ``torch.autograd.Function``s (``autograd_in_forward.py``): a gradient reversal layer, a
straight-through estimator, a clamp with a derivative of its own and a dropout that keeps its mask
for its backward. torch.fx traced through their forwards and dropped their backwards: the schedule
executor trained this model with gradients off by 1.33 times the largest, silently."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import recompute_graph as rg
from recompute_graph.trace import trace
from recompute_graph.verification import parameter_gradient_error


class GradientReversal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class RoundStraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class ClampSteep(torch.autograd.Function):
    """A clamp whose derivative inside the range is 2, not autograd's 1: it saves its input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() < 1).to(grad.dtype) * 2.0


class MaskedDropout(torch.autograd.Function):
    """Dropout drawing its mask inside the Function: a recomputation must draw the same one."""

    @staticmethod
    def forward(ctx, x, p):
        mask = (torch.rand_like(x) > p).to(x.dtype) / (1 - p)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask * 0.5, None  # not autograd's derivative: the test tells the two apart


class DomainAdversarial(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        self.classifier = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.domain = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
        self.quantized = nn.Linear(64, 64)

    def forward(self, x):
        f = MaskedDropout.apply(ClampSteep.apply(self.features(x)), 0.25)
        q = self.quantized(RoundStraightThrough.apply(f))
        return self.classifier(f + q), self.domain(GradientReversal.apply(f, 0.5))


def _loss(output):
    return output[0].square().mean() + output[1].square().mean()


def _step(module, x, seed):
    torch.manual_seed(seed)
    _loss(module(x)).backward()


@pytest.mark.parametrize("compiler", [True, False])
def test_a_models_own_autograd_functions_keep_their_backward_when_recomputed(compiler):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DomainAdversarial()
    reference = copy.deepcopy(model)
    x = torch.randn(1024, 32)
    optimized = rg.optimize(model, 0.6, example_inputs=(x,), compiler=compiler, loss_fn=_loss)
    assert optimized.recompute_plan.recomputed_nodes
    for seed in (1, 2):
        model.zero_grad(), reference.zero_grad()
        _step(reference, x, seed)
        _step(optimized, x, seed)
        assert parameter_gradient_error(model, reference) == 0.0
    if not compiler:  # one node per application, which calls the Function itself
        names = [n.name for n in optimized.recompute_plan.graph.nodes]
        assert {"gradient_reversal_apply", "clamp_steep_apply", "masked_dropout_apply"} <= set(names)
        assert names.index("masked_dropout_apply") in optimized.recompute_plan.recomputed_nodes  # drawn again


def test_the_export_tracer_refuses_a_models_own_autograd_function():
    """Non-strict torch.export records the forward's aten ops: the Function's backward is lost."""
    with pytest.raises(rg.TraceError, match=r"autograd\.Function .*GradientReversal.* compiler path"):
        rg.optimize(DomainAdversarial(), 0.6, example_inputs=(torch.randn(64, 32),), compiler=False,
                    tracer="export", loss_fn=_loss)


def test_a_function_given_an_argument_fx_cannot_hold_makes_its_submodule_opaque():
    """A Python callable as an argument has no place in the fx graph: the submodule applying the
    Function becomes one opaque node, which runs the Function itself."""
    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale):
            ctx.scale = scale
            return x * scale(1.0)

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.scale(3.0), None

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(32, 32)

        def forward(self, x):
            return Scaled.apply(self.linear(x), lambda value: value * 2)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), Block(), nn.ReLU(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    x = torch.randn(64, 32)
    result = trace(model)
    assert result.opaque_modules == ("1",) and "Scaled" in result.opaque_reasons[0]
    optimized = rg.optimize(model, 1.0, example_inputs=(x,), compiler=False)
    _step(reference, x, 0)
    _step(optimized, x, 0)
    assert parameter_gradient_error(model, reference) == 0.0


class _HalvedGradient(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.linear(x))
        h.register_hook(lambda grad: grad * 0.5)
        return h


class _HookedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(32, 64), nn.GELU())
        self.hooked = _HalvedGradient()
        self.head = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.head(self.hooked(self.stem(x)))


def test_a_gradient_hook_on_an_activation_is_kept_by_the_compiler_and_refused_by_the_executor():
    """``h.register_hook(fn)`` in ``forward``: the executor's tapes never ran it, so the layers below got
    the unscaled gradient (off by the whole of it, silently, on fx and export graphs alike). The
    compiler path keeps it; the executor refuses it on either tracer."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _HookedStack()
    reference = copy.deepcopy(model)
    x = torch.randn(1024, 32)
    optimized = rg.optimize(model, 0.6, example_inputs=(x,), compiler=True)
    assert optimized.recompute_plan.recomputed_nodes
    reference(x).square().mean().backward()
    optimized(x).square().mean().backward()
    assert parameter_gradient_error(model, reference) == 0.0
    for tracer in ("fx", "export", "auto"):
        with pytest.raises(rg.TraceError, match=r"registers a gradient hook .*register_hook.* compiler path keeps"):
            rg.optimize(_HookedStack(), 0.6, example_inputs=(x,), compiler=False, tracer=tracer)


class _PhysicsInformed(nn.Module):
    """A physics-informed network: its forward returns the solution and its derivative in the inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, xt):
        u = self.net(xt)
        return u, torch.autograd.grad(u.sum(), xt, create_graph=True)[0]


@pytest.mark.parametrize("options", [{"compiler": "auto"}, {"compiler": False, "tracer": "export"}])
def test_a_forward_that_differentiates_is_refused_with_the_line_that_does(options):
    """The fx graph recorded the ``autograd.grad`` call, which failed while it was priced ("element 0 of
    tensors does not require grad"); export failed on "a fake tensor in the exported program constant's
    list". Neither said what to do. Compiled, Dynamo breaks the graph there and falls back."""
    torch._dynamo.reset()
    x = torch.randn(256, 2, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rg.CompilerFallbackWarning)
        with pytest.raises(rg.TraceError, match=r"differentiates \(torch\.autograd\.grad at .*test_autograd_in_forward"
                                                r"\.py:\d+.*Train this model without optimize"):
            rg.optimize(_PhysicsInformed(), 0.6, example_inputs=(x,),
                        loss_fn=lambda out: out[0].square().mean() + out[1].square().mean(), **options)


class _RetainedActivation(_HookedStack):
    def forward(self, x):
        h = self.stem(x)
        h.retain_grad()  # an activation's gradient read after backward (saliency, Grad-CAM)
        return self.head(self.hooked.linear(h))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_retain_grad_on_an_activation_is_refused_with_what_to_do(tracer):
    """``retain_grad()`` in ``forward``: the fx graph's node failed while it was priced ("can't
    retain_grad on Tensor that has requires_grad=False"); Dynamo refuses it as well."""
    with pytest.raises(rg.TraceError, match=r"Tensor\.retain_grad.*call retain_grad\(\) outside the optimized"):
        rg.optimize(_RetainedActivation(), 0.9, example_inputs=(torch.randn(64, 32),), compiler=False, tracer=tracer)
