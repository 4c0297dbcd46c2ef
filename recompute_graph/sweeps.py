"""Budget sweeps: every solver at every budget fraction, the simulator's verdict on each plan. Pure Python
(no torch); used by ``recompute-graph plot`` and ``bench`` and by the benchmark scripts."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from .errors import InfeasibleBudgetError, SolverError
from .graph import CostGraph
from .planner import RecomputePlan, make_plan
from .progress import progress_bar

__all__ = ["SweepPoint", "budget_sweep", "pareto_front"]


@dataclass(frozen=True)
class SweepPoint:
    """One solver at one budget. ``plan`` is None when nothing fitted (``note`` says why)."""

    solver: str
    fraction: float
    plan: RecomputePlan | None
    seconds: float
    note: str = ""

    @property
    def peak_bytes(self) -> int | None:
        return self.plan.predicted_peak_bytes if self.plan else None

    @property
    def overhead(self) -> float | None:
        return self.plan.predicted_compute_overhead if self.plan else None


def budget_sweep(graph: CostGraph, solvers: Sequence[str], fractions: Sequence[float], *,
                 progress: bool = False) -> list[SweepPoint]:
    """``make_plan(graph, fraction, solver)`` for every pair, timed; infeasible or failing pairs give a
    point without a plan. A progress bar on stderr when ``progress``."""
    points = []
    with progress_bar(len(solvers) * len(fractions), f"planning {graph.name}", progress, unit="plan") as bar:
        for solver in solvers:
            for fraction in fractions:
                start = time.perf_counter()
                try:
                    plan, note = make_plan(graph, fraction, solver), ""
                except InfeasibleBudgetError as error:
                    plan, note = None, f"infeasible (smallest {error.min_budget_bytes} bytes)"
                except SolverError as error:
                    plan, note = None, str(error).split(";")[0]
                points.append(SweepPoint(solver, fraction, plan, time.perf_counter() - start, note))
                bar.update()
    return points


def pareto_front(points: Sequence[SweepPoint]) -> list[SweepPoint]:
    """The points with a plan that no other plan beats on both peak and overhead, by increasing peak."""
    planned = sorted((p for p in points if p.plan is not None), key=lambda p: (p.peak_bytes, p.overhead))
    front: list[SweepPoint] = []
    for point in planned:
        if not front or point.overhead < front[-1].overhead - 1e-12:
            front.append(point)
    return front
