"""Lists and dicts outside a model that its forward fills with activations, put back after planning.

A forward may put a tensor of the step into a container outside the model for the loss to read: a
global list of feature maps (``FEATURES.append(h)``, a deep-supervision or perceptual term the loss sums
and clears), a dict in a closure. The compiler path trains it exactly, as eager PyTorch does (Dynamo
replays the append after its graph). But planning runs the forward too (the model's own forward, then
one compiled forward), and each run appended: the first training step's loss read two stale feature
maps besides its own, and its gradients were twice the largest one off (before session 44).

:class:`OutsideContainers` records the activations an eager run makes (a ``TorchFunctionMode`` keeping
weak references to every result that requires grad and has a ``grad_fn``). Once the run's output is
dropped, :meth:`OutsideContainers.take_out` finds the lists and dicts still holding one of them (not a
module's own attributes), takes them out, and remembers the containers; :meth:`OutsideContainers.put_back`
restores those containers after later runs (the compiled trial). The schedule executor refuses such a
forward instead (``kept_tensors.containers_keeping_proxies``).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .kept_tensors import TensorsMade, carried_by_a_run, taken_out_of_containers

__all__ = ["OutsideContainers"]


class OutsideContainers:
    """The containers outside ``model`` its forward fills (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.made: "list[weakref.ref[torch.Tensor]]" = []
        self.containers: "list[list | dict]" = []

    def recording(self) -> TorchFunctionMode:
        """The mode to run the eager forward(s) under."""
        return TensorsMade(self.made, carried_by_a_run)

    def take_out(self) -> None:
        """Take the activations still alive out of the lists and dicts outside the model that hold them."""
        alive = [t for t in (ref() for ref in self.made) if t is not None]
        self.made.clear()
        for container, _ in taken_out_of_containers(alive, self.model) if alive else ():
            if not any(container is known for known in self.containers):
                self.containers.append(container)

    @contextlib.contextmanager
    def put_back(self) -> Iterator[None]:
        """Around a run that is not eager (the compiled trial): the containers found as they were before."""
        saved = [(container, container.copy()) for container in self.containers]
        try:
            yield
        finally:
            for container, before in saved:
                if isinstance(container, list):
                    container[:] = before
                else:
                    container.clear()
                    container.update(before)
