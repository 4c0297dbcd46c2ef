"""Random small networks for the fuzz tests (tests/test_fuzz_models.py: the schedule executor;
tests/test_fuzz_compiled.py: the compiler path): a vocabulary of ops that third-party models use
(convolution, linear, BatchNorm, InstanceNorm with running statistics, LayerNorm, GroupNorm,
activations including in-place ones, dropout, add, cat, split, chunk, permute, attention over pixels,
pooling and upsampling, a shared module, writes through views and in-place ops on views, a shape read
after a permute sizing an ``expand``, frozen layers before a ``freeze``: fine-tuning), random losses, and
the reference step."""
from __future__ import annotations

import copy

import torch
from hypothesis import assume, event
from hypothesis import strategies as st
from torch import nn

from recompute_graph.measure import default_loss, make_training_step, peak_memory

__all__ = ["CHANNELS", "OPS", "LOSSES", "RandomNet", "networks", "step_result", "network_and_reference_step",
           "checked_step"]

CHANNELS = 4
OPS = ("conv", "shared_conv", "bn", "relu_", "gelu", "dropout", "add", "cat", "split_add", "layer_norm",
       "linear_pixels", "sigmoid_mul", "slice_write", "view_inplace_dropout", "base_read_after_view_write",
       "shape_expand", "pool_upsample", "attention", "group_norm", "inplace_residual", "silu_", "masked_fill",
       "chunk_mul", "avgpool_bn", "instance_norm", "transposed_conv", "freeze")


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
                "group_norm": lambda: nn.GroupNorm(2, CHANNELS),
                "silu_": lambda: nn.SiLU(inplace=True),
                "avgpool_bn": lambda: nn.BatchNorm2d(CHANNELS),
                "instance_norm": lambda: nn.InstanceNorm2d(CHANNELS, affine=True, track_running_stats=True),
                "transposed_conv": lambda: nn.ConvTranspose2d(CHANNELS, CHANNELS, 2, stride=2),
                "attention": lambda: nn.Linear(CHANNELS, 3 * CHANNELS),
            }.get(op, nn.Identity)())
        self.head = nn.Conv2d(CHANNELS, 2, 1)
        if "freeze" in [op for op, _, _ in spec]:  # fine-tuning: the layers before the last freeze are frozen
            last = max(k for k, (op, _, _) in enumerate(spec) if op == "freeze")
            for module in (self.shared, *self.layers[:last]):
                module.requires_grad_(False)
            self.token.requires_grad_(False)

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
            elif op == "pool_upsample":  # U-Net: down, up and a skip
                out = nn.functional.interpolate(nn.functional.max_pool2d(u, 2), scale_factor=2.0) + v
            elif op == "attention":  # self-attention over the pixels: matmuls, softmax, a chunked projection
                tokens = u.flatten(2).transpose(1, 2)
                q, k, w = layer(tokens).chunk(3, dim=-1)
                scores = torch.softmax(q @ k.transpose(1, 2) / 2.0, dim=-1)
                out = (scores @ w).transpose(1, 2).reshape(u.shape)
            elif op == "inplace_residual":  # ``out += v`` on a fresh activation
                out = u * 1.5
                out += v
            elif op == "silu_":
                out = layer(u + 0.0)
            elif op == "masked_fill":  # a mask read from another activation
                out = u.masked_fill(v > 0.5, 0.0)
            elif op == "chunk_mul":  # a gate: two halves of one activation multiplied
                first, second = u.chunk(2, dim=1)
                out = torch.cat([first * second, second], dim=1)
            elif op == "avgpool_bn":  # a BatchNorm at half resolution, repeated back up
                out = layer(nn.functional.avg_pool2d(u, 2)).repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)
            elif op == "transposed_conv":
                out = layer(nn.functional.avg_pool2d(u, 2))
            else:  # conv, bn, gelu, dropout, group_norm, instance_norm (running statistics), freeze ...
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
    """The parameters' gradients and the buffers after one seeded training step of ``module`` on ``x``."""
    torch.manual_seed(7)
    module.zero_grad(set_to_none=True)
    loss_fn(module(x)).backward()
    return ([p.grad.clone() if p.grad is not None else None for p in module.parameters()],
            [b.clone() for b in module.buffers()])


def checked_step(optimized: nn.Module, x: torch.Tensor, loss_fn, expected: tuple) -> tuple:
    """Assert that one step of ``optimized`` leaves the gradients and buffers ``expected``
    (:func:`step_result` of the original) and return its plan and the allocator's peak of a step."""
    grads, buffers = step_result(optimized, x, loss_fn)
    for a, b in zip(expected[0], grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(expected[1], buffers):
        torch.testing.assert_close(a, b)
    plan = optimized.recompute_plan
    event("plan recomputes" if plan.recomputed_nodes else "plan keeps everything")
    return plan, peak_memory(make_training_step(optimized, (x,), loss_fn))


def network_and_reference_step(spec: list, seed: int, auxiliary: bool, loss_name: str) -> tuple:
    """``(model, x, loss_fn, expected)``: the seeded network of ``spec``, an input, the loss, and the
    :func:`step_result` of a copy of it (an invalid network, one eager PyTorch fails on, is not a case)."""
    torch.manual_seed(seed)
    model = RandomNet(spec, auxiliary)
    loss_fn = LOSSES[loss_name]
    x = torch.randn(4, CHANNELS, 16, 16)
    try:
        expected = step_result(copy.deepcopy(model), x, loss_fn)
    except RuntimeError:
        assume(False)
    return model, x, loss_fn, expected
