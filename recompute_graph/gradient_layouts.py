"""Parameter gradients laid out as ``.grad`` takes them, where the backward makes them.

Autograd's ``AccumulateGrad`` keeps a parameter's new gradient as ``.grad`` only when its strides are
the parameter's (the *layout contract*: equal strides wherever a size is not 1); otherwise it copies it
into the parameter's layout (``clone_obey_contract``) and the gradient it was given is freed. A
convolution whose input is channels-last makes its weight's gradient channels-last, so a model that
permutes its activations (timm's PoolFormer v2, ``LayerNorm2d`` between its convolutions) gets one such
copy per convolution. Eager PyTorch makes each copy as soon as the gradient is made. A compiled step
returns every parameter gradient at the end of its backward graph, so the copies are made there, on
top of the step's highest level: ``poolformerv2_s12`` (64 x 64, batch 2) measured 51,433,616 B against
48,843,172 B predicted, 1.053 (session 48).

:func:`conform_parameter_gradients` adds each copy to the joint graph where its gradient is made (an
``aten.clone`` into the parameter's memory format), so the backward returns gradients autograd keeps as
they are, the copies happen where eager makes them, and the plan prices them. Units: none (a graph pass).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import fx

from .joint_coefficients import is_tangent

__all__ = ["obeys_layout_contract", "conform_parameter_gradients"]


def obeys_layout_contract(gradient: torch.Tensor, parameter: torch.Tensor) -> bool:
    """Whether autograd keeps ``gradient`` as ``parameter.grad`` without a copy (its
    ``obeys_layout_contract`` for dense parameters): equal strides wherever the size is not 1, no 0
    stride where it is."""
    if gradient.shape != parameter.shape:
        return False
    return all((g == p) if size != 1 else g != 0
               for size, g, p in zip(gradient.shape, gradient.stride(), parameter.stride()))


def _memory_format(parameter: torch.Tensor) -> "torch.memory_format | None":
    """The memory format whose dense layout is ``parameter``'s (None for another layout)."""
    for memory_format in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d):
        try:
            if parameter.is_contiguous(memory_format=memory_format):
                return memory_format
        except RuntimeError:  # (channels-last of a tensor of another rank)
            continue
    return None


def conform_parameter_gradients(joint: fx.GraphModule, num_fwd_outputs: int,
                                leaf_positions: Sequence[int]) -> int:
    """Copy each gradient of a leaf of ``joint`` that autograd would copy into the leaf's layout, where it
    is made (module docstring). ``leaf_positions``: which primals (AOTAutograd's flat inputs, in order)
    are leaves that require grad (parameters; an earlier graph's output is not: its gradient goes to
    that graph's backward); the joint graph's outputs after the first ``num_fwd_outputs`` are the
    primals' gradients in that order. Returns how many copies it added."""
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and not is_tangent(n)]
    output = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    outputs = list(output.args[0])
    if len(outputs) - num_fwd_outputs != len(primals):
        return 0
    added = 0
    for position in leaf_positions:
        gradient, parameter = outputs[num_fwd_outputs + position], primals[position].meta.get("val")
        value = gradient.meta.get("val") if isinstance(gradient, fx.Node) else None
        if not isinstance(value, torch.Tensor) or not isinstance(parameter, torch.Tensor) or \
                value.shape != parameter.shape or obeys_layout_contract(value, parameter):
            continue
        memory_format = _memory_format(parameter)
        if memory_format is None:
            continue
        with joint.graph.inserting_after(gradient):
            copy = joint.graph.call_function(torch.ops.aten.clone.default, (gradient,),
                                             {"memory_format": memory_format})
        copy.meta["val"] = _fake_clone(value, memory_format)
        outputs[num_fwd_outputs + position] = copy
        added += 1
    if added:
        output.args = (type(output.args[0])(outputs), *output.args[1:])
        joint.recompile()
    return added


def _fake_clone(value: Any, memory_format: torch.memory_format) -> Any:
    from torch._guards import detect_fake_mode
    mode = detect_fake_mode([value])
    if mode is None:
        return value.clone(memory_format=memory_format)
    with mode:
        return torch.ops.aten.clone.default(value, memory_format=memory_format)
