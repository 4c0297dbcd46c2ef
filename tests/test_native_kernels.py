"""The fake values of the ops in ``native_kernels.KERNEL_LAYOUTS`` are laid out as their CPU kernels lay
out their results, for every pair of four layouts of 4-d inputs, while ``native_kernels()`` is active;
without it, each op's decomposition lays out some of them otherwise. A model whose backward reshapes
such a result trains exactly on the compiler path (transformers' Doge failed there, as under
``torch.compile(backend="aot_eager")``: a ``view`` of ``softplus_backward``'s gradient)."""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import recompute_graph as rg
from recompute_graph.native_kernels import KERNEL_LAYOUTS, native_kernels

aten = torch.ops.aten
_SHAPE = (2, 6, 4, 3)
_PERMUTATIONS = ((0, 1, 2, 3), (0, 2, 3, 1), (0, 3, 2, 1), (1, 0, 2, 3))  # contiguous, channels-last, two more


def _per_channel(x: torch.Tensor) -> torch.Tensor:
    return torch.rand(x.shape[1]) + 0.5


def _group_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grouped = x.reshape(x.shape[0], 2, -1)
    return grouped.mean(-1), grouped.var(-1).add(1e-5).rsqrt()


#: op -> its call on (an incoming gradient or second operand ``g``, an input ``x``), both of ``_SHAPE``
CALLS = {
    aten.softplus_backward.default: lambda g, x: aten.softplus_backward(g, x, 1, 20),
    aten.hardswish_backward.default: lambda g, x: aten.hardswish_backward(g, x),
    aten.hardsigmoid_backward.default: lambda g, x: aten.hardsigmoid_backward(g, x),
    aten.hardtanh_backward.default: lambda g, x: aten.hardtanh_backward(g, x, -1, 1),
    aten.logit_backward.default: lambda g, x: aten.logit_backward(g, x.sigmoid(), None),
    aten.native_dropout_backward.default: lambda g, x: aten.native_dropout_backward(g, x > 0, 2.0),
    aten.floor_divide.default: lambda g, x: aten.floor_divide(x, g.abs() + 1),
    aten.elu_backward.default: lambda g, x: aten.elu_backward(g, 1.0, 1, 1, False, x),
    aten._log_softmax_backward_data.default: lambda g, x: aten._log_softmax_backward_data(g, x, 1, torch.float32),
    aten.mse_loss_backward.default: lambda g, x: aten.mse_loss_backward(g, x, x * 0.5, 0),
    aten.huber_loss_backward.default: lambda g, x: aten.huber_loss_backward(g, x, x * 0.5, 0, 1.0),
    aten.smooth_l1_loss_backward.default: lambda g, x: aten.smooth_l1_loss_backward(g, x, x * 0.5, 0, 1.0),
    aten.native_layer_norm_backward.default: lambda g, x: aten.native_layer_norm_backward(
        g, x, [x.shape[-1]], x.mean(-1, keepdim=True), x.var(-1, keepdim=True).add(1e-5).rsqrt(),
        torch.rand(x.shape[-1]), torch.rand(x.shape[-1]), [True, True, True])[0],
    aten.glu_backward.default: lambda g, x: aten.glu_backward(g.narrow(1, 0, 3), x, 1),
    aten.log_sigmoid_forward.default: lambda g, x: aten.log_sigmoid_forward(x)[0],
    aten.binary_cross_entropy.default: lambda g, x: aten.binary_cross_entropy(x.sigmoid(), (g > 0).float(), None, 0),
    aten.binary_cross_entropy_backward.default: lambda g, x: aten.binary_cross_entropy_backward(
        g, x.sigmoid(), (x > 0).float(), None, 0),
    aten.native_batch_norm.default: lambda g, x: aten.native_batch_norm(
        x, _per_channel(x), _per_channel(x), _per_channel(x), _per_channel(x), True, 0.1, 1e-5)[0],
    aten._native_batch_norm_legit_functional.default: lambda g, x: aten._native_batch_norm_legit_functional(
        x, _per_channel(x), _per_channel(x), _per_channel(x), _per_channel(x), True, 0.1, 1e-5)[0],
    aten._native_batch_norm_legit.default: lambda g, x: aten._native_batch_norm_legit(
        x, _per_channel(x), _per_channel(x), _per_channel(x), _per_channel(x), True, 0.1, 1e-5)[0],
    aten._native_batch_norm_legit_no_training.default: lambda g, x: aten._native_batch_norm_legit_no_training(
        x, _per_channel(x), _per_channel(x), _per_channel(x), _per_channel(x), 0.1, 1e-5)[0],
    aten.native_batch_norm_backward.default: lambda g, x: aten.native_batch_norm_backward(
        g, x, _per_channel(x), _per_channel(x), _per_channel(x), _per_channel(x), _per_channel(x), True, 1e-5,
        [True, True, True])[0],
    aten.batch_norm_backward.default: lambda g, x: aten.batch_norm_backward(
        g, x, _per_channel(x), _per_channel(x), _per_channel(x), _per_channel(x), _per_channel(x), True, 1e-5,
        [True, True, True], torch.empty(0, dtype=torch.uint8))[0],
    aten.native_group_norm_backward.default: lambda g, x: aten.native_group_norm_backward(
        g, x, *_group_statistics(x), _per_channel(x), x.shape[0], x.shape[1], x.shape[2] * x.shape[3], 2,
        [True, True, True])[0],
}


