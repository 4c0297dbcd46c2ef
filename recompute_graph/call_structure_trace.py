"""torch.fx traces of a model for one call structure, where its ``forward`` cannot be traced as written.

The executor's fx graph mirrors ``forward``'s signature (``trace.trace``): every parameter becomes a
placeholder, a proxy during the trace. Two kinds of ``forward`` cannot be traced so:

* one that branches on an argument's value (``if not return_dict:``, ``if use_cache:``): a proxy cannot
  decide a branch;
* one a decorator wraps in ``(*args, **kwargs)`` (``transformers``' ``@can_return_tuple``): fx builds its
  placeholders from the wrapper's code and the wrapped function's signature, and raised
  ``ValueError: code: co_varnames is too small``.

Where torch.export fails too (``call_graphs.CallGraphs.graph_for``), :func:`root_function` makes a root
for the call at hand: a function taking the call's tensors alone, which calls ``forward`` with them by
name and with the call's other values as constants; parameters the call leaves out keep their defaults.
The graph then serves the calls of that structure only (:func:`call_structure`: the same tensor
arguments, equal constants), and each other structure is traced anew. Only values fx can bake in are
constants: ``None``, booleans, numbers, strings, and tuples or lists of them; a call passing anything
else (a cache object, a list of tensors) has no such trace.
"""
from __future__ import annotations

import inspect
import keyword
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn

__all__ = ["CallStructure", "call_structure", "root_function", "call_values", "wrapped_in_varargs"]

_CONSTANT_TYPES = (type(None), bool, int, float, str)


class CallStructure(NamedTuple):
    """What a call's trace depends on: the names of its tensor arguments, in the order the call gives
    them (the graph's placeholders), and its other arguments' values by name (``**kwargs``' entries as
    arguments of their own)."""

    tensor_names: tuple[str, ...]
    constants: tuple[tuple[str, Any], ...]

    @property
    def key(self) -> tuple[tuple[str, ...], str]:
        """A hashable stand-in (a constant may be a list): the tensors' names and the constants' ``repr``."""
        return self.tensor_names, repr(self.constants)

    def __repr__(self) -> str:
        constants = ", ".join(f"{name}={value!r}" for name, value in self.constants)
        return f"CallStructure(tensors: {', '.join(self.tensor_names) or '-'}; constants: {constants or '-'})"


def _is_constant(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_is_constant(item) for item in value)
    return isinstance(value, _CONSTANT_TYPES)


def _named_values(signature: inspect.Signature, args: tuple, kwargs: dict) -> Iterator[tuple[str | None, Any]]:
    """``(name, value)`` of each argument the call passes (``**kwargs``' entries by their own names);
    ``(None, value)`` for one that cannot be passed by name (positional-only, ``*args``)."""
    bound = signature.bind(*args, **kwargs)
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            yield from value.items()
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                yield None, value
        elif kind is inspect.Parameter.POSITIONAL_ONLY:
            yield None, value
        else:
            yield name, value


def _forward_function(model: nn.Module) -> Any:
    """The function fx traces as the root (``type(model).forward``), or None where an instance attribute
    overrides it (the call would not run it)."""
    return None if "forward" in model.__dict__ else type(model).forward


def call_structure(model: nn.Module, args: tuple, kwargs: dict) -> CallStructure | None:
    """The structure of the call ``model(*args, **kwargs)``, or None where no trace for it can be made:
    an argument neither a tensor nor a constant (module docstring), one not passed by name, a name that
    is not an identifier, or a ``forward`` the call would not run."""
    if _forward_function(model) is None:
        return None
    try:
        named = list(_named_values(inspect.signature(model.forward), args, kwargs))
    except TypeError:  # the call does not fit the signature: the model's own error says it
        return None
    tensors, constants = [], []
    for name, value in named:
        if name is None or not name.isidentifier() or keyword.iskeyword(name) or name == "self":
            return None
        if isinstance(value, torch.Tensor):
            tensors.append(name)
        elif _is_constant(value):
            constants.append((name, value))
        else:
            return None
    return CallStructure(tuple(tensors), tuple(constants))


def root_function(model: nn.Module, structure: CallStructure) -> Callable[..., Any]:
    """``forward(self, <tensors>)``, calling the model's ``forward`` with those tensors and the
    structure's constants, by name (module docstring)."""
    forward = _forward_function(model)
    passed = [f"{name}={name}" for name in structure.tensor_names]
    passed += [f"{name}=constants[{i}]" for i, (name, _) in enumerate(structure.constants)]
    source = (f"def forward({', '.join(('self',) + structure.tensor_names)}):\n"
              f"    return model_forward({', '.join(['self'] + passed)})\n")
    namespace: dict[str, Any] = {"model_forward": forward, "constants": [value for _, value in structure.constants]}
    exec(compile(source, f"<{type(model).__name__}.forward for one call structure>", "exec"), namespace)
    made = namespace["forward"]
    made.__qualname__ = getattr(forward, "__qualname__", "forward")
    return made


def call_values(model: nn.Module, structure: CallStructure) -> Callable[[tuple, dict], list[Any]]:
    """``inputs_of(args, kwargs)``: the values of the placeholders of a graph traced for ``structure``
    (the call's tensors, by name) for a call of that structure."""
    signature = inspect.signature(model.forward)

    def inputs_of(args: tuple, kwargs: dict) -> list[Any]:
        named = dict(_named_values(signature, args, kwargs))
        return [named[name] for name in structure.tensor_names]
    return inputs_of


def wrapped_in_varargs(function: Any) -> bool:
    """Whether ``function`` is a decorator's ``(*args, **kwargs)`` wrapper around a function with a
    signature of its own (``functools.wraps``), which torch.fx cannot mirror (module docstring)."""
    code = getattr(function, "__code__", None)
    if code is None or not hasattr(function, "__wrapped__") or not code.co_flags & inspect.CO_VARARGS:
        return False
    parameters = inspect.signature(function).parameters.values()
    return not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)
