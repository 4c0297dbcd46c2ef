"""Module hooks and planned steps: which hooks a plan runs, and what happens when they change after planning.

A planned step runs the model's forward hooks and forward pre-hooks (``register_forward_hook``,
``register_forward_pre_hook``, and the global ``nn.modules.module.register_module_forward_hook``) as
they were when the model was captured: the compiler path's graph and the executor's traced graph have
them inlined, so a hook registered later is not called by that plan. And neither path runs a module
*backward* hook (``register_full_backward_hook``, ``register_full_backward_pre_hook``, the legacy
``register_backward_hook``): the compiled graph has no module boundary for it (dynamo refuses it), and
the executor's traced graph drops it where the module's call is inlined.

So :func:`planned_hooks_key` is part of a plan's signature: the compiler path captures and plans again
when the forward hooks change (its next training call), the executor, whose traced graph is made once,
raises :class:`~recompute_graph.errors.RewriteError` then (optimize the model again); a module backward
hook is refused on both paths. Tensor hooks on parameters (``p.register_hook``,
``register_post_accumulate_grad_hook``) run as in eager autograd, once per step, on both paths.

**A forward hook that keeps a tensor of the model** (``feats[name] = output``, the usual way to read a
layer's features for a perceptual or distillation loss) is exact on the compiler path, where dynamo makes
the kept tensor a graph output. The executor cannot give it that tensor: a hook inlined in its graph ran
once, at trace time, on proxies or fake tensors, and a leaf module's hook runs at each run of its node,
recomputations included, on tensors outside the model's autograd graph. The gradient of a loss on the
kept feature was lost silently, or the step failed in autograd. :func:`kept_hook_tensors_refused` watches
the hooks while the executor traces (``TraceError``) and prices (``RewriteError``) the model and refuses
it when one of them left such a tensor alive. Detached copies (``output.detach()``, logging) are allowed; torch's own
hooks (pruning, weight and spectral norm, quantization observers, FSDP) are not watched.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx, nn
from torch.nn.modules import module as module_globals
from torch.utils._pytree import tree_leaves

from .errors import RewriteError
from .kept_tensors import TensorsMade, carried_by_a_run

__all__ = ["planned_hooks_key", "hooks_changed_error", "kept_hook_tensors_refused", "torch_own_hook"]


def planned_hooks_key(named_modules: Sequence[tuple[str, nn.Module]], owner: str) -> tuple[Any, ...]:
    """The forward hooks and pre-hooks of a model's modules (its ``named_modules()`` as a list, made once:
    a training call checks the hooks, 0.1-0.2 ms for ResNet-152's 423 modules, half the time of walking
    them) and the global ones, by their handles' ids (a hook removed and another added is a change).
    ``RewriteError`` when a module backward hook is registered (module docstring): what to do instead
    is in the message."""
    if module_globals._global_backward_hooks or module_globals._global_backward_pre_hooks:
        raise RewriteError(_backward_hook_message(owner, "a global module backward hook "
                                                         "(nn.modules.module.register_module_full_backward_hook)"))
    key: list[Any] = [tuple(module_globals._global_forward_hooks), tuple(module_globals._global_forward_pre_hooks)]
    for index, (name, module) in enumerate(named_modules):
        if module._backward_hooks or module._backward_pre_hooks:
            raise RewriteError(_backward_hook_message(owner, f"module {name or '(the root)'!r} "
                                                             f"({type(module).__name__}) has a backward hook"))
        if module._forward_hooks or module._forward_pre_hooks:
            key.append((index, tuple(module._forward_hooks), tuple(module._forward_pre_hooks)))
    return tuple(key)


def _backward_hook_message(owner: str, what: str) -> str:
    return (f"{owner}: {what}, which a planned step cannot run: the compiled graph has no module boundary to "
            "call it at, and the executor's traced graph drops it. Remove it before optimize(); hooks on the "
            "parameters (p.register_hook, p.register_post_accumulate_grad_hook) and forward hooks run as usual.")


def hooks_changed_error(owner: str) -> RewriteError:
    """The executor's error when the forward hooks changed after it traced the model."""
    return RewriteError(f"{owner}: forward hooks (or pre-hooks) were added or removed after optimize() traced the "
                        "model; the schedule executor's graph runs the hooks it was traced with. Register hooks "
                        "before optimize(), or optimize the model again (the compiler path, compiler=True, plans "
                        "again by itself).")


def _carries_the_graph(value: Any) -> bool:
    """A value that, kept past the step, should have carried the model's autograd graph: a proxy or fake
    tensor of a trace, or a real activation that requires grad (not a leaf: the user's input, a weight)."""
    return _of_a_trace(value) or carried_by_a_run(value)


