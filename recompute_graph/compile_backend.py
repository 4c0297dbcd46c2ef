"""``rg.backend``: the ``torch.compile`` backend that plans each graph with our solvers at a budget.

``torch.compile(model, backend=budget_backend("6GiB"), dynamic=False)``: for each graph Dynamo hands
over, AOTAutograd traces the joint forward+backward graph, and its partitioner (ours) prices it
(``joint_lowering.price_joint``), plans it (``planner.make_plan``) and lowers the plan into the forward
and backward graphs AOTAutograd runs (``joint_lowering.lower_plan``).

**Graph breaks.** A graph break splits the step into graphs that run one after another, each holding
what it saved while the later ones run. Planned one at a time within the whole budget, such a step
measured 1.222 of a byte budget (``python scripts/graph_break_budget.py``, session 33). So the backend
plans a broken step's graphs together (``step_graphs``):

1. A graph that ends at a break or resumes after one (``joint_capture.warn_of_graph_break``), and
   every graph compiled after one, is *shared*: at its first compilation it is priced and planned at
   its smallest-memory plan, since the graphs that run after it are not known yet.
2. Once a graph is shared, the backend records its graphs' forward calls (a model compiled as one
   graph pays nothing for this), and the backward of each graph; at the end of each
   backward pass (a callback queued with autograd's engine) the forwards whose backward ran, in
   forward order, are the step (a forward dropped without a backward, a validation call under grad
   say, is not part of it).
3. When the next step begins (the next forward), and the step just ended had several calls and a
   shared graph and differs from the last one planned, ``step_graphs.choose_step_plans`` chooses each
   graph's plan from its candidates (``planner.candidate_pool`` for ``"auto"``) so that the whole step
   fits the budget at the least recomputation, and each graph whose plan changed is compiled again
   with it (AOTAutograd retraced on fake copies of its first example inputs; the priced cost graph is
   kept, nothing is measured again; a compiled plan is kept and reused). ``backend.step_plan`` says
   what was chosen; each lowering reaches ``on_lowered``.

So the first step of a broken model runs each graph at its floor, and the budget holds from the second
step on. What runs at the break (eager code between graphs) is not counted. With ``on_infeasible=
"raise"`` a budget that no choice fits raises ``InfeasibleBudgetError`` at the start of every step
until it is raised (the graphs keep their floor plans); ``"floor"`` takes the choice of the least step
peak, with an ``InfeasibleBudgetWarning``. Inductor's measured excess (``fit_plan_to_inductor``) is
not taken from a shared budget. A step is one backward pass: with two losses backpropagated one after
the other, each pass is planned as a step of its own.
"""
from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx
from torch.autograd import Variable

from .collector import full_collections_deferred
from .errors import InfeasibleBudgetError, user_stacklevel
from .gradient_layouts import conform_parameter_gradients
from .graph import CostGraph
from .joint_capture import refuse_symbolic_shapes, warn_of_graph_break
from .joint_lowering import (InfeasibleBudgetWarning, Lowered, SchedulePass, lower_plan, plan_and_lower, price_joint,
                             set_last_lowering)
from .joint_partition import boxed_interpreter
from .joint_units import JointUnits, drop_backward_copies, is_tangent, joint_units
from .native_kernels import native_kernels
from .step_graphs import StepPlan, choose_step_plans
from .zero_gradients import ZeroTangentBackward, fold_zero_tangents, leave_gradients_missing

__all__ = ["budget_backend", "RecomputeBackend", "MAX_STEP_CALLS"]

#: Forwards of the backend's graphs remembered without a backward pass ending (a loop of forwards under
#: grad without backward, say); beyond, they are forgotten
MAX_STEP_CALLS = 10_000


@dataclass(eq=False)
class _CompiledGraph:
    """One graph Dynamo handed over: what re-compiling it with another plan needs."""

    key: int
    gm: fx.GraphModule
    fake_inputs: list[Any]
    shared: bool  # one of several graphs of a step: planned with the others
    parameter_grad_bytes: int  # the gradients its backward leaves: its parameters' (not its inputs')
    leaf_positions: tuple[int, ...] = ()  # which example inputs are leaves requiring grad (parameters): primals
    run: Callable[..., Any] | None = None  # AOTAutograd's compiled function of the current plan
    units: JointUnits | None = None
    graph: CostGraph | None = None
    num_fwd_outputs: int = 0
    lowered: Lowered | None = None
    target: Any = None  # the RecomputePlan the next compilation lowers
    compiled: dict[Any, tuple[Callable[..., Any], Lowered]] = field(default_factory=dict)  # schedule -> ...


