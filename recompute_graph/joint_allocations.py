"""The allocator's side of pricing a joint graph: what the liveness of its values does not show.

* :func:`kernel_workspace_bytes`: the temporaries each node's kernels allocate beyond their outputs,
  by the allocator, from one run of the joint graph on real tensors shaped like its inputs;
* :func:`node_seconds`: each node's run time, on the same real tensors (the kernels this device runs,
  where a FLOP roofline misjudges them: a CPU's training-mode BatchNorm costs twice its roofline, its
  convolutions 0.4 of it, a view nothing), and of a training BatchNorm's normalization from its batch
  statistics, what recomputing it costs (``batch_norm_recompute``);
* :func:`outputs_loss_bytes`: the transient of the training loop's loss on the model's outputs.

All go into ``joint_costs.joint_cost_graph`` (``workspace``, ``node_seconds`` and ``loss_bytes``).
Units: bytes, seconds.
"""
from __future__ import annotations

import contextlib
import contextvars
import statistics
import time
from typing import Any, Iterator, Sequence

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map

from .batch_norm_recompute import RECOMPUTE_SECONDS_SUFFIX, normalize_from_statistics, training_batch_norm
from .joint_costs import _is_buffer_update
from .meta_flops import node_signature
from .joint_units import JointUnits, is_tangent
from .joint_storage import value_bytes as _value_bytes
from .joint_partition import _is_tensor

__all__ = ["kernel_workspace_bytes", "node_seconds", "outputs_loss_bytes", "own_loss_expected"]

_own_loss_expected: contextvars.ContextVar["bool | None"] = contextvars.ContextVar("own_loss_expected", default=None)


@contextlib.contextmanager
def own_loss_expected(returns_own_loss: "bool | None") -> Iterator[None]:
    """While the block runs, :func:`outputs_loss_bytes` takes it as known whether the model returns its
    own loss (``losses.own_loss`` on its structured output, which the joint graph's flat outputs do not
    carry): ``optimize()``'s compiled module runs the model's own forward first and says so. None: the
    graph alone decides (``_returns_own_loss``), as under a user's ``torch.compile`` with ``rg.backend``."""
    token = _own_loss_expected.set(returns_own_loss)
    try:
        yield
    finally:
        _own_loss_expected.reset(token)


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
                  stacklevel=2)
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
    shape = [int(d) for d in value.shape]
    stride = [int(d) for d in value.stride()]
    real = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
    if real.is_floating_point() or real.is_complex():
        real.normal_()
    else:
        real.zero_()
    return real


def outputs_loss_bytes(joint: fx.GraphModule, units: JointUnits, loss_fn: Any) -> int | None:
    """Transient bytes of ``loss_fn`` on the model's outputs (the joint graph's forward outputs that are
    not buffer updates, as one tensor or a tuple), forward and backward, above the output gradients it
    leaves, by the allocator on real tensors shaped like them (on meta, by the liveness of the storages
    it makes: ``measure.StorageTracker``): what the step adds when the gradients arrive; 0 when the
    model returns its own loss (:func:`_returns_own_loss`). None when the loss cannot run on them."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from .loss_pricing import allocator_windows, node_window
    from .measure import StorageTracker
    graph = joint.graph
    buffers = {p for p, g in zip([n for n in graph.nodes if n.op == "placeholder" and not is_tangent(n)],
                                 units.gradient_outputs(graph)) if g is None}
    outputs = [n for n in units.forward_outputs(graph) if not _is_buffer_update(n, buffers) and _is_tensor(n)]
    if not outputs:
        return None
    from .losses import default_training_loss
    known = _own_loss_expected.get()
    if loss_fn is default_training_loss and (known if known is not None else _returns_own_loss(graph, outputs)):
        # a model that returns its own loss (``transformers`` given labels): training backpropagates it,
        # and its computation is in the graph; the default loss on the flat outputs would price another
        # loss (Llama: 29 KB on a 245 KB step, 10 % over), as ``planner.loss_allowance_bytes`` rules too
        return 0
    with unset_fake_temporarily():
        real = [_materialize(n.meta["val"]) for n in outputs]
        leaves = [t.requires_grad_(True) if t.is_floating_point() else t for t in real]
        cuda = next((t.device for t in real if t.is_cuda), None)

        def loss_and_gradients() -> tuple:
            with torch.enable_grad():
                loss = loss_fn(leaves[0] if len(leaves) == 1 else tuple(leaves))
                return torch.autograd.grad(loss, [t for t in leaves if t.requires_grad], allow_unused=True)
        try:
            if any(t.is_meta for t in real) or (cuda is None and _cpu_allocator_blind()):
                # nothing is allocated, or the allocator cannot be read: the storages' own liveness
                with StorageTracker() as tracker:
                    grads = loss_and_gradients()
                start, peak = 0, tracker.peak_bytes
            else:
                with allocator_windows(False, cuda) as windows:
                    with node_window("loss"):
                        grads = loss_and_gradients()
                start, peak, _ = windows().get("loss", (0, 0, 0))
        except Exception:  # noqa: BLE001 - a loss that does not take these outputs: not priced
            return None
        kept = sum(g.untyped_storage().nbytes() for g in grads if g is not None)
        return max(0, peak - start - kept)


#: The classification losses whose integer targets mark the model's own loss (``transformers`` given
#: ``labels``: cross-entropy is ``_log_softmax`` and ``nll_loss_forward`` in the joint graph)
LABELLED_LOSS_TARGETS = ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")


def _returns_own_loss(graph: fx.Graph, outputs: Sequence[fx.Node]) -> bool:
    """Whether the training loop's loss is the model's own loss among ``outputs``, which the graph's flat
    outputs cannot say by their structure (``losses.own_loss`` reads a ``ModelOutput``'s ``loss``):
    only for the default loss, and only for a floating-point scalar output computed by a
    classification loss (:data:`LABELLED_LOSS_TARGETS`) on targets from an integer input of the model
    (the labels of a ``transformers`` model). A scalar beside the model's outputs is not enough: a model
    returning ``(logits, h.mean())`` trained on both had its loss priced at 0, 57,416 B measured against
    49,224 B predicted (tests/test_fuzz_compiled.py); nor is a scalar computed from an integer input
    (a mixture of experts' balance loss, from token ids through the router). Used where the model's own
    forward has not said so (:func:`own_loss_expected`): CLIP's loss, on targets it makes itself, is not
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
                return True
    return False


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen
