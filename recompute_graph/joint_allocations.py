"""The allocator's side of pricing a joint graph: what the liveness of its values does not show.

* :func:`kernel_workspace_bytes`: the temporaries each node's kernels allocate beyond their outputs,
  by the allocator, from one run of the joint graph on real tensors shaped like its inputs;
* :func:`node_seconds`: each node's run time, on the same real tensors (the kernels this device runs,
  where a FLOP roofline misjudges them: a CPU's training-mode BatchNorm costs twice its roofline, its
  convolutions 0.4 of it, a view nothing), and of a training BatchNorm's normalization from its batch
  statistics, what recomputing it costs (``batch_norm_recompute``);
* :func:`outputs_loss_bytes`: the transient of the training loop's loss on the model's outputs, run as
  the loop runs it (the outputs in the structure the model returns, let go of once the loss is made),
  and the zero gradients of the outputs it does not reach.

All go into ``joint_costs.joint_cost_graph`` (``workspace``, ``node_seconds``, ``loss_bytes`` and
``loss_unreached_gradient_bytes``).
Units: bytes, seconds.
"""
from __future__ import annotations

import contextlib
import contextvars
import statistics
import time
from typing import Any, Iterator, NamedTuple, Sequence

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map

from .batch_norm_recompute import RECOMPUTE_SECONDS_SUFFIX, normalize_from_statistics, training_batch_norm
from .errors import user_stacklevel
from .joint_costs import buffer_updates
from .meta_flops import node_signature
from .joint_units import JointUnits, is_tangent
from .joint_storage import storage_of, value_bytes as _value_bytes
from .joint_partition import _is_tensor
from .output_structure import OutputStructure, filled_tensor, structure_builder

__all__ = ["kernel_workspace_bytes", "node_seconds", "outputs_loss_bytes", "own_output_known"]

_own_output: contextvars.ContextVar["OutputStructure | None"] = contextvars.ContextVar("own_output", default=None)


@contextlib.contextmanager
def own_output_known(structure: "OutputStructure | None") -> Iterator[None]:
    """While the block runs, :func:`outputs_loss_bytes` knows the output of the model's own forward
    (``output_structure.OutputStructure``, which the joint graph's flat outputs do not carry): whether it
    returns its own loss (``losses.own_loss``), and its structure, on which the loss is priced.
    ``optimize()``'s compiled module runs the model's own forward first and says so. None: the graph
    alone decides (``_own_loss_output``) and the loss runs on the flat outputs, as under a user's
    ``torch.compile`` with ``rg.backend``."""
    token = _own_output.set(structure)
    try:
        yield
    finally:
        _own_output.reset(token)


def kernel_workspace_bytes(joint: fx.GraphModule, joint_inputs: Sequence[Any]) -> dict[str, int]:
    """Bytes each node of ``joint`` allocates beyond its outputs while it runs (kernel temporaries: the
    mkldnn buffers of a CPU convolution's backward, a reduction's scratch), by the allocator
    (``loss_pricing.allocator_windows``: ``torch.profiler`` memory events on CPU, the caching
    allocator's statistics on CUDA), from one run of the joint graph on real tensors shaped like
    ``joint_inputs`` (random floats, zero integers), after an unmeasured one on CUDA. Empty when they
    cannot be made (meta, symbolic shapes) or the run fails: the liveness model alone is used then."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():  # a partitioner runs under AOTAutograd's fake mode
        return _kernel_workspace_bytes(joint, joint_inputs)


def _cpu_allocator_blind() -> bool:
    """A ``torch.profiler`` session is recording already (``loss_pricing.profiler_recording``): the CPU
    allocator's events cannot be read. Warns."""
    import warnings

    from .errors import ProfilerActiveWarning
    from .loss_pricing import profiler_recording
    if not profiler_recording():
        return False
    warnings.warn("a torch.profiler session is recording while rg.backend prices a graph on the CPU: "
                  "reading the allocator would end it, so the kernels' temporaries are left out of the plan "
                  "and the loss is priced by the storages it makes. Run the first step (which compiles and "
                  "plans) outside the profiler for prices by the allocator.", ProfilerActiveWarning,
                  stacklevel=user_stacklevel())
    return True


