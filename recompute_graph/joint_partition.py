"""Lowering a choice of saved values into a forward and a backward graph with recompute nodes.

AOTAutograd hands a *partitioner* the joint forward+backward graph of a model: placeholders for the
primals (parameters, buffers, inputs) and the tangents (the gradients of the outputs), the forward ops,
and the backward ops. The partitioner decides which forward values the backward reads from memory
(*saved*) and which it computes again (*recomputed*), and returns two graphs:

* a forward ``fx.GraphModule`` returning the model's outputs and exactly the saved values;
* a backward ``fx.GraphModule`` taking the saved values and the tangents, in which every forward op the
  backward needs and that was not saved is duplicated (a *recompute node*) and placed right before its
  first use, so that it is live only from there to its last use (fx frees a value after its last use).

Here the forward nodes are the nodes that do not depend on a tangent. :func:`partition_with_policy`
asks a policy which forward tensors it would keep, then walks back from what the backward reads: a
kept value ends the walk and is saved, any other forward op on the way is recomputed. Whatever the
policy says:

* a random op's outputs are saved (recomputing one would draw a new mask), and so are those of an op
  that reads state the step updates in place (BatchNorm reads the running statistics that AOTAutograd
  writes back after the forward);
* a primal the recomputation reaches is saved (it is alive anyway: a parameter, buffer or input);
* non-tensor values (symbolic sizes) follow the tensors that need them.

The graphs are built by ``torch._functorch.partitioners._extract_fwd_bwd_modules`` (the same routine
``torch.compile``'s own partitioners use, so AOTAutograd's calling conventions hold), then the backward's
recompute nodes are moved to their first use (:func:`place_recomputation`), since extraction keeps the
joint graph's order, which would recompute everything at the start of the backward.

:func:`recompute_backend` is a ``torch.compile`` backend built on it (forward and backward run by
:func:`boxed_interpreter`), and ``last_partition()`` shows what the last compilation did:
the saved values, the recompute nodes and the backward's code.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from .joint_capture import RANDOM_TARGETS, op_name, reachable

__all__ = ["Partition", "POLICIES", "partition_with_policy", "place_recomputation", "extract_graphs",
           "drop_dead_random_nodes", "drop_redundant_aliases", "recompute_backend",
           "last_partition", "boxed_interpreter"]

#: A policy gets the forward tensors (in graph order) and returns the names of those it would keep; of
#: those, the ones the backward's recomputation reaches are saved.
Policy = Callable[[list[fx.Node]], set[str]]

#: ops whose output a selective policy keeps: the expensive ones (matrix products, convolutions,
#: attention); the cheap pointwise ops and views around them are recomputed.
COMPUTE_BOUND_TARGETS = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
                                   "_scaled_dot_product_flash_attention",
                                   "_scaled_dot_product_flash_attention_for_cpu",
                                   "_scaled_dot_product_efficient_attention", "scaled_dot_product_attention",
                                   "embedding", "_native_batch_norm_legit_functional",
                                   "native_batch_norm", "native_layer_norm"})


def _producer(node: fx.Node) -> fx.Node:
    """The op behind a ``getitem`` of a multi-output op, else the node itself."""
    import operator
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0]
    return node


#: ops that read state the step then updates in place (BatchNorm's running statistics: AOTAutograd
#: copies their new values back after the forward), so a recomputation would read the new values:
#: their outputs are saved, like a random op's.
STATE_READING_TARGETS = frozenset({"_native_batch_norm_legit_functional", "native_batch_norm",
                                   "_native_batch_norm_legit", "batch_norm", "_batch_norm_impl_index",
                                   "cudnn_batch_norm", "miopen_batch_norm"})


POLICIES: dict[str, Policy] = {
    # every candidate saved: the default partitioner's plan, no recomputation
    "save_all": lambda candidates: {n.name for n in candidates},
    # save the outputs of compute-bound ops; recompute pointwise ops and views from them
    "save_compute_bound": lambda candidates: {n.name for n in candidates
                                              if op_name(_producer(n).target) in COMPUTE_BOUND_TARGETS},
    # save nothing the rules allow not to: recompute the whole forward in backward from the primals
    "save_nothing": lambda candidates: set(),
}


@dataclass(frozen=True)
class Partition:
    """What one partition did: the saved values, the recompute nodes of the backward and its code."""

    saved: tuple[str, ...]
    recomputed: tuple[str, ...]
    forward_graph: fx.GraphModule
    backward_graph: fx.GraphModule

    @property
    def backward_code(self) -> str:
        """The generated backward as Python; each recompute node is a line of forward op before its use."""
        return self.backward_graph.code

    def __repr__(self) -> str:
        return f"Partition({len(self.saved)} saved, {len(self.recomputed)} recomputed in backward)"


_LAST: list[Partition] = []


def last_partition() -> Partition | None:
    """The :class:`Partition` of the most recent :func:`partition_with_policy` call, or None."""
    return _LAST[-1] if _LAST else None


def partition_with_policy(joint_module: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                          policy: Policy | str = "save_compute_bound", **_: Any
                          ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """An AOTAutograd ``partition_fn``: the forward and backward graphs for ``policy``'s saved values
    (module docstring). ``policy`` is a :data:`POLICIES` name or a callable."""
    choose = POLICIES[policy] if isinstance(policy, str) else policy
    graph = joint_module.graph
    tangents = [n for n in graph.nodes if n.op == "placeholder" and "tangents" in n.name]
    backward = reachable(tangents, lambda n: [u for u in n.users if u.op != "output"])  # tangents included
    output = next(n for n in graph.nodes if n.op == "output")
    forward = [n for n in graph.nodes if n not in backward and n.op != "output"]
    forward_set = set(forward)
    candidates = [n for n in forward if n.op != "placeholder" and _is_tensor(n)]
    chosen = set(choose(candidates))
    always_saved_ops = {n for n in forward if n.op == "call_function"
                        and op_name(n.target) in RANDOM_TARGETS | STATE_READING_TARGETS}

    def ends_walk(node: fx.Node) -> bool:  # a primal, a chosen value, a random or state-reading op's output
        return node.op == "placeholder" or (_is_tensor(node) and (node.name in chosen
                                                                  or _producer(node) in always_saved_ops))
    # walk back from what the backward reads through the forward: the nodes that end the walk are
    # saved (a non-tensor primal as a symbolic value); every other forward node on the way is recomputed
    needed = [n for n in forward if _is_tensor(n) and any(u in backward for u in n.users)]
    needed += [n for n in _backward_outputs(output, num_fwd_outputs) if n in forward_set]
    walked = reachable(needed, lambda n: [] if ends_walk(n) else n.all_input_nodes)
    saved = {n for n in walked if ends_walk(n) and _is_tensor(n)}
    sym_saved = {n for n in walked if n.op == "placeholder" and not _is_tensor(n)}
    saved_values = [n for n in forward if n in saved]
    saved_sym = [n for n in forward if n in sym_saved]
    forward_graph, backward_graph = extract_graphs(joint_module, saved_values, saved_sym,
                                                   num_fwd_outputs=num_fwd_outputs)
    recomputed = place_recomputation(backward_graph, {n.name for n in forward} - {n.name for n in saved_values})
    _LAST[:] = [Partition(tuple(n.name for n in saved_values), tuple(recomputed), forward_graph, backward_graph)]
    return forward_graph, backward_graph


def extract_graphs(joint_module: fx.GraphModule, saved_values: list[fx.Node], saved_sym: list[fx.Node], *,
                   num_fwd_outputs: int, recomputed: frozenset[str] = frozenset()
                   ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward graphs of ``joint_module`` saving ``saved_values`` (torch's
    ``_extract_fwd_bwd_modules``), without the random forward ops it copies into the backward where
    nothing reads them (:func:`drop_dead_random_nodes`), nor the recompute nodes (named in
    ``recomputed``) it leaves unread in the forward. Its dead-code elimination keeps random ops where
    ``torch._inductor.config.fallback_random`` is set: a recomputed dropout's replay and the 31 nodes
    from it to an unread attention (an op that may draw) then also ran in ViT's forward (249 KB over
    the plan, inductor's ViT at 80 %: 0.902 of the allocator's peak)."""
    from torch._functorch.partitioners import _extract_fwd_bwd_modules
    forward_graph, backward_graph = _extract_fwd_bwd_modules(joint_module, saved_values, saved_sym,
                                                             num_fwd_outputs=num_fwd_outputs)
    drop_dead_random_nodes(backward_graph)
    drop_dead_random_nodes(forward_graph, only=recomputed)
    drop_redundant_aliases(forward_graph, in_backward=False)
    drop_redundant_aliases(backward_graph, in_backward=True)
    return forward_graph, backward_graph


