"""The executor: runs any schedule the simulator accepts, on any device.

One ``torch.autograd.Function`` wraps the whole model. Its ``forward`` runs the schedule's forward ops,
its ``backward`` the backward ops, node by node (the Rotor/Rockmate model, docs/architecture.md):

* ``Forward(v, tape=False)`` runs the fx node under ``torch.no_grad()``.
* ``Forward(v, tape=True)`` runs it with grad enabled on *detached* inputs (leaves requiring grad), so
  that the node has a local autograd graph holding exactly what its backward saves.
* ``FreeValue(v)`` drops the executor's reference. If the node's tape still exists, the tape's output
  tensor gets an empty placeholder as ``.data`` so that the storage lives only while saved tensors need
  it; the shape is restored right before the backward.
* ``Backward(v)`` calls ``torch.autograd.grad`` on the node's local graph with the accumulated gradient
  of its output, adds the gradients of the detached inputs into their producers' buffers, and collects
  parameter gradients, which ``backward`` returns to autograd (so parameter hooks and DDP work as usual);
  a node with neither (its output made to require grad by ``output.requires_grad_()``) ends there.
* A taped ``value[k]`` on a tuple or list of tensors is the element as a detached leaf with an identity
  tape (``_taped_item``): its ``Backward`` hands the gradient on to the producer without autograd.

Fused backward runs (``fuse=True``, the default without an observer): a maximal run of consecutive
``Backward``/``FreeValue`` ops with several ``Backward`` ops is one ``autograd.grad`` call. A node taped
for such a run reads the inputs taped for the *same* run through an alias that keeps the autograd edge,
so the run's local graphs form one graph; the run's ``FreeValue`` ops go first (no op of a backward run
reads a value). A run is fused only when every edge between its nodes can be connected this way, its
``Backward`` ops come in the reverse order of their tapes (autograd's engine order), no value from
outside it is read by three or more of its tapes and none of its parameters got a gradient earlier in
the step (decided once per schedule); otherwise it runs node by node, so memory is what the simulator
says, or less. Fusion removes the per-node cost of an autograd call (0.1 ms on CPU). The per-step state
and the small autograd tools are in ``executor_state.py``.

Correctness of recomputation: the first computation in a step of a random node that the schedule
computes again records the CPU and CUDA RNG states, and every recomputation replays them (dropout masks
are identical); a recomputation of a node that mutates module buffers (BatchNorm running statistics)
restores them afterwards, so they are updated once per step. Non-tensor intermediates (shape
arithmetic) are evaluated once per step. The forward's autocast settings are re-entered for the
recomputations in backward, which usually runs outside the caller's ``autocast`` block, and so are its
parameters, where something swapped them out after the forward (``torch.func.functional_call``).
"""
from __future__ import annotations

import contextlib
import operator
from collections import Counter
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import RewriteError
from .executor_state import (InjectGradient, StepState, Tape, autocast_as, autocast_state, compact_gradients,
                             forward_parameters_held, fresh_results, parameter_hooks_held, parameter_slots,
                             pytree_leaves, recomputed_state, replayed_rng, unique_parameters, unpack_saved)
from .fused_runs import plan_fused_runs
from .graph import CostGraph
from .measure import storage_key
from .model_state import held_generators, values_put_back
from .schedule import Backward, Forward, FreeValue, Op, Schedule

__all__ = ["RewriteError", "ScheduleExecutor"]


#: the words of autograd's refusal of a saved tensor written in place (``executor_state.unpack_saved``)
_INPLACE_WRITE = "modified by an inplace operation"


