"""What a model's forward asks of autograd, which the schedule executor's graphs must keep or refuse.

**Custom ``torch.autograd.Function``s.** A model's own Function (a gradient reversal layer, a
straight-through estimator, a clipped derivative: RecurrentGemma's ``SqrtBoundDerivative``, Bloom's
``GeLUFunction``) pairs a forward with a backward of its own. Neither of the executor's tracers keeps
that pairing by itself:

* ``torch.fx`` calls ``Function.apply`` with proxies, which runs the forward's Python code and records
  its ops; the graph's backward is then autograd's derivative of those ops, not the Function's. A
  domain-adversarial model trained with wrong gradients, silently (``tests/test_autograd_in_forward.py``).
  :func:`functions_kept_whole` makes each application one ``call_function`` node that calls the
  Function itself, so the executor runs it whole, forward and backward, and recomputes it whole.
* Non-strict ``torch.export`` records the aten ops the forward reaches, below autograd: the Function's
  backward is lost the same way, and an exported graph has no node a Python Function could be.
  :func:`functions_refused` raises a :class:`TraceError` that names the Function and says to take the
  compiler path, where AOTAutograd traces the real backward.

Functions of ``torch`` itself are left to the tracers as before (their forward switches grad mode, which
the tracers refuse, or their backward is autograd's own derivative).

**Gradient hooks on activations** (``h.register_hook(lambda g: g * 0.5)`` in ``forward``): the
executor runs each node on detached inputs and its own ``autograd.grad`` calls, so a hook on an
activation never saw its gradient, which then reached the layers below unchanged (gradients off by the
whole of their value). Both tracers refuse them (:func:`hooks_refused` for export,
:func:`proxy_hooks_refused` for fx, which would otherwise make the submodule opaque and run the hook
outside the executor's tapes); the compiler path keeps them. ``retain_grad()`` on an activation is
refused the same way (AOTAutograd refuses it too; the fx node failed while it was priced).

**Differentiation inside ``forward``** (``torch.autograd.grad(u.sum(), x, create_graph=True)``: a
physics-informed network's derivatives, an input-gradient penalty): no plan can run it. The
executor's nodes run on detached inputs, so the traced ``autograd.grad`` failed while it was priced,
with autograd's own words; export failed on a fake tensor in its constants; Dynamo breaks the graph
there. Both tracers now say so (:func:`differentiation_refused`, :func:`refuse_differentiation_nodes`).
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from .errors import TraceError

__all__ = ["functions_kept_whole", "functions_refused", "hooks_refused", "proxy_hooks_refused", "HookRefused",
           "differentiation_refused", "refuse_differentiation_nodes", "export_refusals"]

_FUNCTION = torch.autograd.function.Function
_TORCH_DIR = os.path.dirname(torch.__file__)
_LIBRARY_DIR = os.path.dirname(os.path.abspath(__file__))


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
def _attributes_replaced(owner: Any, replacements: dict[str, Any]) -> Iterator[None]:
    """``owner``'s (a class's or a module's) attributes set to ``replacements`` for the block; after it,
    what ``owner`` itself held before is put back, or the attribute is removed (an inherited one shows)."""
    missing = object()
    before = {name: vars(owner).get(name, missing) for name in replacements}
    for name, value in replacements.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


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


_HOOK_ADVICE = ("The compiler path keeps it: optimize(..., compiler='auto') (the default) or compiler=True. Or "
                "write the change to the gradient as a torch.autograd.Function, which the compiler path and "
                "the executor's torch.fx graph keep.")


def _hook_error(model_name: str, tracer: str, method: str, where: str) -> TraceError:
    effect, advice = ("gradients would reach the layers below without it", _HOOK_ADVICE) if method == "register_hook" \
        else ("the activation's .grad would stay empty (its pricing failed on it)", "torch.compile refuses it too "
              "(AOTAutograd): call retain_grad() outside the optimized module, on what it returns.")
    return TraceError(
        f"{model_name}.forward registers a gradient hook on an activation (Tensor.{method}){where}: the "
        f"{tracer} graph the schedule executor runs does not keep it, and {effect}. {advice}",
        module_path="", source_location=where.removeprefix(" at "))


#: The tensor methods that hook an activation's gradient
_HOOK_METHODS = ("register_hook", "retain_grad")


@contextlib.contextmanager
def hooks_refused(model_name: str, tracer: str) -> Iterator[None]:
    """Raise :class:`TraceError` after the block when the model hooked the gradient of a tensor other
    than a parameter (:data:`_HOOK_METHODS`) while ``tracer`` recorded it."""
    originals = {method: getattr(torch.Tensor, method) for method in _HOOK_METHODS}
    registered: list[tuple[str, str]] = []

    def watched(method: str) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(tensor, nn.Parameter) and not registered:
                registered.append((method, _caller_outside_torch()))
            return originals[method](tensor, *args, **kwargs)
        return call
    with _attributes_replaced(torch.Tensor, {method: watched(method) for method in _HOOK_METHODS}):
        yield
    if registered:
        method, where = registered[0]
        raise _hook_error(model_name, tracer, method, f" at {where}" if where else "")


class HookRefused(TraceError):
    """A gradient hook registered on an activation while ``torch.fx`` traced: refused for the whole
    model, not made an opaque submodule (which would run the hook outside the executor's tapes)."""


@contextlib.contextmanager
def proxy_hooks_refused(model_name: str) -> Iterator[None]:
    """While ``torch.fx`` traces, hooking a traced value's gradient (:data:`_HOOK_METHODS`) raises
    :class:`HookRefused`."""
    def refused(method: str) -> Callable[..., Any]:
        def call(proxy: fx.Proxy, *args: Any, **kwargs: Any) -> Any:
            where = _caller_outside_torch()
            error = _hook_error(model_name, "torch.fx", method, f" at {where}" if where else "")
            raise HookRefused(str(error), module_path="", source_location=where)
        return call
    with _attributes_replaced(fx.Proxy, {method: refused(method) for method in _HOOK_METHODS}):
        yield


def _caller_outside_torch() -> str:
    """``file:line`` of the innermost frame outside torch and this library, or ""."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_TORCH_DIR, _LIBRARY_DIR)):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


_DIFFERENTIATING = {torch.autograd.grad: "torch.autograd.grad", torch.autograd.backward: "torch.autograd.backward"}


def _differentiation_error(model_name: str, what: str, where: str) -> TraceError:
    return TraceError(
        f"{model_name}.forward differentiates ({what}{where}): a plan runs the forward as a graph whose "
        "backward autograd runs once, after it, and neither of optimize()'s paths can plan a forward that "
        "runs a backward of its own (torch.compile breaks the graph there, and the schedule executor runs "
        "each node on detached inputs). Train this model without optimize().", module_path="",
        source_location=where.removeprefix(" at "))


def refuse_differentiation_nodes(model_name: str, graph: fx.Graph, locate: Callable[[str], str]) -> None:
    """:class:`TraceError` for the first call of ``torch.autograd.grad``/``backward`` (or a tensor's
    ``backward``) in a ``torch.fx`` graph; ``locate`` finds the user's line in a node's stack trace."""
    for node in graph.nodes:
        what = _DIFFERENTIATING.get(node.target) if node.op == "call_function" else (
            "Tensor.backward" if node.op == "call_method" and node.target == "backward" else None)
        if what is not None:
            where = locate(node.stack_trace or "")
            raise _differentiation_error(model_name, what, f" at {where}" if where else "")


@contextlib.contextmanager
def differentiation_refused(model_name: str, tracer: str) -> Iterator[None]:
    """While ``tracer`` (non-strict ``torch.export``) records the model, ``torch.autograd.grad``,
    ``torch.autograd.backward`` and ``Tensor.backward`` raise :class:`TraceError`."""
    def refused(what: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            where = _caller_outside_torch()
            raise _differentiation_error(model_name, what, f" at {where}" if where else "")
        return call
    with _attributes_replaced(torch.autograd, {"grad": refused("torch.autograd.grad"),
                                               "backward": refused("torch.autograd.backward")}), \
            _attributes_replaced(torch.Tensor, {"backward": refused("Tensor.backward")}):
        yield


@contextlib.contextmanager
def export_refusals(model_name: str) -> Iterator[None]:
    """What non-strict ``torch.export`` would drop or cannot trace in the model's forward, refused while
    it records: the model's own Functions, gradient hooks on activations, differentiation."""
    with functions_refused(model_name, "torch.export"), hooks_refused(model_name, "torch.export"), \
            differentiation_refused(model_name, "torch.export"):
        yield