def _fake_copies(example_inputs: Any) -> list[Any]:
    """The example inputs as fake tensors (shapes, strides, dtypes, ``requires_grad``): a graph compiled
    again later must not keep its first inputs' memory (the activations a graph break handed over)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    return [mode.from_tensor(value) if isinstance(value, torch.Tensor) else value for value in example_inputs]


def _parameter_grad_bytes(example_inputs: Any) -> int:
    """The bytes of the gradients of the graph's parameters (Dynamo hands them over as inputs, as
    ``nn.Parameter``s), without those of its other inputs that require one (an earlier graph's outputs)."""
    return sum(value.numel() * value.element_size() for value in example_inputs
               if isinstance(value, torch.nn.Parameter) and value.requires_grad)


def _leaf_positions(example_inputs: Any) -> tuple[int, ...]:
    """Which example inputs are leaves that require grad (parameters, a user's input with
    ``requires_grad``): their gradients go to ``AccumulateGrad``, not to an earlier graph's backward."""
    return tuple(i for i, v in enumerate(example_inputs)
                 if isinstance(v, torch.Tensor) and v.requires_grad and v.is_leaf)


class RecomputeBackend:
    """The callable ``budget_backend`` returns (a Dynamo backend); the module docstring says how it
    plans. ``step_plan``: the plans chosen for a broken step's graphs together (None before the second
    step of one, and for a model compiled as one graph); ``lowerings``: each graph's current one."""

    def __init__(self, budget: Any, *, solver: str, schedule_pass: SchedulePass | None, price_kernels: bool,
                 loss_fn: Any, on_infeasible: str, graph_compiler: Callable[..., Any], inductor: bool,
                 on_lowered: Callable[[Lowered], None] | None, saved_plan: Any, device_profile: Any,
                 timing: str, on_joint: Callable[[fx.GraphModule, Any], None] | None) -> None:
        self.budget, self.solver, self.schedule_pass = budget, solver, schedule_pass
        self.price_kernels, self.loss_fn, self.on_infeasible = price_kernels, loss_fn, on_infeasible
        self.graph_compiler, self.inductor, self.on_lowered = graph_compiler, inductor, on_lowered
        self.saved_plan, self.device_profile, self.timing, self.on_joint = saved_plan, device_profile, timing, on_joint
        self.graphs: list[_CompiledGraph] = []
        self.step_plan: StepPlan | None = None
        self._breaks = False
        self._calls: list[int] = []  # the forwards since the last backward pass, by graph key
        self._backwards: Counter[int] = Counter()  # backwards of each graph in the pass running
        self._pass_running = False  # the end of the backward pass is queued with autograd's engine
        self._finished: tuple[int, ...] = ()  # the calls of the last step, not yet looked at
        self._planned_calls: tuple[int, ...] | None = None
        self.planned_bytes = 0  # the most a graph compiled alone was planned at (``make_plan_for_call``)

    @property
    def lowerings(self) -> tuple[Lowered, ...]:
        return tuple(g.lowered for g in self.graphs if g.lowered is not None)

    def __repr__(self) -> str:
        shared = sum(g.shared for g in self.graphs)
        return (f"RecomputeBackend(budget={self.budget!r}, solver={self.solver!r}: {len(self.graphs)} graphs, "
                f"{shared} of them sharing the budget; step_plan={self.step_plan!r})")

    # ------------------------------------------------------------------ compiling
    def __call__(self, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        shared = warn_of_graph_break(gm) or self._breaks
        self._breaks = self._breaks or shared
        record = _CompiledGraph(len(self.graphs), gm, _fake_copies(example_inputs), shared,
                                _parameter_grad_bytes(example_inputs),
                                _leaf_positions(example_inputs))
        compiled = self._compile(record, example_inputs)
        if record.lowered is None:  # no partition: an inference graph (no_grad), nothing to plan or track
            return compiled
        self.graphs.append(record)
        record.run = compiled
        record.compiled[record.lowered.plan.schedule] = (compiled, record.lowered)

        def run(*args: Any) -> Any:
            if self._breaks:  # only a broken model's steps are learned (nothing on one graph's hot path)
                self._before_forward(record)
            result = record.run(*args)  # type: ignore[misc]
            if record.lowered is not None and record.lowered.zero_tangents:
                leave_gradients_missing(result)  # (the unreached outputs' gradients: zero_gradients)
            return result
        for name in ("zero_grad", "named_parameters", "named_buffers"):
            if hasattr(compiled, name):
                setattr(run, name, getattr(compiled, name))
        return run

    def _compile(self, record: _CompiledGraph, example_inputs: Any) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd

        lowered_here: list[Lowered] = []  # this compilation's lowering (the record's may change later)

        def backward_compiler(gm: fx.GraphModule, inputs: Any) -> Callable[..., Any]:
            compiled = self._compile_backward(gm, inputs, lowered_here[-1] if lowered_here else None)

            def run(*args: Any) -> Any:
                result = compiled(*args)
                if self._breaks:
                    self._after_backward(record)
                return result
            if getattr(compiled, "_boxed_call", False):
                run._boxed_call = True  # type: ignore[attr-defined]
            return run
        with native_kernels():  # interpolation as its kernel, not PyTorch's gathers (native_kernels.py)
            return aot_autograd(fw_compiler=self.graph_compiler, bw_compiler=backward_compiler,
                                partition_fn=lambda joint, joint_inputs, **kwargs: self._partition(
                                    record, joint, joint_inputs, lowered_here, **kwargs))(record.gm, example_inputs)

    def _compile_backward(self, gm: fx.GraphModule, inputs: Any, lowered: Lowered | None) -> Callable[..., Any]:
        """The backward's compiled function: ``gm``'s, or, where the plan folded the tangents of outputs the
        loss does not reach, a :class:`~recompute_graph.zero_gradients.ZeroTangentBackward` that runs the
        folded backward when their gradients are missing and ``gm`` (compiled on first need) otherwise."""
        folded = lowered.folded_backward_graph if lowered is not None else None
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if folded is None or [n.name for n in placeholders] != [n.name for n in folded.graph.nodes
                                                                 if n.op == "placeholder"]:
            return self.graph_compiler(gm, inputs)
        zero = {i for i, n in enumerate(placeholders) if n.name in lowered.zero_tangents}
        dropped = fold_zero_tangents(folded, lowered.zero_tangents, drop_placeholders=True)  # (nothing reads them)
        compiled = self.graph_compiler(dropped, [a for i, a in enumerate(inputs) if i not in zero])
        tangents = {i: n.meta["val"] for i, n in enumerate(placeholders) if is_tangent(n)}
        return ZeroTangentBackward(compiled, lambda: self.graph_compiler(gm, inputs), zero, tangents)

    def _partition(self, record: _CompiledGraph, joint: fx.GraphModule, joint_inputs: Any, made: list[Lowered], *,
                   num_fwd_outputs: int, **_: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        with full_collections_deferred():  # also a recompilation's planning, inside the user's step
            drop_backward_copies(joint, num_fwd_outputs)
            if len(joint_inputs[0]) == len(record.fake_inputs):  # (the primals are the example inputs)
                conform_parameter_gradients(joint, num_fwd_outputs, record.leaf_positions)
            if record.target is not None:  # compiled again with a plan chosen for the step
                lowered = self._lower_target(record, joint, num_fwd_outputs)
            else:
                refuse_symbolic_shapes(joint)
                if self.on_joint is not None:
                    self.on_joint(joint, joint_inputs)
                lowered = self._plan_first(record, joint, joint_inputs, num_fwd_outputs)
        record.lowered = lowered
        made.append(lowered)
        if self.on_lowered is not None:
            self.on_lowered(lowered)
        return lowered.forward_graph, lowered.backward_graph

    def _plan_first(self, record: _CompiledGraph, joint: fx.GraphModule, joint_inputs: Any,
                    num_fwd_outputs: int) -> Lowered:
        """The first compilation: at the budget, or, for a shared graph, at its smallest-memory plan."""
        measured = self.price_kernels
        if record.shared:
            from .planner import make_plan, min_feasible_budget
            units, graph = price_joint(joint, num_fwd_outputs=num_fwd_outputs, name=f"compiled graph {record.key}",
                                       joint_inputs=joint_inputs if measured else None,
                                       loss_fn=self.loss_fn if measured else None,
                                       device_profile=self.device_profile, timing=self.timing)
            plan = make_plan(graph, min_feasible_budget(graph, self.solver), self.solver)
            lowered = lower_plan(joint, units, graph, plan, num_fwd_outputs=num_fwd_outputs,
                                 schedule_pass=self.schedule_pass)
        else:
            def lower_at(budget: Any, saved_plan: Any = None) -> Lowered:
                return plan_and_lower(joint, budget, num_fwd_outputs=num_fwd_outputs, solver=self.solver,
                                      schedule_pass=self.schedule_pass,
                                      joint_inputs=joint_inputs if measured else None,
                                      loss_fn=self.loss_fn if measured else None, on_infeasible=self.on_infeasible,
                                      saved_plan=saved_plan, device_profile=self.device_profile,
                                      timing=self.timing, earlier_bytes=self.planned_bytes)
            lowered = lower_at(self.budget, self.saved_plan)
            if self.inductor and measured:  # inductor's code measured, the plan made again if over
                from .inductor_lowering import fit_plan_to_inductor
                lowered = fit_plan_to_inductor(lowered, lowered.plan.budget_bytes, lower_at)
                set_last_lowering(lowered)
            self.planned_bytes = max(self.planned_bytes, lowered.plan.budget_bytes)
        record.units, record.graph, record.num_fwd_outputs = lowered.units, lowered.graph, num_fwd_outputs
        return lowered

    def _lower_target(self, record: _CompiledGraph, joint: fx.GraphModule, num_fwd_outputs: int) -> Lowered:
        units = joint_units(joint, num_fwd_outputs)
        assert record.units is not None and record.graph is not None
        if units.names() != record.units.names() or num_fwd_outputs != record.num_fwd_outputs:
            raise RuntimeError(f"compiled graph {record.key} traced to other units the second time: its plan "
                               "cannot be carried over (please report this with the model)")
        units.zero_tangents = record.units.zero_tangents  # (priced with them folded)
        return lower_plan(joint, units, record.graph, record.target, num_fwd_outputs=num_fwd_outputs,
                          schedule_pass=self.schedule_pass)

    # ------------------------------------------------------------------ steps
    def _before_forward(self, record: _CompiledGraph) -> None:
        finished, self._finished = self._finished, ()
        if len(finished) > 1 and finished != self._planned_calls:  # a new step begins
            try:
                self._share_budget(finished)
            except BaseException:
                self._finished = finished  # planned again at the next forward
                raise
        if len(self._calls) >= MAX_STEP_CALLS:  # forwards without a backward, on and on: not a step
            self._calls.clear()
        self._calls.append(record.key)

    def _after_backward(self, record: _CompiledGraph) -> None:
        self._backwards[record.key] += 1
        if not self._pass_running:
            self._pass_running = True
            Variable._execution_engine.queue_callback(self._backward_pass_ended)

    def _backward_pass_ended(self) -> None:
        """The step is the forwards whose backward ran in this pass, in forward order (of a graph's
        forwards, the latest: the others were dropped without a backward, a validation call under
        grad, say)."""
        keep = Counter(self._backwards)
        step = []
        for key in reversed(self._calls):
            if keep[key] > 0:
                keep[key] -= 1
                step.append(key)
        self._finished = tuple(reversed(step))
        self._calls, self._pass_running = [], False
        self._backwards.clear()

    def _share_budget(self, calls: tuple[int, ...]) -> None:
        """Choose the step's plans together and compile each graph whose plan changed."""
        graphs = {key: self.graphs[key].graph for key in set(calls)}
        candidates = {key: self._candidates(graph) for key, graph in graphs.items()}
        gradients = {key: self.graphs[key].parameter_grad_bytes for key in graphs}
        from .planner import steady_plans  # auto's plans that a new capture makes again: a floor that stays
        steady = {key: steady_plans(graph) for key, graph in graphs.items()} if self.solver == "auto" else None
        try:
            step = choose_step_plans(calls, graphs, self.budget, candidates, gradients, steady)
        except InfeasibleBudgetError as error:
            if self.on_infeasible != "floor":
                raise
            warnings.warn(f"{error} Planning the step at its smallest feasible budget, {error.min_budget_bytes} "
                          "bytes (on_infeasible='floor').", InfeasibleBudgetWarning, stacklevel=user_stacklevel())
            step = choose_step_plans(calls, graphs, error.min_budget_bytes, candidates, gradients, steady)
        from .planner import plan_from_solution
        for key in sorted(set(calls)):
            record, chosen = self.graphs[key], step.plans[key]
            if chosen.schedule in record.compiled:
                record.run, record.lowered = record.compiled[chosen.schedule]
                continue
            record.target = plan_from_solution(record.graph, chosen, step.budget_bytes)
            try:
                record.run = self._compile(record, record.fake_inputs)
            finally:
                record.target = None
            record.compiled[chosen.schedule] = (record.run, record.lowered)
        self.step_plan, self._planned_calls = step, calls

    def _candidates(self, graph: CostGraph) -> list[Any]:
        """The plans a graph of a broken step may run: ``auto``'s pool, or the named solver's plans at
        the pool's fractions of the store-all budget and at its lowest peak."""
        from .planner import candidate_pool, make_plan, min_feasible_budget, pool_fractions
        if self.solver == "auto":
            return list(candidate_pool(graph))
        plans: dict[Any, Any] = {}
        floor = min_feasible_budget(graph, self.solver)
        for fraction in pool_fractions(graph):
            try:
                plan = make_plan(graph, fraction, self.solver)
            except InfeasibleBudgetError:
                break
            plans.setdefault(plan.schedule, plan)
        floor_plan = make_plan(graph, floor, self.solver)
        plans.setdefault(floor_plan.schedule, floor_plan)
        from .solvers import Solution
        return [Solution(p.solver, p.schedule, p.simulation, p.description) for p in plans.values()]


def budget_backend(budget: Any, solver: str = "auto", schedule_pass: SchedulePass | None = None,
                   price_kernels: bool = True, loss_fn: Any = None, on_infeasible: str = "raise",
                   graph_compiler: "Callable[..., Any] | str" = boxed_interpreter,
                   on_lowered: Callable[[Lowered], None] | None = None, saved_plan: Any = None,
                   device_profile: Any = "cpu", timing: str = "measure",
                   on_joint: Callable[[fx.GraphModule, Any], None] | None = None) -> RecomputeBackend:
    """``torch.compile(model, backend=budget_backend("6GiB"), dynamic=False)``: AOTAutograd whose
    partitioner plans the joint graph with our solvers at ``budget`` (bytes, a size string, or a fraction
    of store-all) and lowers the plan (``joint_lowering.plan_and_lower``); the graphs run as they are
    (``joint_partition.boxed_interpreter``). A graph break warns (``GraphBreakWarning``), and the step's
    graphs share the budget from its second step on (module docstring; ``backend.step_plan``).
    ``last_lowering()`` shows the plan, the saved values and the backward's code. ``price_kernels``:
    measure each node's kernel workspace, and with ``timing="measure"`` its run time, on real tensors
    first (``joint_allocations.kernel_workspace_bytes``, ``node_seconds``); without it the plan prices
    the graphs' liveness alone, timed from FLOPs. ``loss_fn``: the loss the training loop computes on
    the compiled module's output (default ``losses.default_training_loss``), priced on the outputs'
    shapes and kept free beside the step (``planner.loss_allowance_bytes``).
    ``on_infeasible``: ``"raise"`` (``InfeasibleBudgetError``, with the smallest feasible budget) or
    ``"floor"``: plan that graph (or that broken step) at its smallest feasible budget, with an
    ``InfeasibleBudgetWarning``. ``graph_compiler``: what runs the generated graphs (AOTAutograd's boxed
    convention; the node-marking interpreter of ``joint_timeline`` measures them node by node;
    ``"inductor"``: inductor's code for them, ``inductor_lowering``, measured on the example inputs and
    planned again with less budget where it holds more than the plan, ``inductor_lowering.fit_plan_to_inductor``).
    ``on_lowered(lowered)``: called with each :class:`~recompute_graph.joint_lowering.Lowered` (a graph
    compiled again with a step's plan calls it again). ``on_joint(joint, joint_inputs)``: called before
    planning with each joint graph and its inputs as AOTAutograd hands them over (fake primals and
    tangents; scripts that time or inspect the graph a plan was made on). ``saved_plan``,
    ``device_profile``, ``timing``: as in ``plan_and_lower``. Symbolic shapes are refused:
    ``joint_capture.refuse_symbolic_shapes``."""
    if on_infeasible not in ("raise", "floor") or timing not in ("measure", "flops"):
        raise ValueError(f"on_infeasible={on_infeasible!r}, timing={timing!r}: use 'raise' or 'floor', and "
                         "'measure' (time the joint graph's nodes) or 'flops'")
    inductor = graph_compiler == "inductor"  # by name: its code is measured and the plan fitted to it
    if isinstance(graph_compiler, str):
        if graph_compiler != "inductor":
            raise ValueError(f"graph_compiler={graph_compiler!r}: use 'inductor' or an AOTAutograd compiler")
        from .inductor_lowering import inductor_graph_compiler
        graph_compiler = inductor_graph_compiler
    from .losses import default_training_loss
    return RecomputeBackend(budget, solver=solver, schedule_pass=schedule_pass, price_kernels=price_kernels,
                            loss_fn=loss_fn or default_training_loss, on_infeasible=on_infeasible,
                            graph_compiler=graph_compiler, inductor=inductor, on_lowered=on_lowered,
                            saved_plan=saved_plan, device_profile=device_profile, timing=timing, on_joint=on_joint)
