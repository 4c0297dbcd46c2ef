"""The ``ilp`` solver on graphs with an implicit backward (traced models, Kusumoto's graphs), through their
joint view with tapes.

``JointView(graph)`` has, in this order, for every node ``v``: ``F_v`` (its output value and forward
cost) and, if ``v`` needs a gradient, ``T_v`` (its tape: the bytes its backward saves, no cost of its
own, computed only together with a computation of ``F_v``: an optional node anchored to ``F_v``); then
``B_v`` for every such node in reverse order (reads ``T_v`` and the ``B_s`` of the successors whose
gradients it consumes; holds the gradients it hands to its inputs; the node's backward cost; computed
once). A view contributes no bytes of its own, and a tape's bytes are counted apart from the values it
shares storage with: the model over-estimates where tapes and live values overlap, and it has no
workspaces, accumulation or parameter gradients, so the simulator judges its plans.

A joint schedule becomes ours: ``F_v`` -> ``Forward(v)``, taped when ``T_v`` follows it; ``B_v`` ->
``Backward(v)``; frees from ``insert_frees``. The lower-set DP's plan seeds it (CP-SAT hint, and the
answer if nothing better fits); the model budget is calibrated on the seed (simulated peak minus model
peak) and lowered by the overshoot while the simulated plan does not fit. So the answer fits whenever
the DP's does and is never worse than it; when nothing fits, it is the DP's lowest-peak plan (the
registry's contract: callers check ``fits``).
"""
from __future__ import annotations

from ..graph import CostGraph, CostNode
from ..schedule import Backward, Forward, Schedule, insert_frees
from ..simulate import simulate
from . import Solution

__all__ = ["JointView", "solve_implicit"]


class JointView:
    """The joint graph of ``graph`` and the index maps between the two."""

    def __init__(self, graph: CostGraph) -> None:
        self.graph = graph
        self.value: dict[int, int] = {}
        self.tape: dict[int, int] = {}
        self.backward: dict[int, int] = {}
        nodes: list[CostNode] = []

        def add(**fields) -> int:
            index = len(nodes)
            nodes.append(CostNode(index=index, kind="loaded", requires_grad=False, **fields))
            return index

        for v, node in enumerate(graph.nodes):
            self.value[v] = add(name=f"F:{node.name}", predecessors=tuple(self.value[p] for p in node.predecessors),
                                output_bytes=0 if node.alias_of is not None else node.output_bytes,
                                forward_cost=node.recomputation_cost)
            if node.requires_grad:
                reads = tuple(sorted({self.value[v], *(self.value[p] for p in node.predecessors)}))
                saved = node.saved_input_bytes + node.saved_output_bytes + node.saved_buffer_bytes
                self.tape[v] = add(name=f"T:{node.name}", predecessors=reads, output_bytes=saved, forward_cost=0.0)
        for v in range(len(graph) - 1, -1, -1):
            node = graph.nodes[v]
            if not node.requires_grad:
                continue
            reads = {self.tape[v], *(self.backward[s] for s in node.successors if s in self.backward)}
            handed = sum(graph.nodes[p].grad_bytes for p in node.predecessors if graph.nodes[p].requires_grad)
            self.backward[v] = add(name=f"B:{node.name}", predecessors=tuple(sorted(reads)), output_bytes=handed,
                                   forward_cost=node.backward_cost, phase="backward")
        self.joint = CostGraph(name=f"{graph.name} (joint)", nodes=tuple(nodes), cost_unit=graph.cost_unit,
                               implicit_backward=False, source=f"joint view of {graph.source}")
        self.origin = {j: ("F", v) for v, j in self.value.items()}
        self.origin.update({j: ("T", v) for v, j in self.tape.items()})
        self.origin.update({j: ("B", v) for v, j in self.backward.items()})

    def to_joint(self, schedule: Schedule) -> Schedule:
        """Our schedule as a joint one (a taped Forward(v) is F_v then T_v)."""
        ops = []
        for op in schedule.ops:
            if isinstance(op, Forward):
                ops.append(Forward(self.value[op.node], tape=False))
                if op.tape and op.node in self.tape:
                    ops.append(Forward(self.tape[op.node], tape=False))
            elif isinstance(op, Backward):
                ops.append(Forward(self.backward[op.node], tape=False))
        return insert_frees(self.joint, ops, [], outputs=())

    def from_joint(self, joint_schedule: Schedule) -> Schedule:
        """A joint schedule as ours (module docstring)."""
        sequence = [self.origin[op.node] for op in joint_schedule.ops if isinstance(op, Forward)]
        taped: set[int] = set()   # positions of the F_v computations that carry the tape
        last_value: dict[int, int] = {}
        for position, (kind, v) in enumerate(sequence):
            if kind == "F":
                last_value[v] = position
            elif kind == "T" and v in last_value:
                taped.add(last_value[v])
        first_backward = next((p for p, (kind, _) in enumerate(sequence) if kind == "B"), len(sequence))
        forward_ops, backward_ops = [], []
        for position, (kind, v) in enumerate(sequence):
            if kind == "T":
                continue
            op = Forward(v, tape=position in taped) if kind == "F" else Backward(v)
            (forward_ops if position < first_backward else backward_ops).append(op)
        return insert_frees(self.graph, forward_ops, backward_ops)


def solve_implicit(graph: CostGraph, budget_bytes: int | None, *, time_limit: float = 60.0, workers: int = 2,
                   progress: bool = False, attempts: int = 3, backend: str = "cp-sat") -> Solution:
    """The ilp solver for a graph with an implicit backward (module docstring)."""
    from . import SOLVERS
    from .ilp import solve_ilp
    from .lower_set_dp import dp_for
    seed_name = dp_for(graph) or "chen_greedy"
    seed = SOLVERS[seed_name](graph, budget_bytes)
    if budget_bytes is None:
        budget_bytes = seed.peak_bytes
    view = JointView(graph)
    seed_joint = view.to_joint(seed.schedule)
    model_budget = budget_bytes - (seed.peak_bytes - simulate(view.joint, seed_joint).peak_bytes)
    best = seed if seed.fits(budget_bytes) else None
    for _ in range(attempts):
        if model_budget <= 0:
            break
        result = solve_ilp(view.joint, int(model_budget), time_limit=time_limit / attempts, workers=workers,
                           hint=seed_joint, progress=progress, computed_once=view.backward.values(),
                           optional_nodes={t: view.value[v] for v, t in view.tape.items()}, backend=backend)
        if result.schedule is None:
            break
        candidate = Solution.of("ilp", graph, view.from_joint(result.schedule),
                                f"joint model {result.status}, seeded with {seed_name}")
        if candidate.fits(budget_bytes):
            if best is None or candidate.simulation.compute_cost < best.simulation.compute_cost:
                best = candidate
            break
        model_budget -= candidate.peak_bytes - budget_bytes
    if best is None or best is seed:  # nothing better fits: the seed (the lowest peak known if none fits)
        return Solution("ilp", seed.schedule, seed.simulation, f"{seed_name}'s plan (no better joint schedule)")
    return best
