"""Inductor as the code generator of the compiler path: ``rg.backend(budget, graph_compiler="inductor")``.

The plan is made, and lowered, exactly as for the default (``aot_eager``-style) graphs
(``compile_backend.budget_backend``): on the joint graph AOTAutograd traces without decompositions,
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
generated, uncompiled, with a warning. What inductor still does to memory, the plan does not price: it
fuses pointwise chains, so their intermediates never exist, its decomposed backward kernels hold other
temporaries than eager's, and its scheduler may still move a node next to a fused partner. So the
backend measures it (:func:`fit_plan_to_inductor`): inductor's code for the plan's graphs and the
graphs as generated run once each on real tensors shaped like the example inputs
(:func:`compiled_graphs_peak_bytes`), and what the first holds beyond the second
(:func:`inductor_excess_bytes`, ``Lowered.inductor_excess_bytes``) is added to the plan's predicted
step; where that is over the budget, the excess is taken from the budget and the graph planned again
(T5 of the conformance sample held 8 % more than its plan at 80 %, over the budget, before). Where no
plan fits so, each plan's code is measured again with inductor's fusion limited (``FUSION_LIMITED``,
carried to :func:`inductor_graph_compiler` in the graphs' ``meta``): an unrolled LSTM's fused kernels
spanned time steps and held 5.6x its plan. This is opt-in, not ``optimize()``'s path: it compiles each
graph at least twice.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Sequence

import torch
from torch import fx

from .errors import InfeasibleBudgetError, SolverError, user_stacklevel
from .joint_capture import op_name
from .joint_lowering import replay_random, rng_snapshot
from .joint_partition import boxed_interpreter, copy_graph_module
from .joint_units import is_tangent, tangents_held_through_backward
from .joint_costs import rng_state_bytes
from .native_kernels import with_kernel_layouts

__all__ = ["inductor_graph_compiler", "InductorFallbackWarning", "InductorBudgetWarning", "inductor_excess_bytes",
           "compiled_graphs_peak_bytes", "fit_plan_to_inductor"]


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
            if not isinstance(node.args[0], fx.Node):
                return "a random op without tensor inputs recomputed (its generator is named by a device)"
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


def inductor_graph_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """An AOTAutograd compiler for the forward or backward graph of ``joint_lowering.lower_schedule``:
    inductor's code for it (module docstring), in the boxed calling convention."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    is_backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)
    settings = dict(gm.meta.get(CONFIG_KEY, {}))  # a fusion limit ``fit_plan_to_inductor`` chose
    gm = copy_graph_module(gm)  # the Lowered keeps the graph as generated
    why = _with_custom_ops(gm)
    if why is not None:
        warnings.warn(f"{'backward' if is_backward else 'forward'} graph runs uncompiled: {why}",
                      InductorFallbackWarning, stacklevel=user_stacklevel())
        return boxed_interpreter(gm, example_inputs)
    with inductor_config.patch(fallback_random=True, layout_optimization=False, reorder_for_peak_memory=False,
                               **settings):
        decompositions = with_kernel_layouts({op: fn for op, fn in select_decomp_table().items()
                                              if op_name(op) != "native_dropout"})
        fake_mode = torch._guards.detect_fake_mode(example_inputs)  # AOTAutograd's: constants made fake too
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            decomposed = make_fx(fx.Interpreter(gm).run, decomposition_table=decompositions)(*example_inputs)
        return compile_fx_inner(decomposed, list(example_inputs), is_backward=is_backward)


class InductorBudgetWarning(UserWarning):
    """Inductor's code for a plan measured over the budget, and re-planning did not bring it within;
    or only limiting inductor's fusion did (the message says which)."""


#: How many times a plan is made again with less budget when inductor's code measures over it.
INDUCTOR_REPLANS = 3

#: Where a generated graph carries the ``torch._inductor.config`` settings it is compiled with (its
#: ``GraphModule.meta``), and the fusion limit tried when no plan fits with inductor's default fusion:
#: fused kernels of ops far apart in the graph (an unrolled LSTM's time steps) hold all their outputs
#: at once (``scripts/inductor_fusion_memory.py``: 5.6x the LSTM's store-all graphs, 1.005x unfused).
CONFIG_KEY = "recompute_graph_inductor_config"
FUSION_LIMITED = {"max_fusion_size": 1}


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _unique_bytes(values: Sequence[Any]) -> int:
    storages = {v.untyped_storage()._cdata: v.untyped_storage().nbytes() for v in values
                if isinstance(v, torch.Tensor)}
    return sum(storages.values())


def compiled_graphs_peak_bytes(forward_graph: fx.GraphModule, backward_graph: fx.GraphModule,
                               compiler: Any = None) -> int | None:
    """Peak bytes ``compiler``'s code (default inductor's) for the forward, then the backward graph,
    holds on real tensors shaped like the forward's placeholders, by the allocator
    (``loss_pricing.allocator_windows``), above the primals (parameters and inputs, live before the
    step): the forward's peak, or the backward's with its inputs (the values the forward saved, as the
    compiled forward lays them out, and the output gradients, all of them made), whichever is higher.
    Each graph is compiled here for the measurement (AOTAutograd compiles the graphs it is handed
    itself: the forward's compilation tells it the saved values' layout). None when the graphs cannot
    run on such tensors (symbolic shapes, data-dependent ops)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from .joint_allocations import _materialize
    from .loss_pricing import allocator_windows, node_window
    fake_values = [n.meta.get("val") for n in _placeholders(forward_graph)]
    if any(isinstance(v, torch.Tensor) and v.is_meta for v in fake_values):
        return None
    cuda = next((v.device for v in fake_values if isinstance(v, torch.Tensor) and v.is_cuda), None)
    fake_mode = torch._guards.detect_fake_mode(fake_values)
    try:
        compiler = compiler or inductor_graph_compiler
        forward = compiler(forward_graph, fake_values)
        with unset_fake_temporarily(), torch.random.fork_rng(devices=[cuda] if cuda is not None else []), \
                torch.no_grad():
            primals = {n.name: _materialize(n.meta.get("val")) for n in _placeholders(forward_graph)}
            with allocator_windows(False, cuda) as windows:
                with node_window("forward"):
                    outputs = forward(list(primals.values()))
            forward_start, forward_peak, _ = windows()["forward"]
            names = [n.name if isinstance(n, fx.Node) else None
                     for n in next(n for n in forward_graph.graph.nodes if n.op == "output").args[0]]
            saved = dict(zip(names, outputs))
            del outputs
            args = [primals[n.name] if n.name in primals else saved[n.name] if n.name in saved
                    else _materialize(n.meta.get("val")) for n in _placeholders(backward_graph)]
            del saved
            held = _unique_bytes([a for a, n in zip(args, _placeholders(backward_graph)) if n.name not in primals])
            # fake values laid out as the forward made them, without new symbols in Dynamo's shape env
            like = [fake_mode.from_tensor(a, static_shapes=True)
                    if fake_mode is not None and isinstance(a, torch.Tensor) else a for a in args]
        backward = compiler(backward_graph, like)
        with unset_fake_temporarily(), torch.random.fork_rng(devices=[cuda] if cuda is not None else []), \
                torch.no_grad():
            # where AOTAutograd's runtime holds the output gradients through its backward, so does this
            tangents = [a for a, n in zip(args, _placeholders(backward_graph)) if is_tangent(n)] \
                if tangents_held_through_backward() else []
            with allocator_windows(False, cuda) as windows:
                with node_window("backward"):
                    backward(args)
                    del args
            del tangents
            backward_start, backward_peak, _ = windows()["backward"]
    except Exception:  # noqa: BLE001 - no measurement: the plan's prediction stands
        return None
    return max(forward_peak - forward_start, held + backward_peak - backward_start)


def inductor_excess_bytes(lowered: Any) -> int | None:
    """What inductor's code for ``lowered``'s graphs holds beyond the graphs as generated, both measured
    the same way (:func:`compiled_graphs_peak_bytes`; the generated graphs hold what the plan predicts):
    its fusions and its decomposed backward kernels' temporaries, what the plan does not price. None
    when either cannot be measured."""
    backward = lowered.planned_backward_graph  # (with the unreached outputs' tangents folded away, if any)
    compiled = compiled_graphs_peak_bytes(lowered.forward_graph, backward)
    generated = compiled_graphs_peak_bytes(lowered.forward_graph, backward, boxed_interpreter)
    return None if compiled is None or generated is None else compiled - generated


def fit_plan_to_inductor(lowered: Any, budget_bytes: int, replan: Any) -> Any:
    """``lowered`` with ``inductor_excess_bytes`` measured. Where the plan's smallest budget
    (``RecomputePlan.min_budget_bytes``, what the planner judged it by) with that excess runs over
    ``budget_bytes``, the graph is planned again with the excess taken from the budget
    (``replan(budget_bytes)`` -> a new lowering), up to ``INDUCTOR_REPLANS`` times; the first plan that
    fits is kept, else the one predicted lowest with its excess, and an :class:`InductorBudgetWarning`
    says by how much it is over. An excess of 0 or less keeps the plan as it is, also one the planner
    could not fit (a floor plan, or ``store_all`` under its step): inductor adds nothing to it. An excess
    as large as the budget is not planned again (no budget would be left), and one that no plan fits
    keeps the plans measured (``replan`` raised ``InfeasibleBudgetError``: ``store_all``, or the floor).
    Where no plan fits, each measured plan's code is measured again with inductor's fusion limited
    (``FUSION_LIMITED``, set in the graphs' ``meta``): the first that fits is kept, else the lowest step
    of all, fused or not, and the warning says which.
    """
    import dataclasses

    tried = []
    excess_taken = 0
    no_plan = ""
    for attempt in range(INDUCTOR_REPLANS + 1):
        excess = inductor_excess_bytes(lowered)
        if excess is None:
            return lowered
        lowered = dataclasses.replace(lowered, inductor_excess_bytes=excess)
        if _fits(lowered, budget_bytes):
            return lowered
        step = lowered.predicted_step_peak_bytes
        tried.append((step, attempt, lowered))
        excess_taken = max(excess_taken, excess)
        if attempt == INDUCTOR_REPLANS or excess_taken >= budget_bytes:
            break
        try:
            replanned = replan(budget_bytes - excess_taken)
        except (InfeasibleBudgetError, SolverError) as error:  # no plan at that budget (store_all's own)
            no_plan = str(error).split(";")[0]
            break
        if any(replanned.plan.schedule == other.plan.schedule for _, _, other in tried):
            break  # at the floor, or back to a plan measured already
        lowered = replanned
    fused_less = []  # each plan's code with fusion limited, the budget's own plan first
    for _, attempt, plan in tried:
        limited = _fused_less(plan)
        if limited is not None:
            fused_less.append((limited.predicted_step_peak_bytes, attempt, limited))
            if _fits(limited, budget_bytes):
                break
    fits = bool(fused_less) and _fits(fused_less[-1][2], budget_bytes)
    step, _, best = fused_less[-1] if fits else min(tried + fused_less, key=lambda t: (t[0], t[1]))
    for _, _, limited in fused_less:
        if limited is not best:
            _set_fusion_limit(limited, False)
    if any(limited is best for _, _, limited in fused_less):
        fused = next(plan for _, _, plan in tried if plan.plan is best.plan)
        warnings.warn(f"inductor's fused code for the plan held {fused.inductor_excess_bytes} bytes more than the plan "
                      f"predicts, more than the budget of {budget_bytes} leaves room for; compiled with "
                      f"{FUSION_LIMITED} it holds {best.inductor_excess_bytes} bytes more (its step predicted at "
                      f"{step} bytes{', within the budget' if fits else ''}) and runs slower. Raise the budget for "
                      "inductor's fused code, or leave graph_compiler unset.", InductorBudgetWarning,
                      stacklevel=user_stacklevel())
        return best
    again = ("after planning again with less budget" if len(tried) > 1 else
             f"and planning again with less budget failed: {no_plan}" if no_plan else
             "more than the budget, so it was not planned again" if excess_taken >= budget_bytes
             else "and planning again with less budget made the same plan")
    warnings.warn(f"inductor's code for the plan holds {best.inductor_excess_bytes} bytes more than the plan "
                  f"predicts ({again}): its step is predicted at {step} bytes against the budget of "
                  f"{budget_bytes}. Lower the budget, or leave graph_compiler unset: the generated graphs "
                  "hold what the plan predicts.",
                  InductorBudgetWarning, stacklevel=user_stacklevel())
    return best


def _fits(lowered: Any, budget_bytes: int) -> bool:
    """Whether ``lowered``'s plan, with inductor's measured excess, fits ``budget_bytes`` as the planner
    judges a plan (``min_budget_bytes``); an excess of 0 or less adds nothing to the plan's own fit."""
    excess = lowered.inductor_excess_bytes
    return excess <= 0 or lowered.plan.min_budget_bytes + excess <= budget_bytes


def _set_fusion_limit(lowered: Any, limited: bool) -> None:
    for graph_module in (lowered.forward_graph, lowered.backward_graph, lowered.planned_backward_graph):
        if limited:
            graph_module.meta[CONFIG_KEY] = dict(FUSION_LIMITED)
        else:
            graph_module.meta.pop(CONFIG_KEY, None)


def _fused_less(lowered: Any) -> Any:
    """``lowered`` with its graphs set to compile with ``FUSION_LIMITED`` and that code's excess; None
    (the graphs as they were) when it cannot be measured."""
    import dataclasses
    _set_fusion_limit(lowered, True)
    excess = inductor_excess_bytes(lowered)
    if excess is None:
        _set_fusion_limit(lowered, False)
        return None
    return dataclasses.replace(lowered, inductor_excess_bytes=excess)
