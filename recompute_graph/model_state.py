"""Leaving a user's model as it was, and one training step of it.

Profiling, tracing, verifying and the conformance suite all run a model's code on the side. None of
that may leave a trace in the model: :func:`preserved_state` restores every buffer (BatchNorm running
statistics, ``num_batches_tracked``) by value, the parameters a forward writes into (a momentum update
in ``forward``), optionally the parameters' ``.grad`` and the random generators: the CPU/CUDA ones and
those the model holds (:func:`held_generators`).
:class:`PlainValues` and :func:`changed_at_each_call` find a plain Python value the forward changes at
every call (a step counter, ``self.step += 1``), which no captured graph reproduces: both paths refuse it.
:func:`training_step` is the README loop's step as a callable, for measuring and comparing.
"""
from __future__ import annotations

import contextlib
import copy
import random
import sys
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["preserved_state", "training_step", "generator_states", "values_put_back", "held_generators",
           "generator_state", "set_generator_state", "same_generator_state", "PlainValues", "changed_again",
           "changed_at_each_call", "changing_state_message", "replaced_submodules_refused",
           "submodules_put_back"]

#: the plain Python values of a module's attributes: what ``preserved_state`` puts back, and what a
#: forward that changes them at each call is found by (:class:`PlainValues`)
_PLAIN = (int, float, str, bool, type(None))


#: Parameters some forward was seen writing into in place, by id (a tensor's ``==`` compares values, so a
#: ``WeakSet`` cannot hold them): each later preserved block copies them first
_WRITTEN_PARAMETERS: "dict[int, weakref.ref[torch.Tensor]]" = {}


def _seen_written(parameter: torch.Tensor) -> bool:
    held = _WRITTEN_PARAMETERS.get(id(parameter))
    return held is not None and held() is parameter


def _mark_written(parameter: torch.Tensor) -> None:
    if not _seen_written(parameter):
        key = id(parameter)
        _WRITTEN_PARAMETERS[key] = weakref.ref(parameter, lambda _: _WRITTEN_PARAMETERS.pop(key, None))


class _CopyBeforeWrite(TorchDispatchMode):
    """Copies each of ``parameters`` the first time an op writes into its storage (the schema's
    ``alias_info.is_write``: ``mul_``, ``copy_``, ``out=``), before the write, so it can be put back."""

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        super().__init__()
        self.by_storage = {p.untyped_storage().data_ptr(): p for p in parameters if not p.is_meta}
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for position, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            if isinstance(value, torch.Tensor) and not value.is_meta:
                key = value.untyped_storage().data_ptr()
                if key in self.by_storage and key not in self.copies:
                    parameter = self.by_storage[key]
                    self.copies[key] = (parameter, parameter.detach().clone())
        return func(*args, **kwargs)


def values_put_back(pairs: "Iterable[tuple[torch.Tensor, torch.Tensor]]") -> None:
    """Copy each ``(tensor, value)``'s value back into its tensor, in place (the model keeps holding the
    same buffer), resizing it first where its shape changed: a quantization observer sizes its empty
    per-channel ``min_val``/``max_val`` on its first call."""
    with torch.no_grad():
        for tensor, value in pairs:
            if tensor.shape != value.shape:
                tensor.resize_(value.shape)
            if not torch.equal(tensor, value):
                tensor.copy_(value)


