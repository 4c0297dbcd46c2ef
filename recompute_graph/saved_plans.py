"""Plans on disk: ``plan.save(path)`` / ``RecomputePlan.load(path)``, and whether a saved plan still fits
the model it is offered to.

Format (JSON, ``"format": "recompute_graph.RecomputePlan/1"``): the plan's numbers (solver, budget,
predicted peak, store-all peak, compute overhead, description), its schedule as a list of ops per phase
(``["F", node, tape]``, ``["X", node]`` for a free, ``["B", node]``), the cost graph it was made for
(``CostGraph.to_dict``) and that graph's *structure fingerprint*.

The structure fingerprint hashes everything of the graph that decides whether a schedule runs and what
memory it needs: node names, kinds, targets, edges, every byte count and flag, in order. It leaves out
times (``forward_cost``, ``backward_cost``, FLOPs, ``cost_source``) and the graph's name, which change
between runs or machines without changing the plan's validity. ``mismatch_reason`` says in one sentence
what differs when fingerprints do not match. Pure Python: no torch.
"""
from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from .errors import PlanFileError
from .graph import CostGraph
from .schedule import Backward, Forward, FreeValue, Op, Schedule
from .units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .planner import RecomputePlan

__all__ = ["PLAN_FORMAT", "structure_fingerprint", "mismatch_reason", "reuse_plan", "plan_to_dict", "plan_from_dict",
           "save_plan", "load_plan"]

PLAN_FORMAT = "recompute_graph.RecomputePlan/1"
#: Node fields that are times, not structure (left out of the fingerprint).
_TIME_FIELDS = ("forward_cost", "backward_cost", "recompute_cost", "forward_flops", "backward_flops",
                # kernel temporaries as the allocator sees them: they differ between devices (none on
                # meta) and are re-priced when a plan is reused, like times
                "workspace_bytes", "backward_workspace_bytes", "backward_step_workspace_bytes")
#: Graph fields left out of the fingerprint.
_GRAPH_FIELDS_IGNORED = ("name", "cost_source", "source", "nodes", "format", "loss_bytes", "rng_state_bytes",
                         "estimated_costs")


def _structure(graph: CostGraph) -> dict[str, Any]:
    data = graph.to_dict()
    return {
        "graph": {k: v for k, v in data.items() if k not in _GRAPH_FIELDS_IGNORED},
        "nodes": [{k: v for k, v in node.items() if k not in _TIME_FIELDS} for node in data["nodes"]],
    }


def reuse_plan(saved: "RecomputePlan", graph: CostGraph, budget: Any, stacklevel: int = 3) -> "RecomputePlan | None":
    """``saved`` re-priced on ``graph`` when it is the same structure and fits ``budget``; else None after
    a ``PlanMismatchWarning`` that says why (the caller then makes a new plan)."""
    import warnings

    from .errors import PlanMismatchWarning
    from .planner import replan_schedule
    reason = mismatch_reason(saved.graph, graph)
    if reason is None:
        reused = replan_schedule(saved, graph, budget)
        needed = reused.min_budget_bytes
        if needed <= reused.budget_bytes:
            return reused
        reason = (f"its predicted peak {reused.predicted_peak_bytes} bytes needs a budget of {needed} bytes, "
                  f"over the {reused.budget_bytes} asked for")
    warnings.warn(f"saved plan not reused: {reason}; making a new plan", PlanMismatchWarning,
                  stacklevel=stacklevel + 1)
    return None


