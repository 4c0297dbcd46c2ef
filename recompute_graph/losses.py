"""The loss a plan is made for: the user's ``loss_fn``, or the one the README's training loop uses.

``optimize(model, budget, loss_fn=...)`` prices ``loss_fn(output)`` (its forward and backward, by the
allocator) on the example call and keeps those bytes free beside the model's step, so that the budget
holds for the step the user actually runs. ``loss_fn`` takes what the model returns (a tensor, a tuple,
a ``ModelOutput``) and returns a scalar tensor. Without one, :func:`default_training_loss` is planned for.

When training uses another loss than the planned one, the plan still gives exact gradients (the loss is
outside the recomputed module), but its memory may differ: a loss holding more temporaries than the
planned one can push the step over the budget. ``verify()`` measures the step with the loss you give it
and says so (``VerifyReport.warnings``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["LossFunction", "own_loss", "default_training_loss"]

LossFunction = Callable[[Any], torch.Tensor]


def own_loss(output: Any) -> torch.Tensor | None:
    """The loss a model computed itself: ``output.loss`` of a ``ModelOutput`` or ``output["loss"]`` of a
    dict, when it is a tensor; else None. Recognized by what it is (the model's ``loss`` entry), never by
    its size: a model that also returns an auxiliary scalar (``h.mean()``) does not return its loss."""
    loss = None
    if isinstance(output, dict):
        loss = output.get("loss")
    elif hasattr(output, "loss") and not isinstance(output, torch.Tensor):
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def default_training_loss(output: Any) -> torch.Tensor:
    """The loss of the README's loop: the model's own loss when it returns one (:func:`own_loss`), else
    the sum over its floating-point tensor outputs ``t`` of ``t.float().square().mean()``."""
    loss = own_loss(output)
    if loss is not None:
        return loss
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError("the model output contains no floating-point tensor to build a loss from; "
                         "pass loss_fn= to optimize()")
    total = tensors[0].float().square().mean()
    for t in tensors[1:]:
        total = total + t.float().square().mean()
    return total
