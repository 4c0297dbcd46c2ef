"""The three pictures of a plan (matplotlib, PNG or SVG by the path's suffix):

* ``plot_pareto``: predicted peak memory against compute overhead, one curve per solver over a budget
  sweep (``sweeps.budget_sweep``), store-all as the reference point;
* ``plot_timeline``: the memory of one training step op by op, predicted (the simulator) and measured
  (``timeline.measure_timeline``), with the forward, recompute and backward ops shaded;
* ``plot_strategy``: the model's graph, nodes placed by depth, coloured by how many times the plan
  computes them (kept: once; recomputed: more), sized by their output bytes;
* ``plot_comparison``: solvers on graph files (``comparison.compare_solvers``): extra compute against
  budget, one panel per graph, and solve time against graph size.

matplotlib is optional (``pip install 'recompute_graph[plot]'``); without it these raise ImportError
saying so. No torch here.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from .graph import CostGraph
from .schedule import Backward, Forward, Schedule
from .simulate import SimulationResult
from .sweeps import SweepPoint, pareto_front

__all__ = ["pyplot", "plot_pareto", "plot_timeline", "plot_strategy", "plot_comparison"]

_MIB = 2 ** 20
_PHASE_COLOURS = {"forward": "#d8e8f8", "recompute": "#fde2c8", "backward": "#dcf0d8"}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; ImportError saying how to install it when missing."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib (or pip install "
                          "'recompute_graph[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(figure: Any, paths: Sequence[str]) -> list[str]:
    figure.tight_layout()
    for path in paths:
        figure.savefig(path, dpi=120)
    pyplot().close(figure)
    return list(paths)


def plot_pareto(points: Sequence[SweepPoint], title: str, paths: Sequence[str],
                measured: dict[str, tuple[int, float]] | None = None) -> list[str]:
    """Peak (MiB) vs compute overhead (%) per solver; the Pareto front of all plans dashed. ``measured``:
    optional ``{label: (peak_bytes, step_time_ratio - 1)}`` drawn as crosses."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for solver in sorted({p.solver for p in points}):
        mine = sorted(((p.peak_bytes, p.overhead) for p in points if p.solver == solver and p.plan),
                      key=lambda xy: xy[0])
        if not mine:
            continue
        unique = sorted(set(mine))
        axis.plot([x / _MIB for x, _ in unique], [100 * y for _, y in unique], marker="o", ms=4,
                  label=solver, alpha=0.85)
    front = pareto_front(points)
    if front:
        axis.step([p.peak_bytes / _MIB for p in front], [100 * p.overhead for p in front], where="post",
                  color="black", linestyle="--", linewidth=1, label="Pareto front")
    planned = [p for p in points if p.plan]
    if planned:
        store_all = planned[0].plan.store_all_peak_bytes
        axis.axvline(store_all / _MIB, color="grey", linestyle=":", linewidth=1)
        axis.annotate("store-all peak", (store_all / _MIB, 0), rotation=90, fontsize=8, color="grey",
                      xytext=(-10, 10), textcoords="offset points")
    for label, (peak, overhead) in (measured or {}).items():
        axis.scatter([peak / _MIB], [100 * overhead], marker="x", s=60, label=f"{label} (measured)")
    axis.set_xlabel("predicted peak memory of a training step (MiB)")
    axis.set_ylabel("compute overhead (% of a step without recomputation)")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return _save(figure, paths)


def _op_classes(schedule: Schedule) -> list[str]:
    classes = []
    for position, op in enumerate(schedule.ops):
        if isinstance(op, Backward):
            classes.append("backward")
        elif isinstance(op, Forward):
            classes.append("forward" if position < len(schedule.forward_ops) else "recompute")
        else:  # a free belongs to the phase around it
            classes.append(classes[-1] if classes else "forward")
    return classes


def plot_timeline(graph: CostGraph, schedule: Schedule, simulation: SimulationResult, title: str,
                  paths: Sequence[str], measured: Sequence[Any] | None = None) -> list[str]:
    """Live bytes after each op and the peak while it ran, predicted and (optionally) measured, with the
    phases shaded; ``measured``: ``timeline.MeasuredPoint`` items, one per op."""
    plt = pyplot()
    predicted = [p for p in simulation.timeline if p.op is not None]
    figure, axis = plt.subplots(figsize=(9, 4.5))
    classes = _op_classes(schedule)
    start = 0
    for k in range(1, len(classes) + 1):
        if k == len(classes) or classes[k] != classes[start]:
            axis.axvspan(start - 0.5, k - 0.5, color=_PHASE_COLOURS[classes[start]], linewidth=0)
            start = k
    steps = range(len(predicted))
    axis.plot(steps, [p.peak_bytes / _MIB for p in predicted], color="#1f77b4", linewidth=0.8, alpha=0.5,
              label="predicted peak during op")
    axis.plot(steps, [p.live_bytes / _MIB for p in predicted], color="#1f77b4", linewidth=1.5,
              label="predicted live after op")
    if measured:
        axis.plot(range(len(measured)), [p.peak_bytes / _MIB for p in measured], color="#d62728",
                  linewidth=0.8, alpha=0.5, linestyle="--", label="measured peak during op")
        axis.plot(range(len(measured)), [p.live_bytes / _MIB for p in measured], color="#d62728",
                  linewidth=1.5, linestyle="--", label="measured live after op")
    handles, labels = axis.get_legend_handles_labels()
    from matplotlib.patches import Patch
    for name in ("forward", "recompute", "backward"):
        if name in classes:
            handles.append(Patch(color=_PHASE_COLOURS[name]))
            labels.append(f"{name} ops")
    axis.legend(handles, labels, fontsize=8, loc="upper left")
    axis.set_xlabel("op of the schedule (forward ops, then backward ops)")
    axis.set_ylabel("tensor memory above the step's start (MiB)")
    axis.set_title(title)
    axis.margins(x=0)
    return _save(figure, paths)


