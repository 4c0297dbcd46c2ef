"""Recomputing a training-mode BatchNorm of a joint graph (compiler path).

AOTAutograd traces ``nn.BatchNorm*`` in training mode as ``_native_batch_norm_legit_functional(x, weight,
bias, running_mean, running_var, True, momentum, eps)``, whose items are the normalized output, the
batch's mean and inverse standard deviation (read by its backward), and the new running statistics
(written back after the forward). Recomputing it in the backward must leave the running statistics
alone: AOTAutograd writes them back after the forward, and autograd's version check refuses them there.

Two ways, chosen per node:

* **From the saved statistics** (:func:`normalization_statistics` names them): the recomputation reads the
  mean and inverse std the forward made, which its backward reads anyway, and only normalizes:
  :func:`normalize_from_statistics`, one pass over ``x`` (x·α + β per channel, with α = rstd·weight and
  β = bias − mean·α as the training kernel forms them, so the CPU output is bitwise the forward's). On
  this machine's CPU, all 53 BatchNorms of ResNet-50 at batch 8 take 85.3 ms in training mode and
  10.4 ms normalized from their statistics (``python scripts/batch_norm_recompute.py``). The cost graph prices such
  a unit's recomputation at the normalization's time (``CostNode.recompute_cost``) and keeps the
  statistics from its first computation to its backward (``CostNode.recompute_kept_bytes``, with the
  new running statistics, which its backward reads from the forward either way:
  :func:`items_read_from_the_forward`).
* **From the batch** (:func:`copy_batch_norm`, when the statistics are not the backward's alone, the
  dtypes differ, as under autocast, or they are bfloat16 or float16):
  ``_native_batch_norm_legit.no_stats``, which recomputes the
  statistics too (the same output, mean and inverse std) without touching the running ones.

Other BatchNorm forms read the running statistics in place (:func:`reads_updated_state`) and are never
copied into the backward: their outputs are saved.
"""
from __future__ import annotations

import operator
from typing import Callable, Container

import torch
from torch import fx

from .joint_capture import op_name
from .joint_partition import STATE_READING_TARGETS

__all__ = ["training_batch_norm", "reads_updated_state", "normalization_statistics", "items_read_from_the_forward",
           "normalize_from_statistics", "copy_batch_norm", "copy_normalization", "RECOMPUTE_SECONDS_SUFFIX"]

#: ``joint_allocations.node_seconds`` times a normalization from saved statistics under the BatchNorm
#: node's name with this suffix (no node of a graph has a ``#`` in its name).
RECOMPUTE_SECONDS_SUFFIX = "#recompute"


def training_batch_norm(node: fx.Node) -> bool:
    """``_native_batch_norm_legit_functional`` in training mode: it normalizes by the batch's statistics."""
    return (node.op == "call_function" and node.target is torch.ops.aten._native_batch_norm_legit_functional.default
            and bool(node.args[5]))


