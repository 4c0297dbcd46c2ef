"""The compute pass of pricing (``costs.py``, pass 2 and 3): each node alone, forward and backward.

:class:`ComputePass` runs every node of the traced graph on detached copies of its inputs
(``items_read``: an item of a tuple copies that item alone) and records a :class:`NodeCompute`:

* ``timing="flops"``: its forward and backward FLOPs under ``FlopCounterMode``; its isolated backward
  again under the storage tracker (the gradients it returns, whether it hands its incoming gradient on),
  and once more with no dispatch mode in an allocator window of its own (``_allocator_window``), whose
  peak above the level before it and the gradients it returns is ``backward_workspace_bytes``;
* ``timing="measure"``: the median seconds of its forward and backward on the model's device
  (``warmup`` runs, then ``repeats`` or three once they took 10 ms), without profiler or meters.

The isolated backward computes the gradients the step's backward computes: of the parameters and of
inputs produced by nodes that require grad. Also here: the helpers both passes use (``tensors_of``,
``node_error``, ``buffer_arguments``).
"""
from __future__ import annotations

import operator
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from .errors import ProfileError
from .executor_state import compact_gradients
from .loss_pricing import gradient_seeds, node_window
from .measure import StorageTracker, storage_key, unique_storages
from .trace import BoundInterpreter

__all__ = ["ComputePass", "NodeCompute", "items_read", "tensors_of", "node_error", "buffer_arguments"]


def tensors_of(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def node_error(node: fx.Node, error: BaseException) -> ProfileError:
    hint = ""
    if "meta" in str(error).lower() or "data-dependent" in str(error).lower():
        hint = ("\n  This node depends on tensor values, which meta tensors do not have: price this model "
                "on real tensors (a smaller batch works) instead.")
    return ProfileError(f"cannot run node {node.format_node()}: {type(error).__name__}: {error}{hint}")


def buffer_arguments(n: fx.Node, env: dict) -> list[torch.Tensor]:
    """The module buffers a function node reads through ``get_attr`` (an exported BatchNorm's running
    statistics): state, not activations; writing them makes the node ``stateful``."""
    return [value for a in n.all_input_nodes if a.op == "get_attr"
            for value in [env.get(a)] if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)]


@dataclass
class NodeCompute:
    forward_flops: int = 0
    backward_flops: int = 0
    forward_seconds: float | None = None
    backward_seconds: float | None = None
    forward_bytes_moved: int = 0
    backward_workspace_bytes: int = 0
    backward_aliases_grad: bool = False
    has_backward: bool = False
    returned_bytes: int = 0  # new storage of the input gradients the isolated backward returns


def items_read(n: fx.Node, args: tuple) -> tuple:
    """``args`` of ``n``, where ``n`` takes one item of a tuple or list (``operator.getitem``) with the
    other items left out: its isolated runs copy only the one it reads. Copying all, the items of a
    model's ``h.unbind(0)`` over 512 rows cost 512 copies each, 512 squared a block: planning ran out of
    24 GiB (the profiler's records of those copies)."""
    if n.target is not operator.getitem or len(args) != 2 or type(args[1]) is not int \
            or not isinstance(args[0], (tuple, list)) or not -len(args[0]) <= args[1] < len(args[0]):
        return args
    container, k = args
    k %= len(container)
    return tuple(item if i == k else None for i, item in enumerate(container)), k


