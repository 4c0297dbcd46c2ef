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
"""
from __future__ import annotations

from typing import Any, Sequence

from torch import nn
from torch.nn.modules import module as module_globals

from .errors import RewriteError

__all__ = ["planned_hooks_key", "hooks_changed_error"]


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
