"""The conformance check: third-party models (``third_party.py``) planned and trained against the original.

For a model, :func:`check_model` prices it once (``optimize`` at store-all, with the model's loss), then
for each activation fraction ``f`` plans at the budget

    parameter-gradient bytes + f * (store-all budget - parameter-gradient bytes)

under each solver, runs one planned step against the original (``recompute_graph.verify``) and returns
one :class:`ConformanceRow` per (fraction, solver). A budget below the solver's floor is raised to that
floor (the row says so: ``at_floor``; on the compiler path each capture measures its own node times, and
so may find another floor: the budget follows it, up to three times); a solver that cannot take the
graph is reported, not run.
The tests (``tests/conformance/``) assert that every row passes; ``scripts/conformance.py`` writes them
to ``docs/conformance.md``.
"""
from __future__ import annotations

import copy
import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from recompute_graph.model_state import preserved_state, training_step
from . import third_party

__all__ = ["ConformanceRow", "check_model", "activation_budget_bytes", "DEFAULT_FRACTIONS", "call_of"]

DEFAULT_FRACTIONS = (0.8, 0.5)


@dataclass(frozen=True)
class ConformanceRow:
    model: str
    family: str
    fraction: float
    solver: str                 # the solver asked for ("auto" or a name)
    chosen: str = ""            # the solver whose plan ran
    budget_bytes: int = 0
    floor_bytes: int = 0
    at_floor: bool = False
    predicted_peak_bytes: int = 0
    measured_peak_bytes: int = 0
    store_all_measured_bytes: int = 0
    gradient_error: float = 0.0
    buffer_mismatches: tuple[str, ...] = ()
    missing_gradients: tuple[str, ...] = ()
    ok: bool = False
    step_time_ratio: float | None = None  # planned step / original step (time_steps=True)
    path: str = "executor"      # what ran the plan: "executor" (rewrite.py) or "compiler" (compiled_module.py)
    skipped: str = ""           # why the solver did not run (it does not take this graph)
    error: str = ""             # an unexpected failure: the row fails
    seconds: float = 0.0
    #: with a ``dtype``: the gradient error against ``torch.compile(model, backend="aot_eager")`` in that
    #: dtype, which the row is judged by (``gradient_error`` is eager's: in bfloat16 compiled and eager
    #: PyTorch round differently, 1.5e-2 on GPT-2 tiny)
    compiled_reference_error: float | None = None

    @property
    def passed(self) -> bool:
        return bool(self.skipped) or (self.ok and not self.error)


