"""Custom ``torch.autograd.Function``s in the model's code, while the schedule executor's tracers run.

A model's own ``autograd.Function`` (a gradient reversal layer, a straight-through estimator, a
clipped derivative: RecurrentGemma's ``SqrtBoundDerivative``, PhiMoE's sparse mixer) pairs a forward
with a backward of its own. Neither of the executor's tracers keeps that pairing by itself:

* ``torch.fx`` calls ``Function.apply`` with proxies, which runs the forward's Python code and records
  its ops; the graph's backward is then autograd's derivative of those ops, not the Function's. A
  domain-adversarial model trained with wrong gradients, silently (``tests/test_custom_functions.py``).
  :func:`functions_kept_whole` makes each application one ``call_function`` node that calls the
  Function itself, so the executor runs it whole, forward and backward, and recomputes it whole.
* Non-strict ``torch.export`` records the aten ops the forward reaches, below autograd: the Function's
  backward is lost the same way, and an exported graph has no node a Python Function could be.
  :func:`functions_refused` raises a :class:`TraceError` that names the Function and says to take the
  compiler path, where AOTAutograd traces the real backward.

Functions of ``torch`` itself are left to the tracers as before (their forward switches grad mode, which
the tracers refuse, or their backward is autograd's own derivative).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from .errors import TraceError

__all__ = ["functions_kept_whole", "functions_refused"]

_FUNCTION = torch.autograd.function.Function


def _is_the_models_own(function_class: type) -> bool:
    """Whether ``function_class`` comes from the model's code rather than from torch."""
    module = function_class.__module__ or ""
    return not (module == "torch" or module.startswith("torch."))


@functools.lru_cache(maxsize=None)
def _application_of(function_class: type) -> Callable[..., Any]:
    """A plain function calling ``function_class.apply``: the target of the traced node, named after the
    Function so that the graph's code and its node names say which one runs (``GradReverse_apply``)."""
    def apply(*args: Any, **kwargs: Any) -> Any:
        return function_class.apply(*args, **kwargs)
    apply.__name__ = apply.__qualname__ = f"{function_class.__name__}_apply"
    apply.__module__ = __name__
    apply.autograd_function = function_class  # type: ignore[attr-defined]
    return apply


@contextlib.contextmanager
def _apply_replaced(replacement: Callable[..., Any]) -> Iterator[None]:
    """``Function.apply`` is ``replacement(cls, original_apply, *args, **kwargs)`` for the block."""
    original = _FUNCTION.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        return replacement(cls, functools.partial(original.__func__, cls), *args, **kwargs)
    _FUNCTION.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        _FUNCTION.apply = original  # type: ignore[method-assign]


@contextlib.contextmanager
def functions_kept_whole(model_name: str) -> Iterator[None]:
    """While ``torch.fx`` traces: a model's own Function applied to proxies becomes one node calling it.
    An argument the graph cannot hold (a Python callable) is a :class:`TraceError`."""
    def apply(cls: type, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        proxies = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, fx.Proxy)]
        if not proxies or not _is_the_models_own(cls):
            return original(*args, **kwargs)
        try:
            return proxies[0].tracer.create_proxy("call_function", _application_of(cls), args, kwargs)
        except NotImplementedError as error:  # an argument fx cannot record
            raise TraceError(
                f"{model_name} applies the autograd.Function {cls.__qualname__} to an argument the torch.fx "
                f"graph cannot hold ({error}); traced through, its own backward would be lost. The compiler "
                "path keeps it: optimize(..., compiler='auto') (the default).", module_path="") from error
    with _apply_replaced(apply):
        yield


@contextlib.contextmanager
def functions_refused(model_name: str, tracer: str) -> Iterator[None]:
    """Raise :class:`TraceError` after the block when the model applied a Function of its own while
    ``tracer`` (non-strict ``torch.export``) recorded it: the graph would lose the Function's backward."""
    applied: list[type] = []

    def apply(cls: type, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if _is_the_models_own(cls) and cls not in applied:
            applied.append(cls)
        return original(*args, **kwargs)
    with _apply_replaced(apply):
        yield
    if applied:
        names = ", ".join(f"{cls.__module__}.{cls.__qualname__}" for cls in applied)
        raise TraceError(
            f"{model_name} applies autograd.Function {names} with a backward of its own, which the "
            f"{tracer} graph the schedule executor runs does not keep (it records the forward's ops and "
            "differentiates those): gradients would differ from the model's. The compiler path keeps it: "
            "optimize(..., compiler='auto') (the default) or compiler=True.", module_path="")
