"""The module ``optimize()`` returns: trains like the original, within the planned memory.

:class:`RecomputedModule` shares the original's submodules, parameters and buffers (same objects, same
``state_dict`` keys), so an optimizer built on either trains both. In training mode with grad enabled
it runs the planned schedule through one ``torch.autograd.Function``; in ``eval()`` or under
``torch.no_grad()`` it runs the plain forward (no recomputation, no overhead): the fx graph, or the
original model when the model was exported (``export_trace.py``).
"""
from __future__ import annotations

import functools
import inspect
import time
import types
import warnings
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import fx, nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from .errors import (BudgetExceededWarning, EvalModeGradientWarning, InfeasibleBudgetError, ManyCallSignaturesWarning,
                     RecompilationWarning, RewriteError, UnplannedCallWarning, user_stacklevel)
from .executor_state import autocast_state
from .library_classes import is_peft_model, is_transformers_model
from .module_hooks import hooks_changed_error, planned_hooks_key
from .units import format_bytes
from .rewrite import ScheduleExecutor

__all__ = ["PeakWatch", "PreparedStep", "RecomputedModule", "SharedModelModule", "placeholder_binder", "run_schedule",
           "infeasible_for_new_call"]


class _ScheduleFunction(torch.autograd.Function):
    """Forward: the schedule's forward ops. Backward: its backward ops (see rewrite.py)."""

    @staticmethod
    def forward(ctx: Any, executor: ScheduleExecutor, box: dict, *tensors: torch.Tensor) -> Any:
        inputs = box["inputs"]
        ctx.watch = box.get("watch")
        if ctx.watch is not None:
            ctx.watch.start()
        state, output = executor.run_forward(inputs)
        flat, spec = tree_flatten(output)
        tensor_positions = [k for k, item in enumerate(flat) if isinstance(item, torch.Tensor)]
        returned = [flat[k].detach() for k in tensor_positions]
        box["spec"], box["flat"], box["tensor_positions"] = spec, flat, tensor_positions
        ctx.executor, ctx.state = executor, state
        ctx.input_positions = box["input_positions"]
        # an input returned as it is (an autoencoder's ``(reconstruction, x)``) gets no gradient, as in the
        # model: marked differentiable, the loss's gradient for it was 4 MB more than the plan's step
        constants = {id(t) for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and not t.requires_grad}
        ctx.mark_non_differentiable(*[t for k, t in zip(tensor_positions, returned)
                                      if not (t.is_floating_point() or t.is_complex()) or id(flat[k]) in constants])
        # Outputs the loss does not use (the logits beside a model's own loss) get no gradient rather
        # than an output-sized tensor of zeros, as in the original model.
        ctx.set_materialize_grads(False)
        return tuple(returned)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        if torch.is_grad_enabled():  # autograd runs a backward so when asked for create_graph=True
            raise RewriteError(
                "a double backward (torch.autograd.grad(..., create_graph=True), as gradient penalties and "
                "Hessian-vector products take) reached a module optimize() returned: its plan runs one "
                "backward, whose gradients have no graph of their own. Compute that term with the original "
                "model (the optimized module shares its parameters), or leave it out of the recomputed step.")
        if ctx.state is None:  # autograd's own words for it, as the original model would say
            raise RuntimeError(
                "Trying to backward through the graph a second time: the optimized module's step was freed by "
                "its first backward. Specify retain_graph=True in the first backward if you need to backward "
                "through the graph a second time.")
        keep_graph = torch._C._autograd._get_current_graph_task_keep_graph()
        input_grads, parameter_grads = ctx.executor.run_backward(ctx.state, grads, keep_graph)
        if not keep_graph:
            ctx.state = None
        if ctx.watch is not None:
            ctx.watch.finish()
        tensor_input_grads = [input_grads[k] for k in ctx.input_positions]
        return (None, None, *tensor_input_grads, *parameter_grads)