def torch_own_hook(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is torch's own (pruning, weight and spectral norm, quantization observers, FSDP)."""
    target = hook.func if isinstance(hook, functools.partial) else hook
    module = getattr(target, "__module__", None) or type(target).__module__ or ""
    return module.split(".")[0] == "torch"


def _watched(hook: Callable[..., Any], where: str, kept: list[tuple[str, weakref.ref, bool]],
             output_is_last: bool) -> Callable[..., Any]:
    """``hook`` recording weak references to the output it receives (a forward hook's last argument) and
    to the tensors it makes: proxies through the fx tracer, other tensors through a torch-function mode."""
    def watched(*args: Any) -> Any:
        made: list[weakref.ref] = []
        values = tree_leaves(args[1:])
        tracers = {v.tracer for v in values if isinstance(v, fx.Proxy)}
        with _proxies_made(tracers, made) if tracers else TensorsMade(made, _carries_the_graph):
            result = hook(*args)
        received = tree_leaves(args[-1]) if output_is_last else []
        traced = bool(tracers) or any(_of_a_trace(v) for v in values)
        kept.extend((where, weakref.ref(t), traced) for t in received if _carries_the_graph(t))
        kept.extend((where, ref, traced) for ref in made)
        return result
    return watched


@contextlib.contextmanager
def _proxies_made(tracers: set[fx.Tracer], made: list[weakref.ref]) -> Iterator[None]:
    """Records the proxies ``tracers`` make (an fx trace, where tensor methods on a proxy reach no mode)."""
    def recording(create_proxy: Callable[..., fx.Proxy]) -> Callable[..., fx.Proxy]:
        def create(*args: Any, **kwargs: Any) -> fx.Proxy:
            proxy = create_proxy(*args, **kwargs)
            made.append(weakref.ref(proxy))
            return proxy
        return create
    for tracer in tracers:
        tracer.create_proxy = recording(tracer.create_proxy)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for tracer in tracers:
            del tracer.create_proxy


def _of_a_trace(value: Any) -> bool:
    return isinstance(value, fx.Proxy) or (isinstance(value, torch.Tensor) and (
        isinstance(value, torch._subclasses.fake_tensor.FakeTensor) or torch._is_functional_tensor(value)))


@contextlib.contextmanager
def kept_hook_tensors_refused(named_modules: Sequence[tuple[str, nn.Module]], owner: str,
                              error: Callable[[str], Exception] = RewriteError) -> Iterator[None]:
    """For the executor's traces (``error``: their ``TraceError``, so that ``tracer="auto"`` tries export
    after fx) and pricing of a model (module docstring): its forward hooks and pre-hooks (the global ones
    too) run watched, and ``error`` is raised at the end when a tensor one of them received or made is
    still alive, kept by the hook. The hooks are put back either way."""
    kept: list[tuple[str, weakref.ref, bool]] = []
    replaced: list[tuple[dict, int, Callable[..., Any]]] = []
    tables = [("a global forward hook", module_globals._global_forward_hooks, True),
              ("a global forward pre-hook", module_globals._global_forward_pre_hooks, False)]
    for name, module in named_modules:
        label = f"module {name or '(the root)'!r} ({type(module).__name__})"
        tables += [(f"a forward hook of {label}", module._forward_hooks, True),
                   (f"a forward pre-hook of {label}", module._forward_pre_hooks, False)]
    for where, hooks, output_is_last in tables:
        for key, hook in list(hooks.items()):
            if not torch_own_hook(hook):
                hooks[key] = _watched(hook, where, kept, output_is_last)
                replaced.append((hooks, key, hook))
    try:
        yield
    finally:
        for hooks, key, hook in replaced:
            if key in hooks:
                hooks[key] = hook
    if any(ref() is not None for _, ref, _ in kept):
        gc.collect()  # a reference cycle of the trace's, not the hook's
    alive = [(where, traced) for where, ref, traced in kept if ref() is not None]
    if alive:
        where, traced = alive[0]
        how = ("ran once, when the executor traced the model, so what it kept is a proxy or fake tensor of that "
               "trace, and it does not run in the training steps" if traced else
               "runs at each run of that module's node, recomputations included, on tensors outside the "
               "model's autograd graph, so a loss on what it kept would miss its gradient (keep "
               "output.detach() if the hook only logs)")
        raise error(
            f"{owner}: {where} keeps a tensor it received or made (features stored for a loss, say), which the "
            f"schedule executor cannot give it: the hook {how}. The compiler path (compiler='auto' or True) runs "
            "such a hook as eager PyTorch does when dynamo captures the model; or return the features from "
            "forward().")
