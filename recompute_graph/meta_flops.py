"""FLOPs of one node of an fx graph of aten ops, counted by ``FlopCounterMode`` on meta tensors shaped
like its inputs' fake values (``meta["val"]``), with a cache by signature so that the repeated layers of a
deep model are counted once. Used by ``joint_costs`` to time the joint graph's units from FLOPs."""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["meta_flops", "node_signature"]


def meta_flops(node: fx.Node, known: dict[Any, int] | None = None) -> int:
    """FLOPs of one node, run on meta tensors shaped like its inputs' fake values (0 if it cannot run).
    ``known``: FLOPs by signature (the op, its tensors' shapes, strides and dtypes, its other arguments),
    filled and read, so that the repeated layers of a deep model are counted once (GPT-2-XL's 7,569
    nodes: 7 s under the profiler)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return 0

    def to_meta(value: Any) -> Any:
        if isinstance(value, fx.Node):
            value = value.meta.get("val")
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return value

    key = node_signature(node) if known is not None else None
    if key is not None and key in known:
        return known[key]
    try:
        args, kwargs = tree_map(to_meta, (node.args, node.kwargs))
        with FlopCounterMode(display=False) as counter:
            node.target(*args, **kwargs)
        flops = int(counter.get_total_flops())
    except Exception:  # noqa: BLE001 - an op that cannot run on meta is priced by its bytes alone
        flops = 0
    if key is not None:
        known[key] = flops
    return flops


def _signature(value: Any) -> Any:
    """Hashable, and equal for arguments alike in everything an op's work depends on."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(_signature, value))
    if isinstance(value, dict):
        return ("dict", *((k, _signature(v)) for k, v in sorted(value.items())))
    return value if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device,
                                       torch.layout, torch.memory_format)) else ("object", id(value))


def node_signature(node: fx.Node) -> Any:
    """The op of a ``call_function`` node with its tensors' shapes, strides and dtypes (from their fake
    values) and its other arguments: equal for the nodes of a deep model's repeated layers, which do
    the same work; None when it cannot be made hashable (symbolic shapes and the like)."""
    try:
        key = (node.target, _signature(node.args), _signature(node.kwargs))
    except Exception:  # noqa: BLE001 - symbolic shapes and the like: this node on its own
        return None
    return key if _hashable(key) else None


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