class PeakWatch:
    """Checks one step's peak against the plan's budget with the CUDA caching allocator's statistics:
    the level when the forward starts, and the largest allocation level when the backward ends. Only a
    new maximum set during the step is read (``max_memory_allocated`` is never reset: the user's own
    statistics are left alone), so a step under an earlier maximum is not judged. Warns with
    :class:`~recompute_graph.errors.BudgetExceededWarning` when the rise is over ``budget_bytes``."""

    def __init__(self, device: torch.device, budget_bytes: int, model: str) -> None:
        self.device, self.budget_bytes, self.model = device, budget_bytes, model
        self.start_bytes = self.max_before_bytes = 0
        self.measured_bytes: int | None = None  # the step's rise, once judged

    def start(self) -> None:
        self.start_bytes = torch.cuda.memory_allocated(self.device)
        self.max_before_bytes = torch.cuda.max_memory_allocated(self.device)

    def finish(self) -> None:
        peak = torch.cuda.max_memory_allocated(self.device)
        if peak <= self.max_before_bytes:
            return
        self.measured_bytes = peak - self.start_bytes
        if self.measured_bytes > self.budget_bytes:
            warnings.warn(
                f"{self.model}: this training step allocated {format_bytes(self.measured_bytes)} on {self.device}, "
                f"over the plan's budget of {format_bytes(self.budget_bytes)}. If the loss trained with is not "
                "the one planned for, pass it as optimize(..., loss_fn=...); rg.verify(model, budget, "
                "example_inputs=..., loss_fn=...) compares the two.", BudgetExceededWarning,
                stacklevel=user_stacklevel())


def _cuda_device(inputs: list[Any]) -> torch.device | None:
    return next((t.device for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.is_cuda), None)


def run_schedule(executor: ScheduleExecutor, inputs: list[Any], watch: PeakWatch | None = None) -> Any:
    """Run one step's forward under ``executor``; backward happens when autograd reaches it. ``watch``:
    a :class:`PeakWatch` told when the forward starts and the backward ends."""
    input_positions = [k for k, value in enumerate(inputs) if isinstance(value, torch.Tensor)]
    box: dict[str, Any] = {"inputs": inputs, "input_positions": input_positions, "watch": watch}
    tensors = [inputs[k] for k in input_positions] + list(executor.parameters)
    returned = _ScheduleFunction.apply(executor, box, *tensors)
    flat = list(box["flat"])
    for position, tensor in zip(box["tensor_positions"], returned):
        flat[position] = tensor
    return tree_unflatten(flat, box["spec"])


class PreparedStep(NamedTuple):
    """What training calls of one structure need: the ``executor`` and ``plan``, ``inputs_of(args,
    kwargs)`` giving the graph's placeholder values, and ``output_of(output)`` turning the graph's
    output into what the model returns."""

    executor: ScheduleExecutor
    plan: Any
    inputs_of: Callable[[tuple, dict], list[Any]]
    output_of: Callable[[Any], Any]
    #: the model's trainable parameters when planned: an exported graph holds the objects of its export,
    #: so a wrapper's swap (FSDP2's unsharded parameters) is seen on the model, not on the graph
    model_parameters: tuple = ()

    def parameters_changed(self, model: nn.Module) -> bool:
        """Whether the executor's graph or ``model`` holds other trainable parameters than when planned."""
        if self.executor.parameters_changed():
            return True
        if not self.model_parameters:
            return False
        current = [p for p in model.parameters() if p.requires_grad]
        return len(current) != len(self.model_parameters) or any(
            a is not b for a, b in zip(current, self.model_parameters))


