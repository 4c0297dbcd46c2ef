"""The two OR-Tools back ends the ``ilp`` stage model is written against: CP-SAT (the default) and a MIP
solver through ``pywraplp`` (SCIP, HiGHS or CBC).

The model (``ilp.py``) only needs boolean variables, the constants 0 and 1, linear constraints, a linear
objective to minimize and a solution hint, so both back ends expose exactly that; ``solve`` returns the
status as one of OPTIMAL (proven), FEASIBLE, INFEASIBLE (proven) or UNKNOWN. Objective values and bounds
are in the model's integer cost units. MIP solvers run with a relative gap tolerance of 0, so OPTIMAL
means proven, as with CP-SAT.
"""
from __future__ import annotations

import sys
from typing import Any

from ..errors import SolverError

__all__ = ["BACKENDS", "make_backend", "CpSatBackend", "MipBackend"]

#: Back-end names accepted by ``solve_ilp(backend=...)``; the MIP ones are ``pywraplp`` solver ids.
BACKENDS = ("cp-sat", "scip", "highs", "cbc")
_MIP_IDS = {"scip": "SCIP", "highs": "HIGHS_MIXED_INTEGER_PROGRAMMING", "cbc": "CBC"}
_INSTALL = "pip install 'ortools>=9.8' (or pip install 'recompute_graph[ilp]')"


def make_backend(name: str):
    """The back end called ``name`` (one of ``BACKENDS``); SolverError when unknown or not installed."""
    if name == "cp-sat":
        return CpSatBackend()
    if name in _MIP_IDS:
        return MipBackend(name)
    raise SolverError(f"unknown ilp backend {name!r}; use one of {', '.join(BACKENDS)}")


class CpSatBackend:
    """OR-Tools CP-SAT: integer coefficients, a solution callback for progress lines."""

    name = "cp-sat"

    def __init__(self) -> None:
        try:
            from ortools.sat.python import cp_model
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise SolverError(f"the ilp solver needs OR-Tools: {_INSTALL}") from error
        self._cp_model = cp_model
        self.model = cp_model.CpModel()
        self.one = self.model.NewConstant(1)
        self.zero = self.model.NewConstant(0)
        self._solver = None

    def bool_var(self, name: str) -> Any:
        return self.model.NewBoolVar(name)

    def add(self, constraint: Any) -> None:
        self.model.Add(constraint)

    def minimize(self, expression: Any) -> None:
        self.model.Minimize(expression)

    def hint(self, variable: Any, value: int) -> None:
        self.model.AddHint(variable, value)

    def size(self) -> tuple[int, int]:
        proto = self.model.Proto()
        return len(proto.variables), len(proto.constraints)

    def solve(self, time_limit: float, workers: int, on_solution, parameters: dict | None = None,
              progress: bool = False, log=None) -> str:
        """Solve; ``on_solution(objective_units, bound_units)`` is called at each improving solution."""
        cp_model = self._cp_model
        solver = self._solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = float(time_limit)
        solver.parameters.num_search_workers = max(1, int(workers))
        for name, value in (parameters or {}).items():
            setattr(solver.parameters, name, value)

        class _Callback(cp_model.CpSolverSolutionCallback):
            def on_solution_callback(self) -> None:
                on_solution(self.ObjectiveValue(), self.BestObjectiveBound())

        return solver.StatusName(solver.Solve(self.model, _Callback()))

    def value(self, expression: Any) -> int:
        return int(self._solver.Value(expression))

    def bound(self) -> float:
        return self._solver.BestObjectiveBound()


class MipBackend:
    """A MIP solver through ``pywraplp``: the LP relaxation with the solver's cuts gives the bound.
    Progress: the solver's own log on stdout. The hint is passed as a MIP start, except to HiGHS
    (OR-Tools 9.15 crashes there); the result is still never worse than the hint (``solve_ilp``)."""

    def __init__(self, name: str) -> None:
        try:
            from ortools.linear_solver import pywraplp
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise SolverError(f"the ilp solver needs OR-Tools: {_INSTALL}") from error
        self.name = name
        self._pywraplp = pywraplp
        self.model = pywraplp.Solver.CreateSolver(_MIP_IDS[name])
        if self.model is None:
            raise SolverError(f"this OR-Tools build has no {name} MIP solver; use backend 'cp-sat' or one of "
                              f"{', '.join(b for b in BACKENDS if b != name)}")
        self.one = self.model.IntVar(1, 1, "one")
        self.zero = self.model.IntVar(0, 0, "zero")
        self._hints: tuple[list, list] = ([], [])
        self._objective: Any = None

    def bool_var(self, name: str) -> Any:
        return self.model.BoolVar(name)

    def add(self, constraint: Any) -> None:
        self.model.Add(constraint)

    def minimize(self, expression: Any) -> None:
        self._objective = expression
        self.model.Minimize(expression)

    def hint(self, variable: Any, value: int) -> None:
        self._hints[0].append(variable)
        self._hints[1].append(float(value))

    def size(self) -> tuple[int, int]:
        return self.model.NumVariables(), self.model.NumConstraints()

    def solve(self, time_limit: float, workers: int, on_solution, parameters: dict | None = None,
              progress: bool = False, log=None) -> str:
        pywraplp = self._pywraplp
        solver = self.model
        solver.SetTimeLimit(int(time_limit * 1000))
        if self.name != "cbc":  # this CBC build has no threads setting
            solver.SetNumThreads(max(1, int(workers)))
        if self._hints[0] and self.name != "highs":  # OR-Tools 9.15's HiGHS interface crashes on hints
            solver.SetHint(*self._hints)
        if parameters:
            solver.SetSolverSpecificParametersAsString(
                "\n".join(f"{key} = {value}" for key, value in parameters.items()))
        if progress:
            solver.EnableOutput()
            print(f"  ilp: {self.name} log follows", file=log if log is not None else sys.stderr, flush=True)
        settings = pywraplp.MPSolverParameters()
        settings.SetDoubleParam(settings.RELATIVE_MIP_GAP, 0.0)
        code = solver.Solve(settings)
        names = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
                 pywraplp.Solver.INFEASIBLE: "INFEASIBLE"}
        status = names.get(code, "UNKNOWN")
        if status in ("OPTIMAL", "FEASIBLE"):
            on_solution(solver.Objective().Value(), self.bound())
        return status

    def value(self, expression: Any) -> int:
        return int(round(expression.solution_value()))

    def bound(self) -> float:
        return self.model.Objective().BestBound()
