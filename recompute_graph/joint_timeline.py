"""Node by node, what the allocator sees in a compiled step beside the generated graphs' own liveness.

``compiled_timeline(model, inputs, budget)`` compiles ``model`` with our backend
(``compile_backend.budget_backend``), runs its forward and backward graphs through an interpreter that
wraps every node in an empty-named ``torch.profiler.record_function`` range, and returns one
:class:`TimelinePoint` per node: the bytes the graphs' liveness holds while it runs
(``joint_lowering.graph_live_bytes``, activations only, no kernel workspace), and what the CPU allocator
measured (``measure.AllocatorRecorder.markers``): the level after the node and the peak since the
previous node, in bytes above the step's start. Between the two graphs one point (graph and node
``"loss"``) is the training loop's loss, forward and backward, up to the moment the output gradients
have all arrived, beside the plan's prediction for it (``planner.loss_peak_bytes``): without it the
loss's peak was charged to the backward graph's first kernel. Where a prediction misses, the first node whose
measured peak exceeds the liveness by more than the rest of the step says which value the cost graph
does not see (``excess_bytes``). CPU only (the allocator meter is the profiler's); one graph only
(a model with graph breaks raises ``ValueError``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx

from .losses import default_training_loss
from .measure import AllocatorRecorder

__all__ = ["TimelinePoint", "compiled_timeline", "marked_interpreter"]

_MARK = "recompute_graph.joint::"


@dataclass(frozen=True)
class TimelinePoint:
    """While one node of the forward or backward graph ran (bytes above the step's start)."""

    graph: str
    node: str
    predicted_live_bytes: int
    measured_level_bytes: int
    measured_peak_bytes: int

    @property
    def excess_bytes(self) -> int:
        """Measured peak minus the graphs' liveness: kernel workspace, the loss, or a value not priced."""
        return self.measured_peak_bytes - self.predicted_live_bytes


def _graph_tag(gm: fx.GraphModule) -> str:
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return "backward" if any(name.startswith("tangents") for name in placeholders) else "forward"


class _MarkingInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.tag = _graph_tag(gm)

    def run_node(self, n: fx.Node) -> Any:
        with torch.profiler.record_function(f"{_MARK}{self.tag}:{n.name}"):
            return super().run_node(n)


def marked_interpreter(gm: fx.GraphModule, _example_inputs: Any = None) -> Callable[[list], Any]:
    """An AOTAutograd compiler (boxed convention: the argument list is cleared, each value dropped after
    its last use) that marks every node with a ``record_function`` range."""
    def run(args: list) -> Any:
        return _MarkingInterpreter(gm).boxed_run(args)
    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def compiled_timeline(model: torch.nn.Module, inputs: Sequence[Any], budget: Any, *, solver: str = "auto",
                      loss_fn: Callable[[Any], torch.Tensor] = default_training_loss,
                      on_infeasible: str = "floor", kwargs: dict[str, Any] | None = None
                      ) -> tuple[list[TimelinePoint], Any]:
    """``(points, lowered)`` of one compiled training step of ``model`` at ``budget`` (module docstring);
    ``lowered`` is ``joint_lowering.last_lowering()``; ``kwargs``: keyword inputs of the model's call.
    Parameter gradients are cleared first."""
    from .compile_backend import budget_backend
    from .joint_lowering import graph_live_bytes, last_lowering
    from .planner import loss_peak_bytes
    lowerings: list[Any] = []
    backend = budget_backend(budget, solver=solver, loss_fn=loss_fn, on_infeasible=on_infeasible,
                             graph_compiler=marked_interpreter)

    def counting(gm: fx.GraphModule, example_inputs: Any) -> Any:
        compiled_graph = backend(gm, example_inputs)
        lowerings.append(True)
        return compiled_graph
    from .compiled_module import ignored_logging_calls, logging_calls_ignored
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting)

    def step(marked: bool = False) -> None:
        model.zero_grad(set_to_none=True)
        with logging_calls_ignored(ignored_logging_calls()):  # as optimize() compiles
            output = compiled(*inputs, **(kwargs or {}))
            if marked:
                _mark_gradients_arrived(output)
            loss = loss_fn(output)
        del output
        loss.backward()  # the output dropped first, as in the README loop the prediction is for
    step()
    if len(lowerings) != 1:
        raise ValueError(f"torch.compile split the model into {len(lowerings)} graphs; the timeline "
                         "covers models compiled as one graph")
    lowered = last_lowering()
    model.zero_grad(set_to_none=True)
    with AllocatorRecorder() as recorder:
        step(marked=True)
    measured = {label: (level, peak) for label, level, peak in recorder.markers(_MARK)}
    points = []
    for tag, name, live in graph_live_bytes(lowered.forward_graph, lowered.planned_backward_graph):
        if tag == "backward" and points[-1].graph == "forward":  # the loss, between the two graphs
            level, peak = measured.get(f"{_LOSS}:{_LOSS}", (0, 0))
            predicted = loss_peak_bytes(lowered.graph, lowered.plan.simulation)
            points.append(TimelinePoint(_LOSS, _LOSS, predicted, level, peak))
        level, peak = measured.get(f"{tag}:{name}", (0, 0))
        points.append(TimelinePoint(tag, name, live, level, peak))
    return points, lowered


_LOSS = "loss"


def _mark_gradients_arrived(output: Any) -> None:
    """An empty marker range once the loss's backward has made the gradients of all of ``output``'s
    tensors that require grad: what the allocator saw from the forward graph's end to there is the
    loss's, not the backward graph's first node's."""
    from torch.utils._pytree import tree_flatten
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]

    def arrived(_gradients: Any) -> None:
        with torch.profiler.record_function(f"{_MARK}{_LOSS}:{_LOSS}"):
            pass
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, arrived)
