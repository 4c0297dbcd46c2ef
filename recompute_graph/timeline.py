"""The memory timeline of one training step under a schedule, measured op by op, next to the simulator's.

``measure_timeline`` runs one step (forward, default loss, backward) of the traced model through the
executor with a :class:`~recompute_graph.measure.StorageTracker` and records, after every op, the bytes
of tensor storage live (created during the step and still referenced) and the peak since the previous
op. The points line up with the simulator's timeline points that carry an op (``forward_ops`` then
``backward_ops``), so the two can be drawn on one axis (``plots.plot_timeline``). Backward runs are not
fused here, so that every op is seen (the executor's default fuses them; the values are the same, the
memory may differ by a few percent, tests/test_executor.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx

from .graph import CostGraph
from .measure import StorageTracker, default_loss
from .optimized_module import run_schedule
from .rewrite import ScheduleExecutor
from .schedule import Op, Schedule

__all__ = ["MeasuredPoint", "measure_timeline"]


@dataclass(frozen=True)
class MeasuredPoint:
    """After one op: ``live_bytes`` now and ``peak_bytes`` while it ran (bytes above the step's start)."""

    phase: str
    position: int
    op: Op
    live_bytes: int
    peak_bytes: int


def measure_timeline(graph_module: fx.GraphModule, graph: CostGraph, schedule: Schedule, inputs: Sequence[Any],
                     loss_fn: Callable[[Any], torch.Tensor] = default_loss) -> list[MeasuredPoint]:
    """One training step under ``schedule``, measured after every op (module docstring). Parameter
    gradients are cleared to None first and left in place after the step."""
    tracker = StorageTracker()
    points: list[MeasuredPoint] = []

    def observe(phase: str, position: int, op: Op) -> None:
        points.append(MeasuredPoint(phase, position, op, tracker.live_bytes, tracker.peak_bytes))
        tracker.reset_peak()

    executor = ScheduleExecutor(graph_module, graph, schedule, observer=observe)
    for parameter in graph_module.parameters():
        parameter.grad = None
    with tracker:
        loss_fn(run_schedule(executor, list(inputs))).backward()
    return points
