"""What the executor (``rewrite.py``) keeps during one step, and its small autograd tools.

* :class:`Tape`: one node's local autograd graph (outputs, detached input leaves, saved storages);
* :class:`StepState`: the values, tapes, gradient buffers and RNG snapshots of one training step;
* :func:`autocast_state` / :func:`autocast_as`: the forward's autocast settings, re-entered for the
  recomputations in backward;
* :class:`InjectGradient`: hands a gradient computed outside autograd back into it;
* :class:`replayed_rng`: the generator states a random node saw the first time, replayed when it is
  recomputed (dropout masks are identical);
* :func:`forward_parameters_held`: the parameters the forward ran with, put back into the modules while
  the backward recomputes (``torch.func.functional_call`` swaps its own in for the forward alone);
* :func:`compact_gradients`: a gradient autograd returns in an oversized storage (``F.unfold``'s) copied
  to its own size;
* small helpers over pytrees of tensors.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .measure import storage_key
from .model_state import values_put_back

__all__ = ["Tape", "StepState", "recomputed_state", "autocast_state", "autocast_as", "pytree_leaves",
           "unique_parameters", "fresh_results", "compact_gradients", "InjectGradient", "unpack_saved", "replayed_rng",
           "parameter_slots", "forward_parameters_held"]


@dataclass
class Tape:
    outputs: list[torch.Tensor]            # output tensors requiring grad (local graph roots)
    positions: list[int]                   # their positions in the node's flattened value
    leaves: list[tuple[Any, int, torch.Tensor]]  # (source, position, detached input leaf)
    parameters: list[nn.Parameter]
    freed_shapes: list[torch.Size] | None = None
    connected: list[torch.Tensor] = field(default_factory=list)  # producer tensors read with their edge
    identity: bool = False  # every output is one of the input leaves: backward hands gradients on as is


@dataclass
class StepState:
    """Everything one training step keeps between the forward and the backward ops."""

    values: dict[int, Any] = field(default_factory=dict)
    static: dict[str, Any] = field(default_factory=dict)
    tapes: dict[int, Tape] = field(default_factory=dict)
    grads: dict[Any, dict[int, torch.Tensor]] = field(default_factory=dict)
    owned_grads: set[tuple[Any, int]] = field(default_factory=set)
    rng_states: dict[int, tuple] = field(default_factory=dict)  # see ``replayed_rng``
    generators: tuple = ()  # the torch.Generators the model holds, replayed with the default ones
    random_computations: Counter = field(default_factory=Counter)  # of each replayed random node so far
    computed: set[int] = field(default_factory=set)
    output_sources: list[tuple[int | None, int]] = field(default_factory=list)
    # the inputs and outputs a recomputation reads, with their versions when the forward ended
    read_again: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    autocast: tuple = ()  # the autocast settings of the forward, re-entered to recompute in backward
    external_keys: set = field(default_factory=set)  # storages of the output gradients autograd handed in
    passed_on: set = field(default_factory=set)  # ids of tensors a node returned as given (an nn.Identity)
    state_before: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # see ``recomputed_state``
    # while a backward runs with ``retain_graph=True``: the step as the forward left it, whose values
    # and tapes that backward must leave intact for the next one (see ``retained``)
    kept_for_next_backward: StepState | None = None

    def retained(self) -> StepState:
        """A copy of the step's containers (the tensors are shared) that a backward run with
        ``retain_graph=True`` leaves as it is: the state is put back from it afterwards (``put_back``),
        so that another backward runs from the forward's values again."""
        return dataclasses.replace(
            self, values=dict(self.values), static=dict(self.static), tapes=dict(self.tapes),
            grads={source: dict(buffers) for source, buffers in self.grads.items()},
            owned_grads=set(self.owned_grads), rng_states=dict(self.rng_states),
            random_computations=Counter(self.random_computations), computed=set(self.computed),
            output_sources=list(self.output_sources), read_again=list(self.read_again),
            passed_on=set(self.passed_on),
            state_before=dict(self.state_before), kept_for_next_backward=None)

    def put_back(self, retained: StepState) -> None:
        """The containers of ``retained`` (from :meth:`retained`) in place of this step's own."""
        for name in (f.name for f in dataclasses.fields(self)):
            setattr(self, name, getattr(retained, name))
        self.kept_for_next_backward = None

    def kept_value(self, index: int, value: Any) -> bool:
        """Whether ``value`` of node ``index`` is the forward's, which a backward retaining the graph
        must not release."""
        kept = self.kept_for_next_backward
        return kept is not None and kept.values.get(index) is value

    def kept_tape(self, index: int, tape: Tape) -> bool:
        """Whether ``tape`` of node ``index`` is the one the forward recorded, which a backward retaining
        the graph runs with ``retain_graph=True``."""
        kept = self.kept_for_next_backward
        return kept is not None and kept.tapes.get(index) is tape


