"""Switches of autograd's grad mode and of autocast inside a model's forward, which a traced graph drops.

A tracer runs the forward's Python once; a ``with torch.no_grad():`` or ``with torch.autocast(...):``
block there switches a global mode while the tracer records ops, and neither switch is an op:
- neither torch.fx's graph nor torch.export's keeps a grad-mode switch, so the schedule executor ran a
  stop-gradient's ops with grad and gradients flowed where the model stops them (a SimSiam-like target
  branch: gradients off by 1e-3, silently, before session 39);
- torch.fx's graph drops an autocast block too (export keeps it as ``wrap_with_autocast``), so the
  executor ran the block in float32 where the model asks for bfloat16, or under the caller's autocast
  where the model turns it off (outputs 1e-3 off relative to their size, gradients 5e-5, silently,
  before session 44).

:func:`grad_mode_switches_refused` and :func:`autocast_switches_refused` watch the global setters while a
tracer runs and raise :class:`~recompute_graph.errors.TraceError` naming the model's line. Calls made by
torch or by this library are not the model's. The compiler path keeps both switches. Export's autocast
blocks are exact only outside the caller's autocast (:func:`refuse_autocast_blocks_under_autocast`).
"""
from __future__ import annotations

import contextlib
import linecache
import os
import sys
from types import FrameType
from typing import Any, Iterator

import torch
from torch import nn

from .errors import TraceError

__all__ = ["grad_mode_switches_refused", "autocast_switches_refused", "refuse_autocast_blocks_under_autocast"]

_LIBRARY_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(torch.__file__)


def _model_line(frame: "FrameType | None") -> "str | None":
    """``file:line (code)`` of the first frame from ``frame`` up that is the model's code: None when this
    library's code comes first (its own switches), skipping torch's and ``contextlib``'s frames."""
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_LIBRARY_DIR):
            return None
        if not path.startswith(_TORCH_DIR) and "contextlib" not in path:
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            return f"{frame.f_code.co_filename}:{frame.f_lineno} ({line})"
        frame = frame.f_back
    return None


@contextlib.contextmanager
def grad_mode_switches_refused(model: nn.Module, tracer: str) -> Iterator[None]:
    """Raise :class:`TraceError` after the block when the model's own code switched autograd's grad mode
    while ``tracer`` ran it (module docstring)."""
    found: list[str] = []
    original = torch._C._set_grad_enabled

    def watched(mode: bool) -> None:
        if mode != torch.is_grad_enabled() and not found:
            line = _model_line(sys._getframe(1))
            if line is not None:
                found.append(line)
        original(mode)
    torch._C._set_grad_enabled = watched
    try:
        yield
    finally:
        torch._C._set_grad_enabled = original
    if found:
        raise TraceError(
            f"{type(model).__name__}.forward switches autograd's grad mode at {found[0]}: the {tracer} graph "
            "the schedule executor runs does not keep the switch, and gradients would flow where the model "
            "stops them. The compiler path keeps it: optimize(..., compiler='auto') (the default) or "
            "compiler=True.", module_path="", source_location=found[0])


@contextlib.contextmanager
def autocast_switches_refused(model: nn.Module) -> Iterator[None]:
    """Raise :class:`TraceError` after the block when the model's own code entered an autocast block
    while torch.fx traced it (module docstring), turning autocast on or off: either way the graph runs
    the block as its caller's setting says."""
    found: list[str] = []
    original = torch.set_autocast_enabled

    def watched(*args: Any) -> None:
        if not found:
            line = _model_line(sys._getframe(1))
            if line is not None:
                found.append(line)
        original(*args)
    torch.set_autocast_enabled = watched
    try:
        yield
    finally:
        torch.set_autocast_enabled = original
    if found:
        raise TraceError(
            f"{type(model).__name__}.forward enters an autocast block at {found[0]}: the torch.fx graph the "
            "schedule executor runs does not keep it, and would run the block in the caller's precision. "
            "torch.export's graph keeps it (tracer='export', or 'auto'), and so does the compiler path "
            "(compiler='auto', the default).", module_path="", source_location=found[0])


def refuse_autocast_blocks_under_autocast(graph: torch.fx.Graph, model_name: str) -> None:
    """:class:`TraceError` when torch.export's ``graph`` keeps an autocast block of the forward
    (``wrap_with_autocast``) and the call is planned under the caller's autocast. Export traces the ops
    before autocast casts them, so a cast the forward makes around its block (``h.float()`` going into
    a block that turns autocast off) is a no-op in the trace and is dropped; under the caller's autocast
    the block then ran on bfloat16 values (outputs 6e-4 off, silently, before session 44)."""
    blocks = [n for n in graph.nodes if n.target is getattr(torch.ops.higher_order, "wrap_with_autocast", None)]
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    if blocks and any(torch.is_autocast_enabled(device) for device in devices):
        raise TraceError(
            f"{model_name}.forward enters an autocast block, and this call runs under the caller's autocast: "
            "torch.export's graph, which the schedule executor runs, drops the casts the forward makes around "
            "the block, so the block would run in other precisions than eager PyTorch's. Train this call "
            "without the outer autocast (the block sets its own precision), or on the compiler path "
            "(compiler='auto', the default).", module_path="")