def drop_redundant_aliases(gm: fx.GraphModule, in_backward: bool) -> int:
    """Erase alias ops that only cost a call: every ``t`` of a value after its first (an unrolled
    LSTM transposes its two weights at each of its 200 steps, and its backward each step's gate
    gradients twice), a ``t`` of a ``t`` (a linear's weight gradient is ``t(t(mm))``: the ``mm``), and,
    in a backward graph, every ``detach`` (it runs without autograd, where ``detach`` is its input under
    another name). Each result shares its input's storage, so no value lives longer. A ``t`` the graph
    returns stays. Returns how many were erased (the LSTM at T = 200: 398 in the forward, 2,198 in the
    backward: its store-all step went from 30.0 to 25.5 ms, as fast as ``aot_eager``'s; the ``t`` of a
    ``t`` and the repeated gate transposes since: 1,405 to 605 ``t`` calls in its backward)."""
    transposes: dict[fx.Node, fx.Node] = {}
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.args[0] if node.args else None, fx.Node):
            continue
        source = node.args[0]
        if in_backward and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(source)
        elif node.target is torch.ops.aten.t.default and not any(u.op == "output" for u in node.users):
            twice = source.target is torch.ops.aten.t.default and isinstance(source.args[0], fx.Node)
            first = source.args[0] if twice else transposes.setdefault(source, node)
            if first is node:
                continue
            node.replace_all_uses_with(first)
        else:
            continue
        gm.graph.erase_node(node)
        dropped += 1
    for node in reversed(list(gm.graph.nodes)):  # the inner ``t`` of a ``t`` of a ``t``, now unread
        if node.target is torch.ops.aten.t.default and not node.users:
            gm.graph.erase_node(node)
            dropped += 1
    if dropped:
        gm.recompile()
    return dropped


