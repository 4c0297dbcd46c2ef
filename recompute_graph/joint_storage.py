"""Storages of a joint graph's values, and the order in which a unit's backward frees what it saved.

A value's storage is read from the fake tensor of ``meta["val"]`` (:func:`storage_of`): a view shares its
base's key. The generated backward (``joint_lowering``) is a sequence of kernels, and its liveness frees
a saved value after its last read: GELU's ``mul(x, 1 + tanh(...))`` reads ``1 + tanh`` to make ``x``'s
gradient, and frees it before it makes the other input's. :func:`backward_steps` says so to the
simulator, as a unit's ``backward_steps``, ``backward_step_workspace_bytes`` and ``tape_release_steps``
(``graph.CostNode``). Without them the simulator made both gradients beside both saved values.

Model (unit ``i``, its backward nodes ``B`` in execution order):

* a storage *made* in ``B`` and read outside ``B`` by the backward of unit ``r`` is a gradient of the
  predecessor ``p`` of ``i`` whose gradient reaches ``r``: ``p`` itself, or a unit before it that it
  passes the gradient to through units without backward nodes (``1 + tanh``: its gradient goes to the
  ``tanh``'s backward). Storages whose predecessor is not unique are left out;
* a step starts at each node of ``B`` that makes a predecessor's gradient first (a gradient made in two
  parts counts as made at the first, the safe side) and after each node that is the last to read a
  saved value; its bytes are the largest of its nodes': the temporaries ``B`` made and reads later, the
  returned gradients made so far, and the node's kernel workspace;
* a saved value is let go of after the step holding the last node of ``B`` that reads its storage
  (directly, or through a view of it);
* the unit's incoming gradient is let go of after the step holding the last node of ``B`` that reads
  it (a functionalized in-place write's backward copies it first, then makes two gradients from the
  copy).
"""
from __future__ import annotations

from typing import Container, Iterable, Sequence

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

__all__ = ["storage_of", "value_bytes", "allocates", "backward_steps", "internal_peak_bytes"]


def storage_of(node: fx.Node) -> list[tuple[int, int]]:
    """``(storage key, bytes)`` of each tensor in the node's value."""
    out = []
    for value in tree_flatten(node.meta.get("val"))[0]:
        if isinstance(value, torch.Tensor):
            try:
                storage = value.untyped_storage()
                out.append((storage._cdata, storage.nbytes()))
            except (RuntimeError, NotImplementedError):
                continue
    return out


def value_bytes(node: fx.Node) -> int:
    return sum(nbytes for _, nbytes in storage_of(node))


def allocates(node: fx.Node) -> bool:
    """Whether the node's value has a storage none of its inputs has (it allocates)."""
    inputs = {key for a in node.all_input_nodes for key, _ in storage_of(a)}
    return any(key not in inputs for key, _ in storage_of(node))


def internal_peak_bytes(members: Sequence[fx.Node], internal: dict[int, int], kept: set[int],
                        kernel_bytes: Sequence[int] = ()) -> int:
    """The most bytes of a unit's ``internal`` storages (``{storage key: bytes}``: made by its forward
    nodes ``members``, in execution order, and read by no other unit) live at once while the unit runs:
    each from the node making it to the last member reading it (or to the end, for the ``kept`` ones its
    backward reads), as the generated forward frees them. A fused chain of pointwise ops (BLOOM's
    scripted GELU with its backward's coefficient, 16 temporaries of one size under one ``seq_nr``)
    holds two or three at a time, not all 16. ``kernel_bytes``: each member's kernel temporaries, held
    beside what is live while it runs (a frozen ResNet-18 backbone is one unit of 129 nodes: its first
    convolution's 9.5 MB of temporaries come when 2.4 MB are live, its peak of stored values later, at
    4.7 MB; their sum, 14.2 MB, was the unit's workspace, against 9.8 MB measured)."""
    made: dict[int, int] = {}
    last: dict[int, int] = {}
    for k, node in enumerate(members):
        for key, _ in storage_of(node):
            if key in internal:
                made.setdefault(key, k)
                last[key] = k
        for a in node.all_input_nodes:
            for key, _ in storage_of(a):
                if key in internal:
                    last[key] = k
    change = [0] * (len(members) + 1)  # bytes made at k, and let go of after k (at k + 1)
    for key, at in made.items():
        change[at] += internal[key]
        if key not in kept:
            change[last[key] + 1] -= internal[key]
    live = peak = 0
    for k in range(len(members)):
        live += change[k]
        peak = max(peak, live + (kernel_bytes[k] if k < len(kernel_bytes) else 0))
    return peak


def _gradient_reach(predecessors: Iterable[int], unit_predecessors: Sequence[Sequence[int]],
                    has_backward: Sequence[bool]) -> dict[int, set[int]]:
    """``{p: units whose backward reads p's gradient}``: p, and through units without backward nodes,
    the units they pass it on to."""
    reach: dict[int, set[int]] = {}
    for p in predecessors:
        seen, stack = {p}, [p]
        while stack:
            u = stack.pop()
            if not has_backward[u]:
                for q in unit_predecessors[u]:
                    if q not in seen:
                        seen.add(q)
                        stack.append(q)
        reach[p] = seen
    return reach