def _kernel_workspace_bytes(joint: fx.GraphModule, joint_inputs: Sequence[Any]) -> dict[str, int]:
    from .loss_pricing import allocator_windows, node_window
    made = _real_inputs(joint_inputs)
    if made is None:
        return {}
    real, cuda = made
    if cuda is None and _cpu_allocator_blind():
        return {}

    class _Windowed(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            with node_window(n.name):
                return super().run_node(n)
    try:
        if cuda is not None:
            # the first run on a device makes buffers that then stay for the process (cuBLAS's workspace
            # per handle and stream, cuDNN's handle), in the caching allocator: charged to the first node
            # that happened to make them, as workspace no training step allocates again
            with torch.no_grad():
                fx.Interpreter(joint).run(*real)
        with torch.no_grad(), allocator_windows(False, cuda) as windows:
            _Windowed(joint).run(*real)
    except Exception:  # noqa: BLE001 - data-dependent ops on random values: no measurement
        return {}
    nodes = {n.name: n for n in joint.graph.nodes}
    workspace = {}
    for name, (start, peak, _end) in windows().items():
        if name in nodes:
            workspace[name] = max(0, peak - start - _value_bytes(nodes[name]))
    return workspace


#: a timed run stops repeating once the runs so far took this long (seconds): planning stays quick
TIMING_SECONDS = 1.0


def node_seconds(joint: fx.GraphModule, joint_inputs: Sequence[Any], runs: int = 3,
                 warm_up: bool = True) -> dict[str, float]:
    """Seconds each ``call_function`` node of ``joint`` takes, the least of up to ``runs`` runs of the
    joint graph on real tensors shaped like ``joint_inputs`` (after one untimed run that warms the
    kernels and the allocator, unless ``warm_up`` is False because a run just did, the workspace's;
    no more runs once :data:`TIMING_SECONDS` have gone by), each node timed
    alone (``torch.cuda.synchronize`` on either side on CUDA); nodes doing the same work (a deep
    model's repeated layers) get the median of their times. A training BatchNorm's normalization from
    its statistics is timed beside it, under its name with ``RECOMPUTE_SECONDS_SUFFIX``. Empty when the
    tensors cannot be made
    (meta, symbolic shapes) or the run fails: FLOP estimates price the graph then."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        return _node_seconds(joint, joint_inputs, runs, warm_up)


def _node_seconds(joint: fx.GraphModule, joint_inputs: Sequence[Any], runs: int, warm_up: bool
                  ) -> dict[str, float]:
    made = _real_inputs(joint_inputs)
    if made is None:
        return {}
    real, cuda = made
    sync = (lambda: torch.cuda.synchronize(cuda)) if cuda is not None else (lambda: None)
    seconds: dict[str, float] = {}

    class _Timed(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n.op != "call_function":
                return super().run_node(n)
            sync()
            start = time.perf_counter()
            result = super().run_node(n)
            sync()
            took = time.perf_counter() - start
            seconds[n.name] = min(took, seconds.get(n.name, took))
            if training_batch_norm(n) and result[1].dtype == result[0].dtype:  # its recomputation
                data, weight, bias = (self.env[a] if isinstance(a, fx.Node) else a for a in n.args[:3])
                start = time.perf_counter()
                normalize_from_statistics(data, weight, bias, result[1], result[2])
                sync()
                took = time.perf_counter() - start
                key = n.name + RECOMPUTE_SECONDS_SUFFIX
                seconds[key] = min(took, seconds.get(key, took))
            return result
    began = time.perf_counter()
    try:
        with torch.no_grad():
            if warm_up:
                fx.Interpreter(joint).run(*real)
            for _ in range(max(1, runs)):
                _Timed(joint).run(*real)
                if time.perf_counter() - began > TIMING_SECONDS:
                    break
    except Exception:  # noqa: BLE001 - data-dependent ops on random values: no measurement
        return {}
    return _alike_as_one(joint, seconds)


def _alike_as_one(joint: fx.GraphModule, seconds: dict[str, float]) -> dict[str, float]:
    """Each timed node's seconds replaced by the median of the nodes doing the same work (one
    ``meta_flops.node_signature``: the repeated layers of a deep model), so that one slow spell of the
    machine does not make one layer look dearer to recompute than its twins. Nodes without fake values
    for their inputs keep their own time."""
    groups: dict[Any, list[str]] = {}
    for node in joint.graph.nodes:
        if node.name in seconds and all(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):
            key = node_signature(node)
            if key is not None:
                groups.setdefault(key, []).append(node.name)
    alike = dict(seconds)
    for names in groups.values():
        recomputations = [key for key in (name + RECOMPUTE_SECONDS_SUFFIX for name in names) if key in seconds]
        for keys in (names, recomputations):
            if len(keys) > 1:
                middle = statistics.median(seconds[key] for key in keys)
                alike.update((key, middle) for key in keys)
    return alike


def _real_inputs(joint_inputs: Sequence[Any]) -> "tuple[list[Any], torch.device | None] | None":
    """Real tensors shaped like ``joint_inputs`` (AOTAutograd passes [primals, tangents]) and the CUDA
    device among them, or None when they cannot be made (symbolic shapes) or are on meta."""
    try:
        real = tree_map(_materialize, list(joint_inputs))
    except (TypeError, RuntimeError, ValueError):
        return None
    tensors = [t for t in tree_flatten(real)[0] if isinstance(t, torch.Tensor)]
    if not tensors or any(t.is_meta for t in tensors):
        return None
    return real, next((t.device for t in tensors if t.is_cuda), None)


def _materialize(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return filled_tensor([int(d) for d in value.shape], [int(d) for d in value.stride()], value.dtype, value.device)


class _FreshOutput(torch.autograd.Function):
    """A model output made anew, shaped like ``value`` (``_materialize``), whose gradient is read at its
    gradient edge: nothing outside the loss's graph holds it once the loss has let go of it (a leaf's
    ``AccumulateGrad`` node would keep it alive)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: Any) -> torch.Tensor:  # noqa: ARG004
        return _materialize(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # noqa: ARG004 - never run: read at the edge
        return None, None


def _fresh_output(value: Any, differentiable: bool = True) -> torch.Tensor:
    """A real tensor shaped like the fake ``value``, requiring grad (through :class:`_FreshOutput`) when
    ``differentiable`` and floating-point."""
    if not differentiable or not _needs_gradient(value):
        return _materialize(value)
    anchor = torch.zeros((), dtype=value.dtype, device=value.device, requires_grad=True)
    with torch.enable_grad():  # the backend plans under no_grad
        return _FreshOutput.apply(anchor, value)


def outputs_loss_bytes(joint: fx.GraphModule, units: JointUnits, loss_fn: Any) -> "LossOnOutputs | None":
    """Transient bytes of ``loss_fn`` on the model's outputs (the joint graph's forward outputs that are
    not buffer updates: in the structure the model's own forward returned, ``own_output_known``, where it
    matches them, else as one tensor or a tuple), forward and backward, above the output gradients it
    leaves, by the allocator on real tensors shaped like them, each let go of once the loss is made
    unless the model's backward reads it (on meta, by the liveness of the storages it makes:
    ``measure.StorageTracker``): what the step adds when the gradients arrive; 0 when the
    model returns its own loss (:func:`_own_loss_output`). With it, the zero gradients of the outputs
    the loss does not reach (:class:`LossOnOutputs`). None when the loss cannot run on them."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.autograd.graph import get_gradient_edge

    from .loss_pricing import allocator_windows, node_window
    from .measure import StorageTracker
    graph = joint.graph
    primals = [n for n in graph.nodes if n.op == "placeholder" and not is_tangent(n)]
    buffers = {p for p, g in zip(primals, units.gradient_outputs(graph)) if g is None}
    updates = buffer_updates(graph, units.forward_outputs(graph), buffers)
    outputs = [n for n in units.forward_outputs(graph) if n not in updates and _is_tensor(n)]
    if not outputs:
        return None
    from .losses import default_training_loss
    structure = _own_output.get()
    own = structure.returns_own_loss if structure is not None else _own_loss_output(graph, outputs) is not None
    if loss_fn is default_training_loss and own:
        # a model that returns its own loss (``transformers`` given labels): training backpropagates it,
        # and its computation is in the graph; the default loss on the flat outputs would price another
        # loss (Llama: 29 KB on a 245 KB step, 10 % over), as ``planner.loss_allowance_bytes`` rules too
        loss_output = _own_loss_among(structure, graph, outputs)
        return LossOnOutputs(0, 0, tuple(n.name for n in outputs if n is not loss_output)
                             if loss_output is not None else ())
    # an input returned (an autoencoder's ``(reconstruction, x)``) is the caller's: held through the
    # step, outside what the step allocates, and without a gradient unless the input takes one
    input_storages = {key for p in primals for key, _ in storage_of(p)}
    callers = [any(key in input_storages for key, _ in storage_of(n)) for n in outputs]
    trainable = set(primals) - buffers
    differentiable = [bool(trainable & (_ancestors(n) | {n})) for n in outputs]
    # an output the model's backward reads (a last ReLU's, whose backward reads it) outlives the loss
    backward = {b for nodes in units.backward_of for b in nodes}
    read_keys = {key for b in backward for a in b.all_input_nodes if a not in backward for key, _ in storage_of(a)}
    saved = [any(key in read_keys for key, _ in storage_of(n)) for n in outputs]
    with unset_fake_temporarily():
        values = [n.meta["val"] for n in outputs]
        on_meta, cuda = any(v.is_meta for v in values), next((v.device for v in values if v.is_cuda), None)
        caller_held = {i: _fresh_output(v, differentiable[i]) for i, v in enumerate(values) if callers[i]}
        structured = structure_builder(structure, values)  # the output as the loss takes it

        def made() -> list[torch.Tensor]:
            return [caller_held[i] if i in caller_held else _fresh_output(v, differentiable[i])
                    for i, v in enumerate(values)]

        def loss_and_gradients(held: list[torch.Tensor]) -> tuple:
            # the loop holds the outputs only through the loss's graph once the loss is made
            # (``loss_fn(model(x)).backward()``), as the simulator's backward does: a cross-entropy on
            # shifted logits copies them and lets them go (GPT-2 small's step, priced holding them, was
            # predicted 57.7 MiB beside 48 MiB measured; scripts/demo.py)
            edges = [get_gradient_edge(t) for t in held if t.requires_grad]
            backward_reads = [t for t, read in zip(held, saved) if read]  # to the window's end
            with node_window("loss"), torch.enable_grad():
                loss = loss_fn(structured(held))
                held.clear()
                gradients = torch.autograd.grad(loss, edges, allow_unused=True)
                del backward_reads  # held to here: the model's backward lets go of them later
            return gradients
        try:
            if on_meta or (cuda is None and _cpu_allocator_blind()):
                # nothing is allocated, or the allocator cannot be read: the storages' own liveness
                held = made()  # the storages made before are not counted
                with StorageTracker() as tracker:
                    grads = loss_and_gradients(held)
                start, peak = 0, tracker.peak_bytes
            else:
                with allocator_windows(False, cuda) as windows:  # made inside, seen to be freed
                    grads = loss_and_gradients(made())
                start, peak, _ = windows().get("loss", (0, 0, 0))
        except Exception as error:  # noqa: BLE001 - a loss that does not take these outputs: not priced
            if loss_fn is not default_training_loss:
                _warn_not_priced(error, structure is not None and structure.matches(values))
            return None
        kept = sum(g.untyped_storage().nbytes() for g in grads if g is not None)
        reached = iter(g is not None for g in grads)  # in the order of the edges: the differentiable outputs
        unreached = [n for n, v, d in zip(outputs, values, differentiable)
                     if d and _needs_gradient(v) and not next(reached)]
        return LossOnOutputs(max(0, peak - start - kept),
                             sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in unreached
                                 if n in units.unit_of),
                             tuple(n.name for n in unreached))


def _warn_not_priced(error: Exception, structured: bool) -> None:
    import warnings

    from .errors import LossNotPricedWarning
    taken = ("the output as the model's own forward returned it" if structured else
             "the compiled graph's flat outputs (one tensor, or a tuple in the order the model returns them: "
             "under rg.backend, or where the model's output could not be rebuilt)")
    warnings.warn(f"loss_fn could not run on {taken} ({type(error).__name__}: {error}); bytes are set aside for "
                  "it by a guess, the outputs' size, not by its measured transient. Give a loss_fn that takes "
                  f"{'that output' if structured else 'those outputs'}, or check the step with rg.verify.",
                  LossNotPricedWarning, stacklevel=user_stacklevel())


class LossOnOutputs(NamedTuple):
    """:func:`outputs_loss_bytes`' answer: the loss's transient bytes above the gradients it hands back
    (``CostGraph.loss_bytes``), and the bytes of the zero gradients AOTAutograd makes, when the backward
    starts, for the differentiable outputs the loss does not reach (``CostGraph.loss_unreached_gradient_bytes``:
    a dictionary of logits and hidden values trained on the logits alone was predicted 1.17 of the
    allocator with them counted while the loss ran)."""

    transient_bytes: int
    unreached_gradient_bytes: int
    #: the names of the forward outputs the loss sends no gradient to (``zero_gradients``: their
    #: gradients are folded away where their tangents are known)
    unreached_outputs: tuple[str, ...] = ()


def _needs_gradient(value: Any) -> bool:
    return value.is_floating_point() or value.is_complex()


#: The classification losses whose integer targets mark the model's own loss (``transformers`` given
#: ``labels``: cross-entropy is ``_log_softmax`` and ``nll_loss_forward`` in the joint graph)
LABELLED_LOSS_TARGETS = ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")


def _own_loss_among(structure: "OutputStructure | None", graph: fx.Graph, outputs: Sequence[fx.Node]
                    ) -> fx.Node | None:
    """The output among ``outputs`` that is the model's own loss: the one the output's structure puts in
    its ``loss`` entry (rebuilt from stand-ins, found by identity), else :func:`_own_loss_output`."""
    from .losses import own_loss
    from .output_structure import HELD
    assignment = structure.assignment([n.meta["val"] for n in outputs]) if structure is not None else None
    if structure is None or assignment is None:
        return _own_loss_output(graph, outputs)
    stand_ins = [torch.empty(0) for _ in outputs]
    held = {i: torch.empty(0) for i, leaf in enumerate(structure.leaves) if leaf.kind == HELD}
    loss = own_loss(structure.rebuild(stand_ins, assignment, held))
    return next((n for n, t in zip(outputs, stand_ins) if t is loss), None)


def _own_loss_output(graph: fx.Graph, outputs: Sequence[fx.Node]) -> fx.Node | None:
    """The output that is the model's own loss among ``outputs`` (None when none is), where the training
    loop's loss is that loss, which the graph's flat outputs cannot say by their structure
    (``losses.own_loss`` reads a ``ModelOutput``'s ``loss``): only for the default loss, and only for a
    floating-point scalar output computed by a
    classification loss (:data:`LABELLED_LOSS_TARGETS`) on targets from an integer input of the model
    (the labels of a ``transformers`` model). A scalar beside the model's outputs is not enough: a model
    returning ``(logits, h.mean())`` trained on both had its loss priced at 0, 57,416 B measured against
    49,224 B predicted (tests/test_fuzz_compiled.py); nor is a scalar computed from an integer input
    (a mixture of experts' balance loss, from token ids through the router). Used where the model's own
    forward has not said so (:func:`own_output_known`): CLIP's loss, on targets it makes itself, is not
    recognized here. A loss function of the user's is run on the flat outputs instead: on a model that
    returns its own loss it reads it (``out[0]``: nothing to price) or fails on the tuple (``out.loss``:
    the planner's guess)."""
    integer_inputs = {n for n in graph.nodes if n.op == "placeholder" and not is_tangent(n)
                      and isinstance(n.meta.get("val"), torch.Tensor)
                      and not (n.meta["val"].is_floating_point() or n.meta["val"].is_complex())}
    for output in outputs:
        value = output.meta["val"]
        if value.dim() != 0 or not value.is_floating_point():
            continue
        for node in _ancestors(output):
            target = node.args[1] if str(node.target) in LABELLED_LOSS_TARGETS and len(node.args) > 1 else None
            if isinstance(target, fx.Node) and integer_inputs & (_ancestors(target) | {target}):
                return output
    return None


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen
