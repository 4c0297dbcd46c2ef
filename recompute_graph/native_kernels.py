"""The aten ops the compiler path captures as themselves, not as PyTorch's Python decompositions of them.

AOTAutograd traces a step through the Python kernels PyTorch registers on some ops' autograd keys
(``op.py_impl(DispatchKey.Autograd)``, ``torch/_decomp/decompositions.py``), so the joint graph holds
their decomposition rather than the op. For interpolation that decomposition is four gathers of the
input in the forward and, in the backward, four input-sized buffers of zeros scattered into and summed:
inductor fuses them into one kernel, but the graphs the compiler path runs by default (AOTAutograd's
interpreter) hold each one. SegFormer's decode head, which upsamples four feature maps bilinearly, took
1.41 times eager PyTorch's peak in a store-all step of the compiler path; with the op kept, 0.97
(``pytest tests/test_compiled_optimize.py -k interpolation``).

:func:`native_kernels` takes those Python kernels off while AOTAutograd traces (``compile_backend``'s
compilations and ``joint_capture.capture_joint``) and puts them back after: the ops then reach the graph
as ``aten.upsample_bilinear2d`` and its ``_backward``, whose eager kernels allocate the output and the
input's gradient only. Nearest-neighbour upsampling stays decomposed: its decomposition is one gather,
and its backward one scatter into one buffer, as the kernel's. The kernels are process-wide: a model
traced by another thread meanwhile would not see the decompositions either.

It also gives some ops' fake values the layouts their kernels give them (:data:`KERNEL_LAYOUTS`).
Fake tensors (and the Meta device) run a Python decomposition for these ops, which lays the result out
otherwise than the kernel for some layouts of the inputs. A graph traced so is wrong about the layout
the step will see:

- ``softplus_backward``'s kernel (TensorIterator) keeps the layout of a gradient that arrives
  transposed, where its decomposition makes it contiguous. transformers' Doge computes a gate as
  ``exp(A * softplus(linear(v))).transpose(-1, -2)``, and the linear's backward was traced as a
  ``view`` of that gradient, which fails on the kernel's layout: the step raised (so does
  ``torch.compile(backend="aot_eager")``, by the same trace).
- ``native_layer_norm_backward``'s decomposition lays the input's gradient out like the incoming
  gradient, where the kernels make it contiguous. A layer norm whose gradient arrives transposed (Swin's
  last norm) was traced with a ``clone`` and an ``_unsafe_view`` where eager PyTorch's ``reshape`` is a
  view: a copy eager never makes (``tv_swin_t`` held 1.028 of eager's peak in a store-all step).

While AOTAutograd traces, :func:`native_kernels` wraps each such decomposition so that its first output
is laid out as the kernel lays it out (a copy into that layout, free on fake tensors), and drops those
ops' entries from fake tensors' dispatch cache on the way in and out (made outside, they would be handed
out inside). :func:`with_kernel_layouts` wraps inductor's decompositions alike, so that the generated
graphs' views trace again there. Each rule was checked against the CPU kernels on every pair of four
layouts of 4-d inputs (``tests/test_native_kernels.py``); a rule set by a device-specific kernel's own
code (batch norm, group norm, GLU, binary cross-entropy, log-sigmoid) is applied on the CPU only, and a
decomposition fake tensors do not run (``copysign``'s reference) is not reached this way.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch._C import DispatchKey
from torch._prims_common import compute_elementwise_output_strides, suggest_memory_format

__all__ = ["KEPT_OPS", "KERNEL_LAYOUTS", "KernelLayout", "native_kernels", "with_kernel_layouts"]

_aten = torch.ops.aten

#: the ops kept whole in a captured joint graph (every overload that has a Python kernel)
KEPT_OPS = (_aten.upsample_linear1d.vec, _aten.upsample_bilinear2d.vec, _aten.upsample_bilinear2d.default,
            _aten.upsample_trilinear3d.vec, _aten.upsample_bicubic2d.vec, _aten.upsample_bicubic2d.default)

_KEYS = (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd)


@dataclass(frozen=True)
class KernelLayout:
    """How an op's kernels lay out its (first) output: ``"elementwise"``, as TensorIterator does from
    the tensor arguments at ``arguments`` in that order (``compute_elementwise_output_strides``);
    ``"contiguous"``; or ``"memory_format"``, contiguous in the suggested memory format of the tensor at
    ``arguments[0]`` (channels-last for a channels-last input). ``devices``: the device types whose
    kernels were checked to do so (``None``: every device, the layout being set by code the devices
    share, a structured kernel's meta function or TensorIterator)."""

    rule: str
    arguments: tuple[int, ...] = ()
    devices: "tuple[str, ...] | None" = None

    def strides(self, args: tuple, kwargs: dict, schema: Any, first: torch.Tensor) -> "tuple[int, ...] | None":
        """The strides the kernel gives ``first`` for these arguments, or None where the rule does not
        apply (another device, an argument that is not a tensor)."""
        if self.devices is not None and first.device.type not in self.devices:
            return None
        tensors = []
        for position in self.arguments:
            value = args[position] if position < len(args) else kwargs.get(schema.arguments[position].name)
            if not isinstance(value, torch.Tensor):
                return None
            tensors.append(value)
        if self.rule == "elementwise":  # (same-shaped operands only: a broadcast one is left as it is)
            return tuple(compute_elementwise_output_strides(*tensors)) \
                if all(t.shape == first.shape for t in tensors) else None
        memory_format = suggest_memory_format(tensors[0]) if self.rule == "memory_format" else torch.contiguous_format
        return tuple(torch.empty(first.shape, device="meta").contiguous(memory_format=memory_format).stride())


_CPU = ("cpu",)
#: ops whose fake values (their Python decompositions, which fake tensors and the Meta device run) are
#: laid out otherwise than their kernels lay them out, for some layouts of their inputs. Each was
#: checked against the CPU kernels on every pair of four layouts of 4-d inputs
#: (``tests/test_native_kernels.py``); a device-specific kernel's rule holds on the CPU only.
KERNEL_LAYOUTS: dict[Any, KernelLayout] = {
    # TensorIterator over (grad_output, input): the layout of the incoming gradient where it decides
    **{op: KernelLayout("elementwise", (0, 1)) for op in (
        _aten.softplus_backward.default, _aten.hardswish_backward.default, _aten.hardsigmoid_backward.default,
        _aten.hardtanh_backward.default, _aten.logit_backward.default, _aten.native_dropout_backward.default,
        _aten.floor_divide.default)},
    _aten.elu_backward.default: KernelLayout("elementwise", (0, 5)),
    # contiguous: log-softmax's structured meta function, the losses' shared backward code, layer norm's kernels
    **{op: KernelLayout("contiguous") for op in (
        _aten._log_softmax_backward_data.default,
        _aten.mse_loss_backward.default, _aten.huber_loss_backward.default, _aten.smooth_l1_loss_backward.default,
        _aten.native_layer_norm_backward.default)},
    # the CPU kernels' own choices
    **{op: KernelLayout("contiguous", devices=_CPU) for op in (
        _aten.glu_backward.default, _aten.log_sigmoid_forward.default)},
    _aten.binary_cross_entropy.default: KernelLayout("elementwise", (0,), _CPU),
    _aten.binary_cross_entropy_backward.default: KernelLayout("elementwise", (1,), _CPU),
    **{op: KernelLayout("memory_format", (0,), _CPU) for op in (
        _aten.native_batch_norm.default, _aten._native_batch_norm_legit_functional.default,
        _aten._native_batch_norm_legit.default, _aten._native_batch_norm_legit_no_training.default)},
    **{op: KernelLayout("memory_format", (1,), _CPU) for op in (
        _aten.native_batch_norm_backward.default, _aten.batch_norm_backward.default,
        _aten.native_group_norm_backward.default)},
}


def _laid_out_as_the_kernel(op: Any, kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel`` (a Python decomposition of ``op``) with its first output laid out as
    :data:`KERNEL_LAYOUTS` says the op's kernels lay it out (a copy, on fake tensors free)."""
    layout = KERNEL_LAYOUTS[op]

    def laid_out_as_the_kernel(*args: Any, **kwargs: Any) -> Any:
        result = kernel(*args, **kwargs)
        several = isinstance(result, (tuple, list))
        first = result[0] if several else result
        if not isinstance(first, torch.Tensor):
            return result
        strides = layout.strides(args, kwargs, op._schema, first)
        if strides is not None and tuple(first.stride()) != strides:
            first = torch.empty_strided(first.shape, strides, dtype=first.dtype, device=first.device).copy_(first)
        return (first, *result[1:]) if several else first
    laid_out_as_the_kernel.laid_out = True  # type: ignore[attr-defined]
    # (fake tensors run a decomposition of ``torch._decomp``'s own in place of the Meta kernel)
    laid_out_as_the_kernel.__module__, laid_out_as_the_kernel.__name__ = kernel.__module__, kernel.__name__
    return laid_out_as_the_kernel


def with_kernel_layouts(decompositions: dict[Any, Callable[..., Any]]) -> dict[Any, Callable[..., Any]]:
    """``decompositions`` with those of :data:`KERNEL_LAYOUTS` laying out their first output as the
    kernels do (module docstring)."""
    table = dict(decompositions)
    for op in KERNEL_LAYOUTS:
        if op in table and not getattr(table[op], "laid_out", False):
            table[op] = _laid_out_as_the_kernel(op, table[op])
    return table


def _forget_fake_results(ops: Any) -> None:
    """Drop the fake values of ``ops`` that fake tensors' dispatch cache (one for the process) holds:
    made outside :func:`native_kernels` they would be handed out inside it, and the other way round."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    for key in [key for key in FakeTensorMode.cache if key.key and key.key[0] in ops]:
        FakeTensorMode.cache.pop(key, None)


@contextlib.contextmanager
def native_kernels() -> Iterator[None]:
    """While the block runs, :data:`KEPT_OPS` dispatch to their C++ kernels, and the fake values of
    :data:`KERNEL_LAYOUTS` are laid out as their kernels lay them out (module docstring)."""
    removed, replaced = [], []
    for op in KEPT_OPS:
        for key in _KEYS:
            if key in op.py_kernels:
                removed.append((op, key, op.py_kernels.pop(key)))
        op._dispatch_cache.clear()
    from torch._decomp import decomposition_table  # (what fake tensors run for these ops)
    for op in KERNEL_LAYOUTS:
        kernel = decomposition_table.get(op)
        if kernel is not None and not getattr(kernel, "laid_out", False):
            replaced.append((op, kernel))
            decomposition_table[op] = _laid_out_as_the_kernel(op, kernel)
    _forget_fake_results(KERNEL_LAYOUTS)
    try:
        yield
    finally:
        for op, key, kernel in removed:
            op.py_kernels[key] = kernel
        for op, kernel in replaced:
            decomposition_table[op] = kernel
        _forget_fake_results(KERNEL_LAYOUTS)
        for op in KEPT_OPS:
            op._dispatch_cache.clear()