@contextlib.contextmanager
def preserved_state(module: nn.Module, *, rng: bool = False, grads: bool = False,
                    watch_parameters: bool = False) -> Iterator[None]:
    """On exit, put back every buffer of ``module`` (by value, and the tensor itself where the block
    assigned the buffer anew; buffers on ``meta`` hold none), each module's submodules and the
    plain Python values its modules hold as attributes (``self.calls += 1`` in a forward: planning runs
    the forward twice, which counted as two calls; the training flag aside), and with ``rng`` the CPU
    and (initialized) CUDA random states and the generators the model holds, with ``grads`` each
    parameter's ``.grad``.

    Parameters: a ``.data`` assigned anew (``p.data = p.data * m + ...``, MoCo's momentum update) is put
    back (nothing copied). One written in place is copied before the block when an earlier block saw it
    written (``_WRITTEN_PARAMETERS``), and, with ``watch_parameters`` (an eager block: a dispatch mode
    watches it, which ``torch.compile`` does not run under), right before its first write. A write no
    block saw coming is not undone; the parameter is copied from then on."""
    parameters = list(module.parameters())
    data = [(p, p.data) for p in parameters if not p.is_meta]
    versions = [(p, p._version) for p in parameters]
    known = [(p, p.detach().clone()) for p in parameters if _seen_written(p) and not p.is_meta]
    watch = _CopyBeforeWrite(parameters) if watch_parameters else contextlib.nullcontext()
    buffers = [(b, b.detach().clone()) for b in module.buffers() if not b.is_meta]
    buffer_tables = [(m, dict(m._buffers)) for m in module.modules() if m._buffers]
    module_tables = _submodule_tables(module)
    scalars = [(m, name, value) for m in module.modules() for name, value in m.__dict__.items()
               if name != "training" and isinstance(value, _PLAIN)]
    saved_grads = [(p, p.grad) for p in module.parameters()] if grads else []
    cpu_rng = torch.get_rng_state() if rng else None
    held = [(g, generator_state(g)) for _, g in held_generators(module)] if rng else []
    cuda_rng = (torch.cuda.get_rng_state_all()
                if rng and torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    try:
        with watch:
            yield
    finally:
        for m, table in buffer_tables:  # a buffer assigned anew (``self.center = 0.9 * self.center + ...``)
            m._buffers.update((name, b) for name, b in table.items() if m._buffers.get(name) is not b)
        with torch.no_grad():
            values_put_back(buffers)
            for p, before in data:
                if p.data.untyped_storage().data_ptr() != before.untyped_storage().data_ptr():
                    p.data = before
            copied = [*known, *(watch.copies.values() if watch_parameters else ())]
            for p, saved in copied:
                if not torch.equal(p, saved):
                    p.copy_(saved)
            for p, version in versions:  # written in the block (a restore by copy counts too)
                if p._version != version:
                    _mark_written(p)
        _put_back_submodules(module_tables)
        for m, name, value in scalars:
            if m.__dict__.get(name, value) is not value:
                m.__dict__[name] = value
        for p, grad in saved_grads:
            p.grad = grad
        for generator, state in held:
            set_generator_state(generator, state)
        if cpu_rng is not None:
            torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _submodule_tables(model: nn.Module) -> list[tuple[nn.Module, dict[str, nn.Module]]]:
    """Each module's table of submodules, copied (a scripted module's table is no dict: left out)."""
    return [(m, dict(m._modules)) for m in model.modules() if m._modules and isinstance(m._modules, dict)]


def _put_back_submodules(tables: list[tuple[nn.Module, dict[str, nn.Module]]]) -> list[tuple[str, Any, Any]]:
    """Put back the tables of :func:`_submodule_tables`; returns ``(name, before, now)`` of each entry
    that had changed (a forward replacing a submodule: transformers' BigBird switching its attention)."""
    changed = []
    for m, table in tables:
        now = m._modules
        if now.keys() != table.keys() or any(now[k] is not v for k, v in table.items()):
            changed += [(name, table.get(name), now.get(name)) for name in {*table, *now}
                        if table.get(name) is not now.get(name)]
            now.clear()
            now.update(table)
    return changed


@contextlib.contextmanager
def submodules_put_back(model: nn.Module) -> Iterator[None]:
    """Each module's submodules as they were after the block (a trace or an export running a forward
    that replaces some)."""
    tables = _submodule_tables(model)
    try:
        yield
    finally:
        _put_back_submodules(tables)


class PlainValues:
    """The plain Python values (``int``, ``float``, ``str``, ``bool``, ``None``) every module of a model
    holds as attributes at one moment, the training flag aside."""

    def __init__(self, model: nn.Module) -> None:
        self.values = {(name, key): value for name, module in model.named_modules()
                       for key, value in module.__dict__.items() if key != "training" and isinstance(value, _PLAIN)}

    def changed_since(self, earlier: "PlainValues") -> list[str]:
        """``self.step: 3 -> 4`` for each value that is not ``earlier``'s (one set or removed counts)."""
        changed = []
        for name, key in sorted(set(self.values) | set(earlier.values)):
            before, now = earlier.values.get((name, key), _MISSING), self.values.get((name, key), _MISSING)
            if before is not now and (type(before) is not type(now) or before != now) and not _both_nan(before, now):
                changed.append(f"self.{name + '.' if name else ''}{key}: {_shown(before)} -> {_shown(now)}")
        return changed


_MISSING = object()


def _both_nan(a: Any, b: Any) -> bool:
    return isinstance(a, float) and isinstance(b, float) and a != a and b != b


def _shown(value: Any) -> str:
    return "(not set)" if value is _MISSING else repr(value)


def changed_again(model: nn.Module, before: PlainValues, call: Callable[[], Any]) -> list[str]:
    """The plain values (:class:`PlainValues`) a forward of ``model`` changes at every call, inside a block
    that puts them back (:func:`preserved_state`): ``before`` was taken before a first call that already
    ran there. When that call changed any, ``call`` runs the forward once more (its output dropped), and
    what it changes again is returned. A value set by the first call only (transformers' Funnel and
    SegFormer set attributes up on their first forward) is not state that changes."""
    after = PlainValues(model)
    if not after.changed_since(before):
        return []
    output = call()
    del output
    return PlainValues(model).changed_since(after)


def changed_at_each_call(model: nn.Module, call: Callable[[], Any]) -> list[str]:
    """:func:`changed_again` of one or two runs of ``call``, a forward of ``model`` with grad, undone
    (Python's and numpy's global generators too); ``ChangingStateError`` where the first run replaces a
    submodule (:func:`replaced_submodules_refused`)."""
    numpy = sys.modules.get("numpy")
    host_states = random.getstate(), numpy.random.get_state() if numpy is not None else None
    try:
        with preserved_state(model, rng=True, watch_parameters=True), torch.enable_grad():
            before = PlainValues(model)
            with replaced_submodules_refused(model):
                output = call()
                del output
            return changed_again(model, before, call)
    finally:
        random.setstate(host_states[0])
        if host_states[1] is not None:
            numpy.random.set_state(host_states[1])


@contextlib.contextmanager
def replaced_submodules_refused(model: nn.Module) -> Iterator[None]:
    """Around a forward run on the side: where it replaced, added or removed a submodule, every module's
    table of submodules is put back and ``ChangingStateError`` raised. transformers' BigBird-Pegasus
    replaces its attention modules on a short sequence (``set_attention_type("original_full")``); the
    plain values were put back and the modules were not, so the model was left half switched, and its
    steps switched it again under a plan of the old modules (gradients 1e-2 off, 3.6x the predicted peak)."""
    from .errors import ChangingStateError
    names = {id(module): path for path, module in model.named_modules()}
    tables = _submodule_tables(model)
    try:
        yield
    finally:
        replaced = [(f"{names.get(id(m), '?')}.{name}".lstrip("."), before, now)
                    for m, table in tables for name, before, now in _put_back_submodules([(m, table)])]
    if replaced:
        where, old, new = sorted(replaced, key=lambda r: r[0])[0]
        kinds = " -> ".join(type(m).__name__ if m is not None else "nothing" for m in (old, new))
        raise ChangingStateError(
            f"{type(model).__name__}: its forward replaces submodule {where} ({kinds})"
            f"{f' and {len(replaced) - 1} more' if len(replaced) > 1 else ''} as it runs (transformers' BigBird "
            "switches to full attention on a short sequence), which a plan of the modules as they were cannot "
            "follow. Run one training-mode forward on a batch like the training ones before optimize(), so "
            "that the model settles into the modules it keeps, or configure it so that it does not switch "
            "(BigBird: attention_type='original_full').")


def changing_state_message(owner: str, changed: list[str], how: str) -> str:
    """What a refusal of values changed at each call (:func:`changed_at_each_call`) says: which, why (``how``),
    and what to do."""
    name = changed[0].split(":")[0].removeprefix("self.").rsplit(".", 1)[-1]
    return (f"{owner}: its forward changes {', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''} at "
            f"every call (a step counter, a value annealed inside forward), and {how}. Keep a value that changes "
            f"between steps in a buffer, which both paths update as eager PyTorch does: "
            f"self.register_buffer({name!r}, torch.zeros(())) in __init__, then self.{name} += 1 (or "
            f".fill_(value)) in forward. A value that changes rarely (once per epoch) may be set outside forward(), "
            "where each new value is captured and planned again.")


def held_generators(module: nn.Module) -> list[tuple[str, Any]]:
    """``(where, generator)`` for each random generator a module of ``module`` holds as an attribute
    (``self.rng = np.random.default_rng(0)``): a ``torch.Generator``, a numpy ``Generator`` or
    ``RandomState``, a ``random.Random`` (in an fx ``GraphModule``, the constants its graph reads, such as
    the generator of ``torch.rand(..., generator=g)``: attributes ``_opaque_obj0`` ...). ``where`` reads
    ``"ClassName (path.attribute)"``."""
    numpy = sys.modules.get("numpy")  # not imported: no numpy generator exists
    kinds = (torch.Generator, random.Random,
             *((numpy.random.Generator, numpy.random.RandomState) if numpy is not None else ()))
    found, seen = [], set()
    for path, m in module.named_modules():
        for name, value in vars(m).items():
            if isinstance(value, kinds) and id(value) not in seen:
                seen.add(id(value))
                found.append((f"{type(module).__name__} ({path + '.' if path else ''}{name})", value))
    return found


def generator_state(generator: Any) -> Any:
    """A copy of ``generator``'s state (a kind :func:`held_generators` finds)."""
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, random.Random):
        return generator.getstate()
    if hasattr(generator, "bit_generator"):  # numpy.random.Generator
        return copy.deepcopy(generator.bit_generator.state)
    return generator.get_state(legacy=False)  # numpy.random.RandomState


