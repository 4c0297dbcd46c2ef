"""Inductor as the code generator of the compiler path: ``rg.backend(budget, graph_compiler="inductor")``.

The plan is made, and lowered, exactly as for the default (``aot_eager``-style) graphs
(``joint_lowering.budget_backend``): on the joint graph AOTAutograd traces without decompositions,
whose ops the planner's rules know (a training BatchNorm recomputed without its statistics, a dropout
replayed from an RNG snapshot). Only then is each generated graph, the forward and the backward with its
recompute nodes, handed to inductor (:func:`inductor_graph_compiler`):

1. the lowering's two Python helpers become custom ops inductor can call as they are
   (``recompute_graph::rng_snapshot``, ``recompute_graph::replay_native_dropout``);
2. the graph is retraced with inductor's decompositions (``make_fx``), except ``native_dropout``;
3. ``compile_fx_inner`` compiles it with ``fallback_random=True``: random ops run as torch's own
   kernels, so a dropout draws the mask eager autograd draws, and its replay in the backward the same
   mask again. (Inductor's own random numbers, ``rand``-based dropout, could not be replayed.) Two of
   inductor's memory-moving passes are off, because the plan was priced without them:
   ``layout_optimization`` (a convolutional network turned channels-last: the small ResNet-18's
   store-all step measured 1.45x its prediction on CPU, 1.000 without) and ``reorder_for_peak_memory``
   (its own estimate reorders the planned backward: GPT-2 tiny at 70 % measured 0.884 of the
   prediction with it, 0.951 without; the small ResNet-18 at 90 % 0.965 with it, 0.936 without).

A recomputed random op other than ``native_dropout`` is not supported there: that graph runs as
generated, uncompiled, with a warning. What inductor still does to memory, unpriced: it fuses
pointwise chains, so their intermediates never exist, its decomposed backward kernels hold other
temporaries than eager's, and its scheduler may still move a node next to a fused partner. The
prediction is 0.93-1.10 of the measured peak on the tiny zoo models (``python scripts/compiler_check.py
--inductor``), but T5 of the conformance sample measures 8 % above it at 80 %, over the budget
(docs/compiler.md), so this is opt-in, not ``optimize()``'s path.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Sequence

import torch
from torch import fx

from .joint_capture import op_name
from .joint_lowering import replay_random, rng_snapshot
from .joint_partition import boxed_interpreter
from .joint_costs import rng_state_bytes

__all__ = ["inductor_graph_compiler", "InductorFallbackWarning"]


class InductorFallbackWarning(UserWarning):
    """A generated graph inductor cannot compile as planned runs uncompiled (the message says why)."""


_OPS: dict[str, Any] = {}


def _custom_ops() -> dict[str, Any]:
    """``recompute_graph::rng_snapshot`` and ``recompute_graph::replay_native_dropout``, registered once."""
    if _OPS:
        return _OPS

    @torch.library.custom_op("recompute_graph::rng_snapshot", mutates_args=())
    def snapshot(like: torch.Tensor) -> torch.Tensor:
        return rng_snapshot(like).clone()

    @snapshot.register_fake
    def _(like: torch.Tensor) -> torch.Tensor:
        return torch.empty(rng_state_bytes(like.device if like.is_cuda else None), dtype=torch.uint8,
                           device=like.device if like.is_cuda else "cpu")

    @torch.library.custom_op("recompute_graph::replay_native_dropout", mutates_args=())
    def replay(state: torch.Tensor, x: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
        out, mask = replay_random(state, x, torch.ops.aten.native_dropout.default, x, p, train)
        return out.clone(), mask.clone()

    @replay.register_fake
    def _(state: torch.Tensor, x: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)

    _OPS.update(snapshot=torch.ops.recompute_graph.rng_snapshot.default,
                replay=torch.ops.recompute_graph.replay_native_dropout.default)
    return _OPS


def _with_custom_ops(gm: fx.GraphModule) -> str | None:
    """Put the custom ops in place of the lowering's Python helpers in ``gm``; the reason it cannot be
    compiled by inductor, or None."""
    ops = _custom_ops()
    for node in list(gm.graph.nodes):
        if node.target is rng_snapshot:
            node.target = ops["snapshot"]
        elif node.target is replay_random:
            state, _like, target, *args = node.args
            if op_name(target) != "native_dropout" or node.kwargs:
                return f"a recomputed {op_name(target)} (only native_dropout is replayed under inductor)"
            x, p, train = (list(args) + [None])[:3]
            node.target, node.args = ops["replay"], (state, x, p, train)
        elif node.target is torch.ops.aten.view.default:
            # the retrace's decompositions may lay a result out otherwise than the op the ``view`` was
            # traced against (HF GPT-2's attention: "Cannot view a tensor with shape [2, 4, 8, 16] and
            # strides (512, 8, 1, 32)"); ``reshape`` is that view wherever one exists
            node.target = torch.ops.aten.reshape.default
    gm.recompile()
    return None


def _copy_of(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph module over ``gm``'s attributes with copies of its nodes (their ``meta`` copied
    shallowly: a deep copy of the fake values fails on models with tensor constants, HF GPT-2 and T5)."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return fx.GraphModule(gm, graph)


def inductor_graph_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """An AOTAutograd compiler for the forward or backward graph of ``joint_lowering.lower_schedule``:
    inductor's code for it (module docstring), in the boxed calling convention."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    is_backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)
    gm = _copy_of(gm)  # the Lowered keeps the graph as generated
    why = _with_custom_ops(gm)
    if why is not None:
        warnings.warn(f"{'backward' if is_backward else 'forward'} graph runs uncompiled: {why}",
                      InductorFallbackWarning, stacklevel=2)
        return boxed_interpreter(gm, example_inputs)
    with inductor_config.patch(fallback_random=True, layout_optimization=False, reorder_for_peak_memory=False):
        decompositions = {op: fn for op, fn in select_decomp_table().items()
                          if op_name(op) != "native_dropout"}
        fake_mode = torch._guards.detect_fake_mode(example_inputs)  # AOTAutograd's: constants made fake too
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            decomposed = make_fx(fx.Interpreter(gm).run, decomposition_table=decompositions)(*example_inputs)
        return compile_fx_inner(decomposed, list(example_inputs), is_backward=is_backward)