class ScheduleExecutor:
    """Executes a :class:`Schedule` over the fx graph a :class:`CostGraph` was profiled from.

    ``observer(phase, position, op)`` (optional) is called after every op, e.g. to record memory.
    """

    def __init__(self, graph_module: fx.GraphModule, graph: CostGraph, schedule: Schedule,
                 observer: Callable[[str, int, Op], None] | None = None, fuse: bool | None = None) -> None:
        """``fuse`` (default: on unless an ``observer`` wants to see every op) executes backward runs
        with one autograd call each (module docstring)."""
        self.gm = graph_module
        self.graph = graph
        self.schedule = schedule
        self.observer = observer
        self.fx_nodes = {n.name: n for n in graph_module.graph.nodes}
        missing = [node.name for node in graph if node.name not in self.fx_nodes]
        if missing:
            raise RewriteError(f"cost graph nodes {missing[:5]} are not in the traced module; profile the "
                               "same traced module that you execute")
        self.cost_index = {node.name: node.index for node in graph}
        self.fx_of = [self.fx_nodes[node.name] for node in graph]
        self.placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        self.output_node = next(n for n in graph_module.graph.nodes if n.op == "output")
        self.parameters = unique_parameters([p for p in graph_module.parameters() if p.requires_grad])
        self._parameter_slots = parameter_slots(graph_module)
        self._parameter_ids = {id(p): i for i, p in enumerate(self.parameters)}
        self._node_parameters = [self._parameters_of(n) for n in self.fx_of]
        self._state_tensors = [self._mutable_state(n) if graph.nodes[i].stateful else []
                               for i, n in enumerate(self.fx_of)]
        # RNG snapshots only for the random nodes the schedule computes more than once (each costs
        # ``graph.rng_state_bytes`` until the node's last computation; the simulator counts them the same way)
        computations = Counter(op.node for op in (*schedule.forward_ops, *schedule.backward_ops)
                               if isinstance(op, Forward))
        self._random = [node.random and computations[node.index] > 1 for node in graph]
        # What a tape saved is checked when the backward unpacks it (``unpack_saved``); the inputs and
        # outputs a recomputation reads (through a view too) are checked when the backward starts: the
        # caller may write them in place after the forward, and the recomputation would read them so.
        owner = list(range(len(graph.nodes)))
        for node in graph.nodes:
            if node.alias_of is not None:
                owner[node.index] = owner[node.alias_of]
        read_again = {a.name for v in schedule.recomputed_nodes() for a in self.fx_of[v].all_input_nodes}
        owners_read_again = {owner[self.cost_index[name]] for name in read_again if name in self.cost_index}
        self._outputs_read_again = {node.index for node in graph.nodes if owner[node.index] in owners_read_again}
        self._inputs_read_again = [p for p in self.placeholders if p.name in read_again]
        self._buffer_keys = {storage_key(b) for b in graph_module.buffers()}
        self._computations = computations
        self._modules: dict[str, nn.Module] = {}
        self._generators = tuple(g for _, g in held_generators(graph_module) if isinstance(g, torch.Generator))
        # getitem nodes with a constant integer index into another node's value: (producer, index)
        self._tuple_items = [(self.cost_index[n.args[0].name], n.args[1])
                             if n.op == "call_function" and n.target is operator.getitem and not n.kwargs
                             and isinstance(n.args[0], fx.Node) and n.args[0].name in self.cost_index
                             and type(n.args[1]) is int else None for n in self.fx_of]
        self._cost_inputs = [[self.cost_index[a.name] for a in n.all_input_nodes if a.name in self.cost_index]
                             for n in self.fx_of]
        self._fused_runs: dict[int, int] = {}          # first backward position of a fused run -> its end
        self._connections: dict[int, frozenset[int]] = {}  # taped forward position -> inputs read with edge
        if fuse if fuse is not None else observer is None:
            self._fused_runs, self._connections = plan_fused_runs(schedule, graph, self._cost_inputs,
                                                                  self._node_parameters)

    def parameters_changed(self) -> bool:
        """True when the traced module's trainable parameters are no longer the objects this executor
        was built with (replaced by assignment, frozen or unfrozen, or swapped by a wrapper)."""
        current = unique_parameters([p for p in self.gm.parameters() if p.requires_grad])
        return len(current) != len(self.parameters) or any(a is not b for a, b in zip(current, self.parameters))

    # ------------------------------------------------------------------ public entry points
    def run_forward(self, inputs: Sequence[Any]) -> tuple[StepState, Any]:
        """Run the forward ops on ``inputs`` (one per placeholder); returns the state and the output."""
        state = StepState(autocast=autocast_state(), generators=self._generators)
        for placeholder, value in zip(self.placeholders, inputs):
            state.static[placeholder.name] = value
        for position, op in enumerate(self.schedule.forward_ops):
            self._run(state, op, first_pass=True, position=position)
            if self.observer is not None:
                self.observer("forward", position, op)
        output = fx.node.map_arg(self.output_node.args[0], lambda a: self._lookup(state, a))
        for leaf in tree_flatten(self.output_node.args[0])[0]:
            count = sum(isinstance(t, torch.Tensor) for t in tree_flatten(self._lookup(state, leaf))[0]) \
                if isinstance(leaf, fx.Node) else int(isinstance(leaf, torch.Tensor))
            source = self.cost_index.get(leaf.name) if isinstance(leaf, fx.Node) else None
            state.output_sources += [(source, k) for k in range(count)]
            if source in self._outputs_read_again:
                state.read_again += [(t, t._version) for t in pytree_leaves(state.values.get(source))
                                     if isinstance(t, torch.Tensor)]
        state.read_again += [(t, t._version) for p in self._inputs_read_again
                             for t in pytree_leaves(state.static.get(p.name)) if isinstance(t, torch.Tensor)]
        return state, output

    @staticmethod
    def _refuse_written_values(state: StepState) -> None:
        """Autograd's refusal, for an input or output a recomputation reads that the caller wrote in
        place after the forward (``x.add_(1)`` after ``model(x)``): the recomputation would read the
        written values, silently. Then the step lets go of them (outputs are freed as planned)."""
        for tensor, version in state.read_again:
            if tensor._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: a tensor of shape {tuple(tensor.shape)} (at version {tensor._version}; expected "
                    f"version {version}), which the optimized module's backward recomputes from, was written "
                    "in place after the forward. Write to a copy (x = x.clone()) or out of place.")
        state.read_again = []

    def run_backward(self, state: StepState, output_grads: Sequence[torch.Tensor | None], keep_graph: bool = False
                     ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Run the backward ops given the gradients of the flattened tensor outputs; returns the
        gradients of the placeholders and of ``self.parameters``. ``keep_graph`` (the caller's
        ``retain_graph=True``): the forward's values and tapes are left intact (those the schedule frees
        are only let go of, their recomputations are released as planned) and ``state`` is put back as
        the forward left it, so another backward can run; the step's peak is then the forward's values
        plus the backward's, as autograd's own when it retains a graph."""
        if keep_graph:
            state.kept_for_next_backward = state.retained()
        kept = state.kept_for_next_backward
        try:
            with forward_parameters_held(self._parameter_slots):  # the recomputations read the forward's
                return self._run_backward(state, output_grads)
        finally:
            if kept is not None:
                state.put_back(kept)

    def _run_backward(self, state: StepState, output_grads: Sequence[torch.Tensor | None]
                      ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        self._refuse_written_values(state)
        state.external_keys = {storage_key(g) for g in output_grads if g is not None}
        for (source, position), grad in zip(state.output_sources, output_grads):
            if source is not None and grad is not None:
                self._accumulate(state, source, position, grad)
        state.output_sources = []
        ops, start = self.schedule.backward_ops, len(self.schedule.forward_ops)
        position = 0
        while position < len(ops):
            end = self._fused_runs.get(start + position)
            if end is not None:
                self._run_fused(state, ops[position:end - start])
                position = end - start
                continue
            op = ops[position]
            self._run(state, op, first_pass=False, position=start + position)
            if self.observer is not None:
                self.observer("backward", position, op)
            position += 1
        input_grads = [state.grads.get(("input", p.name), {}).get(0) for p in self.placeholders]
        collected = state.grads.get("parameters", {})
        parameter_grads = [collected.get(i) for i in range(len(self.parameters))]
        state.values.clear()
        state.tapes.clear()
        state.grads.clear()
        return input_grads, parameter_grads

    # ------------------------------------------------------------------ ops
    def _run(self, state: StepState, op: Op, first_pass: bool, position: int) -> None:
        if isinstance(op, Forward):
            if first_pass:
                self._forward(state, op.node, op.tape, self._connections.get(position))
            else:  # a recomputation in backward: under the forward's autocast settings, not the caller's
                with autocast_as(state.autocast):
                    self._forward(state, op.node, op.tape, self._connections.get(position))
            if first_pass:
                self._evaluate_static_users(state, self.fx_of[op.node])
        elif isinstance(op, FreeValue):
            self._free(state, op.node)
        elif isinstance(op, Backward):
            self._backward(state, op.node)
        else:  # pragma: no cover - the simulator rejects these first
            raise RewriteError(f"unknown op {op!r}")

    def _last_computation(self, state: StepState, index: int) -> bool:
        """Counts a computation of random node ``index``; whether it is the schedule's last of it."""
        state.random_computations[index] += 1
        return state.random_computations[index] == self._computations[index]

    def _forward(self, state: StepState, index: int, tape: bool, connect: frozenset[int] | None = None) -> None:
        if tape and connect is None and self._tuple_items[index] is not None and self._taped_item(state, index):
            return
        node = self.fx_of[index]
        leaves: list[tuple[Any, int, torch.Tensor]] = []
        connected: list[torch.Tensor] = []
        inputs: dict[fx.Node, Any] = {}  # a value read twice is one tensor (``attention(x, x, x)`` tests ``is``)

        def input_of(a: fx.Node) -> Any:
            if a not in inputs:
                inputs[a] = self._input(state, a, leaves if tape else None, connect, connected)
            return inputs[a]
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), input_of)
        recompute = index in state.computed
        restore = recomputed_state(state, index, self._state_tensors[index], recompute, self._computations[index])
        saved: list[int | None] | None = [] if tape else None
        try:
            with (replayed_rng(state, index, recompute, (args, kwargs), last=self._last_computation(state, index))
                  if self._random[index] else contextlib.nullcontext()):
                out = self._call_in_grad_mode(node, args, kwargs, saved)
        except Exception as error:  # noqa: BLE001
            raise RewriteError(f"node {node.format_node()} failed: {type(error).__name__}: {error}") from error
        finally:
            values_put_back(restore)
        state.computed.add(index)
        state.values[index] = out
        if isinstance(out, torch.Tensor) and any(out is v for v in inputs.values()):
            state.passed_on.add(id(out))  # see _held_elsewhere
        if tape:
            compact_gradients(out)
            flat = pytree_leaves(out)
            positions = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if positions:
                roots = [flat[k] for k in positions]
                identity = not connected and all(any(t is leaf for _, _, leaf in leaves) for t in roots)
                state.tapes[index] = Tape(roots, positions, leaves, self._node_parameters[index],
                                           connected=connected, identity=identity)
            # The local graph holds its input leaves; release the storage of those its backward does not
            # read (saved tensors are separate aliases, see _call_in_grad_mode).
            outputs = {id(t) for t in flat}
            released = [leaf for _, _, leaf in leaves if id(leaf) not in outputs]
            if released:
                saved_keys = set(saved)
                for leaf in released:
                    if storage_key(leaf) not in saved_keys:
                        leaf.data = torch.empty(0, dtype=leaf.dtype, device=leaf.device)

    def _taped_item(self, state: StepState, index: int) -> bool:
        """Fast path of a taped ``value[k]`` on a tuple or list of tensors: the element as a detached leaf,
        with an identity tape (what the general path makes, without leaves for the other elements and
        without an autograd call in backward). False when the value is not such a container."""
        source, k = self._tuple_items[index]
        container = state.values.get(source)
        if type(container) not in (tuple, list) or not container \
                or not all(isinstance(t, torch.Tensor) for t in container):
            return False
        k = k % len(container)
        item = container[k]
        needs_grad = item.requires_grad or (self.graph.nodes[source].requires_grad
                                            and (item.is_floating_point() or item.is_complex()))
        leaf = item.detach().requires_grad_(True) if needs_grad else item.detach()
        state.computed.add(index)
        state.values[index] = leaf
        if needs_grad:
            state.tapes[index] = Tape([leaf], [0], [(source, k, leaf)], [], identity=True)
        return True

    @staticmethod
    def _held_elsewhere(state: StepState, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether one of ``tensors`` is the value of a live node (one a node handed on as its output: an
        ``nn.Identity``, which timm's RepVGG adds into in place), whose ``.data`` must stay when freed."""
        if not any(id(t) in state.passed_on for t in tensors):
            return False
        live = {id(t) for v in state.values.values() for t in pytree_leaves(v) if isinstance(t, torch.Tensor)}
        return any(id(t) in live for t in tensors)

    def _free(self, state: StepState, index: int) -> None:
        value = state.values.pop(index)
        tape = state.tapes.get(index)
        if tape is not None and tape.freed_shapes is None and not state.kept_value(index, value):
            flat = pytree_leaves(value)
            if all(any(t is f for f in flat) for t in tape.outputs) and not self._held_elsewhere(state, tape.outputs):
                tape.freed_shapes = [t.shape for t in tape.outputs]
                leaves = [leaf for _, _, leaf in tape.leaves]
                for t in tape.outputs:
                    base = t._base
                    # a view output keeps its base alive: release it too when it belongs to this node
                    # (created inside it, or one of its input leaves); never a parameter or buffer, never
                    # the value of a producer read through an autograd edge (it may still be live)
                    # (a connected input is a view_as alias: its own base is the producer's value)
                    if base is not None and (base.grad_fn is not None or any(base is leaf for leaf in leaves)) \
                            and not any(base is c or base is c._base for c in tape.connected):
                        base.data = torch.empty(0, dtype=base.dtype, device=base.device)
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    def _backward(self, state: StepState, index: int) -> None:
        tape = state.tapes.pop(index, None)
        grads = state.grads.pop(index, {})
        if tape is None:
            return
        pairs = [(t, grads[k]) for t, k in zip(tape.outputs, tape.positions) if k in grads]
        if not pairs or not (tape.leaves or tape.parameters):
            return
        if tape.identity:  # the outputs are input leaves (a getitem on a tuple): hand the gradients on
            for source, position, leaf in tape.leaves:
                incoming = [g for t, g in pairs if t is leaf]
                if incoming:
                    self._accumulate(state, source, position, incoming[0] if len(incoming) == 1 else sum(incoming))
            return
        if tape.freed_shapes is not None:
            for t, shape in zip(tape.outputs, tape.freed_shapes):
                t.data = torch.empty((), dtype=t.dtype, device=t.device).expand(shape)
        targets = [leaf for _, _, leaf in tape.leaves] + tape.parameters
        try:
            with parameter_hooks_held(tape.parameters):  # they run once, on the summed gradient
                results = torch.autograd.grad([t for t, _ in pairs], targets, [g for _, g in pairs], allow_unused=True,
                                              retain_graph=state.kept_tape(index, tape))
        except RuntimeError as error:
            if _INPLACE_WRITE in str(error):  # autograd's own refusal, as the original model raises it
                raise
            raise RewriteError(f"backward of node {self.fx_of[index].format_node()} failed: {error}") from error
        fresh = fresh_results(results, {storage_key(g) for _, g in pairs})
        for (source, position, _), grad, owned in zip(tape.leaves, results, fresh):
            if grad is not None:
                self._accumulate(state, source, position, grad, owned)
        for parameter, grad, owned in zip(tape.parameters, results[len(tape.leaves):], fresh[len(tape.leaves):]):
            if grad is not None:
                self._accumulate(state, "parameters", self._parameter_ids[id(parameter)], grad, owned)

    def _run_fused(self, state: StepState, ops: Sequence[Op]) -> None:
        """One backward run (Backward and FreeValue ops only) as a single autograd call."""
        for op in ops:
            if isinstance(op, FreeValue):
                self._free(state, op.node)
        roots: list[torch.Tensor] = []
        root_grads: list[torch.Tensor] = []
        leaves: list[tuple[Any, int, torch.Tensor]] = []
        parameters: list[nn.Parameter] = []
        retain = False
        for op in ops:
            if not isinstance(op, Backward):
                continue
            tape = state.tapes.pop(op.node, None)
            grads = state.grads.pop(op.node, {})
            if tape is None:
                continue
            retain = retain or state.kept_tape(op.node, tape)
            if tape.freed_shapes is not None:
                for t, shape in zip(tape.outputs, tape.freed_shapes):
                    t.data = torch.empty((), dtype=t.dtype, device=t.device).expand(shape)
            for t, k in zip(tape.outputs, tape.positions):
                if k in grads:
                    roots.append(t)
                    root_grads.append(grads[k])
            leaves += tape.leaves
            parameters += tape.parameters
        if not roots:
            return
        parameters = unique_parameters(parameters)
        targets = [leaf for _, _, leaf in leaves] + parameters
        incoming_keys = {storage_key(g) for g in root_grads}
        # Each incoming gradient enters through its own node, so that autograd drops it as soon as the
        # node it feeds has run (as the node-by-node execution does), instead of holding all of them
        # for the whole call as ``grad_outputs`` would.
        with torch.enable_grad():
            dummies = [InjectGradient.apply(t, [g]) for t, g in zip(roots, root_grads)]
        del roots, root_grads
        try:
            with parameter_hooks_held(parameters):
                results = torch.autograd.grad(dummies, targets, allow_unused=True, retain_graph=retain)
        except RuntimeError as error:
            if _INPLACE_WRITE in str(error):
                raise
            names = [self.fx_of[op.node].name for op in ops if isinstance(op, Backward)]
            raise RewriteError(f"backward of nodes {names[:5]}... failed: {error}") from error
        fresh = fresh_results(results, incoming_keys)
        for (source, position, _), grad, owned in zip(leaves, results, fresh):
            if grad is not None:
                self._accumulate(state, source, position, grad, owned)
        for parameter, grad, owned in zip(parameters, results[len(leaves):], fresh[len(leaves):]):
            if grad is not None:
                self._accumulate(state, "parameters", self._parameter_ids[id(parameter)], grad, owned)

    # ------------------------------------------------------------------ helpers
    def _accumulate(self, state: StepState, source: Any, position: int, grad: torch.Tensor,
                    owned: bool = False) -> None:
        """Add ``grad`` into a gradient buffer. A buffer that may alias another tensor (``owned`` False:
        autograd returned an incoming gradient as is) is written in place only once nothing else holds
        its storage (``_sole_holder``)."""
        buffers = state.grads.setdefault(source, {})
        previous = buffers.get(position)
        if previous is None:
            buffers[position] = grad
            if owned:
                state.owned_grads.add((source, position))
        elif (source, position) in state.owned_grads or self._sole_holder(state, source, position, previous):
            previous.add_(grad)
            state.owned_grads.add((source, position))
        else:
            buffers[position] = previous + grad
            state.owned_grads.add((source, position))

    @staticmethod
    def _sole_holder(state: StepState, source: Any, position: int, buffer: torch.Tensor) -> bool:
        """Whether the gradient buffer at ``(source, position)``, handed on by a pass-through backward,
        is no longer shared: no other buffer of the step has its storage and autograd did not hand it in
        (the model outputs' gradients). Then it is summed into in place, as autograd's own engine does
        (and as the simulator predicts)."""
        key = storage_key(buffer)
        if key is None or key in state.external_keys:
            return False
        return not any(storage_key(other) == key for s, buffers in state.grads.items()
                       for k, other in buffers.items() if (s, k) != (source, position))

    def _input(self, state: StepState, a: fx.Node, leaves: list | None,
               connect: frozenset[int] | None = None, connected: list | None = None) -> Any:
        value = self._lookup(state, a)
        if leaves is None or (a.name not in self.cost_index and a.op != "placeholder"):
            return value
        if connect is not None and self.cost_index.get(a.name) in connect:
            # same fused run: keep the autograd edge, through an alias so that pass-through ops never
            # return the producer's own tensor object (its .data may be emptied on FreeValue)
            if isinstance(value, torch.Tensor):
                if not value.requires_grad:
                    return value
                connected.append(value)
                with torch.enable_grad():  # Function.forward runs under no_grad
                    return value.view_as(value)
            flat, spec = (list(value), None) if type(value) is tuple else tree_flatten(value)
            aliased = []
            with torch.enable_grad():
                for item in flat:
                    if isinstance(item, torch.Tensor) and item.requires_grad:
                        connected.append(item)
                        aliased.append(item.view_as(item))
                    else:
                        aliased.append(item)
            return tuple(aliased) if spec is None else tree_unflatten(aliased, spec)
        source = self.cost_index.get(a.name, ("input", a.name))
        # values computed without tape do not require grad at run time: ask the cost graph instead
        node_needs_grad = a.name in self.cost_index and self.graph.nodes[self.cost_index[a.name]].requires_grad
        if isinstance(value, torch.Tensor):  # fast path for the common case
            flat, spec = [value], None
        else:
            flat, spec = tree_flatten(value)
        detached = []
        for position, item in enumerate(flat):
            if isinstance(item, torch.Tensor) and (item.requires_grad or (
                    node_needs_grad and (item.is_floating_point() or item.is_complex()))):
                leaf = item.detach().requires_grad_(True)
                leaves.append((source, position, leaf))
                detached.append(leaf)
            elif isinstance(item, torch.Tensor):
                detached.append(item.detach())
            else:
                detached.append(item)
        return detached[0] if spec is None else tree_unflatten(detached, spec)

    def _lookup(self, state: StepState, a: fx.Node) -> Any:
        if a.name in self.cost_index:
            index = self.cost_index[a.name]
            if index not in state.values:
                raise RewriteError(f"node {a.name!r} is read but its value is not live; the schedule was not "
                                   "checked by the simulator")
            return state.values[index]
        if a.name not in state.static:
            self._evaluate_static(state, a)
        return state.static[a.name]

    def _evaluate_static(self, state: StepState, a: fx.Node) -> None:
        if a.op == "get_attr":
            state.static[a.name] = self._get_attr(a)
            return
        if a.op == "placeholder":
            raise RewriteError(f"model input {a.name!r} was not given")
        args, kwargs = fx.node.map_arg((a.args, a.kwargs), lambda b: self._lookup(state, b))
        with torch.no_grad():
            state.static[a.name] = self._call(a, args, kwargs)

    def _evaluate_static_users(self, state: StepState, node: fx.Node) -> None:
        """Evaluate non-tensor users (shape arithmetic) as soon as their inputs exist, once per step."""
        for user in node.users:
            if user.name in self.cost_index or user.name in state.static or user.op == "output":
                continue
            if all(self._available(state, a) for a in user.all_input_nodes):
                self._evaluate_static(state, user)
                self._evaluate_static_users(state, user)

    def _available(self, state: StepState, a: fx.Node) -> bool:
        if a.name in self.cost_index:
            return self.cost_index[a.name] in state.values
        return a.name in state.static or a.op == "get_attr"

    def _call_in_grad_mode(self, node: fx.Node, args: Any, kwargs: Any, saved: list[int | None] | None) -> Any:
        """Call without grad (``saved`` None), or with grad, appending the storage key of every tensor
        autograd saves to ``saved`` and packing it as a separate alias, so that emptying ``.data`` of an
        input leaf or an output never touches what the backward reads."""
        def pack(tensor: torch.Tensor) -> tuple[torch.Tensor, int | None]:
            key = storage_key(tensor)
            saved.append(key)
            # checked when unpacked (``unpack_saved``), but for the buffers a recomputation puts back
            return tensor.detach(), None if key in self._buffer_keys else tensor._version
        previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(saved is not None)  # cheaper than a grad-mode context object (hot path)
        try:
            if saved is None:
                return self._call(node, args, kwargs)
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack_saved):
                return self._call(node, args, kwargs)
        finally:
            torch._C._set_grad_enabled(previous)

    def _call(self, node: fx.Node, args: Any, kwargs: Any) -> Any:
        if node.op == "call_module":
            module = self._modules.get(node.target)
            if module is None:
                module = self._modules[node.target] = self.gm.get_submodule(node.target)
            return module(*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            receiver, *rest = args
            return getattr(receiver, node.target)(*rest, **kwargs)
        raise RewriteError(f"cannot execute node {node.format_node()}")  # pragma: no cover

    def _parameters_of(self, node: fx.Node) -> list[nn.Parameter]:
        if node.op == "call_module":
            found = list(self.gm.get_submodule(node.target).parameters())
        else:
            found = []
            for a in node.all_input_nodes:
                if a.op == "get_attr":
                    value = self._get_attr(a)
                    if isinstance(value, nn.Parameter):
                        found.append(value)
        return unique_parameters([p for p in found if p.requires_grad])

    def _get_attr(self, a: fx.Node) -> Any:
        target: Any = self.gm
        for part in a.target.split("."):
            target = getattr(target, part)
        return target

    def _mutable_state(self, node: fx.Node) -> list[torch.Tensor]:
        """Buffers a stateful node may write (restored after each recomputation)."""
        if node.op == "call_module":
            return list(self.gm.get_submodule(node.target).buffers())
        attributes = [self._get_attr(a) for a in node.all_input_nodes if a.op == "get_attr"]
        return [t for t in attributes if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)]