def set_generator_state(generator: Any, state: Any) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, random.Random):
        generator.setstate(state)
    elif hasattr(generator, "bit_generator"):
        generator.bit_generator.state = state
    else:
        generator.set_state(state)


def same_generator_state(a: Any, b: Any) -> bool:
    """Whether two states of :func:`generator_state` are equal (numpy's hold arrays)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_generator_state(a[k], b[k]) for k in a)
    if hasattr(a, "shape"):  # a numpy array
        return a.shape == b.shape and bool((a == b).all())
    return bool(a == b)


def generator_states() -> list[torch.Tensor]:
    """The CPU random generator's state, then each initialized CUDA device's (compared to tell whether
    some code drew random numbers)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return [torch.get_rng_state(), *cuda]


def training_step(module: nn.Module, args: tuple, kwargs: dict | None = None,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  seed: int | None = None) -> Callable[[], float]:
    """One step of the README loop as a callable: zero the gradients (to ``None``), seed the generator
    when ``seed`` is given, forward, ``loss_fn`` (default ``losses.default_training_loss``), backward.
    It returns the loss as a float."""
    from .losses import default_training_loss
    loss_of = loss_fn or default_training_loss
    kwargs = kwargs or {}

    def step() -> float:
        module.zero_grad(set_to_none=True)
        if seed is not None:
            torch.manual_seed(seed)
        loss = loss_of(module(*args, **kwargs))
        loss.backward()
        return float(loss.detach())
    return step
