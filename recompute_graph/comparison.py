"""Every solver that takes a graph, on that graph, over a budget sweep: extra compute (the simulator's,
relative to no recomputation), solve time and, for ``ilp``, status and gap. Budgets are fractions of the
no-recomputation peak itself (as in Checkmate and Moccasin), so that every solver is judged against the
same bytes. Pure Python; ``plots.plot_comparison`` draws the rows."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from .errors import SolverError
from .graph import CostGraph
from .progress import progress_bar
from .solvers import SOLVERS, solvers_for

__all__ = ["ComparisonRow", "compare_solvers"]


@dataclass(frozen=True)
class ComparisonRow:
    """``extra`` is None when the solver's plan does not fit the budget (``note`` says why)."""

    graph: str
    nodes: int
    solver: str
    fraction: float
    extra: float | None
    seconds: float
    note: str = ""

    def as_dict(self) -> dict:
        return {"graph": self.graph, "nodes": self.nodes, "solver": self.solver, "fraction": self.fraction,
                "extra_compute": self.extra, "solve_seconds": self.seconds, "note": self.note}


def compare_solvers(graph: CostGraph, fractions: Sequence[float], solvers: Sequence[str] | None = None, *,
                    label: str | None = None, time_limit: float = 30.0, backend: str = "cp-sat",
                    progress: bool = False) -> list[ComparisonRow]:
    """One row per (solver, fraction); ``solvers`` defaults to every solver that takes the graph but
    store-all (the reference). ``time_limit`` and ``backend`` reach ``ilp``."""
    label = label or graph.name
    names = [s for s in (solvers or solvers_for(graph)) if s != "store_all"]
    takes = set(solvers_for(graph))
    kind = "implicit-backward" if graph.implicit_backward else "joint (explicit backward)"
    store_all = SOLVERS["store_all"](graph, None)
    base = store_all.simulation.compute_cost
    rows = []
    with progress_bar(len(names) * len(fractions), f"comparing on {label}", progress, unit="solve") as bar:
        for fraction in fractions:
            budget = int(fraction * store_all.peak_bytes)
            for name in names:
                if name not in takes:
                    rows.append(ComparisonRow(label, len(graph), name, fraction, None, 0.0,
                                              f"{name} takes no {kind} graphs"))
                    bar.update()
                    continue
                options = {"time_limit": time_limit, "backend": backend} if name == "ilp" else {}
                start = time.perf_counter()
                try:
                    solution = SOLVERS[name](graph, budget, **options)
                except SolverError as error:
                    rows.append(ComparisonRow(label, len(graph), name, fraction, None,
                                              time.perf_counter() - start, str(error).split(";")[0][:60]))
                    bar.update()
                    continue
                seconds = time.perf_counter() - start
                fits = solution.fits(budget)
                extra = solution.simulation.recompute_cost / base if fits and base > 0 else (0.0 if fits else None)
                rows.append(ComparisonRow(label, len(graph), name, fraction, extra, seconds,
                                          solution.description if name == "ilp" else ""))
                bar.update()
    return rows