class SharedModelModule(nn.Module):
    """A module that shares ``model``'s submodules, parameters and buffers (same objects, same
    ``state_dict`` keys) and binds calls as ``model.forward`` does: the base of the modules ``optimize``
    returns (the executor's :class:`RecomputedModule` and ``compiled_module.CompiledRecomputedModule``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        # the model's own tables, not copies: a submodule, parameter or buffer set on either is the other's
        self._modules, self._parameters, self._buffers = model._modules, model._parameters, model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self.training = model.training
        object.__setattr__(self, "_original_class", type(model).__name__)
        object.__setattr__(self, "_signature", inspect.signature(model.forward))
        object.__setattr__(self, "_original", model)
        object.__setattr__(self, "_named_modules", list(model.named_modules()))  # whose hooks calls check
        object.__setattr__(self, "_planning_seconds", {})  # call signature -> the seconds its planning took
        self._bind_forward()

    def _signature_planned(self, key: tuple, seconds: float, args: tuple, kwargs: dict) -> None:
        """Record that call signature ``key`` was planned in ``seconds`` (again, when the parameters were
        swapped); the :data:`MANY_SIGNATURES`-th signature gets a :class:`ManyCallSignaturesWarning`
        (once per module)."""
        known = key in self._planning_seconds
        if not known and not self.__dict__.get("_values_warned"):
            differing = _values_only_difference(key, self._planning_seconds, args, kwargs)
            if differing:
                object.__setattr__(self, "_values_warned", True)
                warnings.warn(
                    f"{self._original_class}: this training call was captured and planned again, as a new call "
                    f"signature, because {', '.join(differing)} differs from a call planned before: a Python "
                    "value passed to forward is part of the signature, so each new value costs a planning. "
                    "Pass a value that changes between steps as a tensor (torch.tensor(value)), an input of "
                    "the plan rather than part of its signature.", RecompilationWarning,
                    stacklevel=user_stacklevel())
        self._planning_seconds[key] = self._planning_seconds.get(key, 0.0) + seconds
        count = len(self._planning_seconds)
        if known or count != MANY_SIGNATURES:
            return
        spent_seconds = sum(self._planning_seconds.values())
        warnings.warn(
            f"{self._original_class}: {count} call signatures planned so far, {spent_seconds:.0f} s "
            f"of planning (the last with inputs of shapes {_input_shapes(args, kwargs)}). Each new input shape is "
            "captured and planned on its first training call, so batches padded to their own longest sequence pay "
            "for a plan per length: pad them to a few fixed lengths (transformers' DataCollatorWithPadding("
            "pad_to_multiple_of=64), or to one maximum length) (docs/training.md, \"Calls of other shapes\").",
            ManyCallSignaturesWarning, stacklevel=user_stacklevel())

    def _bind_forward(self) -> None:
        """``inspect.signature(optimized.forward)`` is the model's (``transformers``' Trainer keeps the
        dataset columns the forward names; ours is ``(*args, **kwargs)``): an instance attribute that
        calls the class's ``forward``, made again for a copy (``__setstate__``)."""
        own_forward = types.MethodType(type(self).forward, self)

        def forward(*args: Any, **kwargs: Any) -> Any:
            return own_forward(*args, **kwargs)
        forward.__signature__ = self._signature  # type: ignore[attr-defined]
        forward.__doc__ = getattr(self._original.forward, "__doc__", None)
        object.__setattr__(self, "forward", forward)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("forward", None)  # bound to this module: a copy binds its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._bind_forward()

    def __getattr__(self, name: str) -> Any:
        """The model's own attributes where the module has none of its own (``config``, ``device``,
        ``save_pretrained``, ``get_input_embeddings`` of a ``transformers`` model: what training loops
        and the Trainer read); its submodules, parameters and buffers are shared already."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original")
            if original is None or name.startswith("__"):
                raise
            value = getattr(original, name)
            if isinstance(value, types.MethodType) and value.__self__ is original and _users_method(value):
                return self._watched_method(value)
            return value

    def _watched_method(self, method: types.MethodType) -> Callable[..., Any]:
        """``method`` of the model (its ``self`` is the model, not this module), warning with
        :class:`UnplannedCallWarning` when it calls the model in a training step: that call is not planned
        (``compute_loss(self, batch)`` calling ``self(x)``)."""
        original, owner = self._original, self._original_class

        @functools.wraps(method)
        def watched(*args: Any, **kwargs: Any) -> Any:
            trained: list[bool] = []
            handle = original.register_forward_pre_hook(
                lambda module, inputs: trained.append(module.training and torch.is_grad_enabled()))
            try:
                return method(*args, **kwargs)
            finally:
                handle.remove()
                if any(trained) and not self.__dict__.get("_unplanned_warned"):
                    object.__setattr__(self, "_unplanned_warned", True)
                    warnings.warn(
                        f"{owner}.{method.__name__}, read through the optimized module, called the model itself "
                        "in a training step: its self is the model, so that call ran the plain forward, outside "
                        "the plan and its budget. Call the module optimize() returned in the training loop "
                        f"(loss = loss_fn(optimized(x)), or a {method.__name__} taking it as an argument).",
                        UnplannedCallWarning, stacklevel=user_stacklevel())
        return watched

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """The model's class for a ``transformers`` model (``isinstance(optimized, PreTrainedModel)``,
        ``optimized._get_name()``) or a ``peft`` one, this module's own otherwise; ``type(optimized)`` is
        always its own. The Trainer saves a model that is not a ``PreTrainedModel`` as a bare state dict,
        which safetensors refuses for tied weights: GPT-2 training stopped at its first checkpoint. Its
        label smoothing shifts the labels only for a causal language model it recognizes by class name. A
        ``PeftModel`` it saves as adapters, and reads the dataset columns off its base model's forward."""
        original = self.__dict__.get("_original")
        shown = original is not None and (is_transformers_model(original) or is_peft_model(original))
        return type(original) if shown else type(self)

    @__class__.setter
    def __class__(self, cls: type) -> None:
        """FSDP2's ``fully_shard`` sets ``module.__class__`` to ``FSDP{class}(FSDPModule, class)``, made
        from the class it reads: made from the model's class instead of this module's, it would drop this
        module's ``forward``. The class set is made from this module's own type in its place."""
        shown, own = self.__class__, type(self)
        if shown is not own and shown in cls.__bases__:
            namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
            cls = type(cls.__name__, tuple(own if base is shown else base for base in cls.__bases__), namespace)
        object.__dict__["__class__"].__set__(self, cls)

    def __repr__(self) -> str:
        text, shown = super().__repr__(), self._get_name()
        return type(self).__name__ + text[len(shown):] if text.startswith(shown) else text

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Copied (``copy.deepcopy``: an EMA of the model) or pickled (``torch.save``) as the original
        model with ``optimize()``'s arguments, which the copy is optimized with again: the same budget,
        planned at the copy's first training call. A copy of the wrapper itself would keep this one's
        compiled code, graphs and executors, bound to the original's parameters (the executor's copy
        failed on its first step, the compiler's could not be copied at all)."""
        options = self.__dict__.get("_optimize_options")
        if options is None:  # made directly, not by optimize()
            return super().__reduce_ex__(protocol)
        return _optimized_again, (self._original, options, self.training)

    def __setattr__(self, name: str, value: Any) -> None:
        """An attribute set here that is not this module's own is set on the model, whose forward reads it
        (``optimized.tau = 0.5``, a submodule replaced); the tables of submodules, parameters and buffers
        stay shared. Before session 43 it was set on this module alone, and the steps ran the model's old
        value, silently."""
        original = self.__dict__.get("_original")
        if original is None or name == "training" or name.startswith("__") or name in self.__dict__:
            super().__setattr__(name, value)
            return
        setattr(original, name, value)

    def __delattr__(self, name: str) -> None:
        original = self.__dict__.get("_original")
        if original is None or name in self.__dict__ or name.startswith("__"):
            super().__delattr__(name)
        else:
            delattr(original, name)

    def train(self, mode: bool = True) -> "SharedModelModule":
        """Set training mode here, in the shared submodules and on the original root module (whose own
        ``forward`` may read ``self.training`` when it runs the plain forward)."""
        super().train(mode)
        self._original.training = mode
        return self

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        try:
            self._signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{self._original_class}.forward: {error}") from None

    def _trains(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call is a training step: training mode, grad enabled, and a parameter or an
        input that requires grad (otherwise the plain forward runs). In ``eval()`` mode with grad
        enabled and something requiring grad, an ``EvalModeGradientWarning`` says so, once."""
        if not torch.is_grad_enabled():
            return False
        differentiable = any(p.requires_grad for p in self.parameters()) or any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten((args, kwargs))[0])
        if differentiable and not self.training and not self.__dict__.get("_eval_gradient_warned"):
            object.__setattr__(self, "_eval_gradient_warned", True)
            warnings.warn(f"{self._original_class} is called in eval() mode with grad enabled: the call runs the "
                          "model's plain forward, so a backward from it is not planned and not kept within the "
                          "budget. Wrap validation in torch.no_grad(); to train with BatchNorm or dropout frozen, "
                          "call model.train() and then .eval() on those modules.", EvalModeGradientWarning,
                          stacklevel=user_stacklevel())
        return self.training and differentiable


def _optimized_again(model: nn.Module, options: dict[str, Any], training: bool) -> nn.Module:
    """``optimize(model, **options)`` in ``training`` mode: a copied or unpickled optimized module."""
    from .api import optimize
    return optimize(model, **options).train(training)


#: ``torch.compile`` around an optimized module leaves its forward to run as it is (a graph break): the
#: module compiles its own training step (the compiler path) or runs its schedule (the executor), which
#: dynamo failed to trace (a ``NameError`` inside its tracer)
OUTER_COMPILE_REASON = ("recompute_graph's optimized module runs its own compiled step; pass "
                        "graph_compiler='inductor' to optimize() for inductor's code")


class RecomputedModule(SharedModelModule):
    """Wraps a model and executes a recomputation plan in training.

    ``prepare(args, kwargs)`` returns the :class:`PreparedStep` for calls like ``model(*args, **kwargs)``;
    it is asked again whenever the call's structure, shapes, dtypes or the autocast setting change (one
    plan is cached per signature). ``eval_forward(args, kwargs)`` runs the plain forward (``eval()``,
    ``torch.no_grad()``). ``recompute_plan`` is the plan of the last signature used.
    """

    def __init__(self, model: nn.Module, prepare: Callable[[tuple, dict], PreparedStep],
                 eval_forward: Callable[[tuple, dict], Any], retrace: Callable[[], None] | None = None) -> None:
        super().__init__(model)
        object.__setattr__(self, "_prepare", prepare)
        object.__setattr__(self, "_retrace", retrace)
        object.__setattr__(self, "_traced_structure", TracedStructure(self._named_modules))
        object.__setattr__(self, "_eval_forward", eval_forward)
        object.__setattr__(self, "_plans", {})
        object.__setattr__(self, "_watched", set())  # ids of the prepared steps whose first step was checked
        object.__setattr__(self, "recompute_plan", None)
        # the forward hooks the traced graph runs (``module_hooks``; a backward hook is refused now)
        object.__setattr__(self, "_traced_hooks", planned_hooks_key(self._named_modules, self._original_class))

    def plan(self, *args: Any, **kwargs: Any) -> Any:
        """Plan (or fetch the cached plan) for calls like this one; returns the plan."""
        self._check_call(args, kwargs)
        return self._prepared(args, kwargs).plan

    def _prepared(self, args: tuple, kwargs: dict) -> PreparedStep:
        if self._retrace is not None and self._traced_structure.changed():
            self._trace_again()
        if planned_hooks_key(self._named_modules, self._original_class) != self._traced_hooks:
            raise hooks_changed_error(self._original_class)
        key = _signature_key(args, kwargs)
        if key not in self._plans:
            started = time.perf_counter()
            self._plans[key] = self._prepare(args, kwargs)
            self._signature_planned(key, time.perf_counter() - started, args, kwargs)
        step = self._plans[key]
        object.__setattr__(self, "recompute_plan", step.plan)
        return step

    def _trace_again(self) -> None:
        """Trace and plan again: a submodule was replaced or a plain attribute changed (``model.tau =
        0.5``), which the traced graph holds as it was (as dynamo's guards make the compiler path do;
        before session 43 the steps ran the old module or value, silently). The hooks are traced again
        with the model."""
        object.__setattr__(self, "_named_modules", list(self._original.named_modules()))
        self._retrace()
        self._plans.clear()
        object.__setattr__(self, "_traced_structure", TracedStructure(self._named_modules))
        object.__setattr__(self, "_traced_hooks", planned_hooks_key(self._named_modules, self._original_class))

    @torch.compiler.disable(reason=OUTER_COMPILE_REASON)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_call(args, kwargs)
        if not self._trains(args, kwargs):
            return self._eval_forward(args, kwargs)
        step = self._prepared(args, kwargs)
        if step.parameters_changed(self._original):
            # Parameters were replaced since planning (assignment, ``requires_grad_``, FSDP2's unsharded
            # parameters on its first all-gather): plan again, so gradients reach the tensors in use.
            self._plans.clear()
            step = self._prepared(args, kwargs)
        inputs = step.inputs_of(args, kwargs)
        watch = None
        if id(step) not in self._watched:  # the first step of each plan is checked against its budget
            device = _cuda_device(inputs)
            if device is not None:
                self._watched.add(id(step))
                watch = PeakWatch(device, step.plan.budget_bytes, self._original_class)
        return step.output_of(run_schedule(step.executor, inputs, watch))

    def extra_repr(self) -> str:
        plan = self.recompute_plan
        return f"{self._original_class}, plan: {plan.one_line() if plan is not None else 'on first call'}"


def placeholder_binder(model: nn.Module, graph_module: fx.GraphModule) -> Callable[[tuple, dict], list[Any]]:
    """``bind(args, kwargs)``: the values of ``graph_module``'s placeholders for the call
    ``model(*args, **kwargs)`` (fx placeholders mirror ``model.forward``'s signature; defaults apply)."""
    signature = inspect.signature(model.forward)
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]

    def bind(args: tuple, kwargs: dict) -> list[Any]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = []
        for node in placeholders:
            name = node.target.lstrip("*")
            if name in bound.arguments:
                values.append(bound.arguments[name])
            elif node.args:
                values.append(node.args[0])
            else:  # pragma: no cover - fx placeholders mirror the signature
                raise TypeError(f"missing argument {name!r}")
        return values
    return bind