def call_of(call: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a factory's call (a tuple of inputs or a dict of keyword arguments)."""
    return (tuple(call), {}) if isinstance(call, (tuple, list)) else ((), dict(call))


def activation_budget_bytes(plan: Any, fraction: float) -> int:
    """The budget at ``fraction`` of the activation memory of a store-all plan ``plan``: its
    parameter-gradient bytes plus ``fraction`` of the rest of its budget."""
    parameter_grads = sum(node.param_grad_bytes for node in plan.graph)
    return int(parameter_grads + fraction * (plan.budget_bytes - parameter_grads))


def check_model(name: str, fractions: Sequence[float] = DEFAULT_FRACTIONS, solvers: Sequence[str] = ("auto",),
                time_steps: bool = False, summary: dict | None = None, compiler: "bool | str" = False,
                dtype: torch.dtype | None = None, **options: Any) -> list[ConformanceRow]:
    """Every (fraction, solver) row of conformance model ``name`` (module docstring). ``options`` go
    to ``optimize`` (default ``timing="flops"``: deterministic plans). ``compiler``: ``optimize``'s
    path (default the schedule executor, each row planned on the one store-all graph; ``True`` or
    ``"auto"``: the compiler path, each row compiled and planned anew, the row's ``path`` saying which
    path ran; profiling options do not apply to it). ``time_steps``: also time each
    planned step against the original's (in turn, fastest of 3). ``summary``: a dict filled with the
    model's floor (smallest feasible budget, bytes and as a fraction of store-all's) and the peer
    (``torch.utils.checkpoint`` on every block) measured the same way. ``dtype``: the model and its
    floating-point inputs cast to it first (``torch.bfloat16``: a reduced-precision model)."""
    import recompute_graph as rg
    from recompute_graph.errors import InfeasibleBudgetError, SolverError
    from recompute_graph.verification import verify
    options = {"timing": "flops", **options} if compiler is False else options
    family = third_party.CONFORMANCE_MODELS[name][0]
    rows: list[ConformanceRow] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, call = third_party.build(name)
        args, kwargs = call_of(call)
        if dtype is not None:
            model, args, kwargs = _cast(model, args, kwargs, dtype)
        store_all = rg.optimize(model, 1.0, example_inputs=args or None, example_kwargs=kwargs or None,
                                solver="store_all", compiler=compiler, **options)
        base = store_all.recompute_plan
        reuse = {"cost_graph": base.graph} if compiler is False else {}
        store_all_peak = _original_peak(model, args, kwargs)
        if summary is not None:
            from recompute_graph.planner import min_feasible_budget
            floor_bytes = min_feasible_budget(base.graph)
            summary.update(family=family, store_all_budget_bytes=base.budget_bytes, floor_bytes=floor_bytes,
                           floor_fraction=floor_bytes / base.budget_bytes, store_all_measured_bytes=store_all_peak,
                           nodes=len(base.graph),
                           tracer="export" if any("aten" in n.target for n in base.graph) else "fx",
                           peer=_peer(model, args, kwargs, store_all_peak))
        for fraction in fractions:
            budget = activation_budget_bytes(base, fraction)
            for solver in solvers:
                start = time.perf_counter()
                common = dict(model=name, family=family, fraction=fraction, solver=solver,
                              store_all_measured_bytes=store_all_peak)
                try:
                    try:
                        optimized, floor = rg.optimize(model, budget, solver=solver, example_inputs=args or None,
                                                       example_kwargs=kwargs or None, compiler=compiler,
                                                       **reuse, **options), 0
                    except InfeasibleBudgetError as error:
                        floor = error.min_budget_bytes
                        for attempt in range(3):  # each capture measures its own node times, which the
                            try:  # solvers' plans, and so the floor, follow: the next may say another
                                optimized = rg.optimize(model, floor, solver=solver, example_inputs=args or None,
                                                        example_kwargs=kwargs or None, compiler=compiler,
                                                        **reuse, **options)
                                break
                            except InfeasibleBudgetError as again:
                                if attempt == 2 or again.min_budget_bytes is None:
                                    raise
                                floor = again.min_budget_bytes
                    report = verify(model, example_inputs=args, example_kwargs=kwargs, optimized=optimized)
                    reference_error = (None if dtype is None
                                       else _compiled_reference_error(model, optimized, args, kwargs))
                except SolverError as error:
                    rows.append(ConformanceRow(**common, skipped=str(error).splitlines()[0][:160]))
                    continue
                except Exception as error:  # noqa: BLE001 - a failing model is a row, not a crash
                    rows.append(ConformanceRow(**common, error=f"{type(error).__name__}: {error}"[:400],
                                               seconds=time.perf_counter() - start))
                    continue
                plan = optimized.recompute_plan
                ratio = _time_ratio(model, optimized, args, kwargs) if time_steps else None
                rows.append(ConformanceRow(
                    **common, chosen=plan.solver, budget_bytes=plan.budget_bytes, floor_bytes=floor,
                    at_floor=bool(floor), predicted_peak_bytes=report.predicted_peak_bytes,
                    measured_peak_bytes=report.measured_peak_bytes, gradient_error=report.gradient_error,
                    buffer_mismatches=report.buffer_mismatches, missing_gradients=report.missing_gradients,
                    ok=report.ok if reference_error is None
                    else dataclasses.replace(report, gradient_error=reference_error).ok,
                    compiled_reference_error=reference_error, step_time_ratio=ratio, seconds=time.perf_counter() - start,
                    path="executor" if isinstance(optimized, rg.RecomputedModule) else "compiler"))
    return rows


def _compiled_reference_error(model: torch.nn.Module, optimized: torch.nn.Module, args: tuple, kwargs: dict
                              ) -> float:
    """The largest gradient difference (relative to each parameter's largest) between one seeded step of
    ``optimized`` and one of ``torch.compile(model, backend="aot_eager")`` (the same functional graph as
    ours, partitioned by torch). ``model``'s gradients and buffers are as they were afterwards."""
    from recompute_graph.verification import parameter_gradient_error
    twin = copy.deepcopy(model)
    with preserved_state(model, grads=True):
        training_step(optimized, args, kwargs, seed=0)()
        training_step(torch.compile(twin, backend="aot_eager"), args, kwargs, seed=0)()
        return parameter_gradient_error(model, twin)


def _cast(model: torch.nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype
          ) -> tuple[torch.nn.Module, tuple, dict]:
    """``model`` and the floating-point tensors of its call in ``dtype`` (integer inputs, token ids, stay)."""
    def cast(value: Any) -> Any:
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
    return model.to(dtype), tuple(cast(a) for a in args), {key: cast(v) for key, v in kwargs.items()}


def _original_peak(model: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """The allocator's peak of one step of the unmodified model (its buffers restored afterwards)."""
    from recompute_graph.measure import peak_memory
    with preserved_state(model):
        step = training_step(model, args, kwargs)
        step()
        peak = peak_memory(step)
        model.zero_grad(set_to_none=True)
    return peak


def _time_ratio(model: torch.nn.Module, optimized: torch.nn.Module, args: tuple, kwargs: dict) -> float:
    """Fastest of 3 planned steps over the fastest of 3 original steps, timed in turn."""
    from recompute_graph.measure import time_steps_in_turn
    with preserved_state(model):
        original, planned = time_steps_in_turn([training_step(model, args, kwargs),
                                                training_step(optimized, args, kwargs)], rounds=3)
    return min(planned.seconds) / min(original.seconds)


def _peer(model: torch.nn.Module, args: tuple, kwargs: dict, store_all_peak: int) -> dict:
    """``torch.utils.checkpoint`` on every block of a copy of ``model``: its allocator-measured peak and
    step time against the original's, or why it does not apply."""
    from recompute_graph.measure import peak_memory, time_steps_in_turn
    from recompute_graph.peers import checkpoint_blocks
    try:
        peer = checkpoint_blocks(model)
    except ValueError as error:
        return {"applies": False, "reason": str(error)}
    step = training_step(peer, args, kwargs)
    try:
        step()
    except Exception as error:  # noqa: BLE001 - the peer's own failure is its row, not ours
        return {"applies": False, "reason": f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"}
    peak = peak_memory(step)
    original, checkpointed = time_steps_in_turn([training_step(model, args, kwargs), step], rounds=3)
    return {"applies": True, "measured_bytes": peak, "fraction_of_store_all": peak / max(1, store_all_peak),
            "step_time_ratio": min(checkpointed.seconds) / min(original.seconds)}
