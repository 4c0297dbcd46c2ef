"""Does any op of a model's joint graph get another layout from its kernel than from its fake value?

    python scripts/kernel_layouts_check.py [NAME ...]      (default: every conformance model)

For each conformance model (``models_zoo.third_party``): ``torch.compile(model, backend=rg.backend(1.0))``
traces its joint forward+backward graph as training does (with ``native_kernels``' layouts), and the
graph is then run on real tensors laid out as its fake inputs (``joint_allocations``' filled tensors),
comparing each node's result with its fake value: strides that differ in a dimension of size above 1
are a layout the trace got wrong (docs/compiler.md, Stage 1). Prints ``NAME ok`` or the ops that
differ (how many nodes, and the first one's shape, kernel strides and fake strides). Session 48: 104 of
104 ok on the CPU. A run of the graph that fails is reported as ``RUN FAILED``.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
from torch import fx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import recompute_graph as rg  # noqa: E402
from models_zoo import third_party  # noqa: E402
from models_zoo.conformance import call_of  # noqa: E402
from recompute_graph.joint_allocations import _real_inputs  # noqa: E402


def layout_differences(joint: fx.GraphModule, joint_inputs: Any) -> dict[str, list[tuple]]:
    """Per op, the nodes whose kernel result is laid out otherwise than their fake value:
    ``(shape, kernel strides, fake strides)``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    found: dict[str, list[tuple]] = {}
    with unset_fake_temporarily():
        made = _real_inputs(joint_inputs)
        if made is None:
            return found

        class Compared(fx.Interpreter):
            def run_node(self, node: fx.Node) -> Any:
                result = super().run_node(node)
                fake = node.meta.get("val")
                if node.op == "call_function" and isinstance(result, torch.Tensor) and \
                        isinstance(fake, torch.Tensor) and result.shape == fake.shape and \
                        any(size != 1 and a != b for size, a, b in zip(result.shape, result.stride(), fake.stride())):
                    found.setdefault(str(node.target), []).append((tuple(result.shape), result.stride(),
                                                                   fake.stride()))
                return result
        try:
            with torch.no_grad():
                Compared(joint).run(*made[0])
        except Exception as error:  # noqa: BLE001 - reported, not raised
            found.setdefault("RUN FAILED", []).append((str(error)[:100],))
    return found


def main(names: list[str]) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    third_party.import_timm()
    for name in names or list(third_party.CONFORMANCE_MODELS):
        if not third_party.available(name):
            print(f"{name}: not installed")
            continue
        found: dict[str, list[tuple]] = {}
        torch._dynamo.reset()
        model, call = third_party.build(name)
        args, kwargs = call_of(call)
        try:
            backend = rg.backend(1.0, on_joint=lambda joint, inputs: found.update(layout_differences(joint, inputs)))
            torch.compile(model, backend=backend, dynamic=False)(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a row per model
            print(f"{name} error: {type(error).__name__}: {str(error)[:100]}", flush=True)
            continue
        print(name, {op: (len(rows), rows[0]) for op, rows in found.items()} or "ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