#: the packages whose methods on a model are not the user's (they do not call the model to train it)
_LIBRARIES = frozenset({"torch", "transformers", "peft", "diffusers", "timm", "torchvision", "accelerate",
                        "recompute_graph"})


def _users_method(method: types.MethodType) -> bool:
    return getattr(method.__func__, "__module__", "torch").split(".")[0] not in _LIBRARIES


class TracedStructure:
    """What a traced graph holds as it was when traced: each module's submodules and plain tensor
    attributes (by identity), and the numbers, strings, booleans and ``None`` (and tuples of them) the
    modules hold as attributes, the training flag aside (a temperature, a drop rate: constants of the
    graph). :meth:`changed` compares with C-level maps: 0.14 ms for ResNet-152's 423 modules, where a
    walk of every ``__dict__`` took 3 ms."""

    def __init__(self, named_modules: Sequence[tuple[str, nn.Module]]) -> None:
        self.tables = [module._modules for _, module in named_modules]
        self.children = self._children()
        entries = [(module.__dict__, name) for _, module in named_modules
                   for name, value in module.__dict__.items() if name != "training" and _plain(value)]
        self.dicts, self.names = [d for d, _ in entries], [n for _, n in entries]
        self.values = tuple(map(dict.get, self.dicts, self.names))
        tensors = [(module.__dict__, name) for _, module in named_modules  # (``self.mask = torch.tril(...)``)
                   for name, value in module.__dict__.items() if isinstance(value, torch.Tensor)]
        self.tensor_dicts, self.tensor_names = [d for d, _ in tensors], [n for _, n in tensors]
        self.tensor_ids = self._tensor_ids()

    def _children(self) -> tuple:  # (a scripted module's table is no dict: ``OrderedModuleDict``)
        return tuple(tuple(table.values()) for table in self.tables)

    def _tensor_ids(self) -> tuple:
        return tuple(map(id, map(dict.get, self.tensor_dicts, self.tensor_names)))

    def changed(self) -> bool:
        return (self._children() != self.children
                or tuple(map(dict.get, self.dicts, self.names)) != self.values
                or self._tensor_ids() != self.tensor_ids)


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str)) or (
        isinstance(value, tuple) and all(_plain(v) for v in value))