def structure_fingerprint(graph: CostGraph) -> str:
    """A 16-hex-digit hash of the graph's structure and byte counts (module docstring)."""
    text = json.dumps(_structure(graph), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def mismatch_reason(saved: CostGraph, current: CostGraph) -> str | None:
    """None when both graphs have the same structure fingerprint, else what differs first, in words."""
    a, b = _structure(saved), _structure(current)
    if a == b:  # equal structures, equal fingerprints
        return None
    if len(saved) != len(current):
        return (f"the plan was made for a graph of {len(saved)} nodes and the model now traces to "
                f"{len(current)} nodes (the model's code or configuration changed)")
    for old, new in zip(a["nodes"], b["nodes"]):
        if old == new:
            continue
        label = f"node {old['index']} {old['name']!r}"
        for key in ("name", "kind", "target", "predecessors"):
            if old[key] != new[key]:
                return (f"{label}: {key} is {old[key]!r} in the plan and {new[key]!r} now (the model's code "
                        "changed)")
        for key in sorted(old, key=lambda k: (k != "output_bytes", k)):
            if old[key] != new[key]:
                if key.endswith("_bytes"):
                    return (f"{label}: {key} is {format_bytes(old[key])} in the plan and {format_bytes(new[key])} "
                            "now (the inputs' shapes or dtypes, or the model's sizes, differ from those the "
                            "plan was made for)")
                return f"{label}: {key} is {old[key]!r} in the plan and {new[key]!r} now"
    for key in sorted(a["graph"]):
        if a["graph"][key] != b["graph"].get(key):
            value_old, value_new = a["graph"][key], b["graph"].get(key)
            if key.endswith("_bytes"):
                value_old, value_new = format_bytes(value_old), format_bytes(value_new or 0)
            return f"the graph's {key} is {value_old} in the plan and {value_new} now"
    return "the graphs differ"  # pragma: no cover - every field is compared above


def _op_to_list(op: Op) -> list:
    if isinstance(op, Forward):
        return ["F", op.node, int(op.tape)]
    if isinstance(op, FreeValue):
        return ["X", op.node]
    return ["B", op.node]


def _op_from_list(item: list) -> Op:
    kind = item[0]
    if kind == "F":
        return Forward(int(item[1]), tape=bool(item[2]))
    if kind == "X":
        return FreeValue(int(item[1]))
    if kind == "B":
        return Backward(int(item[1]))
    raise PlanFileError(f"saved plan has an unknown op {item!r} (expected F, X or B)")


def plan_to_dict(plan: "RecomputePlan") -> dict[str, Any]:
    return {
        "format": PLAN_FORMAT,
        "solver": plan.solver, "description": plan.description,
        "budget_bytes": plan.budget_bytes, "predicted_peak_bytes": plan.predicted_peak_bytes,
        "store_all_peak_bytes": plan.store_all_peak_bytes,
        "predicted_compute_overhead": plan.predicted_compute_overhead,
        "recomputed_nodes": [plan.graph.nodes[i].name for i in plan.recomputed_nodes],
        "structure_fingerprint": structure_fingerprint(plan.graph),
        "schedule": {"forward": [_op_to_list(op) for op in plan.schedule.forward_ops],
                     "backward": [_op_to_list(op) for op in plan.schedule.backward_ops]},
        "graph": plan.graph.to_dict(),
    }


def plan_from_dict(data: dict[str, Any]) -> "RecomputePlan":
    """The plan saved in ``data``; the schedule is simulated again on the saved graph (so a file edited
    by hand into an invalid schedule fails here, with the simulator's error)."""
    from .planner import RecomputePlan
    from .simulate import simulate
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise PlanFileError(f"not a saved recompute_graph plan (missing format {PLAN_FORMAT!r})")
    try:
        graph = CostGraph.from_dict(data["graph"])
        schedule = Schedule(tuple(_op_from_list(op) for op in data["schedule"]["forward"]),
                            tuple(_op_from_list(op) for op in data["schedule"]["backward"]))
        simulation = simulate(graph, schedule)
        return RecomputePlan(solver=data["solver"], budget_bytes=int(data["budget_bytes"]),
                             predicted_peak_bytes=simulation.peak_bytes,
                             store_all_peak_bytes=int(data["store_all_peak_bytes"]),
                             predicted_compute_overhead=float(data["predicted_compute_overhead"]),
                             schedule=schedule, simulation=simulation, graph=graph,
                             description=data.get("description", ""))
    except (KeyError, TypeError, IndexError, ValueError) as error:
        raise PlanFileError(f"saved plan is incomplete or malformed: {type(error).__name__}: {error}") from None


def save_plan(plan: "RecomputePlan", path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(plan_to_dict(plan), f, indent=1)


def load_plan(path: str) -> "RecomputePlan":
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise PlanFileError(f"no plan file at {path!r}") from None
    except json.JSONDecodeError as error:
        raise PlanFileError(f"{path!r} is not JSON: {error}") from None
    return plan_from_dict(data)
