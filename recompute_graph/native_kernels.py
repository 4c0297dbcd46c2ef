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
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch._C import DispatchKey

__all__ = ["KEPT_OPS", "native_kernels"]

_aten = torch.ops.aten

#: the ops kept whole in a captured joint graph (every overload that has a Python kernel)
KEPT_OPS = (_aten.upsample_linear1d.vec, _aten.upsample_bilinear2d.vec, _aten.upsample_bilinear2d.default,
            _aten.upsample_trilinear3d.vec, _aten.upsample_bicubic2d.vec, _aten.upsample_bicubic2d.default)

_KEYS = (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd)


@contextlib.contextmanager
def native_kernels() -> Iterator[None]:
    """While the block runs, :data:`KEPT_OPS` dispatch to their C++ kernels (module docstring)."""
    removed = []
    for op in KEPT_OPS:
        for key in _KEYS:
            if key in op.py_kernels:
                removed.append((op, key, op.py_kernels.pop(key)))
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, key, kernel in removed:
            op.py_kernels[key] = kernel
        for op in KEPT_OPS:
            op._dispatch_cache.clear()
