"""The memory timeline of one training step under a schedule, measured op by op, next to the simulator's.

``measure_timeline`` runs one step (forward, loss, backward) of the traced model through the executor
and records, after every op, the bytes allocated above the step's start and the peak since the previous
op. ``meter="allocator"`` (default) reads ``torch.profiler``'s memory events, marking each op with an
empty ``record_function`` range, so kernel temporaries and RNG snapshots count as they do for the
budget; ``meter="storage"`` uses a :class:`~recompute_graph.measure.StorageTracker` (tensor storages
only). The points line up with the simulator's timeline points that carry an op (``forward_ops`` then
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
from .measure import AllocatorRecorder, StorageTracker, default_loss
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


_MARK = "recompute_graph.op::"


def measure_timeline(graph_module: fx.GraphModule, graph: CostGraph, schedule: Schedule, inputs: Sequence[Any],
                     loss_fn: Callable[[Any], torch.Tensor] = default_loss,
                     meter: str = "allocator") -> list[MeasuredPoint]:
    """One training step under ``schedule``, measured after every op (module docstring). Parameter
    gradients are cleared to None first and left in place after the step."""
    if meter == "allocator" and not any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
        return _allocator_timeline(graph_module, graph, schedule, inputs, loss_fn)
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


def _allocator_timeline(graph_module: fx.GraphModule, graph: CostGraph, schedule: Schedule, inputs: Sequence[Any],
                        loss_fn: Callable[[Any], torch.Tensor]) -> list[MeasuredPoint]:
    ops: list[tuple[str, int, Op]] = []

    def observe(phase: str, position: int, op: Op) -> None:
        with torch.profiler.record_function(f"{_MARK}{len(ops)}"):
            pass
        ops.append((phase, position, op))

    executor = ScheduleExecutor(graph_module, graph, schedule, observer=observe)
    for parameter in graph_module.parameters():
        parameter.grad = None
    with AllocatorRecorder() as recorder:
        with torch.profiler.record_function(f"{_MARK}start"):
            pass
        loss_fn(run_schedule(executor, list(inputs))).backward()
    levels = recorder.markers(_MARK)
    start = next((level for label, level, _ in levels if label == "start"), 0)
    by_op = {int(label): (level, peak) for label, level, peak in levels if label != "start"}
    return [MeasuredPoint(phase, position, op, by_op[k][0] - start, by_op[k][1] - start)
            for k, (phase, position, op) in enumerate(ops)]
