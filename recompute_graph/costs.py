"""Pricing a traced model: fx graph -> :class:`~recompute_graph.graph.CostGraph`.

Passes over the traced graph, with the model in its current train/eval mode:

1. **Memory pass** (store-all forward, grad enabled): every node runs under a
   :class:`~recompute_graph.measure.StorageTracker` that attributes each new storage to the node that
   allocated it, and under ``torch.autograd.graph.saved_tensors_hooks`` that record which storages
   autograd saves for its backward. From these: ``output_bytes`` / ``alias_of`` (views and in-place ops
   own no storage), saved inputs / output / internal buffers (deduplicated by storage; storages live
   before the step are not counted), ``backward_needs``, ``workspace_bytes`` (the larger of the
   tracker's and the allocator's, ``loss_pricing.allocator_windows``), and the flags ``inplace``,
   ``random`` (a random aten op ran) and ``stateful`` (a module buffer was written). Then the user's
   loss is priced on the store-all output (``loss_pricing.price_loss``).
2. **Compute pass** (``node_compute.ComputePass``): each node alone on detached copies of its inputs,
   forward and backward: FLOPs, and ``backward_workspace_bytes`` from its isolated backward run apart
   (FlopCounterMode decomposes some: silu, 5x), with no dispatch mode, in an allocator window.
3. With ``timing="measure"``, a third pass times each node on the model's device (``warmup`` runs, then
   ``repeats`` runs or three once they took 10 ms, median), without the profiler or the meters.

``timing="flops"`` (forced on the ``meta`` device) prices time from FLOPs and bytes moved with a
:class:`DeviceProfile` roofline: ``seconds = max(flops / flops_per_second, bytes / bytes_per_second)``.

Model state is restored afterwards: buffers (BatchNorm running statistics) and the CPU/CUDA RNG states
are exactly as before profiling.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from .device_profiles import DEVICE_PROFILES, DeviceProfile
from .functionalization import mutated_input_constraints
from .graph import CostGraph, CostNode
from .loss_pricing import (LossPrice, allocator_windows, incoming_gradient_layouts, node_window,
                           price_loss, rng_state_bytes)
from .losses import LossFunction, default_training_loss
from .measure import StorageTracker, storage_key, unique_storages
from .model_state import preserved_state
from .node_compute import ComputePass, NodeCompute, buffer_arguments, node_error, tensors_of
from .progress import progress_bar
from .trace import BoundInterpreter, TraceResult, trace

__all__ = ["DeviceProfile", "DEVICE_PROFILES", "profile_model", "profile_graph"]

#: aten ops that draw random numbers (a node running one of them is marked ``random``).
RANDOM_OPS = frozenset({
    "native_dropout", "dropout", "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like",
    "randint", "randint_like", "randperm", "normal", "normal_", "uniform_", "exponential_", "multinomial",
    "poisson", "rrelu_with_noise", "fused_dropout", "_fused_dropout",
})


def profile_model(model: nn.Module, example_inputs: Sequence[Any], *, timing: str = "measure",
                  repeats: int = 5, warmup: int = 1, device_profile: DeviceProfile | str = "cpu",
                  name: str | None = None, progress: bool = False) -> tuple[TraceResult, CostGraph]:
    """Trace ``model`` and price every node on ``example_inputs``; see :func:`profile_graph`."""
    traced = trace(model)
    graph = profile_graph(traced, example_inputs, timing=timing, repeats=repeats, warmup=warmup,
                          device_profile=device_profile, name=name or type(model).__name__, progress=progress)
    return traced, graph


def profile_graph(traced: TraceResult, example_inputs: Sequence[Any], *, timing: str = "measure",
                  repeats: int = 5, warmup: int = 1, device_profile: DeviceProfile | str = "cpu",
                  name: str | None = None, progress: bool = False, loss_fn: "LossFunction | None" = None,
                  output_of: "Callable[[Any], Any] | None" = None) -> CostGraph:
    """Price the nodes of a traced model on ``example_inputs`` (see the module docstring).

    ``timing``: ``"measure"`` (wall clock on the inputs' device, the default) or ``"flops"``
    (deterministic estimate from FLOPs with ``device_profile``). On ``meta`` tensors timing is always
    ``"flops"``. Raises :class:`ProfileError` naming the node when a node cannot run. ``progress``: a
    progress bar on stderr over the passes. ``loss_fn`` (default ``losses.default_training_loss``) is
    run on the store-all output, put in the model's own structure by ``output_of`` (default: the
    graph's output as it is): the transient bytes of its forward and backward become the graph's
    ``loss_bytes`` and the outputs it sends gradients to its ``loss_gradient_outputs``.
    """
    if timing not in ("measure", "flops"):
        raise ValueError(f"timing must be 'measure' or 'flops', got {timing!r}")
    if isinstance(device_profile, str):
        if device_profile not in DEVICE_PROFILES:
            raise ValueError(f"unknown device profile {device_profile!r}; known: {sorted(DEVICE_PROFILES)}")
        device_profile = DEVICE_PROFILES[device_profile]
    gm = traced.graph_module
    inputs = tuple(example_inputs)
    on_meta = any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten(inputs)[0])
    if on_meta:
        timing = "flops"
    passes = 3 if timing == "measure" else 2
    with progress_bar(len(gm.graph.nodes) * passes, f"profiling {name or 'model'}", progress) as bar:
        cuda = next((t.device for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.is_cuda), None)
        with allocator_windows(on_meta, cuda) as memory_windows:
            memory = _run_counted(_MemoryPass(gm), inputs, bar)
        memory.add_allocator_workspace(memory_windows())
        loss_fn, output_of = loss_fn or default_training_loss, output_of or (lambda value: value)
        loss = price_loss(gm, memory.env, loss_fn, output_of)
        layouts = incoming_gradient_layouts(gm, memory.env, loss_fn, output_of)
        grad_nodes = {node for node, record in memory.records.items() if record.requires_grad}
        with allocator_windows(on_meta, cuda) as compute_windows:
            compute = _run_counted(ComputePass(gm, "flops", repeats, warmup, grad_nodes, layouts,
                                                allocator_windows=not on_meta), inputs, bar)
        compute.add_allocator_workspace(compute_windows())
        if timing == "measure":  # timed apart: the profiler's per-op cost would distort the times
            timed = _run_counted(ComputePass(gm, timing, repeats, warmup, grad_nodes, layouts), inputs, bar)
            for node_name, record in compute.records.items():
                record.forward_seconds = timed.records[node_name].forward_seconds
                record.backward_seconds = timed.records[node_name].backward_seconds
    return _build_cost_graph(gm, traced, memory, compute, timing, device_profile, name or "model", inputs, loss)


# --------------------------------------------------------------------------------------------- helpers
def _run_counted(interpreter: Any, inputs: tuple, bar: Any) -> Any:
    """Run a profiling pass on ``inputs``, advancing ``bar`` after every node and leaving the module's
    buffers and the RNG states as they were; returns the pass."""
    run_node = interpreter.run_node

    def counted(n: fx.Node) -> Any:
        result = run_node(n)
        bar.update()
        return result
    interpreter.run_node = counted
    # the first pass (memory: not timed) watches for writes into parameters, which later passes undo too
    with preserved_state(interpreter.module, rng=True, watch_parameters=isinstance(interpreter, _MemoryPass)):
        interpreter.run(*inputs)
    return interpreter


@dataclass
class _NodeMemory:
    output_keys: set[int]
    output_bytes: int = 0
    alias_of: str | None = None
    grad_bytes: int = 0
    requires_grad: bool = False
    saved_input_bytes: int = 0
    saved_output_bytes: int = 0
    saved_buffer_bytes: int = 0
    backward_needs: tuple[str, ...] = ()
    workspace_bytes: int = 0
    inplace: bool = False
    random: bool = False
    stateful: bool = False
    parameters: tuple[nn.Parameter, ...] = ()
    has_tensor_output: bool = False
    kept_bytes: int = 0  # storages created by the node still alive after it


class _MemoryPass(BoundInterpreter):
    """Store-all forward recording storages, saved tensors and side effects per node."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.tracker = StorageTracker()
        self.records: dict[str, _NodeMemory] = {}
        self.whole_step_saved: dict[int, int] = {}  # storage key -> bytes, all nodes together
        # storage key -> (bytes, serial) while a node runs, then bytes: a key is the storage's address, which a
        # later storage reuses once the first is freed, so the tracker's serial tells them apart
        self._saved_now: dict[int, Any] = {}

    def run(self, *args: Any) -> "_MemoryPass":
        with torch.enable_grad(), self.tracker, torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            super().run(*args)
        return self

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key is not None and key in self.tracker.owner_of:  # created during the step
            self._saved_now[key] = (tensor.untyped_storage().nbytes(), self.tracker.serial[key])
        return tensor

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "get_attr", "output"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        input_tensors = tensors_of((args, kwargs))
        versions = [t._version for t in input_tensors]
        module = self.module.get_submodule(n.target) if n.op == "call_module" else None
        buffers = list(module.buffers()) if module is not None else buffer_arguments(n, self.env)
        buffer_versions = [b._version for b in buffers]
        # aten.batch_norm and a QAT observer's fused kernel (in a module too) write statistics without
        # bumping versions: compare values (not a module's on meta: all would count as written)
        buffer_values = [b.clone() for b in buffers] if module is None or not any(b.is_meta for b in buffers) else []
        self._saved_now = {}
        self.tracker.ops_seen = set()
        self.tracker.owner = n.name
        live_before = self.tracker.live_bytes
        self.tracker.reset_peak()
        try:
            with node_window(n.name):
                result = getattr(self, n.op)(n.target, args, kwargs)
        except Exception as error:  # noqa: BLE001
            raise node_error(n, error) from error
        finally:
            self.tracker.owner = None
        # a storage freed inside the node with the backward that saved it holds nothing
        self._saved_now = {k: b for k, (b, serial) in self._saved_now.items() if self.tracker.serial.get(k) == serial}
        self.records[n.name] = self._record(n, result, input_tensors, versions, module, buffers,
                                            buffer_versions, live_before, buffer_values)
        self.whole_step_saved.update(self._saved_now)
        return result

    def add_allocator_workspace(self, windows: dict[str, tuple[int, int, int]]) -> None:
        """Raise ``workspace_bytes`` to the allocator's peak inside each node above the level before it
        and the storages it keeps: kernel temporaries no tensor holds."""
        for name, (start, peak, _) in windows.items():
            if name in self.records:
                record = self.records[name]
                record.workspace_bytes = max(record.workspace_bytes, peak - start - record.kept_bytes)

    def _record(self, n: fx.Node, result: Any, input_tensors: list[torch.Tensor], versions: list[int],
                module: nn.Module | None, buffers: list[torch.Tensor], buffer_versions: list[int],
                live_before: int, buffer_values: list[torch.Tensor]) -> _NodeMemory:
        owner_of = self.tracker.owner_of
        outputs = tensors_of(result)
        output_keys = {storage_key(t) for t in outputs} - {None}
        own_keys = {k for k in output_keys if owner_of.get(k) == n.name}
        record = _NodeMemory(output_keys=output_keys, has_tensor_output=bool(outputs))
        used_keys = {storage_key(t) for t in tensors_of(_used_outputs(n, result))}
        record.output_bytes = sum(t.untyped_storage().nbytes() for t in unique_storages(outputs)
                                  if storage_key(t) in own_keys & used_keys)
        foreign = [owner_of[k] for k in output_keys - own_keys if k in owner_of]
        record.alias_of = foreign[0] if foreign and not own_keys else None
        grad_outputs = [t for t in outputs if t.requires_grad]
        record.requires_grad = bool(grad_outputs)
        record.grad_bytes = sum(t.numel() * t.element_size() for t in grad_outputs)
        needs: set[str] = set()
        for key, nbytes in self._saved_now.items():
            owner = owner_of.get(key)
            if key in output_keys and owner == n.name and key not in used_keys:
                # an item of the node's tuple no consumer reads (BatchNorm's saved mean and inverse
                # std in an exported graph): held by the backward alone, like an internal buffer
                record.saved_buffer_bytes += nbytes
            elif key in output_keys:
                record.saved_output_bytes += nbytes
                needs.add(owner)
            elif owner == n.name:  # created here but not returned: an internal buffer
                record.saved_buffer_bytes += nbytes
            else:
                record.saved_input_bytes += nbytes
                needs.add(owner)
        record.backward_needs = tuple(sorted(needs))
        kept_new = sum(nbytes for key, nbytes in self.tracker._live.items() if owner_of.get(key) == n.name)
        record.workspace_bytes = max(0, self.tracker.peak_bytes - live_before - kept_new)
        record.kept_bytes = kept_new
        buffer_ids = {id(b) for b in buffers}
        record.inplace = any(t._version != v for t, v in zip(input_tensors, versions) if id(t) not in buffer_ids)
        record.random = bool(self.tracker.ops_seen & RANDOM_OPS)
        record.stateful = (any(b._version != v for b, v in zip(buffers, buffer_versions))
                           or any(_changed(b, before) for b, before in zip(buffers, buffer_values)))
        if module is not None:
            record.parameters = tuple(p for p in module.parameters() if p.requires_grad)
        else:
            attrs = [a for a in n.all_input_nodes if a.op == "get_attr"]
            record.parameters = tuple(p for a in attrs for p in [self.env[a]]
                                      if isinstance(p, nn.Parameter) and p.requires_grad)
        return record


def _changed(buffer: torch.Tensor, before: torch.Tensor) -> bool:
    """Whether ``buffer`` no longer equals its copy ``before``; on meta tensors (no values) a
    floating-point buffer counts as changed, which only costs a restore after recomputation."""
    if buffer.is_meta:
        return buffer.is_floating_point()
    return not torch.equal(buffer, before)


def _used_outputs(n: fx.Node, result: Any) -> Any:
    """The part of a node's result that some consumer reads: for a tuple/list result whose users all
    take fixed items (``out[0]``), only those items; unused items die at once and are not outputs."""
    if not isinstance(result, (tuple, list)) or not n.users:
        return result
    indices = set()
    for user in n.users:
        if user.op != "call_function" or user.target is not operator.getitem or not isinstance(user.args[1], int):
            return result
        if user.users:  # an unpacked item nobody reads does not count
            indices.add(user.args[1])
    return [result[i] for i in sorted(indices)]


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _build_cost_graph(gm: fx.GraphModule, traced: TraceResult, memory: _MemoryPass, compute: ComputePass,
                      timing: str, device_profile: DeviceProfile, name: str, inputs: tuple,
                      loss: LossPrice) -> CostGraph:
    compute_nodes = [n for n in gm.graph.nodes
                     if n.op not in ("placeholder", "get_attr", "output") and memory.records[n.name].has_tensor_output]
    index_of = {n.name: i for i, n in enumerate(compute_nodes)}
    opaque = set(traced.opaque_modules)

    # Parameter gradients: charged to the last node (in forward order) that uses the parameter.
    last_user: dict[int, tuple[int, int]] = {}
    for n in compute_nodes:
        for p in memory.records[n.name].parameters:
            last_user[id(p)] = (index_of[n.name], p.numel() * p.element_size())
    param_grad_bytes = [0] * len(compute_nodes)
    for index, nbytes in last_user.values():
        param_grad_bytes[index] += nbytes

    nodes, (computed_once, written_first) = [], mutated_input_constraints(gm)
    for i, n in enumerate(compute_nodes):
        mem = memory.records[n.name]
        comp = compute.records.get(n.name, NodeCompute())
        if timing == "measure":
            forward_cost, backward_cost = comp.forward_seconds or 0.0, comp.backward_seconds or 0.0
        else:
            forward_cost = device_profile.seconds(comp.forward_flops, comp.forward_bytes_moved)
            backward_cost = (device_profile.seconds(comp.backward_flops, 2 * comp.forward_bytes_moved)
                             if mem.requires_grad else 0.0)
        kind = {"call_module": "module", "call_function": "function", "call_method": "method"}[n.op]
        target = n.target if isinstance(n.target, str) else _qualified_name(n.target)
        predecessors = tuple(sorted({index_of[a] for a in _data_predecessors(n, index_of)
                                     | written_first.get(n.name, set()) if a in index_of}))
        alias = index_of[mem.alias_of] if mem.alias_of is not None else None
        if alias is not None and not any(alias in _alias_chain(nodes, p) for p in predecessors):
            # a view of a storage its predecessor does not alias (``broadcasttensors_of(a, b)[1]``: the op
            # aliases ``a`` alone here): that storage must be live when it runs, so it is read too
            predecessors += (alias,)
        nodes.append(CostNode(
            index=i, name=n.name, kind="opaque" if (n.op == "call_module" and n.target in opaque) else kind,
            target=target, predecessors=predecessors, output_bytes=mem.output_bytes, alias_of=alias,
            grad_bytes=mem.grad_bytes, saved_input_bytes=mem.saved_input_bytes,
            saved_output_bytes=mem.saved_output_bytes, saved_buffer_bytes=mem.saved_buffer_bytes,
            backward_needs=tuple(sorted(index_of[o] for o in mem.backward_needs)),
            workspace_bytes=mem.workspace_bytes, backward_workspace_bytes=comp.backward_workspace_bytes,
            backward_aliases_grad=comp.backward_aliases_grad, param_grad_bytes=param_grad_bytes[i],
            forward_cost=forward_cost, backward_cost=backward_cost,
            forward_flops=comp.forward_flops, backward_flops=comp.backward_flops,
            requires_grad=mem.requires_grad, inplace=mem.inplace, random=mem.random, stateful=mem.stateful,
            opaque=n.op == "call_module" and n.target in opaque, reads_mutated_input=n.name in computed_once))
    parameters = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in gm.parameters()}
    buffers = {b.untyped_storage()._cdata: b.untyped_storage().nbytes() for b in gm.buffers()}
    input_storages = {storage_key(t): t.untyped_storage().nbytes() for t in tensors_of(inputs)}
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = sorted({index_of[a.name] for a in output_node.all_input_nodes if a.name in index_of})
    source = "flop-estimate" if timing == "flops" else "measured"
    return CostGraph(
        name=name, nodes=tuple(nodes), cost_unit="seconds",
        cost_source=f"{source} ({device_profile.name})" if timing == "flops" else source,
        input_bytes=sum(input_storages.values()), parameter_bytes=sum(parameters.values()),
        buffer_bytes=sum(buffers.values()), implicit_backward=True, source="traced", output_indices=tuple(outputs),
        loss_bytes=loss.transient_bytes, rng_state_bytes=rng_state_bytes(inputs),
        loss_gradient_outputs=tuple(sorted(index_of[o] for o in loss.gradient_outputs if o in index_of)),
    )


