"""Pricing what surrounds the nodes: the user's loss, allocator windows, RNG snapshots.

* :func:`price_loss` runs ``loss_fn`` once on the store-all output of the memory pass (detached leaves),
  forward and backward, and measures its *transient* bytes: the peak above what is left at the end
  (the output gradients, which the simulator counts at the start of backward), by the allocator
  (``torch.profiler`` memory events) and by the storage tracker, keeping the larger. It also records
  which outputs the loss sends a gradient to (a model's own ``loss``; an auxiliary scalar it ignores).
* :func:`allocator_windows` records the CPU allocator while the profiling passes run, and
  :func:`node_window` marks one node's run, so that each node's workspace is priced as the allocator
  saw it (nothing on ``meta``, where nothing is allocated).
* :func:`incoming_gradient_layouts` runs the step's backward once from the loss and records the shape and
  strides of the gradient each node's outputs receive, so that the isolated backward that prices a node
  is seeded with a gradient laid out as in training (a convolution's backward allocates more for a
  gradient that arrives through a ``transpose`` than for a contiguous one).
* :func:`rng_state_bytes`: one snapshot of the random generators, as the executor keeps it for each
  random node it recomputes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import ProfileError
from .losses import LossFunction
from .measure import AllocatorRecorder, StorageTracker, unique_storages

__all__ = ["WINDOW_PREFIX", "LossPrice", "price_loss", "allocator_windows", "profiler_recording", "node_window",
           "rng_state_bytes", "GradientLayout", "incoming_gradient_layouts", "gradient_seeds"]


#: ``torch.profiler.record_function`` names around each node's priced run: prefix + node name.
WINDOW_PREFIX = "recompute_graph.node::"


#: While a CUDA model is priced: the device, and each window's (start, peak, end) by the caching allocator.
_cuda_windows: dict[str, Any] = {}


def profiler_recording() -> bool:
    """A ``torch.profiler`` session is recording already: the CPU allocator's events cannot be read
    without starting a second session, which would end it (:func:`allocator_windows` records nothing
    then)."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


@contextlib.contextmanager
def allocator_windows(on_meta: bool, cuda_device: Any = None
                      ) -> Iterator[Callable[[], dict[str, tuple[int, int, int]]]]:
    """Record the allocator while the block runs; yields a function giving each node's ``(level at
    start, peak, level at end)`` once the block has ended. CPU: ``torch.profiler`` memory events.
    CUDA (``cuda_device``): the caching allocator's ``memory_allocated`` and ``max_memory_allocated``
    around each :func:`node_window` (its peak statistic is reset at each window). Meta: nothing; nor on
    CPU while a profiler is recording already (a user's ``torch.profiler`` session around a step that
    compiles): a second session would end the user's, whose profile would lose everything after it."""
    if on_meta or (cuda_device is None and profiler_recording()):
        yield dict
        return
    if cuda_device is not None:
        _cuda_windows.clear()
        _cuda_windows["device"] = cuda_device
        try:
            yield lambda: {k: v for k, v in _cuda_windows.items() if k != "device"}
        finally:
            _cuda_windows.pop("device", None)
        return
    with AllocatorRecorder() as recorder:
        yield lambda: recorder.window_peaks(WINDOW_PREFIX)


@contextlib.contextmanager
def node_window(name: str) -> Iterator[None]:
    """Mark one node's priced run for :func:`allocator_windows`."""
    device = _cuda_windows.get("device")
    if device is None:
        with torch.profiler.record_function(WINDOW_PREFIX + name):
            yield
        return
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
    finally:
        torch.cuda.synchronize(device)
        _cuda_windows[name] = (start, torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device))


@dataclass(frozen=True)
class LossPrice:
    transient_bytes: int
    gradient_outputs: tuple[str, ...]  # names of the output nodes the loss sends a gradient to