def _depths(graph: CostGraph) -> list[int]:
    depth = [0] * len(graph)
    for node in graph.nodes:
        if node.predecessors:
            depth[node.index] = 1 + max(depth[p] for p in node.predecessors)
    return depth


def plot_strategy(graph: CostGraph, schedule: Schedule, title: str, paths: Sequence[str]) -> list[str]:
    """The graph with each node coloured by its number of computations in ``schedule`` (module
    docstring); names are written on graphs of at most 60 nodes."""
    plt = pyplot()
    counts = schedule.computation_counts()
    depth = _depths(graph)
    rows: dict[int, int] = {}
    position = {}
    for node in graph.nodes:
        row = rows.get(depth[node.index], 0)
        rows[depth[node.index]] = row + 1
        position[node.index] = (depth[node.index], row)
    height = max(rows.values(), default=1)
    width = max(depth, default=0) + 1
    figure, axis = plt.subplots(figsize=(min(18, 3 + 0.35 * width), min(10, 3.5 + 0.6 * height)))
    from matplotlib.patches import FancyArrowPatch
    for u, v in graph.edges:
        (x0, y0), (x1, y1) = position[u], position[v]
        span = abs(x1 - x0)
        # an edge skipping levels bends, so that skip connections stay visible on chain-like graphs
        style = "arc3,rad=0" if span <= 1 and y0 == y1 else f"arc3,rad={-min(0.5, 0.08 + 0.02 * span)}"
        axis.add_patch(FancyArrowPatch((x0, -y0), (x1, -y1), connectionstyle=style, arrowstyle="-",
                                       color="#999999", linewidth=0.6, zorder=1))
    largest = max((n.output_bytes for n in graph.nodes), default=1) or 1
    most = max(counts.values(), default=1)
    colour_map = plt.get_cmap("YlOrRd")
    for node in graph.nodes:
        x, y = position[node.index]
        count = counts.get(node.index, 0)
        colour = "#4c72b0" if count <= 1 else colour_map(0.35 + 0.65 * (count - 1) / max(1, most - 1))
        size = 20 + 180 * math.sqrt(node.output_bytes / largest)
        axis.scatter([x], [-y], s=size, color=colour, edgecolors="black", linewidths=0.4, zorder=2)
        if len(graph) <= 60:
            axis.annotate(node.name[:18], (x, -y), fontsize=6, xytext=(2, -6), textcoords="offset points",
                          rotation=-50, ha="left", va="top")
    from matplotlib.lines import Line2D
    legend = [Line2D([], [], marker="o", linestyle="", color="#4c72b0", label="kept (computed once)")]
    for count in sorted({c for c in counts.values() if c > 1})[:4]:
        legend.append(Line2D([], [], marker="o", linestyle="",
                             color=colour_map(0.35 + 0.65 * (count - 1) / max(1, most - 1)),
                             label=f"computed {count}x"))
    axis.legend(handles=legend, fontsize=8, loc="lower right")
    recomputed = sum(1 for c in counts.values() if c > 1)
    axis.set_title(f"{title}: {recomputed} of {len(graph)} nodes recomputed (size ~ output bytes)")
    axis.set_xlabel("depth in the graph (longest path from an input)")
    axis.set_yticks([])
    axis.set_ylim(-height - 1.5, 2.5 + 0.1 * width)
    return _save(figure, paths)


def plot_comparison(rows: Sequence[Any], paths: Sequence[str]) -> list[str]:
    """``comparison.ComparisonRow`` items: one panel per graph (extra compute vs budget fraction, a line
    per solver) and a last panel of solve time against graph size (log-log)."""
    plt = pyplot()
    graphs = sorted({row.graph for row in rows})
    columns = min(4, len(graphs) + 1)
    lines = (len(graphs) + 1 + columns - 1) // columns
    figure, axes = plt.subplots(lines, columns, figsize=(4 * columns, 3 * lines), squeeze=False)
    solvers = sorted({row.solver for row in rows})
    color = {solver: f"C{i % 10}" for i, solver in enumerate(solvers)}  # one colour per solver in every panel
    for axis, graph in zip(axes.flat, graphs):
        for solver in sorted({row.solver for row in rows if row.graph == graph}):
            points = sorted((row.fraction, row.extra) for row in rows
                            if row.graph == graph and row.solver == solver and row.extra is not None)
            if points:
                axis.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o", ms=3, label=solver,
                          color=color[solver])
        axis.set_title(graph[:40], fontsize=9)
        axis.set_xlabel("budget (fraction of no-recomputation peak)", fontsize=8)
        axis.set_ylabel("extra compute (%)", fontsize=8)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=6)
    timing = list(axes.flat)[len(graphs)]
    for solver in solvers:
        points = [(row.nodes, max(row.seconds, 1e-4)) for row in rows if row.solver == solver]
        timing.scatter([p[0] for p in points], [p[1] for p in points], s=10, label=solver, color=color[solver])
    timing.set_xscale("log")
    timing.set_yscale("log")
    timing.set_title("solve time vs graph size", fontsize=9)
    timing.set_xlabel("nodes", fontsize=8)
    timing.set_ylabel("seconds", fontsize=8)
    timing.legend(fontsize=6)
    for axis in list(axes.flat)[len(graphs) + 1:]:
        axis.axis("off")
    return _save(figure, paths)