class ComputePass(BoundInterpreter):
    """Runs each node alone, forward and backward: counting its FLOPs and workspace (``timing="flops"``), or
    timing it (``timing="measure"``, the third pass)."""

    def __init__(self, gm: fx.GraphModule, timing: str, repeats: int, warmup: int, grad_nodes: set[str],
                 layouts: dict, allocator_windows: bool = False) -> None:
        """``grad_nodes``: the nodes whose output requires grad in training (from the memory pass);
        ``layouts``: the layouts of their incoming gradients (``loss_pricing.incoming_gradient_layouts``);
        ``allocator_windows``: the allocator is recorded (not on meta), so each backward is run once more
        in a window of its own (``_allocator_window``)."""
        super().__init__(gm)
        self.timing, self.repeats, self.warmup = timing, repeats, warmup
        self.allocator_windows = allocator_windows
        self.grad_nodes, self.layouts = grad_nodes, layouts
        self.records: dict[str, NodeCompute] = {}

    def run(self, *args: Any) -> "ComputePass":
        super().run(*args)
        return self

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "get_attr", "output"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        try:
            with torch.no_grad():
                result = getattr(self, n.op)(n.target, args, kwargs)
            if tensors_of(result):
                self.records[n.name] = self._measure(n, items_read(n, args), kwargs)
        except Exception as error:  # noqa: BLE001
            raise node_error(n, error) from error
        return result

    def add_allocator_workspace(self, windows: dict[str, tuple[int, int, int]]) -> None:
        """Set ``backward_workspace_bytes`` to the allocator's peak in each isolated backward, run with no
        dispatch mode (``_allocator_window``), above the level before it and the input gradients it
        returns (the simulator counts those); the storage tracker's figure stays where no window ran."""
        for name, (start, peak, _) in windows.items():
            record = self.records.get(name)
            if record is not None and record.has_backward:
                record.backward_workspace_bytes = max(0, peak - start - record.returned_bytes)

    def _trainable_argument_ids(self, n: fx.Node) -> set[int]:
        """ids of the argument tensors of ``n`` that require grad in training: outputs of nodes that do,
        parameters, model inputs given with grad; never module buffers (running statistics)."""
        buffer_ids = {id(b) for b in buffer_arguments(n, self.env)}
        ids: set[int] = set()
        for a in n.all_input_nodes:
            produced_with_grad = a.name in self.grad_nodes
            ids.update(id(t) for t in tensors_of(self.env[a])
                       if (produced_with_grad or t.requires_grad) and id(t) not in buffer_ids)
        return ids

    @staticmethod
    def _fresh_inputs(args: Any, kwargs: Any, trainable_ids: set[int]) -> tuple[Any, Any, list[torch.Tensor]]:
        """Detached copies of the tensor arguments; the floating-point ones in ``trainable_ids`` as leaves
        requiring grad, so that the isolated backward computes the gradients the step's backward computes
        and no others."""
        leaves: list[torch.Tensor] = []

        def fresh(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if (value.is_floating_point() or value.is_complex()) and id(value) in trainable_ids:
                leaf = value.detach().clone().requires_grad_(True)
                leaf._from_parameter = isinstance(value, nn.Parameter)
                leaves.append(leaf)
                return leaf.clone()  # non-leaf, so in-place ops on it are allowed
            return value.detach().clone()

        new_args, new_kwargs = tree_map(fresh, (args, kwargs))
        return new_args, new_kwargs, leaves

    def _forward(self, n: fx.Node, fresh_args: Any, fresh_kwargs: Any) -> Any:
        with torch.enable_grad():
            out = getattr(self, n.op)(n.target, fresh_args, fresh_kwargs)
        compact_gradients(out)  # as the executor runs the node
        return out

    def _backward(self, n: fx.Node, out: Any, leaves: list[torch.Tensor],
                  seeds: list[torch.Tensor] | None = None) -> list[torch.Tensor | None] | None:
        """Backward of one isolated node from ``seeds`` (default: ones laid out as in training) as output
        gradients; returns the gradients of its inputs (None: the node has no backward)."""
        outputs = [t for t in tensors_of(out) if t.requires_grad]
        params = [p for p in self._node_parameters(n) if p.requires_grad]
        if not outputs or not leaves + params:  # (an output made to require grad: output.requires_grad_())
            return None
        seeds = seeds if seeds is not None else gradient_seeds(tensors_of(out), self.layouts.get(n.name, {}))
        grads = torch.autograd.grad(outputs, leaves + params, seeds, allow_unused=True)
        return list(grads[: len(leaves)])

    def _node_parameters(self, n: fx.Node) -> list[nn.Parameter]:
        if n.op == "call_module":
            return list(self.module.get_submodule(n.target).parameters())
        return [self.env[a] for a in n.all_input_nodes
                if a.op == "get_attr" and isinstance(self.env.get(a), nn.Parameter)]

    def _measure(self, n: fx.Node, args: Any, kwargs: Any) -> NodeCompute:
        trainable_ids = self._trainable_argument_ids(n)
        if self.timing == "measure":  # the timing pass only times (the counting pass counted)
            return self._timed(n, args, kwargs, trainable_ids)
        record = NodeCompute()
        record.forward_bytes_moved = sum(t.numel() * t.element_size() for t in tensors_of((args, kwargs)))
        fresh_args, fresh_kwargs, leaves = self._fresh_inputs(args, kwargs, trainable_ids)
        with FlopCounterMode(display=False) as counter:
            out = self._forward(n, fresh_args, fresh_kwargs)
        record.forward_flops = int(counter.get_total_flops())
        record.forward_bytes_moved += sum(t.numel() * t.element_size() for t in tensors_of(out))
        with FlopCounterMode(display=False) as counter:
            input_grads = self._backward(n, out, leaves)
        record.backward_flops = int(counter.get_total_flops())
        del input_grads, out, leaves
        # the tracker sees the forward too, so that the backward's peak is net of the saved tensors it
        # frees as it goes (the attention weights of SDPA's math path, freed after the first bmm)
        with StorageTracker() as tracker:
            out, leaves, seeds = self._isolated_forward(n, args, kwargs, trainable_ids)
            tracker.reset_peak()
            live_before = tracker.live_bytes
            tracker.owner = "backward"  # storages made from here on (a freed one's key may be reused)
            input_grads = self._backward(n, out, leaves, seeds)
            tracker.owner = None
        made_by_backward = {key for key, owner in tracker.owner_of.items() if owner == "backward"}
        has_backward = input_grads is not None
        if has_backward:
            # gradients of activations; a parameter passed as an argument (exported graphs) gets its
            # gradient at the end of the step (param_grad_bytes), so it counts as workspace here
            activation_grads = [g for g, leaf in zip(input_grads, leaves) if g is not None
                                and not getattr(leaf, "_from_parameter", False)]
            returned = sum(g.untyped_storage().nbytes() for g in unique_storages(activation_grads)
                           if storage_key(g) in made_by_backward)
            record.backward_workspace_bytes = max(0, tracker.peak_bytes - live_before - returned)
            record.has_backward, record.returned_bytes = True, returned
            passed = [g for g in input_grads if g is not None]
            record.backward_aliases_grad = bool(passed) and all(storage_key(g) not in made_by_backward
                                                                for g in passed)
        del input_grads, seeds
        del out, leaves
        if has_backward and self.allocator_windows:
            self._allocator_window(n, args, kwargs, trainable_ids)
        return record

    def _isolated_forward(self, n: fx.Node, args: Any, kwargs: Any, trainable_ids: set[int]
                          ) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
        """The node's forward on fresh copies of its inputs: its output, the leaves its backward computes
        gradients for, and the output gradients as training lays them out."""
        fresh_args, fresh_kwargs, leaves = self._fresh_inputs(args, kwargs, trainable_ids)
        out = self._forward(n, fresh_args, fresh_kwargs)
        return out, leaves, gradient_seeds(tensors_of(out), self.layouts.get(n.name, {}))

    def _allocator_window(self, n: fx.Node, args: Any, kwargs: Any, trainable_ids: set[int]) -> None:
        """The isolated forward and backward once more, with no dispatch mode active, its backward in
        the allocator window ``add_allocator_workspace`` reads. Under a Python dispatch mode (the
        storage tracker's) autograd takes the out-of-place variants of many backward formulas
        (``areAnyTensorSubclassLike``): gather, index_select, indexing, sort, topk and max over a
        dimension allocated a second gradient-sized tensor that the executor's own backward, run with
        no mode, never makes (a sort's workspace was priced at its gradient's size, 13 % of a step)."""
        out, leaves, seeds = self._isolated_forward(n, args, kwargs, trainable_ids)
        with node_window(n.name):
            input_grads = self._backward(n, out, leaves, seeds)
        del input_grads, seeds, out, leaves

    def _timed(self, n: fx.Node, args: Any, kwargs: Any, trainable_ids: set[int]) -> NodeCompute:
        """Median wall-clock seconds of the node's forward and of its isolated backward, after ``warmup``
        runs, over ``repeats`` runs on fresh inputs each, or over ``TIMED_ENOUGH_RUNS`` once these took
        ``TIMED_ENOUGH_SECONDS`` (a heavy node's median of three is as steady as a light node's of five)."""
        record = NodeCompute()
        device = next((t.device for t in tensors_of((args, kwargs))), torch.device("cpu"))
        forward_times, backward_times = [], []
        for i in range(self.warmup + self.repeats):
            fresh_args, fresh_kwargs, leaves = self._fresh_inputs(args, kwargs, trainable_ids)
            _synchronize(device)
            start = time.perf_counter()
            out = self._forward(n, fresh_args, fresh_kwargs)
            _synchronize(device)
            middle = time.perf_counter()
            record.has_backward = self._backward(n, out, leaves) is not None
            _synchronize(device)
            end = time.perf_counter()
            del out, leaves, fresh_args, fresh_kwargs
            if i >= self.warmup:
                forward_times.append(middle - start)
                backward_times.append(end - middle)
                if (len(forward_times) >= TIMED_ENOUGH_RUNS
                        and sum(forward_times) + sum(backward_times) >= TIMED_ENOUGH_SECONDS):
                    break
        record.forward_seconds = statistics.median(forward_times)
        record.backward_seconds = statistics.median(backward_times) if record.has_backward else 0.0
        return record


#: The timing pass stops a node's runs at this many once they took ``TIMED_ENOUGH_SECONDS`` in all
TIMED_ENOUGH_RUNS = 3
TIMED_ENOUGH_SECONDS = 0.01


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
