"""The module ``optimize()`` returns: trains like the original, within the planned memory.

:class:`RecomputedModule` shares the original's submodules, parameters and buffers (same objects, same
``state_dict`` keys), so an optimizer built on either trains both. In training mode with grad enabled
it runs the planned schedule through one ``torch.autograd.Function``; in ``eval()`` or under
``torch.no_grad()`` it runs the traced graph directly (no recomputation, no overhead).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .rewrite import ScheduleExecutor, autocast_state

__all__ = ["RecomputedModule", "run_schedule"]


class _ScheduleFunction(torch.autograd.Function):
    """Forward: the schedule's forward ops. Backward: its backward ops (see rewrite.py)."""

    @staticmethod
    def forward(ctx: Any, executor: ScheduleExecutor, box: dict, *tensors: torch.Tensor) -> Any:
        inputs = box["inputs"]
        state, output = executor.run_forward(inputs)
        flat, spec = tree_flatten(output)
        tensor_positions = [k for k, item in enumerate(flat) if isinstance(item, torch.Tensor)]
        returned = [flat[k].detach() for k in tensor_positions]
        box["spec"], box["flat"], box["tensor_positions"] = spec, flat, tensor_positions
        ctx.executor, ctx.state = executor, state
        ctx.input_positions = box["input_positions"]
        ctx.mark_non_differentiable(*[t for t in returned if not (t.is_floating_point() or t.is_complex())])
        return tuple(returned)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        input_grads, parameter_grads = ctx.executor.run_backward(ctx.state, grads)
        ctx.state = None
        tensor_input_grads = [input_grads[k] for k in ctx.input_positions]
        return (None, None, *tensor_input_grads, *parameter_grads)


def run_schedule(executor: ScheduleExecutor, inputs: list[Any]) -> Any:
    """Run one step's forward under ``executor``; backward happens when autograd reaches it."""
    input_positions = [k for k, value in enumerate(inputs) if isinstance(value, torch.Tensor)]
    box: dict[str, Any] = {"inputs": inputs, "input_positions": input_positions}
    tensors = [inputs[k] for k in input_positions] + list(executor.parameters)
    returned = _ScheduleFunction.apply(executor, box, *tensors)
    flat = list(box["flat"])
    for position, tensor in zip(box["tensor_positions"], returned):
        flat[position] = tensor
    return tree_unflatten(flat, box["spec"])


class RecomputedModule(nn.Module):
    """Wraps a traced model and executes a recomputation plan in training.

    ``plan_for(inputs)`` is called with the placeholder values and returns ``(executor, plan)``; it is
    asked again whenever the inputs' shapes or dtypes change (plans are cached per signature).
    ``recompute_plan`` is the plan of the last signature used.
    """

    def __init__(self, model: nn.Module, graph_module: fx.GraphModule,
                 plan_for: Callable[[list[Any]], tuple[ScheduleExecutor, Any]]) -> None:
        super().__init__()
        for name, child in model._modules.items():
            self._modules[name] = child
        for name, parameter in model._parameters.items():
            self._parameters[name] = parameter
        for name, buffer in model._buffers.items():
            self._buffers[name] = buffer
        self._non_persistent_buffers_set = set(model._non_persistent_buffers_set)
        self.training = model.training
        object.__setattr__(self, "_graph_module", graph_module)
        object.__setattr__(self, "_plan_for", plan_for)
        object.__setattr__(self, "_plans", {})
        object.__setattr__(self, "_original_class", type(model).__name__)
        object.__setattr__(self, "_signature", inspect.signature(model.forward))
        object.__setattr__(self, "recompute_plan", None)
        self._placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]

    def _bind(self, args: tuple, kwargs: dict) -> list[Any]:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{self._original_class}.forward: {error}") from None
        bound.apply_defaults()
        values = []
        for node in self._placeholders:
            name = node.target.lstrip("*")
            if name in bound.arguments:
                values.append(bound.arguments[name])
            elif node.args:
                values.append(node.args[0])
            else:  # pragma: no cover - fx placeholders mirror the signature
                raise TypeError(f"missing argument {name!r}")
        return values

    def plan(self, *args: Any, **kwargs: Any) -> Any:
        """Plan (or fetch the cached plan) for inputs like these; returns the plan."""
        return self._executor_and_plan(self._bind(args, kwargs))[1]

    def _executor_and_plan(self, inputs: list[Any]) -> tuple[ScheduleExecutor, Any]:
        key = _signature_key(inputs)
        if key not in self._plans:
            self._plans[key] = self._plan_for(inputs)
        executor, plan = self._plans[key]
        object.__setattr__(self, "recompute_plan", plan)
        return executor, plan

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inputs = self._bind(args, kwargs)
        needs_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.parameters())
            or any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs))
        if not (self.training and needs_grad):
            return self._graph_module(*inputs)
        executor, _ = self._executor_and_plan(inputs)
        if executor.parameters_changed():
            executor = self._after_parameter_change(inputs)
        return run_schedule(executor, inputs)

    def _after_parameter_change(self, inputs: list[Any]) -> ScheduleExecutor:
        """Parameters were replaced since planning (assignment, ``requires_grad_``, FSDP2's unsharded
        parameters on its first all-gather): plan again, so gradients reach the tensors in use."""
        self._plans.clear()
        executor, _ = self._executor_and_plan(inputs)
        return executor

    def extra_repr(self) -> str:
        plan = self.recompute_plan
        return f"{self._original_class}, plan: {plan.one_line() if plan is not None else 'on first call'}"


def _signature_key(inputs: list[Any]) -> tuple:
    """Shapes, dtypes, devices and grad flags of the inputs, and the autocast settings (a plan priced in
    float32 is not the plan for a bfloat16 step)."""
    key: list[Any] = [autocast_state()]
    for value in tree_flatten(inputs)[0]:
        if isinstance(value, torch.Tensor):
            key.append((tuple(value.shape), value.dtype, value.device.type, value.requires_grad))
        else:
            key.append(repr(value))
    return tuple(key)