def _signature_key(args: tuple, kwargs: dict) -> tuple:
    """The call's structure, the shapes, dtypes, devices and grad flags of its tensors, its other values,
    and the autocast settings (a plan priced in float32 is not the plan for a bfloat16 step)."""
    leaves, spec = tree_flatten((args, kwargs))
    key: list[Any] = [autocast_state(), str(spec)]
    for value in leaves:
        if isinstance(value, torch.Tensor):
            key.append((tuple(value.shape), value.dtype, value.device.type, value.requires_grad))
        else:
            key.append(repr(value))
    return tuple(key)


def _values_only_difference(key: tuple, earlier: "dict[tuple, float]", args: tuple, kwargs: dict) -> list[str]:
    """``tau=0.9`` for each argument that is not a tensor in which ``key`` (a :func:`_signature_key` of the
    call ``args, kwargs``, perhaps with more after it) differs from an ``earlier`` key of the same
    structure, tensors and autocast; [] when no earlier key is such."""
    paths = [path for path, _ in tree_flatten_with_path((args, kwargs))[0]]
    leaves = range(2, 2 + len(paths))  # (after the autocast state and the call's structure)
    for other in earlier:
        if other == key or len(other) != len(key) or other[:2] != key[:2]:
            continue
        differing = [i for i, (a, b) in enumerate(zip(key, other)) if a != b]
        if all(i in leaves and isinstance(key[i], str) for i in differing):
            return [f"{_argument_name(paths[i - 2])}={key[i]}" for i in differing]
    return []


