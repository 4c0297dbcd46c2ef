"""Leaving a user's model as it was, and one training step of it.

Profiling, tracing, verifying and the conformance suite all run a model's code on the side. None of
that may leave a trace in the model: :func:`preserved_state` restores every buffer (BatchNorm running
statistics, ``num_batches_tracked``) by value, optionally the parameters' ``.grad`` and the CPU/CUDA
random generators. :func:`training_step` is the README loop's step as a callable, for measuring and
comparing.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["preserved_state", "training_step"]


@contextlib.contextmanager
def preserved_state(module: nn.Module, *, rng: bool = False, grads: bool = False) -> Iterator[None]:
    """On exit, put back every buffer of ``module`` (by value; buffers on ``meta`` hold none) and the
    plain Python values its modules hold as attributes (``self.calls += 1`` in a forward: planning runs
    the forward twice, which counted as two calls; the training flag aside), and with ``rng`` the CPU
    and (initialized) CUDA random states, with ``grads`` each parameter's ``.grad``."""
    buffers = [(b, b.detach().clone()) for b in module.buffers() if not b.is_meta]
    scalars = [(m, name, value) for m in module.modules() for name, value in m.__dict__.items()
               if name != "training" and isinstance(value, (int, float, str, bool, type(None)))]
    saved_grads = [(p, p.grad) for p in module.parameters()] if grads else []
    cpu_rng = torch.get_rng_state() if rng else None
    cuda_rng = (torch.cuda.get_rng_state_all()
                if rng and torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                if not torch.equal(buffer, saved):
                    buffer.copy_(saved)
        for m, name, value in scalars:
            if m.__dict__.get(name, value) is not value:
                m.__dict__[name] = value
        for p, grad in saved_grads:
            p.grad = grad
        if cpu_rng is not None:
            torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def training_step(module: nn.Module, args: tuple, kwargs: dict | None = None,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  seed: int | None = None) -> Callable[[], float]:
    """One step of the README loop as a callable: zero the gradients (to ``None``), seed the generator
    when ``seed`` is given, forward, ``loss_fn`` (default ``losses.default_training_loss``), backward.
    It returns the loss as a float."""
    from .losses import default_training_loss
    loss_of = loss_fn or default_training_loss
    kwargs = kwargs or {}

    def step() -> float:
        module.zero_grad(set_to_none=True)
        if seed is not None:
            torch.manual_seed(seed)
        loss = loss_of(module(*args, **kwargs))
        loss.backward()
        return float(loss.detach())
    return step
