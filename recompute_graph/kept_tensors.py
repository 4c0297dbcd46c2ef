"""Tensors of the step a model keeps on its modules: what the schedule executor refuses.

A forward (or a forward hook) may keep a tensor of the step on a module attribute, for the loss to read
after the call: a Bayesian layer's KL term (``self.kl``), features for a perceptual or distillation loss
(``self.features[name] = out``), a mixture-of-experts load-balancing loss. Eager PyTorch leaves the tensor
there with its autograd graph, and so does the compiler path: dynamo makes it an output of the captured
graph and stores it after the step. The schedule executor cannot. Its graph is traced once and has no
Python left to store anything, so the attribute held a value of the trace or of planning:
- torch.export's stale tensor trained silently wrong (a KL term's gradient lost: 1e-3 off; state for
  the next call, ``self.mems = out.detach()``, never updated: outputs 3e-3 off from the second step);
- torch.fx's proxy was dropped after the trace, and the loss met an ``AttributeError``;
- a module the executor runs whole (an opaque or leaf module) stored a tensor detached from the model's
  graph at each run of its node.

:class:`AttributeSnapshot` records every module's own attributes (not its parameters, buffers,
submodules or hooks) before a trace or pricing. :meth:`AttributeSnapshot.kept` then names what now holds
such a tensor, looking into dicts, lists and tuples, and :meth:`AttributeSnapshot.restore` puts the
attributes back, so nothing of the trace stays on the user's model. :func:`kept_tensors_refused` does
both around a block and raises the tracer's error. Buffers are not attributes here: writing a buffer is
a mutation both tracers plan.
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .collector import every_object_seen
from .errors import TraceError

__all__ = ["AttributeSnapshot", "kept_tensors_refused", "kept_tensor_message", "KEPT_TENSOR_WORDS",
           "carried_by_a_trace", "carried_by_export", "carried_by_a_run", "KeptOutsideTheModel",
           "containers_keeping_proxies", "taken_out_of_containers", "TensorsMade"]

#: the words every refusal of a kept tensor has (``call_graphs`` tells two tracers' refusals of one by them)
KEPT_TENSOR_WORDS = "keeps a tensor of the step in"

#: nn.Module's own bookkeeping in ``__dict__`` (hooks, tables of parameters, buffers and submodules).
_STANDARD = frozenset({
    "training", "_parameters", "_buffers", "_non_persistent_buffers_set", "_modules", "_backward_hooks",
    "_backward_pre_hooks", "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_is_full_backward_hook", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_initialize_hook",
    "_load_hook"})


def carried_by_a_trace(value: Any) -> bool:
    """A torch.fx proxy: any value of the trace kept outside its graph."""
    return isinstance(value, fx.Proxy)


def carried_by_export(value: Any) -> bool:
    """Any tensor of a torch.export trace: one that needs no gradient may be state for the next call
    (Transformer-XL's ``self.mems = out.detach()``), which export's graph froze at its value of the trace."""
    return isinstance(value, torch.Tensor)


def carried_by_a_run(value: Any) -> bool:
    """A real activation that requires grad (not a leaf: an input or a weight the model keeps a handle on)."""
    return isinstance(value, torch.Tensor) and value.requires_grad and value.grad_fn is not None


def _copied(value: Any) -> Any:
    """``value`` with its dicts, lists and tuples copied (their items are compared later, not copied)."""
    if type(value) in (dict, list, tuple):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        copy = {key: _copied(item) for key, item in items}
        return copy if isinstance(value, dict) else type(value)(copy.values())
    return value


def _kept_in(path: str, before: Any, now: Any, carries: Callable[[Any], bool], found: list[str]) -> None:
    if now is before:
        return
    if carries(now):
        found.append(path)
    elif isinstance(now, (dict, list, tuple)):
        items = now.items() if isinstance(now, dict) else enumerate(now)
        old = before if isinstance(before, type(now)) else ({} if isinstance(now, dict) else ())
        for key, item in items:
            earlier = old.get(key) if isinstance(old, dict) else (old[key] if key < len(old) else None)
            _kept_in(f"{path}[{key!r}]", earlier, item, carries, found)


def _set_by_torch(module: nn.Module) -> set[str]:
    """The attributes torch's own forward pre-hooks compute for the module to read (``weight`` from
    ``weight_orig`` under pruning, old-style weight and spectral norm)."""
    names = set()
    for hook in module._forward_pre_hooks.values():
        if type(hook).__module__.startswith("torch."):
            names.update(n for n in (getattr(hook, "name", None), getattr(hook, "_tensor_name", None))
                         if isinstance(n, str))
    return names


class AttributeSnapshot:
    """Every module's own attributes at one moment (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = [(name, module, {key: _copied(value) for key, value in module.__dict__.items()
                                        if key not in _STANDARD}, _set_by_torch(module))
                        for name, module in model.named_modules()]

    def kept(self, carries: Callable[[Any], bool]) -> list[tuple[str, nn.Module, str]]:
        """``(path, module, attribute)`` of each value that ``carries`` and was not there before; the path
        reads as code does (``self.layers.0.kl``, ``self.features['mid']``)."""
        found: list[tuple[str, nn.Module, str]] = []
        weights = {id(t) for _, module, _, _ in self.modules  # (export's fake ones: nn.LSTM's _flat_weights)
                   for t in (*module._parameters.values(), *module._buffers.values())}

        def kept_value(value: Any) -> bool:
            return id(value) not in weights and carries(value)
        for name, module, before, computed in self.modules:
            for key, value in list(module.__dict__.items()):
                if key in _STANDARD or key in computed:
                    continue
                paths: list[str] = []
                _kept_in(f"self.{name + '.' if name else ''}{key}", before.get(key), value, kept_value, paths)
                found.extend((path, module, key) for path in paths)
        return found

    def restore(self, kept: list[tuple[str, nn.Module, str]]) -> None:
        """The attributes named in ``kept`` as they were (containers refilled in place), or removed where
        they were not there before."""
        saved = {id(module): before for _, module, before, _ in self.modules}
        for module, key in {(id(m), k): (m, k) for _, m, k in kept}.values():
            before, now = saved[id(module)], module.__dict__.get(key)
            if key not in before:
                module.__dict__.pop(key, None)
            elif isinstance(now, dict) and isinstance(before[key], dict):
                now.clear()
                now.update(before[key])
            elif isinstance(now, list) and isinstance(before[key], list):
                now[:] = before[key]
            else:
                module.__dict__[key] = before[key]


