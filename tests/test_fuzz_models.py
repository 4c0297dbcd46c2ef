"""Fuzzing: random small networks built from a vocabulary of ops (convolution, linear, BatchNorm,
LayerNorm, activations including in-place ones, dropout, add, cat, split, permute, a shared module,
writes through views and in-place ops on views, a shape read after a permute sizing an ``expand``)
with or without an auxiliary scalar output, trained with a random loss (mean square, cross-entropy, L1,
sum), times random budgets. Whenever a plan is feasible, the optimized module's gradients and buffers equal the
original's after a training step and the measured peak stays within the budget; otherwise the error is
an InfeasibleBudgetError naming a larger smallest budget."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from torch import nn

from recompute_graph import InfeasibleBudgetError, TraceError, optimize
from recompute_graph.measure import default_loss, make_training_step, peak_memory
from recompute_graph.planner import loss_allowance_bytes

CHANNELS = 4
OPS = ("conv", "shared_conv", "bn", "relu_", "gelu", "dropout", "add", "cat", "split_add", "layer_norm",
       "linear_pixels", "sigmoid_mul", "slice_write", "view_inplace_dropout", "base_read_after_view_write",
       "shape_expand")


def mean_square(output):
    return sum(t.float().square().mean() for t in (output if isinstance(output, tuple) else (output,)))


def cross_entropy(output):
    logits = output[0] if isinstance(output, tuple) else output
    target = torch.arange(logits.shape[2] * logits.shape[3]).remainder(2).reshape(1, *logits.shape[2:])
    return nn.functional.cross_entropy(logits, target.expand(logits.shape[0], -1, -1))


def l1(output):
    return sum(t.abs().mean() for t in (output if isinstance(output, tuple) else (output,)))


def plain_sum(output):
    return sum(t.sum() for t in (output if isinstance(output, tuple) else (output,)))


LOSSES = {"mean_square": mean_square, "cross_entropy": cross_entropy, "l1": l1, "sum": plain_sum}


class RandomNet(nn.Module):
    """``spec``: a list of (op, first input, second input) over the outputs so far (0 = the input)."""

    def __init__(self, spec: list[tuple[str, int, int]], auxiliary: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.auxiliary = auxiliary  # also return a scalar that is not the loss (``h.mean()``)
        self.shared = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1)
        self.token = nn.Parameter(torch.randn(1, CHANNELS, 1, 1))
        self.layers = nn.ModuleList()
        for op, _, _ in spec:
            self.layers.append({
                "conv": lambda: nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1),
                "bn": lambda: nn.BatchNorm2d(CHANNELS),
                "relu_": lambda: nn.ReLU(inplace=True),
                "gelu": lambda: nn.GELU(),
                "dropout": lambda: nn.Dropout(0.3),
                "cat": lambda: nn.Conv2d(2 * CHANNELS, CHANNELS, 1),
                "layer_norm": lambda: nn.LayerNorm(CHANNELS),
                "linear_pixels": lambda: nn.Linear(CHANNELS, CHANNELS),
                "view_inplace_dropout": lambda: nn.Dropout(0.3, inplace=True),
                "base_read_after_view_write": lambda: nn.ReLU(inplace=True),
            }.get(op, nn.Identity)())
        self.head = nn.Conv2d(CHANNELS, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = [x]
        for (op, a, b), layer in zip(self.spec, self.layers):
            u, v = values[a], values[b]
            if op == "shared_conv":
                out = self.shared(u)
            elif op == "relu_":
                out = layer(u * 1.0)  # in place on a fresh tensor, as models do after an op
            elif op == "add":
                out = u + v
            elif op == "cat":
                out = layer(torch.cat([u, v], dim=1))
            elif op == "split_add":
                first, second = torch.split(u, CHANNELS // 2, dim=1)
                out = torch.cat([second, first], dim=1) + v
            elif op in ("layer_norm", "linear_pixels"):
                out = layer(u.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            elif op == "sigmoid_mul":
                out = u * torch.sigmoid(v)
            elif op == "slice_write":  # a write through a slice of an activation (T5's _shift_right)
                out = u * 2.0
                out[:, :1] = v[:, :1]
            elif op == "view_inplace_dropout":  # EfficientNet: flatten, then in-place dropout on the view
                out = layer((u * 1.0).flatten(2)).unflatten(2, u.shape[2:])  # (never into the model input)
            elif op == "base_read_after_view_write":  # the base is read after a write through its view
                out = u + 1.0
                layer(out[:, 1:])
            elif op == "shape_expand":  # ViT's class token: a shape read after a permute sizes an expand
                n = u.permute(0, 2, 3, 1).shape[0]
                out = u + self.token.expand(n, -1, -1, -1)
            else:
                out = layer(u)
            values.append(out)
        logits = self.head(values[-1] + values[len(values) // 2])
        return (logits, values[-1].mean()) if self.auxiliary else logits


@st.composite
def networks(draw) -> list[tuple[str, int, int]]:
    size = draw(st.integers(3, 9))
    spec = []
    for k in range(size):
        op = draw(st.sampled_from(OPS))
        spec.append((op, draw(st.integers(0, k)), draw(st.integers(0, k))))
    return spec


def step_result(module: nn.Module, x: torch.Tensor, loss_fn=default_loss):
    torch.manual_seed(7)
    module.zero_grad(set_to_none=True)
    loss_fn(module(x)).backward()
    return ([p.grad.clone() if p.grad is not None else None for p in module.parameters()],
            [b.clone() for b in module.buffers()])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=networks(), fraction=st.floats(0.5, 1.0), seed=st.integers(0, 1000), auxiliary=st.booleans(),
       loss_name=st.sampled_from(sorted(LOSSES)))
# found by this test: two dropouts on the model input, the first unused; the lower-set DP computed the
# second first, so it drew the first one's mask (random nodes now keep their program order)
@example(spec=[("conv", 0, 0), ("dropout", 0, 0), ("dropout", 0, 0), ("cat", 0, 0), ("conv", 0, 0),
               ("conv", 0, 0)], fraction=0.75, seed=0, auxiliary=False, loss_name="sum")
# found by this test: a split of a value read by a fused backward run released the value's storage
@example(spec=[("conv", 0, 0), ("conv", 0, 0), ("conv", 0, 0), ("conv", 0, 0), ("split_add", 3, 0)],
         fraction=1.0, seed=0, auxiliary=False, loss_name="sum")
# found by this test: Dropout(inplace=True) on a view of the model input writes into the input itself
# (in eager PyTorch too), so the reference step changed the input the planned step then read
@example(spec=[("conv", 0, 0), ("conv", 0, 0), ("conv", 0, 0), ("view_inplace_dropout", 0, 0), ("conv", 0, 0),
               ("conv", 0, 0), ("conv", 0, 0)], fraction=1.0, seed=0, auxiliary=False, loss_name="cross_entropy")
# the three patterns that broke third-party models (T5, EfficientNet, ViT), together, with an auxiliary
# scalar output that must not be taken for the loss
@example(spec=[("conv", 0, 0), ("slice_write", 1, 0), ("view_inplace_dropout", 2, 0), ("shape_expand", 3, 0),
               ("conv", 4, 0), ("base_read_after_view_write", 5, 0), ("conv", 6, 0)],
         fraction=0.6, seed=0, auxiliary=True, loss_name="cross_entropy")
# found by this test: an unused dropout in a model only torch.export traces (a slice write); export's
# functionalized graph dropped it, so the second dropout drew the first one's mask, even with store-all
# (such a model is now refused with a TraceError that names the unused call)
@example(spec=[("conv", 0, 0), ("dropout", 0, 0), ("slice_write", 0, 0), ("conv", 0, 0), ("conv", 0, 0),
               ("dropout", 0, 0)], fraction=1.0, seed=0, auxiliary=False, loss_name="cross_entropy")
# found by this test: an in-place dropout on a flattened channels-last view in a model only
# torch.export traces; its decomposition filled the mask in another order than eager dropout (refused)
@example(spec=[("layer_norm", 0, 0), ("slice_write", 0, 0), ("conv", 0, 0), ("view_inplace_dropout", 1, 0)],
         fraction=1.0, seed=0, auxiliary=False, loss_name="cross_entropy")
# found by this test: a dropout on the model input (a node without predecessors) was moved into the
# segment of its reader, after a dropout the model calls later: each drew the other's mask
@example(spec=[("conv", 0, 0), ("conv", 0, 0), ("conv", 1, 0), ("linear_pixels", 0, 0), ("dropout", 0, 0),
               ("dropout", 1, 0), ("cat", 0, 1), ("conv", 5, 0)], fraction=0.75, seed=0, auxiliary=False,
         loss_name="cross_entropy")
def test_random_networks_train_exactly_within_random_budgets(spec, fraction, seed, auxiliary, loss_name):
    torch.manual_seed(seed)
    model = RandomNet(spec, auxiliary)
    loss_fn = LOSSES[loss_name]
    x = torch.randn(4, CHANNELS, 16, 16)
    reference = copy.deepcopy(model)
    try:
        expected_grads, expected_buffers = step_result(reference, x, loss_fn)
    except RuntimeError:  # an invalid random network (in eager PyTorch too)
        assume(False)
    try:
        optimized = optimize(model, fraction, example_inputs=(x,), timing="flops", loss_fn=loss_fn)
    except InfeasibleBudgetError as error:
        assert error.min_budget_bytes > error.budget_bytes
        event("infeasible budget")
        return
    except TraceError as error:
        assert "random numbers" in str(error), error
        event("refused: random draws torch.export does not reproduce")
        return
    grads, buffers = step_result(optimized, x, loss_fn)
    for a, b in zip(expected_grads, grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(expected_buffers, buffers):
        torch.testing.assert_close(a, b)
    plan = optimized.recompute_plan
    event("plan recomputes" if plan.recomputed_nodes else "plan keeps everything")
    measured = peak_memory(make_training_step(optimized, (x,), loss_fn))
    assert measured <= plan.budget_bytes, (measured, plan)
    # never under-predicted by more than 10 % (over-prediction only wastes memory: a CPU convolution's
    # backward workspace, priced from an isolated run, is larger there than inside a fused backward run)
    assert plan.predicted_peak_bytes + loss_allowance_bytes(plan.graph) >= 0.9 * measured, (measured, plan)