def _argument_name(path: tuple) -> str:
    """``tau`` or ``argument 1`` (and what is inside it: ``options['tau']``) for a path into ``(args, kwargs)``."""
    head, rest = path[1], keystr(path[2:]) if len(path) > 2 else ""
    return f"{head.key}{rest}" if path[0].idx == 1 else f"argument {head.idx}{rest}"


#: the number of call signatures planned at which :class:`ManyCallSignaturesWarning` is shown
MANY_SIGNATURES = 8


def _input_shapes(args: tuple, kwargs: dict) -> str:
    """The shapes of a call's tensors, the first four."""
    shapes = [tuple(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    return ", ".join(map(str, shapes[:4])) + (", ..." if len(shapes) > 4 else "")


def infeasible_for_new_call(error: InfeasibleBudgetError, args: tuple, kwargs: dict) -> InfeasibleBudgetError:
    """``error``, raised planning a training call of another signature (input shapes, dtypes, autocast)
    than the calls planned before it, with that call's shapes and the rule for such calls named."""
    named = _input_shapes(args, kwargs)
    new = InfeasibleBudgetError(
        f"a training call unlike those planned before (its inputs' shapes: {named}) is planned on its own, and "
        f"{error} A byte budget holds for every call; a fraction is of each call's own store-all step, or the "
        "most an earlier call was planned at where that is more (docs/training.md, \"Calls of other shapes\").",
        budget_bytes=error.budget_bytes, min_budget_bytes=error.min_budget_bytes)
    new.__cause__ = error.__cause__
    return new