def _laid_out(permutation: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``_SHAPE`` whose memory holds its dimensions in the order ``permutation``."""
    inverse = [permutation.index(d) for d in range(len(permutation))]
    stored = torch.randn([_SHAPE[d] for d in permutation], generator=torch.Generator().manual_seed(seed))
    return stored.permute(inverse)


def _strides(op, laid_out: bool) -> list[tuple[tuple, tuple]]:
    """(the kernel's strides, the fake value's) for each pair of layouts the kernel takes."""
    pairs = []
    for first, second in itertools.product(_PERMUTATIONS, _PERMUTATIONS):
        g, x = _laid_out(first, 0), _laid_out(second, 1)
        try:
            real = CALLS[op](g, x)
        except RuntimeError:  # a layout the CPU kernel refuses (group norm's forward statistics)
            continue
        with native_kernels() if laid_out else contextlib.nullcontext(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
            try:
                fake = CALLS[op](mode.from_tensor(g), mode.from_tensor(x))
            except (RuntimeError, ValueError):  # (the decomposition refuses it: AOTAutograd fails there)
                continue
        pairs.append((real.stride(), fake.stride()))
    return pairs


def test_every_op_of_the_table_has_a_call():
    assert set(CALLS) == set(KERNEL_LAYOUTS)


@pytest.mark.parametrize("op", list(KERNEL_LAYOUTS), ids=str)
def test_fake_values_are_laid_out_as_the_kernels_lay_them_out(op):
    from torch._decomp import decomposition_table
    kernel = decomposition_table[op]
    with_table = _strides(op, laid_out=True)
    assert len(with_table) >= 8
    assert all(real == fake for real, fake in with_table), with_table
    assert any(real != fake for real, fake in _strides(op, laid_out=False)), "the decomposition lays it out right"
    assert decomposition_table[op] is kernel  # put back


class _SoftplusGate(nn.Module):
    """Transformers' Doge computes its attention gate as ``exp(A * softplus(linear(v))).transpose(-1,
    -2)``: the gradient reaches ``softplus_backward`` transposed, whose kernel keeps that layout, and the
    linear's backward views it as a matrix."""

    def __init__(self, width: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, heads)
        self.scale = nn.Parameter(torch.rand(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.exp(self.scale * F.softplus(self.proj(x))).transpose(-1, -2)  # [batch, heads, tokens]
        return gate @ x


def test_a_softplus_gradient_arriving_transposed_trains_exactly_on_the_compiler_path():
    torch.manual_seed(0)
    model, x = _SoftplusGate(), torch.randn(2, 32, 16)
    report = rg.verify(model, 1.0, example_inputs=(x,), compiler=True)
    assert report.gradient_error < 1e-5
    assert abs(report.prediction_error) <= 0.02