def kept_tensor_message(owner: str, path: str, how: str) -> str:
    """What the executor's refusal of a kept tensor says: where, why (``how``) and what to do."""
    return (f"{owner}: the forward (or a forward hook) {KEPT_TENSOR_WORDS} {path} (a KL term or "
            f"features for the loss, or state for its next call), which the schedule executor cannot "
            f"reproduce: {how}, so a loss or a later call reading it would get a stale value or miss its "
            "gradient. The compiler path (compiler='auto', the default, or True) keeps it as eager PyTorch "
            "does where dynamo captures the model; or return it from forward(), or register state carried "
            "between calls as a buffer (register_buffer), which the executor's graph writes.")


@contextlib.contextmanager
def kept_tensors_refused(model: nn.Module, carries: Callable[[Any], bool], error: Callable[[str], Exception],
                         how: str, *, in_forward: bool = False) -> Iterator[None]:
    """Around a trace or a pricing of ``model``: raises ``error(message)`` after the block when a module
    attribute keeps a value that ``carries`` (compared when the block ends and, with ``in_forward``, as
    the root's forward returns: torch.export puts attributes back itself), which is put back first."""
    snapshot = AttributeSnapshot(model)
    kept: list[tuple[str, nn.Module, str]] = []
    handle = model.register_forward_hook(lambda *_: kept.extend(snapshot.kept(carries))) if in_forward else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
        kept.extend(snapshot.kept(carries))
        snapshot.restore(kept)
    if kept:
        raise error(kept_tensor_message(type(model).__name__, kept[0][0], how))


class KeptOutsideTheModel(TraceError):
    """The forward kept a value of its torch.fx trace in a container outside the model (a global list, a
    dict in a closure: ``FEATURES.append(h)`` for the loss to read). Final for ``tracer="auto"``: export's
    graph would leave a fake tensor there, and neither graph fills the container in training."""


def containers_keeping_proxies(made: "list[weakref.ref[fx.Proxy]]", model: nn.Module) -> list[str]:
    """Where, outside ``model``, a proxy of ``made`` (weak references to every proxy a trace made) is still
    held once the trace is over (``a list``, ``a dict (at key 'mid')``), the proxies taken out: nothing of
    the library holds one then, so whatever does was filled by the forward."""
    if all(ref() is None for ref in made):
        return []
    gc.collect()  # (a proxy held only by a reference cycle is not kept)
    alive = [proxy for proxy in (ref() for ref in made) if proxy is not None]
    return [where for _, where in taken_out_of_containers(alive, model)]


def taken_out_of_containers(values: list, model: nn.Module) -> "list[tuple[list | dict, str]]":
    """Take each of ``values`` out of the lists and dicts that hold it, but for the model's own attribute
    tables and the namespaces of classes and modules: each container emptied of them, with where they were
    (``a list``, ``a dict (at key 'mid')``)."""
    ids = {id(value) for value in values}
    skipped = {id(values), *(id(module.__dict__) for module in model.modules())}
    with every_object_seen():  # (a list made before a frozen block is invisible to get_referrers)
        holders = [holder for value in values for holder in gc.get_referrers(value)]
    found: "list[tuple[list | dict, str]]" = []
    for holder in holders:
        if id(holder) in skipped:
            continue
        skipped.add(id(holder))
        if isinstance(holder, list):
            holder[:] = [item for item in holder if id(item) not in ids]
            found.append((holder, "a list"))
        elif isinstance(holder, dict) and "__module__" not in holder and "__builtins__" not in holder:
            keys = [key for key, value in holder.items() if id(value) in ids]
            for key in keys:
                del holder[key]
            found.extend((holder, f"a dict (at key {key!r})") for key in keys)
    return found


class TensorsMade(TorchFunctionMode):
    """Weak references, appended to ``made``, to the results of the torch functions run under it that
    ``keep`` accepts (a hook's ``output.mean(1)``, an activation a forward puts in a global list)."""

    def __init__(self, made: "list[weakref.ref]", keep: Callable[[Any], bool]) -> None:
        super().__init__()
        self.made, self.keep = made, keep

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        self.made.extend(weakref.ref(t) for t in tree_leaves(result) if self.keep(t))
        return result
