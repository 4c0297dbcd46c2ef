"""Random numbers a traced graph cannot draw again, refused while the executor's tracers run.

The schedule executor runs a graph traced once (torch.fx's or torch.export's). What the model's Python
code drew while it was traced is a constant of that graph, reused at every step; so is a generator it
made in ``forward``, whose state then runs on across steps where the model's own call started it anew.
:func:`host_random_draws_refused` wraps a trace and raises :class:`TraceError` when the model:

- drew from Python's ``random`` or numpy's global generator (wav2vec2's SpecAugment masks);
- under torch.fx (whose proxies record random ops instead of running them), drew from torch's CPU or
  CUDA generators (``torch.rand([]) < p`` deciding whether a layer runs; noise of a fixed shape);
- drew from a generator it holds (``self.rng = np.random.default_rng(0)``; under torch.fx also a held
  ``torch.Generator`` drawn outside the traced values); a held ``torch.Generator`` passed to a traced
  random op is fine: the executor replays it (``executor_state.replayed_rng``);
- made a generator in ``forward``: ``np.random.default_rng()``, or a ``torch.Generator`` passed to a
  torch op (``torch.rand(shape, generator=torch.Generator().manual_seed(0))``).

Every generator's state is put back after the block. The compiler path may capture these models.
"""
from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from .errors import TraceError
from .model_state import generator_state, generator_states, held_generators, same_generator_state, set_generator_state

__all__ = ["host_random_draws_refused", "refuse_generators_made_in_forward"]


class _GeneratorArguments(TorchFunctionMode):
    """Records the torch functions called with a ``generator`` the model does not hold."""

    def __init__(self, held: set[int]) -> None:
        super().__init__()
        self.held, self.found = held, []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and id(generator) not in self.held and not self.found:
            self.found.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _numpy_generators_made(found: list[str]) -> Iterator[None]:
    """Records calls of ``numpy.random.default_rng`` in the block (the name is looked up at call time)."""
    import numpy
    original = numpy.random.default_rng

    def made(*args: Any, **kwargs: Any) -> Any:
        found.append("numpy.random.default_rng")
        return original(*args, **kwargs)
    numpy.random.default_rng = made
    try:
        yield
    finally:
        numpy.random.default_rng = original


@contextlib.contextmanager
def host_random_draws_refused(model: nn.Module, tracer: str, torch_generator: bool = False) -> Any:
    """The check of the module docstring around a trace of ``model`` by ``tracer`` (its name, for the
    message); ``torch_generator``: the tracer is torch.fx."""
    import numpy
    python_state, numpy_state, torch_states = random.getstate(), numpy.random.get_state(), generator_states()
    owned = held_generators(model)
    held = [(where, g, generator_state(g)) for where, g in owned
            if torch_generator or not isinstance(g, torch.Generator)]
    arguments = _GeneratorArguments({id(g) for _, g in owned})
    made: list[str] = []
    try:
        with arguments, _numpy_generators_made(made):
            yield
    finally:
        host = random.getstate() != python_state or not _same_numpy_state(numpy.random.get_state(), numpy_state)
        drew_torch = torch_generator and not all(map(torch.equal, generator_states(), torch_states))
        drew_held = [where for where, g, state in held if not same_generator_state(generator_state(g), state)]
        random.setstate(python_state)
        numpy.random.set_state(numpy_state)
        torch.set_rng_state(torch_states[0])
        for device, state in enumerate(torch_states[1:]):
            torch.cuda.set_rng_state(state, device)
        for _, generator, state in held:
            set_generator_state(generator, state)
    new = [*(f"{name}()" for name in made), *(f"a torch.Generator passed to {name}" for name in arguments.found)]
    if host or drew_torch or drew_held or new:
        raise _refusal(model, tracer, "Python's random module or numpy's global generator" if host else
                       f"a random generator the model holds, {drew_held[0]}" if drew_held else
                       f"a generator it makes itself, {new[0]}" if new else
                       "torch outside the traced values (torch.rand([]) deciding a branch, noise of a fixed shape)")


def refuse_generators_made_in_forward(model: nn.Module, graph_module: fx.GraphModule, tracer: str) -> None:
    """:class:`TraceError` when ``graph_module`` reads a ``torch.Generator`` ``model`` does not hold: one
    made in ``forward``. torch.fx records ``torch.rand(proxy_shape, generator=g)`` without a torch function
    call and keeps ``g`` as a constant of the graph, an attribute of the graph module's root
    (``_opaque_obj0``) that a ``get_attr`` node reads."""
    held = {id(g) for _, g in held_generators(model)}
    for node in graph_module.graph.nodes:
        value = getattr(graph_module, node.target, None) if node.op == "get_attr" else None
        if isinstance(value, torch.Generator) and id(value) not in held:
            users = [getattr(user.target, "__name__", user.target) for user in node.users]
            raise _refusal(model, tracer, "a generator it makes itself, a torch.Generator passed to "
                           f"{users[0] if users else node.target}")


def _refusal(model: nn.Module, tracer: str, source: str) -> TraceError:
    return TraceError(
        f"{type(model).__name__}.forward draws random numbers from {source}: the {tracer} graph the schedule "
        "executor runs would hold those drawn while it traced, and reuse them at every step (a mask drawn "
        "with numpy, as wav2vec2's SpecAugment does; a layer skipped at random). Draw them with torch from a "
        "traced tensor (torch.rand_like(x), x.new_empty(...).bernoulli_(p)), or turn them off (wav2vec2: "
        "mask_time_prob=0, layerdrop=0); the compiler path may capture them: optimize(..., compiler='auto').",
        module_path="")


def _same_numpy_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and a[2:] == b[2:]