#: Device types whose autocast state a step records (``autocast_state``).
AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple:
    """The current autocast settings, ``((device_type, dtype), ...)`` for each device type where autocast
    is enabled (empty when it is off everywhere)."""
    return tuple((device, torch.get_autocast_dtype(device)) for device in AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(device))


@contextlib.contextmanager
def autocast_as(state: tuple) -> Iterator[None]:
    """Re-enter the autocast settings ``state`` (``autocast_state()``), off elsewhere."""
    with contextlib.ExitStack() as stack:
        enabled = dict(state)
        for device in AUTOCAST_DEVICES:
            if device in enabled:
                stack.enter_context(torch.autocast(device_type=device, dtype=enabled[device]))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device_type=device, enabled=False))
        yield


def pytree_leaves(value: Any) -> list[Any]:
    """``tree_flatten(value)[0]``, with fast paths for a tensor and a flat tuple of tensors (hot path)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if type(value) is tuple and all(isinstance(item, torch.Tensor) for item in value):
        return list(value)
    return tree_flatten(value)[0]


def unique_parameters(parameters: list[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    unique = []
    for p in parameters:
        if id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    return unique


@contextlib.contextmanager
def parameter_hooks_held(parameters: Sequence[torch.Tensor]) -> Iterator[None]:
    """The parameters' tensor hooks (``p.register_hook``: gradient clipping or noise) held back while the
    executor's own ``autograd.grad`` runs compute their gradients node by node: the hooks run once, when
    ``_ScheduleFunction.backward`` hands the summed gradient to autograd, as in eager autograd. Inside
    the runs they ran once per tape and once more outside, so a hook doubling its gradient quadrupled it.
    (The engine reads the hooks from the tensor's ``_backward_hooks`` dict, emptied and refilled here.)"""
    held = [(p._backward_hooks, dict(p._backward_hooks)) for p in parameters if p._backward_hooks]
    for hooks, _ in held:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in held:
            hooks.update(saved)


def fresh_results(results: Sequence[torch.Tensor | None], incoming_keys: set) -> list[bool]:
    """Which gradients autograd returned in storage of their own (not an incoming gradient, whose
    storage keys are ``incoming_keys``, passed through, not shared with another result, not a slice of a
    larger storage): those may be accumulated into in place."""
    keys = [storage_key(r) if r is not None else None for r in results]
    counts = Counter(keys)
    # a view into a larger storage (a slice of an intermediate gradient) is not owned either: adding
    # into it in place would keep the whole storage alive, so it gets replaced by a compact sum
    return [k is not None and k not in incoming_keys and counts[k] == 1
            and r.untyped_storage().nbytes() == r.numel() * r.element_size() for k, r in zip(keys, results)]


class InjectGradient(torch.autograd.Function):
    """A scalar root whose backward hands the boxed gradient to ``tensor`` and lets go of it."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, box: list) -> torch.Tensor:
        ctx.box = box
        return tensor.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = ctx.box.pop()
        ctx.box = None
        return grad, None


#: autograd nodes whose backward returns an input's gradient in a storage larger than the gradient:
#: ``F.unfold``'s col2im makes it the size of the unfolded gradient and shrinks it (9x for a 3x3 window)
OVERSIZED_GRADIENT_NODES = frozenset({"Im2ColBackward0"})


def _compacted(grad_inputs: tuple, _: tuple) -> tuple:
    return tuple(g.clone() if g is not None and g.untyped_storage().nbytes() > g.numel() * g.element_size()
                 else g for g in grad_inputs)


def compact_gradients(value: Any) -> None:
    """For each tensor of ``value`` made by an autograd node of :data:`OVERSIZED_GRADIENT_NODES`: a
    hook copying the gradients it returns into storages of their own size as it returns them, so that
    the oversized one is released at once instead of living on as the input's gradient. Both the
    executor's nodes and their isolated pricing runs (``costs.py``) call it, so the copy's moment is
    priced as the node's backward workspace and the gradient by its size, as the simulator counts it."""
    for t in pytree_leaves(value):
        node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
        if node is not None and type(node).__name__ in OVERSIZED_GRADIENT_NODES:
            node.register_hook(_compacted)


def unpack_saved(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    """A tensor a tape saved (``rewrite``'s pack hook: a detached alias and its version then), refused
    as autograd refuses it when it was written in place since: autograd does not check tensors saved
    through hooks, so an input or an output the caller wrote between the forward and the backward
    (``x.add_(1)`` after ``model(x)``) was read modified, silently."""
    tensor, version = packed
    if version is not None and tensor._version != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"a {type(tensor).__name__} of shape {tuple(tensor.shape)} the optimized module's backward reads is "
            f"at version {tensor._version}; expected version {version}. Write to a copy (x = x.clone()) or out "
            "of place between the forward and the backward.")
    return tensor


class replayed_rng:  # noqa: N801 - used like a function: ``with replayed_rng(...)``
    """First computation of a random node: record the RNG states (the CPU generator's, the CUDA ones of
    the devices its tensor arguments are on, and those of the ``torch.Generator``s the model holds or the
    node takes as an argument). Recomputation: replay them and put the generators back afterwards, so
    the rest of the step draws the same numbers as without recomputation. ``last``: the schedule's last
    computation of the node, after which its recorded states are let go."""

    def __init__(self, state: StepState, index: int, recompute: bool, args: Any, last: bool = False) -> None:
        self.state, self.index, self.recompute, self.last = state, index, recompute, last
        leaves = tree_flatten(args)[0]
        self.devices = sorted({t.device.index or 0 for t in leaves
                               if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
        given = [g for g in leaves if isinstance(g, torch.Generator)]
        self.generators = [*state.generators, *(g for g in given if all(g is not h for h in state.generators))]
        self.saved: tuple | None = None

    def _states(self) -> tuple:
        return (torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in self.devices],
                [g.get_state() for g in self.generators])

    def _set(self, states: tuple) -> None:
        cpu, cuda, own = states
        torch.set_rng_state(cpu)
        for device, rng in cuda:
            torch.cuda.set_rng_state(rng, device)
        for generator, rng in zip(self.generators, own):
            generator.set_state(rng)

    def __enter__(self) -> None:
        current = self._states()
        if not self.recompute or self.index not in self.state.rng_states:
            self.state.rng_states[self.index] = current
            return
        self.saved = current
        self._set(self.state.rng_states[self.index])

    def __exit__(self, *exc: Any) -> None:
        if self.saved is not None:
            self._set(self.saved)
        if self.last:
            self.state.rng_states.pop(self.index, None)


def recomputed_state(state: StepState, index: int, tensors: list[torch.Tensor], recompute: bool,
                     computations: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Before one run of the stateful node ``index`` (``tensors``: the buffers it may write), what to put
    back after it: a recomputation runs from the values the buffers had before the node's first
    computation, kept then when the schedule computes the node ``computations > 1`` times, and leaves
    them as it found them. Spectral norm's power iteration reads its vectors: run from the values its
    first computation left, it made another weight, and the gradients were off by 4e-4. (A training
    BatchNorm's output does not read its running statistics; it is restored all the same.)"""
    if not tensors:
        return []
    if not recompute:
        if computations > 1:
            state.state_before[index] = [t.detach().clone() for t in tensors]
        return []
    restore = [(t, t.detach().clone()) for t in tensors]
    values_put_back(zip(tensors, state.state_before.get(index, ())))
    return restore


def parameter_slots(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(submodule, name, tensor)`` of every trainable parameter ``module`` and its submodules hold now
    (a scripted submodule's are left out: ``torch.jit`` holds them, and nothing swaps them)."""
    return [(m, name, p) for m in module.modules() if isinstance(m._parameters, dict)
            for name, p in m._parameters.items() if p is not None and p.requires_grad]


@contextlib.contextmanager
def forward_parameters_held(slots: list[tuple[nn.Module, str, torch.Tensor]]) -> Iterator[None]:
    """For the block, each slot of :func:`parameter_slots` holds its tensor again where it holds another
    now; the other is put back after. An executor runs its forward on the parameters it was built with
    (it plans again when they change), and its recomputations in backward must read the same ones:
    ``torch.func.functional_call`` swaps its parameters in for the forward and back out before the
    backward, which then recomputed with the module's own (their gradients were lost, the rest off)."""
    swapped = [(m, name, p, m._parameters[name]) for m, name, p in slots if m._parameters.get(name) is not p]
    for m, name, p, _ in swapped:
        m._parameters[name] = p
    try:
        yield
    finally:
        for m, name, _, now in swapped:
            m._parameters[name] = now