def reads_updated_state(node: fx.Node) -> bool:
    """A node that cannot be copied into the backward: a BatchNorm (or an item of its result) that
    reads running statistics AOTAutograd writes back after the forward (autograd's version check
    refuses them there), except a training-mode functional BatchNorm, whose copy runs without them, and
    ``_native_batch_norm_legit.no_stats``, which has none (BiT's weight standardization normalizes each
    convolution's weight so: its outputs were saved where the plan recomputed them, a step 1.11 of its
    prediction); and the new running statistics themselves (items 3 and 4), read from the forward."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return reads_updated_state(node.args[0]) or (training_batch_norm(node.args[0]) and node.args[1] >= 3)
    return (node.op == "call_function" and op_name(node.target) in STATE_READING_TARGETS
            and not training_batch_norm(node) and node.target is not torch.ops.aten._native_batch_norm_legit.no_stats)


def _item(node: fx.Node, index: int) -> fx.Node | None:
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == index), None)


def normalization_statistics(node: fx.Node, backward: Container[fx.Node]) -> tuple[fx.Node, fx.Node] | None:
    """The ``getitem`` nodes of a training BatchNorm's batch mean and inverse std, when its recomputation
    can normalize from them: only ``backward`` reads them (the backward nodes of its unit, which keep
    them anyway), and the input, the statistics and the affine parameters share one dtype, float32 or
    float64. None otherwise: a bfloat16 or float16 kernel normalizes at float32 with statistics it
    returns rounded to its dtype, so a normalization from those differed from its output in 30-40 % of
    the elements (a bfloat16 ResNet-18's gradients 9 % off at its floor)."""
    if not training_batch_norm(node):
        return None
    mean, rstd = _item(node, 1), _item(node, 2)
    if mean is None or rstd is None or not all(u in backward for s in (mean, rstd) for u in s.users):
        return None
    data, weight, bias = node.args[:3]
    values = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in (data, mean, rstd, weight, bias)]
    tensors = [v for v in values if v is not None]
    if len(tensors) < 3 or not all(isinstance(v, torch.Tensor) for v in tensors):
        return None
    dtype = tensors[0].dtype
    if dtype not in (torch.float32, torch.float64) or any(v.dtype != dtype for v in tensors) or tensors[0].dim() < 2:
        return None
    return mean, rstd


def items_read_from_the_forward(node: fx.Node, statistics: tuple[fx.Node, fx.Node] | None) -> list[fx.Node]:
    """The items of a training BatchNorm that its recomputations do not make, so that its backward (and
    a normalization) reads the forward's: the new running statistics (items 3 and 4, which AOTAutograd's
    functional BatchNorm backward reads), and ``statistics``, the batch statistics
    :func:`normalization_statistics` gave for it (None where it gave none). Empty for any other node."""
    if not training_batch_norm(node):
        return []
    items = [item for index in (3, 4) if (item := _item(node, index)) is not None]
    return list(statistics or ()) + items


def normalize_from_statistics(data: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                              mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """A training BatchNorm's output from its batch statistics: ``data * alpha + beta`` per channel (dim
    1), ``alpha = rstd * weight``, ``beta = bias - mean * alpha`` (one rounding, as the kernel forms it),
    by the inference kernel (running mean 0, running variance 1, eps 0: it scales by exactly 1)."""
    alpha = rstd if weight is None else rstd * weight
    beta = torch.addcmul(torch.zeros_like(mean) if bias is None else bias, mean, alpha, value=-1)
    return torch.ops.aten._native_batch_norm_legit_no_training.default(
        data, alpha, beta, torch.zeros_like(mean), torch.ones_like(mean), 0.0, 0.0)[0]


def copy_batch_norm(graph: fx.Graph, node: fx.Node, read: Callable[[fx.Node], fx.Node]) -> fx.Node:
    """A training-mode BatchNorm recomputed from the batch without running statistics
    (``_native_batch_norm_legit.no_stats``): the same output, mean and inverse std."""
    data, weight, bias, _mean, _var, training, momentum, eps = node.args
    args = fx.node.map_arg((data, weight, bias), read)
    copy = graph.call_function(torch.ops.aten._native_batch_norm_legit.no_stats, (*args, training, momentum, eps))
    copy.meta = {k: v for k, v in node.meta.items() if k != "val"}
    copy.meta["val"] = tuple(node.meta["val"][:3])
    return copy


def copy_normalization(graph: fx.Graph, node: fx.Node, read: Callable[[fx.Node], fx.Node],
                       statistics: tuple[fx.Node, fx.Node]) -> fx.Node:
    """A training-mode BatchNorm recomputed from ``statistics`` (the forward's mean and inverse std, as
    ``graph`` holds them): :func:`normalize_from_statistics` of its output only."""
    data, weight, bias = fx.node.map_arg(tuple(node.args[:3]), read)
    copy = graph.call_function(normalize_from_statistics, (data, weight, bias, *statistics))
    copy.meta = {k: v for k, v in node.meta.items() if k != "val"}
    copy.meta["val"] = node.meta["val"][0]
    return copy
