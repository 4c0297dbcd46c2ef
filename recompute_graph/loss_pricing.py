"""Pricing what surrounds the nodes: the user's loss, allocator windows, RNG snapshots.

* :func:`price_loss` runs ``loss_fn`` once on the store-all output of the memory pass (detached leaves),
  forward and backward, and measures its *transient* bytes: the peak above what is left at the end
  (the output gradients, which the simulator counts at the start of backward), by the allocator
  (``torch.profiler`` memory events) and by the storage tracker, keeping the larger. It also records
  which outputs the loss sends a gradient to (a model's own ``loss``; an auxiliary scalar it ignores).
* :func:`allocator_windows` records the CPU allocator while the profiling passes run, and
  :func:`node_window` marks one node's run, so that each node's workspace is priced as the allocator
  saw it (nothing on ``meta``, where nothing is allocated).
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
from .measure import AllocatorRecorder, StorageTracker, storage_key

__all__ = ["WINDOW_PREFIX", "LossPrice", "price_loss", "allocator_windows", "node_window", "rng_state_bytes"]


#: ``torch.profiler.record_function`` names around each node's priced run: prefix + node name.
WINDOW_PREFIX = "recompute_graph.node::"


@contextlib.contextmanager
def allocator_windows(on_meta: bool) -> Iterator[Callable[[], dict[str, tuple[int, int, int]]]]:
    """Record the CPU allocator's events (off on meta, where nothing is allocated); yields a function
    giving each node's ``(level at start, peak, level at end)`` once the block has ended."""
    if on_meta:
        yield dict
        return
    with AllocatorRecorder() as recorder:
        yield lambda: recorder.window_peaks(WINDOW_PREFIX)


def node_window(name: str) -> Any:
    return torch.profiler.record_function(WINDOW_PREFIX + name)


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
    with StorageTracker() as tracker:
        if on_meta:
            run()
        else:
            with AllocatorRecorder() as recorder, node_window("loss"):
                run()
    kept = _unique_storage_bytes([g for g in grads if g is not None])
    transient = max(0, tracker.peak_bytes - kept)
    if not on_meta:
        start, peak, end = recorder.window_peaks(WINDOW_PREFIX)["loss"]
        transient = max(transient, peak - max(start, end))
    got_grad = {id(t) for t, g in zip(trainable, grads) if g is not None}
    names = []
    for node in output_node.all_input_nodes:
        node_leaves = [id(d) for d, o in zip(detached, leaves) if isinstance(o, torch.Tensor)
                       and any(o is t for t in [t for t in tree_flatten(env[node])[0] if isinstance(t, torch.Tensor)])]
        if any(i in got_grad for i in node_leaves):
            names.append(node.name)
    return LossPrice(transient, tuple(names))


def _unique_storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int | None, int] = {}
    for t in tensors:
        seen.setdefault(storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


def rng_state_bytes(inputs: tuple) -> int:
    """Bytes of one RNG snapshot as the executor takes it: the CPU generator's state, plus the CUDA
    generator's for each CUDA device the inputs are on."""
    cuda = {t.device.index or 0 for t in [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)] if t.device.type == "cuda"}
    return (torch.get_rng_state().nbytes
            + sum(torch.cuda.get_rng_state(d).nbytes for d in sorted(cuda)))
