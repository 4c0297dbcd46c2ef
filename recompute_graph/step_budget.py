"""What a plan's training step needs of a budget: the loss beside the model's graph, and the margin.

A plan's *step peak* is the simulator's peak, or the loss's transient on top of what is live when the
output gradients arrive, whichever is higher (:func:`step_peak_bytes`). A budget fits a plan when that
peak, with the planning margin (:data:`PLANNING_MARGIN` for a traced model, 0 for a graph from a file),
stays within it (:func:`min_budget_for_step`). Pure Python (no torch). Units: bytes.
"""
from __future__ import annotations

import math

from .graph import SCALAR_LOSS_BYTES, CostGraph
from .simulate import SimulationResult

__all__ = ["PLANNING_MARGIN", "loss_allowance_bytes", "planning_margin", "usable_bytes_of", "step_peak_bytes",
           "loss_peak_bytes", "held_at_loss_bytes", "budget_with_loss_allowance", "min_budget_for_step",
           "min_budget_for_peak"]

#: A plan of a traced model fits a budget when its predicted peak times (1 + PLANNING_MARGIN), plus the
#: loss allowance
#: (``loss_allowance_bytes``: the loss function's own output-sized tensors), does. The margin covers what
#: else the cost model leaves out: allocator rounding, and backward temporaries that depend on the
#: strides of the incoming gradient (measured peaks of the tiny zoo models lie up to 2.5 % above the
#: prediction, tests/test_executor.py).
PLANNING_MARGIN = 0.05


def loss_allowance_bytes(graph: CostGraph) -> int:
    """The loss's transient bytes the graph was priced with (``CostGraph.loss_bytes``, measured), when
    known. Otherwise a guess: bytes set aside, beyond the margin, for the loss computed on the model's
    outputs (``loss(out)`` keeps output-sized temporaries, e.g. ``out.square()``, next to the step's
    peak): the storage of the outputs of a traced model; 0 for graphs loaded from files, where no loss
    runs, and for models that return their own scalar loss (``transformers`` models given ``labels``:
    training backpropagates from ``output.loss``, whose computation is in the graph)."""
    if graph.loss_bytes is not None:
        return graph.loss_bytes
    if graph.source != "traced":
        return 0
    owners = {graph.storage_owner(i) for i in graph.output_indices}
    if any(graph.nodes[i].grad_bytes <= SCALAR_LOSS_BYTES for i in graph.gradient_outputs):
        return 0
    return sum(graph.nodes[i].output_bytes for i in owners)


def planning_margin(graph: CostGraph) -> float:
    """``PLANNING_MARGIN`` for a traced model, which runs on a real allocator; 0 for graphs loaded from
    files (the published benchmark graphs), where the simulator's peak is the whole answer, so that a
    (graph, solver) pair has one smallest budget: the lowest peak the solver's schedule reaches."""
    return PLANNING_MARGIN if graph.source == "traced" else 0.0


def usable_bytes_of(budget_bytes: int, allowance_bytes: int = 0, margin: float = PLANNING_MARGIN) -> int:
    """What a plan's predicted peak may reach within ``budget_bytes``: the budget less the loss allowance,
    divided by ``1 + margin`` (``planning_margin``)."""
    return int((budget_bytes - allowance_bytes) / (1 + margin))


def step_peak_bytes(graph: CostGraph, simulation: SimulationResult) -> int:
    """A whole step's predicted peak, the loss at its moment: the simulator's peak, or the loss's
    transient (``loss_allowance_bytes``) on top of what is live when the output gradients arrive, the
    outputs still live (a loss with a transient holds them while its backward makes their gradients;
    on the compiler path the simulator lets them go first, ``outputs_dropped_bytes``)."""
    return max(simulation.peak_bytes, loss_peak_bytes(graph, simulation))


def loss_peak_bytes(graph: CostGraph, simulation: SimulationResult) -> int:
    """The step's predicted peak while the loss runs (:func:`step_peak_bytes`' second term): what is live
    when the output gradients arrive, with the loss's transient and the outputs it holds."""
    return held_at_loss_bytes(graph, simulation) + loss_allowance_bytes(graph)


def held_at_loss_bytes(graph: CostGraph, simulation: SimulationResult) -> int:
    """What is live beside the loss's transient while it runs: the step when the output gradients
    arrive, and the outputs, which a loss with a transient holds while its backward makes their
    gradients (on the compiler path the simulator lets them go first, ``outputs_dropped_bytes``), less
    the zero gradients of the outputs the loss does not reach, made only when the backward starts
    (``CostGraph.loss_unreached_gradient_bytes``)."""
    arrival = next((p.live_bytes for p in simulation.timeline if p.op is None), simulation.peak_bytes)
    if not loss_allowance_bytes(graph):
        return arrival
    return arrival + simulation.outputs_dropped_bytes - graph.loss_unreached_gradient_bytes


def budget_with_loss_allowance(graph: CostGraph, simulation: SimulationResult) -> int:
    """The budget a schedule fits with the whole loss allowance set aside beside the larger of the
    simulator's peak and what is held while the loss runs (:func:`held_at_loss_bytes`), the margin on
    that alone. The store-all schedule's is the budget a fraction of 1.0 stands for. (The simulator's
    peak alone was used: an autoencoder returning its input beside its reconstruction, the loss
    comparing the two, holds the output and its gradient at the loss, 8.9 MB against a 5.4 MB peak, and
    its store-all step measured 21.5 MB against a budget of 18.2 MB.)"""
    peak = max(simulation.peak_bytes, held_at_loss_bytes(graph, simulation))
    return min_budget_for_peak(peak, loss_allowance_bytes(graph), planning_margin(graph))


def min_budget_for_step(graph: CostGraph, simulation: SimulationResult) -> int:
    """The smallest budget a schedule fits: its step peak (``step_peak_bytes``) with the planning
    margin, or :func:`budget_with_loss_allowance`, whichever is lower. The planner first plans for the
    second (the solvers plan the simulator's peak within the budget less the allowance), then, when
    nothing fits, for the first: a language model's loss on its logits is hundreds of MB, held at the
    end of the forward, while the step's peak lies in the backward among the parameter gradients
    (GPT-2 small at 50 % had no plan on the sum alone)."""
    return min(budget_with_loss_allowance(graph, simulation),
               min_budget_for_peak(step_peak_bytes(graph, simulation), 0, planning_margin(graph)))


def min_budget_for_peak(peak_bytes: int, allowance_bytes: int = 0, margin: float = PLANNING_MARGIN) -> int:
    """The smallest budget that a plan with this predicted peak fits (the margin, ``planning_margin``,
    and the loss allowance, ``loss_allowance_bytes``)."""
    budget = math.ceil(peak_bytes * (1 + margin)) + allowance_bytes
    while usable_bytes_of(budget, allowance_bytes, margin) < peak_bytes:
        budget += 1
    return budget
