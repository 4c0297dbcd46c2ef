"""The cost graph: what every solver receives.

A :class:`CostGraph` is an immutable, topologically ordered DAG of :class:`CostNode` objects. It is pure
Python (no torch import) so that solvers, simulators and benchmark loaders never depend on the framework.

Model
-----
* A node is one *operation of the forward pass* at module granularity: a call of a leaf module
  (``nn.Conv2d``, ``nn.BatchNorm2d``, ...), of a torch function or of a tensor method, or an *opaque*
  submodule that could not be traced. Its output (a tensor or a tuple of tensors) is the value the node
  produces. Model inputs, parameters and buffers are not nodes: they are live before a training step
  starts and are summarised by :attr:`CostGraph.input_bytes`, :attr:`CostGraph.parameter_bytes` and
  :attr:`CostGraph.buffer_bytes`.
* Edge ``u -> v`` iff ``v`` reads ``u``'s output. ``predecessors`` of a node are sorted indices; every
  predecessor has a smaller index (the node order is a topological order).
* Memory is accounted by *storage*: a view (``reshape``, ``permute``, ``x[0]``) or an in-place op
  (``relu_``) allocates nothing, so its ``output_bytes`` is 0 and ``alias_of`` names the node that owns
  the storage it shares. Keeping a view alive keeps its owner's whole storage alive.
* Costs: ``forward_cost`` / ``backward_cost`` are in :attr:`CostGraph.cost_unit` (``"seconds"`` for
  traced models, measured or estimated from FLOPs as :attr:`CostGraph.cost_source` says; the paper's own
  units for benchmark graphs loaded from files).

Invariants (checked at construction): indices are ``0..n-1`` in order, predecessors precede their node,
node names are unique, byte counts and costs are non-negative, ``alias_of`` points to an earlier node
that owns storage, ``backward_needs`` only lists existing nodes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from .errors import GraphError
from .units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    import networkx

__all__ = ["CostNode", "CostGraph", "JOINT_COST_SOURCE", "is_joint_cost_graph"]

#: The end of a joint cost graph's ``cost_source`` (``joint_costs.joint_cost_graph``): what tells a saved
#: plan of the compiler path's graph from one of the schedule executor's (``optimize(..., plan=...)`` runs
#: each on its own path), and a graph whose simulation is the liveness of the code it lowers to.
JOINT_COST_SOURCE = "joint graph"

#: An output of at most this many bytes that requires grad is a scalar loss computed by the model itself.
SCALAR_LOSS_BYTES = 8

NODE_KINDS = ("module", "function", "method", "opaque", "loaded")


@dataclass(frozen=True)
class CostNode:
    """One forward operation and what it costs.

    Attributes (bytes are bytes of tensor storage; costs are in the graph's ``cost_unit``):

    index, name, kind, target
        Position in topological order; unique name (the fx node name for traced models); one of
        ``NODE_KINDS``; what is called (module path, function or method name).
    predecessors, successors
        Indices of the nodes whose output this node reads / that read this node's output.
    order_only_predecessors
        The predecessors whose value the node does not read: edges that only order it (a joint graph's
        unit whose backward reads a gradient theirs makes). Solvers order by every predecessor; what a
        ``Forward`` reads (``read_predecessors``: the simulator's and ``schedule.insert_frees``'
        liveness) leaves these out, as the code lowered from the schedule does.
    output_bytes
        Storage newly allocated for the node's output(s). 0 for views, in-place ops and non-tensors.
    alias_of
        For a view or in-place result: index of the node owning the storage it shares; else ``None``.
    grad_bytes
        Bytes of the gradient of the node's output during backward (0 if it does not require grad).
    saved_input_bytes, saved_output_bytes, saved_buffer_bytes
        What autograd saves for this node's backward, deduplicated by storage: storages produced by other
        nodes (its inputs or their bases), the storage of its own output, and internal buffers created
        by the node that are not its output (BatchNorm statistics, dropout masks, pooling indices).
        Storages live before the step (parameters, model inputs) are not counted.
    backward_needs
        Indices of the nodes whose output storage the node's backward reads (itself included when it
        saves its own output). Empty for nodes without backward.
    workspace_bytes
        Peak transient storage of the forward beyond its output and saved buffers (0 if not measured).
    backward_workspace_bytes
        Peak transient storage of the backward beyond the input gradients it returns: internal
        temporaries and the fresh gradients of the parameters it uses (which are then accumulated).
    backward_aliases_grad
        The backward passes the output gradient on as its input gradients without allocating (views,
        ``getitem``, ``add``): the gradient buffer changes hands instead of being copied.
    grad_term_bytes
        ``(successor, bytes)`` pairs when the output is several views of one storage (``split``,
        ``unbind``, ``chunk``) whose gradient arrives as one term per view, which the backward
        concatenates or stacks: each successor's backward adds the bytes of the views it reads beside
        the terms already made, with no sum (empty: gradients are summed into one ``grad_bytes`` buffer).
    param_grad_bytes
        Bytes of parameter gradients this node's backward allocates. A parameter shared by several
        nodes is charged to the one whose backward runs first (the last user in forward order).
    forward_cost, backward_cost
        Time of the forward / backward of the node in ``cost_unit``.
    forward_flops, backward_flops
        FLOPs counted by ``torch.utils.flop_counter`` (0 when unknown).
    requires_grad, inplace, random, stateful, opaque
        Output requires grad; node writes into an input; node draws random numbers (dropout); node
        mutates state on forward (BatchNorm running statistics); node is an untraceable submodule.
    phase
        ``"forward"``, or ``"backward"`` for the explicit backward nodes of a joint graph (see
        :attr:`CostGraph.implicit_backward`).
    backward_steps, backward_step_workspace_bytes, tape_release_steps
        When the backward is a sequence of kernels that frees each value after its last read (a joint
        graph's generated backward), its steps in order: the predecessor whose gradient each step first
        makes (-1: none; the predecessors no step names get theirs before the first step), the bytes
        the step holds besides the gradients and the tape (its temporaries, the parameter gradients
        made so far, its kernels' workspace), and, for each of ``backward_needs``, the step after
        which the tape lets go of it (``len(backward_steps)``: at the end). Empty: the gradients are made
        before the tape is freed, beside ``backward_workspace_bytes`` (autograd's kernels, the executor).
    random_op_count
        Of a random node: how many of its ops draw random numbers (a joint graph's unit may hold two
        dropouts). A recomputation replays each from its own snapshot of the generators' state, so the
        snapshots kept for it are ``random_op_count * CostGraph.rng_state_bytes``.
    grad_release_step
        With ``backward_steps``: the step after which the backward has read its output gradient for
        the last time, which is then let go of unless something else holds it (-1: at the end).
    recompute_cost, recompute_kept_bytes
        When a recomputation does less than the first computation (a joint graph's training-mode
        BatchNorm, normalized again from the batch statistics its first computation made:
        ``batch_norm_recompute``): the cost of each computation after the first (None: ``forward_cost``),
        and the bytes of the saved buffers it reads from the first computation instead of making them
        (at most ``saved_buffer_bytes``), which are kept from the first computation to the node's
        backward when it is computed more than once. Solvers price every computation at
        :attr:`recomputation_cost` (the first computations are the same in every plan).
    reads_mutated_input
        The node reads the value an input of the step had before the step wrote into it (a model input
        written in place, a parameter's momentum update, a counter buffer): the write lands once the
        forward ends, so a recomputation would read the new value. Such a node is computed once; every
        solver's schedule is made without its recomputations (``schedule_passes.computed_once``).
    state_update_bytes
        The buffers' new values the node's first computation makes (a joint graph's training-mode
        BatchNorm: its new running statistics). The generated forward returns them and the runtime
        copies them into the buffers after it, so they live from that computation to the end of the
        forward ops; no node reads them.
    """

    index: int
    name: str
    kind: str = "function"
    target: str = ""
    predecessors: tuple[int, ...] = ()
    successors: tuple[int, ...] = ()
    output_bytes: int = 0
    alias_of: int | None = None
    grad_bytes: int = 0
    saved_input_bytes: int = 0
    saved_output_bytes: int = 0
    saved_buffer_bytes: int = 0
    backward_needs: tuple[int, ...] = ()
    workspace_bytes: int = 0
    backward_workspace_bytes: int = 0
    backward_aliases_grad: bool = False
    grad_term_bytes: tuple[tuple[int, int], ...] = ()
    param_grad_bytes: int = 0
    forward_cost: float = 0.0
    backward_cost: float = 0.0
    forward_flops: int = 0
    backward_flops: int = 0
    requires_grad: bool = True
    inplace: bool = False
    random: bool = False
    stateful: bool = False
    opaque: bool = False
    phase: str = "forward"
    backward_steps: tuple[int, ...] = ()
    backward_step_workspace_bytes: tuple[int, ...] = ()
    tape_release_steps: tuple[int, ...] = ()
    grad_release_step: int = -1
    order_only_predecessors: tuple[int, ...] = ()
    random_op_count: int = 1
    recompute_cost: float | None = None
    recompute_kept_bytes: int = 0
    state_update_bytes: int = 0
    reads_mutated_input: bool = False

    @property
    def recomputation_cost(self) -> float:
        """The cost of a computation after the first: ``recompute_cost``, else ``forward_cost``."""
        return self.forward_cost if self.recompute_cost is None else self.recompute_cost

    @property
    def read_predecessors(self) -> tuple[int, ...]:
        """The predecessors whose value a computation of the node reads (``order_only_predecessors``)."""
        if not self.order_only_predecessors:
            return self.predecessors
        return tuple(p for p in self.predecessors if p not in self.order_only_predecessors)

    @property
    def saved_bytes(self) -> int:
        """Everything this node's backward holds on to: saved inputs, output and internal buffers."""
        return self.saved_input_bytes + self.saved_output_bytes + self.saved_buffer_bytes

    def to_dict(self) -> dict[str, Any]:
        """The fields, without a recomputation's when it is the forward's (saved graphs keep their form)."""
        data = dataclasses.asdict(self)
        if self.recompute_cost is None and not self.recompute_kept_bytes:
            del data["recompute_cost"], data["recompute_kept_bytes"]
        if not self.state_update_bytes:
            del data["state_update_bytes"]
        if not self.reads_mutated_input:
            del data["reads_mutated_input"]
        return data


@dataclass(frozen=True)
class CostGraph:
    """Immutable, topologically ordered cost graph (see the module docstring for the model).

    ``input_bytes``, ``parameter_bytes`` and ``buffer_bytes`` are live before a step and are *not*
    part of the budget; ``parameter_bytes`` also tells how large the parameter gradients may get.

    ``output_indices``: the nodes whose values the model returns (default: the sinks).

    ``loss_bytes``: transient bytes of the loss the graph was priced with (its forward and backward,
    beyond the output gradients it hands back), measured by the allocator; ``loss_gradient_outputs``:
    the outputs that loss sends a gradient to. None when no loss was priced (graphs from files, older
    saved plans): then the planner guesses (``planner.loss_allowance_bytes``).
    ``loss_unreached_gradient_bytes``: on the compiler path, the gradients of the differentiable outputs
    that loss does not reach: AOTAutograd fills them with zeros when the backward starts, after the
    loss has run, so they count at the gradients' arrival but not while the loss runs
    (``planner.held_at_loss_bytes``).

    ``rng_state_bytes``: bytes of one snapshot of the random generators (the CPU generator's state, and
    the CUDA one's per device in use), which the executor keeps for each random node it recomputes.

    ``output_gradients_held``: whether the gradients of the model outputs live until the model's whole
    backward has run. True for the schedule executor (one autograd Function, whose backward the engine
    hands every output gradient at once and which returns only at the end); False for the compiler path,
    whose generated backward takes them as arguments in the boxed convention and drops each after its
    last use (T5 holds 35 KB of cached keys' and values' gradients that it frees early: 1.113 of the
    allocator's peak with them held).

    ``estimated_costs``: when the nodes' costs are measured, each node's ``(forward, backward)`` seconds
    as the device profile's FLOP roofline estimates them, with its ``recompute_cost`` third where it has
    one (empty otherwise). Measured times carry the
    machine's noise, and a solver's plan near its floor follows small differences in them; the planner
    also plans on these estimates and prices what it finds with the measured times
    (``planner.estimated_times_graph``).

    ``implicit_backward``: True (traced models, Kusumoto graphs) when every node is a forward operation
    whose backward is described by its ``backward_*`` fields. False for plain scheduling DAGs whose nodes
    already are every computation to schedule: Checkmate's joint forward+backward graphs (nodes with
    ``phase="backward"``) and the random layered DAGs, which have no backward at all.
    """

    name: str
    nodes: tuple[CostNode, ...]
    cost_unit: str = "seconds"
    cost_source: str = "measured"
    input_bytes: int = 0
    parameter_bytes: int = 0
    buffer_bytes: int = 0
    implicit_backward: bool = True
    source: str = ""
    output_indices: tuple[int, ...] = ()
    loss_bytes: int | None = None
    rng_state_bytes: int = 0
    loss_gradient_outputs: tuple[int, ...] | None = None
    output_gradients_held: bool = True
    estimated_costs: tuple[tuple[float, ...], ...] = ()
    loss_unreached_gradient_bytes: int = 0
    _index_by_name: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        nodes = tuple(self.nodes)
        successors: list[list[int]] = [[] for _ in nodes]
        names: dict[str, int] = {}
        for position, node in enumerate(nodes):
            self._check_node(position, node, names, len(nodes))
            names[node.name] = position
            for p in node.predecessors:
                successors[p].append(position)
        rebuilt = tuple(
            dataclasses.replace(node, predecessors=tuple(sorted(set(node.predecessors))),
                                successors=tuple(successors[i]))
            for i, node in enumerate(nodes)
        )
        object.__setattr__(self, "nodes", rebuilt)
        object.__setattr__(self, "output_indices", tuple(self.output_indices))
        if self.loss_gradient_outputs is not None:
            object.__setattr__(self, "loss_gradient_outputs", tuple(self.loss_gradient_outputs))
        if self.loss_bytes is not None and self.loss_bytes < 0:
            raise GraphError(f"CostGraph {self.name!r}: loss_bytes is negative")
        for o in self.output_indices:
            if not 0 <= o < len(nodes):
                raise GraphError(f"CostGraph {self.name!r}: output {o} is not a node")
        object.__setattr__(self, "_index_by_name", names)
        object.__setattr__(self, "estimated_costs", tuple(tuple(float(c) for c in entry)
                                                          for entry in self.estimated_costs))
        if self.estimated_costs and (len(self.estimated_costs) != len(nodes)
                                     or any(len(entry) not in (2, 3) for entry in self.estimated_costs)):
            raise GraphError(f"CostGraph {self.name!r}: {len(self.estimated_costs)} estimated costs for "
                             f"{len(nodes)} nodes (each forward, backward and perhaps the recomputation)")
        for name in ("input_bytes", "parameter_bytes", "buffer_bytes"):
            if getattr(self, name) < 0:
                raise GraphError(f"CostGraph {self.name!r}: {name} is negative")

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the memo of derived results (``graph_memo``)."""
        return {k: v for k, v in self.__dict__.items() if k != "_graph_memo"}

    def _check_node(self, position: int, node: CostNode, names: dict[str, int], count: int) -> None:
        where = f"CostGraph {self.name!r}, node {position} ({node.name!r})"
        if node.index != position:
            raise GraphError(f"{where}: index is {node.index}, expected {position} (nodes must be in order)")
        if node.name in names:
            raise GraphError(f"{where}: duplicate node name")
        if node.phase not in ("forward", "backward"):
            raise GraphError(f"{where}: phase {node.phase!r} must be 'forward' or 'backward'")
        if node.kind not in NODE_KINDS:
            raise GraphError(f"{where}: kind {node.kind!r} is not one of {NODE_KINDS}")
        for p in node.predecessors:
            if not 0 <= p < position:
                raise GraphError(f"{where}: predecessor {p} does not precede it; nodes must be topologically "
                                 "ordered and edges must point forward")
        for q in node.backward_needs:
            if not 0 <= q < count:
                raise GraphError(f"{where}: backward_needs names missing node {q}")
        steps = len(node.backward_steps)
        named = [p for p in node.backward_steps if p >= 0]
        if (not set(named) <= set(node.predecessors) or len(set(named)) < len(named)
                or len(node.backward_step_workspace_bytes) != steps
                or any(b < 0 for b in node.backward_step_workspace_bytes)):
            raise GraphError(f"{where}: backward_steps must name distinct predecessors, with one "
                             "non-negative backward_step_workspace_bytes per step")
        if node.tape_release_steps and (len(node.tape_release_steps) != len(node.backward_needs)
                                        or not all(0 <= s <= steps for s in node.tape_release_steps)):
            raise GraphError(f"{where}: tape_release_steps must give one step (0..{steps}) per backward_needs")
        if node.alias_of is not None:
            if not 0 <= node.alias_of < position:
                raise GraphError(f"{where}: alias_of={node.alias_of} must name an earlier node")
        for attr in ("output_bytes", "grad_bytes", "saved_input_bytes", "saved_output_bytes",
                     "saved_buffer_bytes", "workspace_bytes", "backward_workspace_bytes", "param_grad_bytes", "forward_flops",
                     "backward_flops", "state_update_bytes"):
            if getattr(node, attr) < 0:
                raise GraphError(f"{where}: {attr} is negative")
        if not (node.forward_cost >= 0 and node.backward_cost >= 0 and node.recomputation_cost >= 0):  # and NaN
            raise GraphError(f"{where}: costs must be non-negative numbers")
        if not 0 <= node.recompute_kept_bytes <= node.saved_buffer_bytes:
            raise GraphError(f"{where}: recompute_kept_bytes must be within 0..saved_buffer_bytes")

    # ----------------------------------------------------------------- access
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[CostNode]:
        return iter(self.nodes)

    def __getitem__(self, key: int | str) -> CostNode:
        if isinstance(key, str):
            try:
                return self.nodes[self._index_by_name[key]]
            except KeyError:
                raise KeyError(f"no node named {key!r} in cost graph {self.name!r}") from None
        return self.nodes[key]

    def index_of(self, name: str) -> int:
        return self[name].index

    @property
    def edges(self) -> tuple[tuple[int, int], ...]:
        return tuple((p, node.index) for node in self.nodes for p in node.predecessors)

    @property
    def sources(self) -> tuple[int, ...]:
        return tuple(n.index for n in self.nodes if not n.predecessors)

    @property
    def sinks(self) -> tuple[int, ...]:
        return tuple(n.index for n in self.nodes if not n.successors)

    @property
    def outputs(self) -> tuple[int, ...]:
        """Nodes whose values the model returns (the sinks when not given)."""
        return self.output_indices or self.sinks

    @property
    def gradient_outputs(self) -> tuple[int, ...]:
        """The outputs whose gradients arrive at the start of backward (implicit backward): those that
        require grad; in a traced graph, only the scalar ones among them (at most ``SCALAR_LOSS_BYTES``)
        when there are any. A model that returns its own loss (a ``transformers`` model given
        ``labels``) is trained by backpropagating that loss; its other outputs (the logits) get no
        gradient from outside."""
        differentiable = [o for o in self.outputs if self.nodes[o].requires_grad]
        if self.loss_gradient_outputs is not None:
            return tuple(o for o in self.loss_gradient_outputs if self.nodes[o].requires_grad)
        if self.source != "traced":  # graphs from files and tests: every output gets its gradient
            return tuple(differentiable)
        losses = tuple(o for o in differentiable if self.nodes[o].grad_bytes <= SCALAR_LOSS_BYTES)
        return losses or tuple(differentiable)

    def storage_owner(self, index: int) -> int:
        """Index of the node that owns the storage of ``index``'s output (follows ``alias_of``)."""
        while self.nodes[index].alias_of is not None:
            index = self.nodes[index].alias_of  # type: ignore[assignment]
        return index

    # ----------------------------------------------------------------- totals
    @property
    def total_forward_cost(self) -> float:
        return sum(n.forward_cost for n in self.nodes)

    @property
    def total_backward_cost(self) -> float:
        return sum(n.backward_cost for n in self.nodes)

    @property
    def total_output_bytes(self) -> int:
        return sum(n.output_bytes for n in self.nodes)

    def stored_bytes_per_node(self) -> tuple[int, ...]:
        """Bytes each node keeps alive until its backward when nothing is recomputed (store-all).

        A node is charged its internal saved buffers plus its output storage if any node's backward
        reads that storage. The sum over nodes is the deduplicated activation memory autograd keeps
        after a store-all forward.
        """
        needed_storage: set[int] = set()
        for node in self.nodes:
            needed_storage.update(self.storage_owner(q) for q in node.backward_needs)
        return tuple(n.saved_buffer_bytes + (n.output_bytes if n.index in needed_storage else 0)
                     for n in self.nodes)

    def store_all_saved_bytes(self) -> int:
        """Deduplicated bytes autograd keeps after a store-all forward (sum of :meth:`stored_bytes_per_node`)."""
        return sum(self.stored_bytes_per_node())

    # ----------------------------------------------------------------- views and (de)serialisation
    def to_networkx(self) -> "networkx.DiGraph":
        """A ``networkx.DiGraph`` with node keys = indices and every CostNode field as node attributes."""
        import networkx

        g = networkx.DiGraph(name=self.name, cost_unit=self.cost_unit)
        for node in self.nodes:
            g.add_node(node.index, **node.to_dict())
        g.add_edges_from(self.edges)
        return g

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "recompute_graph.CostGraph/1",
            "name": self.name, "cost_unit": self.cost_unit, "cost_source": self.cost_source,
            "input_bytes": self.input_bytes, "parameter_bytes": self.parameter_bytes,
            "buffer_bytes": self.buffer_bytes, "implicit_backward": self.implicit_backward, "source": self.source,
            "output_indices": list(self.output_indices),
            "loss_bytes": self.loss_bytes,
            "rng_state_bytes": self.rng_state_bytes,
            "loss_gradient_outputs": (None if self.loss_gradient_outputs is None
                                      else list(self.loss_gradient_outputs)),
            "output_gradients_held": self.output_gradients_held,
            **({"estimated_costs": [list(pair) for pair in self.estimated_costs]} if self.estimated_costs else {}),
            **({"loss_unreached_gradient_bytes": self.loss_unreached_gradient_bytes}
               if self.loss_unreached_gradient_bytes else {}),
            "nodes": [{k: v for k, v in n.to_dict().items() if k != "successors"} for n in self.nodes],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostGraph":
        if data.get("format") != "recompute_graph.CostGraph/1":
            raise GraphError("not a saved recompute_graph cost graph (missing format "
                             "'recompute_graph.CostGraph/1')")
        fields = {f.name for f in dataclasses.fields(CostNode)}
        nodes = []
        for raw in data["nodes"]:
            unknown = set(raw) - fields
            if unknown:
                raise GraphError(f"saved node {raw.get('name')!r} has unknown fields {sorted(unknown)}")
            raw = dict(raw)
            for key in ("predecessors", "backward_needs", "backward_steps", "backward_step_workspace_bytes",
                        "tape_release_steps", "order_only_predecessors"):
                raw[key] = tuple(raw.get(key, ()))
            raw["grad_term_bytes"] = tuple(tuple(pair) for pair in raw.get("grad_term_bytes", ()))
            nodes.append(CostNode(**raw))
        kwargs = {k: data[k] for k in ("name", "cost_unit", "cost_source", "input_bytes", "parameter_bytes",
                                       "buffer_bytes", "implicit_backward", "source") if k in data}
        kwargs["output_indices"] = tuple(data.get("output_indices", ()))
        kwargs["loss_bytes"] = data.get("loss_bytes")
        kwargs["rng_state_bytes"] = int(data.get("rng_state_bytes", 0))
        kwargs["output_gradients_held"] = bool(data.get("output_gradients_held", True))
        kwargs["estimated_costs"] = tuple(tuple(pair) for pair in data.get("estimated_costs", ()))
        kwargs["loss_unreached_gradient_bytes"] = int(data.get("loss_unreached_gradient_bytes", 0))
        gradient_outputs = data.get("loss_gradient_outputs")
        kwargs["loss_gradient_outputs"] = None if gradient_outputs is None else tuple(gradient_outputs)
        return cls(nodes=tuple(nodes), **kwargs)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CostGraph":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def fingerprint(self) -> str:
        """A short hash of the structure and costs (stable across runs for equal graphs)."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # ----------------------------------------------------------------- display
    def __repr__(self) -> str:
        saved = (f", store-all saved {format_bytes(self.store_all_saved_bytes())}" if self.implicit_backward
                 else f", {sum(n.phase == 'backward' for n in self.nodes)} backward nodes")
        return (f"CostGraph({self.name!r}: {len(self.nodes)} nodes, {len(self.edges)} edges, "
                f"outputs {format_bytes(self.total_output_bytes)}{saved}, compute "
                f"{self.total_forward_cost + self.total_backward_cost:.4g} {self.cost_unit} [{self.cost_source}])")

    def summary(self, max_rows: int = 40) -> str:
        """A fixed-width table of the nodes, for people."""
        header = f"{'#':>4} {'name':<28} {'kind':<8} {'output':>10} {'saved':>10} {'fwd':>10} {'bwd':>10}"
        lines = [repr(self), header]
        rows = self.nodes if len(self.nodes) <= max_rows else self.nodes[: max_rows - 1]
        for n in rows:
            lines.append(f"{n.index:>4} {n.name[:28]:<28} {n.kind:<8} {format_bytes(n.output_bytes):>10} "
                         f"{format_bytes(n.saved_bytes):>10} {n.forward_cost:>10.3g} {n.backward_cost:>10.3g}")
        if len(rows) < len(self.nodes):
            lines.append(f"  ... {len(self.nodes) - len(rows)} more nodes")
        return "\n".join(lines)


def is_joint_cost_graph(graph: CostGraph) -> bool:
    """Whether ``graph`` was priced from a joint graph (``joint_costs.joint_cost_graph``), here or on disk."""
    return graph.cost_source.endswith(JOINT_COST_SOURCE)