def _alias_chain(nodes: list[CostNode], index: int) -> list[int]:
    chain = [index]
    while nodes[chain[-1]].alias_of is not None:
        chain.append(nodes[chain[-1]].alias_of)
    return chain


def _data_predecessors(n: fx.Node, tensor_nodes: dict[str, int]) -> set[str]:
    """Tensor-producing nodes that must have run before ``n``: those whose values it reads, and those
    whose *shape* it reads (``class_token.expand(x.shape[0], -1, -1)``).

    Non-tensor intermediates (shape arithmetic) are looked through to the tensors they were read from.
    A shape read is an edge like any other, so no solver can schedule ``n`` before the tensor it sizes
    itself by (the executor evaluates such values once per step, but only after their source exists).
    """
    found: set[str] = set()
    stack = list(n.all_input_nodes)
    seen: set[str] = set()
    while stack:
        a = stack.pop()
        if a.name in seen:
            continue
        seen.add(a.name)
        if a.name in tensor_nodes:
            found.add(a.name)
        else:
            stack.extend(a.all_input_nodes)
    return found


def _qualified_name(target: Any) -> str:
    """``torch.cat`` rather than ``torch._VariableFunctionsClass.cat``; ``module.qualname`` otherwise."""
    name = getattr(target, "__name__", None)
    if name is not None and getattr(torch, name, None) is target:
        return f"torch.{name}"
    module = getattr(target, "__module__", None) or ""
    qualname = getattr(target, "__qualname__", None) or name or repr(target)
    return f"{module}.{qualname}" if module else qualname
