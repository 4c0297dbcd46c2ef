"""A model's output as its own forward returns it, for pricing the training loop's loss on a captured graph.

A joint graph's forward outputs are flat: a ``ModelOutput``'s keys, a tuple's nesting and the tensors the
model returns without computing them (its input, a parameter, a view of one) are not among them, so a loss
that reads ``out.logits`` or compares ``out[0]`` with ``out[1]`` cannot run on them as it runs in
training. ``optimize()``'s compiled module runs the model's own forward before compiling it; that output's
:class:`OutputStructure` (the pytree spec, and per flat leaf whether the graph makes it, someone else
holds it, or it is a plain value or another object) lets ``joint_allocations.outputs_loss_bytes``
rebuild the output from fresh tensors shaped like the graph's outputs and price the loss on it. The
structure holds no tensor of the model's: shapes, strides, dtypes and devices only, and the plain values
as they were (another object, a ``Cache`` holding tensors, is not kept: the loss gets None there).

Invariant: a structure is used for a graph only when each of its *made* leaves is one of the graph's
forward outputs (buffer updates left out) with its shape and dtype, each output taken once, in order
(:meth:`OutputStructure.assignment`); otherwise the flat outputs are priced as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

__all__ = ["OutputLeaf", "OutputStructure", "structure_builder", "filled_tensor"]

#: A leaf the graph computes: one of the joint graph's forward outputs.
MADE = "made"
#: A tensor leaf the graph does not allocate: an input, a parameter or a buffer, or a view of one.
HELD = "held"
#: A plain value (``None``, a number, a string): kept as it was.
VALUE = "value"
#: Any other object: not kept; the rebuilt output has None in its place (a loss reading it fails, and warns).
OPAQUE = "opaque"


@dataclass(frozen=True)
class OutputLeaf:
    """One flat leaf of the output: its kind (``"made"``, ``"held"``, ``"value"`` or ``"opaque"``) and, for a tensor,
    its layout and whether it required grad."""

    kind: str
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    requires_grad: bool = False
    value: Any = None

    def materialize(self) -> torch.Tensor:
        """A real tensor with this leaf's layout, random values (zeros for integers), requiring grad as
        the original did (a leaf: whoever holds it keeps its storage alive anyway)."""
        tensor = filled_tensor(self.shape, self.stride, self.dtype, self.device)
        return tensor.requires_grad_(self.requires_grad and tensor.is_floating_point())


@dataclass(frozen=True)
class OutputStructure:
    """The structure of one output of the model's own forward (module docstring), and whether it carries
    the model's own loss (``losses.own_loss``)."""

    returns_own_loss: bool
    spec: TreeSpec
    leaves: tuple[OutputLeaf, ...]

    @classmethod
    def of(cls, output: Any, held: Iterable[torch.Tensor], returns_own_loss: bool) -> "OutputStructure":
        """The structure of ``output``; a tensor leaf whose storage is one of ``held``'s (the call's inputs,
        the model's parameters and buffers) is *held*, every other tensor leaf *made*."""
        held_storages = {_storage_key(t) for t in held if isinstance(t, torch.Tensor)} - {None}
        flat, spec = tree_flatten(output)
        leaves = []
        for leaf in flat:
            if not isinstance(leaf, torch.Tensor):
                # a plain value is kept; an object (a transformers ``Cache`` holding the keys and values)
                # is not: the structure would keep its tensors alive, and the loss cannot be rebuilt
                plain = leaf is None or isinstance(leaf, (bool, int, float, complex, str, torch.dtype, torch.device))
                leaves.append(OutputLeaf(VALUE, value=leaf) if plain else OutputLeaf(OPAQUE))
                continue
            kind = HELD if _storage_key(leaf) in held_storages else MADE
            leaves.append(OutputLeaf(kind, tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device,
                                     leaf.requires_grad))
        return cls(returns_own_loss, spec, tuple(leaves))

    @property
    def made(self) -> tuple[OutputLeaf, ...]:
        return tuple(leaf for leaf in self.leaves if leaf.kind == MADE)

    def assignment(self, values: Sequence[Any]) -> list[int] | None:
        """For each made leaf, in order, the position among the graph's forward outputs ``values`` (fake
        or real tensors) of the one it is: the first not yet taken with its shape and dtype. None when a
        made leaf has none. Outputs left over are allowed: the tensors of an opaque leaf (GPT-2's
        ``DynamicCache``, whose keys and values the graph returns before the logits)."""
        free = list(range(len(values)))
        positions = []
        for leaf in self.made:
            found = next((i for i in free if tuple(int(d) for d in values[i].shape) == leaf.shape
                          and values[i].dtype == leaf.dtype), None)
            if found is None:
                return None
            free.remove(found)
            positions.append(found)
        return positions

    def matches(self, values: Sequence[Any]) -> bool:
        """Whether every made leaf is one of the graph's forward outputs ``values`` (:meth:`assignment`)."""
        return self.assignment(values) is not None

    def held_tensors(self) -> dict[int, torch.Tensor]:
        """A real tensor for each held leaf, by its flat position (made once, outside what is measured:
        the caller holds them through the step)."""
        return {i: leaf.materialize() for i, leaf in enumerate(self.leaves) if leaf.kind == HELD}

    def rebuild(self, outputs: Sequence[torch.Tensor], assignment: Sequence[int],
                held: dict[int, torch.Tensor]) -> Any:
        """The output with the graph's ``outputs`` in the made leaves' places (``assignment``), ``held``
        in the held leaves' and None in the opaque leaves'."""
        made_iter = iter(assignment)
        flat: list[Any] = []
        for i, leaf in enumerate(self.leaves):
            flat.append(outputs[next(made_iter)] if leaf.kind == MADE else held[i] if leaf.kind == HELD
                        else leaf.value)
        return tree_unflatten(flat, self.spec)


def filled_tensor(shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A real tensor with this layout: random normal values, zeros for integers and booleans."""
    tensor = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device=device)
    return tensor.normal_() if tensor.is_floating_point() or tensor.is_complex() else tensor.zero_()


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass, a sparse one)
        return None
    return storage.data_ptr() if storage.nbytes() else None


def structure_builder(structure: "OutputStructure | None", values: Sequence[Any]
                      ) -> Callable[[list[torch.Tensor]], Any]:
    """A function from the fresh graph outputs to what the loss takes: the model's structure where its
    made leaves are among the graph's ``values`` (:meth:`~OutputStructure.assignment`), else the flat
    outputs (one tensor, or a tuple)."""
    assignment = structure.assignment(values) if structure is not None else None
    if assignment is not None:
        held = structure.held_tensors()
        return lambda made: structure.rebuild(made, assignment, held)
    return lambda made: made[0] if len(made) == 1 else tuple(made)
