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

It also gives one op's fake value the layout its kernels give it. The Meta kernel of
``native_layer_norm_backward`` (its Python decomposition) lays the input's gradient out like the
incoming gradient, where the CPU and CUDA kernels make it contiguous. A layer norm whose gradient
arrives transposed (Swin's last norm, before its pooling) was then traced with a ``clone`` and an
``_unsafe_view`` where eager PyTorch's ``reshape`` is a view: a copy of the gradient eager never makes,
at the peak of tiny Swin models (``tv_swin_t`` held 1.028 of eager's peak in a store-all step).
:func:`native_kernels` makes that gradient contiguous while AOTAutograd traces, and
:func:`with_kernel_layouts` does the same to a decomposition table (inductor's).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch._C import DispatchKey

__all__ = ["KEPT_OPS", "native_kernels", "with_kernel_layouts"]

_aten = torch.ops.aten

#: the ops kept whole in a captured joint graph (every overload that has a Python kernel)
KEPT_OPS = (_aten.upsample_linear1d.vec, _aten.upsample_bilinear2d.vec, _aten.upsample_bilinear2d.default,
            _aten.upsample_trilinear3d.vec, _aten.upsample_bicubic2d.vec, _aten.upsample_bicubic2d.default)

_KEYS = (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd)


#: ops whose kernels return their first output contiguous, where the Meta kernel does not always
CONTIGUOUS_FIRST_OUTPUT = (_aten.native_layer_norm_backward.default,)


def _contiguous_first(kernel: Callable[..., Any]) -> Callable[..., Any]:
    def laid_out_as_the_kernel(*args: Any, **kwargs: Any) -> Any:
        first, *rest = kernel(*args, **kwargs)
        return (first.contiguous() if first is not None else None, *rest)
    laid_out_as_the_kernel.laid_out = True  # type: ignore[attr-defined]
    # (fake tensors run a decomposition of ``torch._decomp``'s own in place of the Meta kernel)
    laid_out_as_the_kernel.__module__, laid_out_as_the_kernel.__name__ = kernel.__module__, kernel.__name__
    return laid_out_as_the_kernel


def with_kernel_layouts(decompositions: dict[Any, Callable[..., Any]]) -> dict[Any, Callable[..., Any]]:
    """``decompositions`` with those of :data:`CONTIGUOUS_FIRST_OUTPUT` returning their first output
    contiguous, as the kernels do (module docstring)."""
    table = dict(decompositions)
    for op in CONTIGUOUS_FIRST_OUTPUT:
        if op in table and not getattr(table[op], "laid_out", False):
            table[op] = _contiguous_first(table[op])
    return table


@contextlib.contextmanager
def native_kernels() -> Iterator[None]:
    """While the block runs, :data:`KEPT_OPS` dispatch to their C++ kernels, and the fake values of
    :data:`CONTIGUOUS_FIRST_OUTPUT` are laid out as their kernels lay them out (module docstring)."""
    removed, replaced = [], []
    for op in KEPT_OPS:
        for key in _KEYS:
            if key in op.py_kernels:
                removed.append((op, key, op.py_kernels.pop(key)))
        op._dispatch_cache.clear()
    from torch._decomp import decomposition_table  # (what fake tensors run for these ops)
    for op in CONTIGUOUS_FIRST_OUTPUT:
        kernel = decomposition_table.get(op)
        if kernel is not None and not getattr(kernel, "laid_out", False):
            replaced.append((op, kernel))
            decomposition_table[op] = _contiguous_first(kernel)
    try:
        yield
    finally:
        for op, key, kernel in removed:
            op.py_kernels[key] = kernel
        for op, kernel in replaced:
            decomposition_table[op] = kernel
        for op in KEPT_OPS:
            op._dispatch_cache.clear()