def price_loss(gm: fx.GraphModule, env: dict, loss_fn: LossFunction,
               output_of: Callable[[Any], Any]) -> LossPrice:
    """Run ``loss_fn`` on the store-all output (detached leaves), forward and backward, and measure its
    transient bytes (peak above what is left at the end: the output gradients, which the simulator
    counts) by the allocator and by the storage tracker, keeping the larger."""
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    value = fx.node.map_arg(output_node.args[0], lambda n: env[n])
    leaves, spec = tree_flatten(value)
    detached = [t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.requires_grad else t
                for t in leaves]
    structured = output_of(tree_unflatten(detached, spec))
    trainable = [t for t in detached if isinstance(t, torch.Tensor) and t.requires_grad]
    if not trainable:
        return LossPrice(0, ())
    grads: list[Any] = []

    def run() -> None:
        with torch.enable_grad():
            loss = loss_fn(structured)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ProfileError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                   + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
            grads.extend(torch.autograd.grad(loss, trainable, allow_unused=True))
    on_meta = any(t.is_meta for t in trainable)
    cuda = next((t.device for t in trainable if t.is_cuda), None)
    with allocator_windows(on_meta, cuda) as windows, StorageTracker() as tracker:
        with node_window("loss"):
            run()
    kept = sum(g.untyped_storage().nbytes() for g in unique_storages([g for g in grads if g is not None]))
    transient = max(0, tracker.peak_bytes - kept)
    if "loss" in windows():
        start, peak, end = windows()["loss"]
        transient = max(transient, peak - max(start, end))
    got_grad = {id(t) for t, g in zip(trainable, grads) if g is not None}
    names = []
    for node in output_node.all_input_nodes:
        node_leaves = [id(d) for d, o in zip(detached, leaves) if isinstance(o, torch.Tensor)
                       and any(o is t for t in [t for t in tree_flatten(env[node])[0] if isinstance(t, torch.Tensor)])]
        if any(i in got_grad for i in node_leaves):
            names.append(node.name)
    return LossPrice(transient, tuple(names))


#: ``(shape, stride)`` of a gradient.
GradientLayout = tuple[tuple[int, ...], tuple[int, ...]]


def incoming_gradient_layouts(gm: fx.GraphModule, env: dict, loss_fn: LossFunction,
                              output_of: Callable[[Any], Any]) -> dict[str, dict[int, GradientLayout]]:
    """Run ``loss_fn`` on the store-all output and the step's backward once (to the parameters and the
    inputs that require grad; nothing is accumulated in ``.grad``), recording for each node the layout
    of the gradient its tensor outputs receive: node name -> {index in the node's tensor outputs ->
    (shape, stride)}. Empty when nothing requires grad. On ``meta`` too: strides are computed there, and
    a plan made on meta must price views and copies as the real model does."""
    tensors_of = {n.name: [t for t in tree_flatten(env[n])[0] if isinstance(t, torch.Tensor)]
                  for n in gm.graph.nodes if n.op == "call_function" or n.op == "call_module"
                  or n.op == "call_method"}
    targets = [p for p in gm.parameters() if p.requires_grad]
    targets += [env[n] for n in gm.graph.nodes if n.op == "placeholder" and isinstance(env[n], torch.Tensor)
                and env[n].requires_grad and env[n].is_leaf]
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    value = output_of(fx.node.map_arg(output_node.args[0], lambda n: env[n]))
    layouts: dict[str, dict[int, GradientLayout]] = {}
    handles = []

    def recorder(name: str, index: int) -> Callable[[torch.Tensor], None]:
        def record(grad: torch.Tensor | None) -> None:
            if grad is None:  # a tensor whose every element is overwritten later (a slice write) gets none
                return
            layouts.setdefault(name, {})[index] = (tuple(grad.shape), tuple(grad.stride()))
        return record
    try:
        for name, ts in tensors_of.items():
            for i, t in enumerate(ts):
                if t.requires_grad and not t.is_leaf:
                    handles.append(t.register_hook(recorder(name, i)))
        with torch.enable_grad():
            loss = loss_fn(value)
        if not targets or not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return {}
        torch.autograd.grad(loss, targets, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return layouts


def gradient_seeds(outputs: list[torch.Tensor], layouts: dict[int, GradientLayout]) -> list[torch.Tensor]:
    """Ones as the output gradients of an isolated backward, one per output that requires grad, each
    laid out as ``layouts`` says its gradient arrives in training (index in ``outputs``), else contiguous."""
    seeds = []
    for i, t in enumerate(outputs):
        if not t.requires_grad:
            continue
        shape, stride = layouts.get(i, (None, None))
        if shape == tuple(t.shape):
            seeds.append(torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).fill_(1))
        else:
            seeds.append(torch.ones_like(t, memory_format=torch.contiguous_format))
    return seeds


def rng_state_bytes(inputs: tuple) -> int:
    """Bytes of one RNG snapshot as the executor takes it: the CPU generator's state, plus the CUDA
    generator's for each CUDA device the inputs are on."""
    cuda = {t.device.index or 0 for t in [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)] if t.device.type == "cuda"}
    return (torch.get_rng_state().nbytes
            + sum(torch.cuda.get_rng_state(d).nbytes for d in sorted(cuda)))
