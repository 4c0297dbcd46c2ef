"""``verify()``: one planned training step against the original, on the user's own model and inputs.

Before a long run a user wants to know that the plan trains their model exactly and within the budget.
``verify(model, budget, example_inputs=...)`` (or ``recompute-graph check MODEL``) plans the model, then
runs one seeded step of the original (a deep copy) and one of the optimized module with the same loss,
and compares:

* gradients: the largest absolute difference over all parameters divided by the largest absolute
  reference gradient (a conv bias before a training-mode BatchNorm has an exact gradient of 0, so an
  error relative to each tensor would be noise over noise);
* buffers (BatchNorm running statistics): updated exactly once. An integer buffer
  (``num_batches_tracked``) must be equal; a floating-point one within ``BUFFER_TOLERANCE`` of its
  largest value (AOTAutograd's decompositions round otherwise than eager's kernels:
  ``torch.compile(backend="aot_eager")`` itself leaves torchvision's DeepLabV3 statistics 1 ulp off,
  where a second update moves them by the momentum times their change, orders of magnitude more);
* memory: the optimized step's peak by the allocator (``measure.peak_memory``) against the budget and
  against the prediction (the plan's peak plus its loss allowance).

The user's model is left as it was: its parameters' gradients and its buffers are restored.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .losses import default_training_loss
from .measure import peak_memory
from .model_state import preserved_state, training_step
from .units import format_bytes

__all__ = ["VerifyReport", "verify", "GRADIENT_TOLERANCE", "BUFFER_TOLERANCE", "PREDICTION_TOLERANCE",
           "parameter_gradient_error", "model_gradient_error", "buffer_error", "buffer_mismatches",
           "model_buffer_error"]

#: Largest gradient error (relative to the model's largest gradient) a plan may have.
GRADIENT_TOLERANCE = 1e-5
#: Largest difference of a floating-point buffer after the step, relative to its largest value.
BUFFER_TOLERANCE = 1e-5
#: How far the measured peak may lie from the prediction, as a fraction of the measured peak.
PREDICTION_TOLERANCE = 0.10


@dataclass(frozen=True)
class VerifyReport:
    """What one planned step did against the original (module docstring). ``ok`` says whether all
    checks pass; ``str(report)`` prints them."""

    model: str
    solver: str
    gradient_error: float
    gradients_compared: int
    missing_gradients: tuple[str, ...]
    buffer_mismatches: tuple[str, ...]
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    loss_difference: float
    warnings: tuple[str, ...] = field(default=())

    @property
    def prediction_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / max(1, self.measured_peak_bytes)

    @property
    def within_budget(self) -> bool:
        return self.measured_peak_bytes <= self.budget_bytes

    @property
    def ok(self) -> bool:
        return (self.gradient_error <= GRADIENT_TOLERANCE and not self.missing_gradients
                and not self.buffer_mismatches and self.within_budget
                and abs(self.prediction_error) <= PREDICTION_TOLERANCE)

    def __str__(self) -> str:
        def mark(good: bool) -> str:
            return "ok  " if good else "FAIL"
        rows = [
            f"{mark(self.gradient_error <= GRADIENT_TOLERANCE and not self.missing_gradients)} gradients: "
            f"largest error {self.gradient_error:.2e} of the largest gradient over {self.gradients_compared} "
            f"tensors (tolerance {GRADIENT_TOLERANCE:g})"
            + (f"; missing on {', '.join(self.missing_gradients[:5])}" if self.missing_gradients else ""),
            f"{mark(not self.buffer_mismatches)} buffers: "
            + ("updated exactly once" if not self.buffer_mismatches else
               f"differ: {', '.join(self.buffer_mismatches[:5])}"),
            f"{mark(self.within_budget)} peak: measured {format_bytes(self.measured_peak_bytes)} "
            f"(allocator) within budget {format_bytes(self.budget_bytes)}",
            f"{mark(abs(self.prediction_error) <= PREDICTION_TOLERANCE)} prediction: "
            f"{format_bytes(self.predicted_peak_bytes)}, {self.prediction_error:+.1%} of measured",
        ]
        head = f"verify {self.model} ({self.solver}): {'all checks pass' if self.ok else 'CHECKS FAILED'}"
        return "\n".join([head, *("  " + r for r in rows), *("  warning: " + w for w in self.warnings)])


def verify(model: nn.Module, budget: Any = 0.5, *, example_inputs: Sequence[Any] | None = None,
           example_kwargs: dict[str, Any] | None = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
           solver: str = "auto", seed: int = 0, device: Any = None, optimized: nn.Module | None = None,
           **options: Any) -> VerifyReport:
    """Plan ``model`` at ``budget`` (``optimize()``'s arguments) unless ``optimized`` is given, run one
    seeded step of each with ``loss_fn`` (default ``losses.default_training_loss``) and report. The
    model's gradients and buffers are as they were afterwards. ``device``: where the meter reads (a
    CUDA device uses the caching allocator)."""
    from .api import optimize
    args, kwargs = tuple(example_inputs or ()), dict(example_kwargs or {})
    loss = loss_fn or default_training_loss
    reference = copy.deepcopy(model)
    with preserved_state(model, grads=True):
        if optimized is None:
            optimized = optimize(model, budget, example_inputs=args or None, example_kwargs=kwargs or None,
                                 solver=solver, loss_fn=loss_fn, **options)
        plan = optimized.plan(*args, **kwargs)
        expected_loss = training_step(reference, args, kwargs, loss, seed)()
        with preserved_state(model):  # the measured step below starts from the same buffers
            actual_loss = training_step(optimized, args, kwargs, loss, seed)()
            grads = {name: p.grad for name, p in model.named_parameters()}
            buffers_after = {name: b.detach().clone() for name, b in model.named_buffers()}
        error, compared, missing = _gradient_error(grads, dict(reference.named_parameters()))
        mismatches = buffer_mismatches(buffers_after, dict(reference.named_buffers()))
        measured = peak_memory(training_step(optimized, args, kwargs, loss, seed), device=device)
    predicted = plan.predicted_step_peak_bytes
    warnings = []
    if measured > plan.budget_bytes:
        warnings.append(f"the step measured {format_bytes(measured)}, over the {format_bytes(plan.budget_bytes)} "
                        "budget: if training uses another loss than the one planned for, pass it as loss_fn")
    return VerifyReport(model=type(model).__name__, solver=plan.solver, gradient_error=error,
                        gradients_compared=compared, missing_gradients=missing, buffer_mismatches=mismatches,
                        budget_bytes=plan.budget_bytes, predicted_peak_bytes=predicted, measured_peak_bytes=measured,
                        loss_difference=abs(actual_loss - expected_loss), warnings=tuple(warnings))


def buffer_error(mine: torch.Tensor, reference: torch.Tensor) -> float:
    """How far buffer ``mine`` is from ``reference``: a floating-point one's largest difference relative
    to the reference's largest value; an integer (or empty) one 0.0 when equal, else 1.0; another shape
    or dtype infinitely far."""
    if mine.shape != reference.shape or mine.dtype != reference.dtype:
        return float("inf")
    if not reference.is_floating_point() or not reference.numel():
        return 0.0 if torch.equal(mine, reference) else 1.0
    scale = reference.double().abs().max().item()
    return (mine.double() - reference.double()).abs().max().item() / max(scale, 1e-12)


def buffer_mismatches(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """Names of the buffers of ``expected`` that ``actual`` holds otherwise (module docstring): a
    :func:`buffer_error` over ``BUFFER_TOLERANCE`` (an integer one not equal, a floating-point one off
    by more than that fraction of its largest value, one of another shape)."""
    return tuple(name for name, b in expected.items()
                 if name in actual and buffer_error(actual[name], b) > BUFFER_TOLERANCE)


def model_buffer_error(model: nn.Module, reference: nn.Module) -> float:
    """The largest :func:`buffer_error` over the buffers of ``model`` and ``reference`` (in order)."""
    return max((buffer_error(a, b) for a, b in zip(model.buffers(), reference.buffers())), default=0.0)


def parameter_gradient_error(model: nn.Module, reference: nn.Module) -> float:
    """The largest gradient difference between ``model`` and ``reference`` (same parameters, in order)
    relative to that parameter's largest reference gradient: the strictest measure, for exact paths
    (0.0 where the gradients are equal to the bit). Parameters without a reference gradient are skipped."""
    return max((((_dense(p.grad) - _dense(q.grad)).abs().max() / _dense(q.grad).abs().max().clamp_min(1e-12)).item()
                for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None), default=0.0)


def model_gradient_error(model: nn.Module, reference: nn.Module) -> float:
    """The largest gradient difference relative to the reference's largest gradient over the model
    (``verify``'s measure: some exact gradients are 0, and a compiler's rounding is judged against the
    model's scale)."""
    return _gradient_error({name: p.grad for name, p in model.named_parameters()},
                           dict(reference.named_parameters()))[0]


def _dense(gradient: torch.Tensor) -> torch.Tensor:
    """A sparse gradient (``nn.Embedding(..., sparse=True)``) as the dense tensor it stands for."""
    return gradient.to_dense() if gradient.is_sparse else gradient


def _gradient_error(actual: dict[str, torch.Tensor | None], expected: dict[str, nn.Parameter]
                    ) -> tuple[float, int, tuple[str, ...]]:
    """(largest |difference| / largest |reference gradient|, tensors compared, names whose gradient is
    missing on one side only)."""
    largest = max((_dense(p.grad).abs().max().item() for p in expected.values()
                   if p.grad is not None and p.grad.numel()), default=0.0)
    worst, compared, missing = 0.0, 0, []
    for name, p in expected.items():
        mine = actual.get(name)
        if (p.grad is None) != (mine is None):
            missing.append(name)
            continue
        if p.grad is None or not p.grad.numel():
            continue
        compared += 1
        worst = max(worst, (_dense(mine).double() - _dense(p.grad).double()).abs().max().item())
    return (worst / largest if largest > 0 else worst), compared, tuple(missing)