def backward_steps(backward_nodes: Sequence[fx.Node], predecessors: Sequence[int], needs: Sequence[int],
                   owner: dict[int, int], unit_of_backward: dict[fx.Node, int],
                   unit_predecessors: Sequence[Sequence[int]], has_backward: Sequence[bool],
                   temporaries: dict[int, int], returned: dict[int, int], constant_bytes: int,
                   kernel_bytes: dict[str, int], incoming: Container[fx.Node] = ()
                   ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
    """``(backward_steps, backward_step_workspace_bytes, tape_release_steps, grad_release_step)`` of a
    unit whose backward nodes are ``backward_nodes`` (module docstring), or three empty tuples and -1
    when they make no gradient a predecessor is known to read. ``incoming``: the gradients of the
    unit's value that other units' backward make (or the tangents), and the sums of them made here
    (``joint_units.incoming_gradient_sums``), read here directly or through views; ``grad_release_step``
    is the step after which the last node reading them has run (-1: at the end). ``owner``: storage key
    -> the forward unit making it;
    ``unit_predecessors``/``has_backward``: of the units up to this one. A step's bytes: the
    ``temporaries`` (``{storage key: bytes}``) its backward made and reads later, the ``returned``
    gradients (``{storage key: bytes}``, kept to the end of the step) made so far (from the first step
    when no node here makes them), ``constant_bytes`` throughout, and its kernels' workspace
    (``kernel_bytes``, by node name)."""
    own = set(backward_nodes)
    reach = _gradient_reach(predecessors, unit_predecessors, has_backward)
    holders: dict[int, list[int]] = {}    # storage key -> positions (in B) of the nodes holding it
    made_at: dict[int, int] = {}          # storage key made in B -> the position of its maker
    last_use: dict[int, int] = {}         # storage key -> the last position holding or reading it
    last_read: dict[int, int] = {}        # need -> position of the last node of B reading its storage
    last_gradient_read = -1               # position of the last node of B reading an incoming gradient
    gradient_keys = {key for b in backward_nodes for a in (b, *b.all_input_nodes) if a in incoming
                     for key, _ in storage_of(a)}
    for k, b in enumerate(backward_nodes):
        inputs = {key for a in b.all_input_nodes for key, _ in storage_of(a)}
        if inputs & gradient_keys:  # the gradient, or a view of it
            last_gradient_read = k
        for key in inputs:
            last_use[key] = k
            if key in owner:  # a saved value, or a view of it (a view shares its base's key)
                last_read[owner[key]] = k
        for key, _ in storage_of(b):
            holders.setdefault(key, []).append(k)
            last_use[key] = max(last_use.get(key, k), k)
            if key not in inputs and key not in owner:
                made_at.setdefault(key, k)
    makes: dict[int, int] = {}            # position -> the predecessor whose gradient it first makes
    for key, k in sorted(made_at.items(), key=lambda item: item[1]):
        readers = {unit_of_backward[u] for h in holders[key] for u in backward_nodes[h].users
                   if u not in own and u in unit_of_backward}
        targets = {p for p, units in reach.items() if units & readers}
        if len(targets) > 1:  # a predecessor reading it itself, before one passing it on to it
            targets = (targets & readers) or targets
        if len(targets) == 1 and (p := targets.pop()) not in makes.values() and k not in makes:
            makes[k] = p
    if not makes:
        return (), (), (), -1
    count = len(backward_nodes)
    workspace = [constant_bytes + kernel_bytes.get(b.name, 0) for b in backward_nodes]
    for key, nbytes in {**temporaries, **returned}.items():
        first = made_at.get(key, 0)
        last = count - 1 if key in returned or key not in made_at else last_use.get(key, count - 1)
        for k in range(first, last + 1):
            workspace[k] += nbytes
    releases = {q: last_read.get(q, count) for q in needs}
    # merge nodes into steps: a step starts where a gradient is made or after a release
    released_at = set(releases.values()) | {last_gradient_read}
    steps: list[int] = []
    step_bytes: list[int] = []
    step_of: list[int] = []
    for k in range(count):
        if not steps or k in makes or (k - 1) in released_at:
            steps.append(makes.get(k, -1))
            step_bytes.append(0)
        step_bytes[-1] = max(step_bytes[-1], workspace[k])
        step_of.append(len(steps) - 1)
    release_steps = tuple(step_of[k] if k < count else len(steps) for k in (releases[q] for q in needs))
    grad_release_step = step_of[last_gradient_read] if 0 <= last_gradient_read < count - 1 else -1
    if grad_release_step == len(steps) - 1:
        grad_release_step = -1
    return tuple(steps), tuple(step_bytes), release_steps, grad_release_step