def drop_dead_random_nodes(gm: fx.GraphModule, only: frozenset[str] | None = None) -> int:
    """Erase from ``gm`` the random ops whose outputs nothing reads, and every other unread pure node
    (latest first, so the unread tail a copied dropout feeds goes first), and return how many random
    ops went. ``_extract_fwd_bwd_modules`` copies every
    forward op whose inputs the backward has, and dead-code elimination keeps random ops (impure): a
    forward dropout whose input is saved ran again in the backward, drawing from the global generator
    (the next step's masks then differed from eager's) for a mask nobody read (GPT-2 tiny: five of
    them; a plan saving a block's input: a whole attention block of 24 nodes and two dropouts).
    ``only``: erase only nodes of these names (a forward graph's recompute copies: the model's own
    unread dropouts draw as they do in eager)."""
    dropped = erased = 0
    for node in reversed(list(gm.graph.nodes)):
        if node.op != "call_function" or node.users or (only is not None and node.name not in only):
            continue
        random = op_name(node.target) in RANDOM_TARGETS
        # ``impure_random=False``: an op that may draw (attention with a dropout probability) is
        # otherwise impure, and kept with every node feeding it
        if random or not node.is_impure(impure_random=False):
            gm.graph.erase_node(node)
            dropped += random
            erased += 1
    if erased:
        gm.recompile()
    return dropped


def place_recomputation(backward_graph: fx.GraphModule, forward_names: set[str]) -> list[str]:
    """Move every node of ``backward_graph`` named in ``forward_names`` (a forward op copied into the
    backward: a recompute node) right before its first user, latest first, so that its inputs, moved
    the same way, still come before it. Returns the recompute nodes' names in their new order."""
    nodes = list(backward_graph.graph.nodes)
    recompute = [n for n in nodes if n.op == "call_function" and n.name in forward_names]
    for node in reversed(recompute):
        if not node.users:
            continue
        position = {n: i for i, n in enumerate(backward_graph.graph.nodes)}
        first_user = min(node.users, key=lambda u: position[u])
        first_user.prepend(node)
    backward_graph.graph.lint()
    backward_graph.recompile()
    return [n.name for n in backward_graph.graph.nodes if n in set(recompute)]


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph module over ``gm``'s attributes with copies of its nodes (their ``meta``, the output
    node's and the module's copied shallowly: a deep copy of the fake values fails on models with tensor
    constants, HF GPT-2 and T5)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    old_output = next(n for n in gm.graph.nodes if n.op == "output")
    next(n for n in graph.nodes if n.op == "output").meta = dict(old_output.meta)
    copied = fx.GraphModule(gm, graph)
    copied.meta = dict(getattr(gm, "meta", {}))
    return copied


def boxed_interpreter(gm: fx.GraphModule, _example_inputs: Any = None) -> Callable[[list], Any]:
    """A compiler for AOTAutograd that runs ``gm`` as it is, with the *boxed* calling convention done
    right: the argument list is cleared and each value is dropped after its last use. The graph's code
    is regenerated in that convention (``torch.fx``'s ``_BoxedCodeGen``: ``def forward(self,
    args_list)``), or, where that is unavailable, run by ``fx.Interpreter.boxed_run``.
    ``make_boxed_compiler(lambda gm, _: gm)`` would keep the list, and so every saved tensor, alive
    until the backward graph returns (GPT-2 tiny: 571 KB measured for a 380 KB plan)."""
    try:
        from torch.fx.graph import _BoxedCodeGen
    except ImportError:  # pragma: no cover - older or newer torch without it
        def interpret(args: list) -> Any:
            return fx.Interpreter(gm).boxed_run(args)
        interpret._boxed_call = True  # type: ignore[attr-defined]
        return interpret
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args: list) -> Any:
        return gm(args)
    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def recompute_backend(policy: Policy | str = "save_compute_bound") -> Callable[..., Any]:
    """A ``torch.compile`` backend: AOTAutograd with :func:`partition_with_policy` as its partitioner,
    the forward and backward graphs run as they are (:func:`boxed_interpreter`)."""
    from functools import partial

    from torch._dynamo.backends.common import aot_autograd
    return aot_autograd(fw_compiler=boxed_interpreter, bw_compiler=boxed_interpreter,
                        partition_fn=partial(partition_with_policy, policy=policy))


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _backward_outputs(output: fx.Node, num_fwd_outputs: int) -> list[fx.Node]:
    """The joint graph's outputs after the forward's: the gradients (some are forward nodes: a
    gradient that needs no tangent, such as a zero)."""
    return [n for n in output.args[0][num_fwd_outputs:] if isinstance(n, fx.Node)]

