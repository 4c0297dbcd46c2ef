"""``chain_dp``: optimal checkpointing of a heterogeneous chain (Beaumont et al., "rotor", 2019), with
schedules that recompute a stage several times (Revolve and Gruslys' BPTT-HSM are its homogeneous
special cases).

Chain: the graph is cut at Chen's split candidates (nodes through which everything flows, see
:func:`~recompute_graph.solvers.chen.split_candidates`) into stages ``0..L-1``; when there are more than
``max_stages`` candidates, every k-th is used. On a joint cost graph (the compiler path's, whose
simulation is the liveness of the generated code; the executor's simulation of a plan cut so ran 6 %
under the allocator on a Hugging Face BERT), a stage of more than a quarter of the graph's nodes (an
unrolled RNN has no split candidate inside, its state ``(h, c)`` being two tensors; nor has a U-Net
between its skips) is cut further at *narrow* positions (:func:`chain_cuts`): in each of ``k`` equal
windows of it, the position whose boundary (the nodes up to it read after it, :func:`boundary_bytes`)
has the fewest bytes.

Stage ``s`` has forward/backward time ``fw[s]``/``bw[s]``, input activation ``x_s`` (the boundary of the
cut before it) of ``cw[s]`` bytes (``cw[0] = 0``: the model input is not charged), and ``cbw[s+1]``
bytes kept when it runs with tape (what its nodes keep for backward plus its output boundary). A value
open across several cuts is charged at each: the model over-counts, and the simulator, which decides,
does not. Where such values are large (a U-Net's skips) chain_dp alone plans far under its budget at
much recomputation (its meta-priced U-Net: 133 MiB for a 60 % budget at +120 % compute), and ``auto``
takes the lower-set DP's plans there. Charging each value at its first cut only was tried: it fixes
the U-Net and breaks the RNN (free cuts through views, where the values open are older).

Operations: ``Fn(s)`` runs stage ``s`` without tape; ``Fe(s)`` runs it with tape; ``B(s)`` runs its
backward. The DP over memory ``m`` (``slots`` discrete steps) and sub-chain ``[i, l]`` (``x_i`` live,
the gradient of ``x_{l+1}`` live) is rotor's (algorithms.md §5)::

    Opt[i][i](m) = fw[i] + bw[i]  if m >= max(cw[i+1] + cbw[i+1], cw[i] + cw[i+1] + cbw[i+1]) else ∞
    Opt[i][l](m) = min( Opt[i][i](m) + Opt[i+1][l](m - cbw[i+1]),                         (tape i)
                        min_j Σ_{k=i}^{j-1} fw[k] + Opt[j][l](m - cw[j]) + Opt[i][j-1](m) ) (keep x_j)

The held output gradient and the largest backward workspace are charged up front. The parameter
gradients of stage ``s`` (``pg[s]`` bytes) are allocated by ``B(s)`` and stay: a sub-chain ``[i, l]`` ends
with ``P(i, l) = Σ_{k=i}^{l} pg[k]`` more bytes held, so the second term of each case above runs with
``m - P(i+1, l)`` (tape) or ``m - P(j, l)`` (keep) slots, and a single stage needs ``pg[i]`` more. (Charging
all of them up front, as before, priced ResNet-50's early backward, where the large gradients of its last
stages do not exist yet, as if they did: on its joint graph, B=8 at 224², the floor plan, 250 MiB
simulated, cost +55.6 % compute; now +50.8 %.) Like the lower-set DP this
ranks plans in its own model; the simulator decides and the DP budget is tightened until the simulated
plan fits, or, where it fits with room to spare, loosened (``simulator_checked(loosen=True)``: a plan of
the same simulated peak at +42.3 %). Exact for its model in the space of stage-level multi-recompute
schedules; time ``O(L³ · slots)`` with numpy over the memory axis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import SolverError
from ..graph import CostGraph, is_joint_cost_graph
from ..graph_memo import memoized
from ..schedule import Backward, Forward, Op, Schedule, insert_frees
from . import Solution, register, simulator_checked
from .chen import open_after, split_candidates

__all__ = ["Chain", "boundary_bytes", "chain_cuts", "chain_of", "discretize", "gradient_slots", "solve_chain",
           "optimal_time", "lower_chain_ops", "chain_dp", "chain_dp_fine", "DEFAULT_MAX_STAGES", "DEFAULT_SLOTS",
           "DEFAULT_REFINE_ABOVE", "FINE_REFINE_ABOVE", "FINE_MAX_STAGES"]

DEFAULT_MAX_STAGES = 40
DEFAULT_SLOTS = 400
#: A joint cost graph's stage of more than this fraction of its nodes is cut further (``chain_cuts``)
DEFAULT_REFINE_ABOVE = 1 / 4
#: ``chain_dp_fine``: every stage of more than this fraction cut further, into at most this many stages
FINE_REFINE_ABOVE = 1 / 20
FINE_MAX_STAGES = 50


@dataclass(frozen=True)
class Chain:
    """Stages of a graph (node index lists) and rotor's per-stage costs (bytes, graph cost units)."""

    stages: tuple[tuple[int, ...], ...]
    fw: tuple[float, ...]
    bw: tuple[float, ...]
    cw: tuple[int, ...]     # cw[s]: bytes of x_s; cw[L]: bytes of the output (its gradient)
    cbw: tuple[int, ...]    # cbw[s + 1]: bytes stage s keeps when run with tape; cbw[0] unused
    fixed_bytes: int        # held output gradients and the largest backward workspace, charged up front
    pg: tuple[int, ...] = ()  # pg[s]: parameter gradient bytes B(s) allocates (empty: none)


def boundary_bytes(graph: CostGraph) -> list[int]:
    """``b[i]``: the output bytes of the nodes at positions ``0..i`` that a node after ``i`` reads (the
    values a forward cut after ``i`` must hold; ``i``'s own bytes for a split candidate)."""
    return open_after(graph)[1]


def chain_cuts(graph: CostGraph, max_stages: int = DEFAULT_MAX_STAGES,
               boundary: list[int] | None = None, refine_above: float = DEFAULT_REFINE_ABOVE) -> list[int]:
    """The positions after which the chain is cut: split candidates, and on joint cost graphs every stage
    of more than ``refine_above`` of the graph's nodes (a quarter by default) cut further at narrow
    positions (module docstring)."""
    cuts = split_candidates(graph)
    if len(cuts) + 1 > max_stages:
        step = math.ceil((len(cuts) + 1) / max_stages)
        return cuts[step - 1::step]
    count = len(graph)
    wide = count * refine_above
    spans = list(zip([-1] + cuts, cuts + [count - 1]))
    if not is_joint_cost_graph(graph) or not any(high - low > wide for low, high in spans):
        return cuts
    boundary = boundary_bytes(graph) if boundary is None else boundary
    wide_nodes = sum(high - low for low, high in spans if high - low > wide)
    spare = max_stages - len(spans)  # the stages the refinement may add, shared by the wide stages
    refined: list[int] = []
    for low, high in spans:
        if high - low > wide:
            windows = max(1, round((high - low) / wide_nodes * (spare + 1)))
            edges = [low + 1 + (high - low - 1) * w // windows for w in range(windows + 1)]
            for start, stop in zip(edges, edges[1:]):
                if stop > start:  # the narrowest position of the window, the latest of equals
                    refined.append(min(range(start, stop), key=lambda i: (boundary[i], -i)))
        if high < count - 1:
            refined.append(high)
    return sorted(set(refined))


def chain_of(graph: CostGraph, max_stages: int = DEFAULT_MAX_STAGES,
             refine_above: float = DEFAULT_REFINE_ABOVE) -> Chain:
    """Cut ``graph`` into stages at :func:`chain_cuts` (see the module docstring); made once per graph,
    ``max_stages`` and ``refine_above`` (``auto`` asks for it at every fraction of its pool)."""
    return memoized(graph, ("chain_dp.chain_of", max_stages, refine_above),
                    lambda: _chain_of(graph, max_stages, refine_above))


def _chain_of(graph: CostGraph, max_stages: int, refine_above: float) -> Chain:
    boundary = boundary_bytes(graph)
    cuts = chain_cuts(graph, max_stages, boundary, refine_above)
    bounds = [-1] + cuts + [len(graph) - 1]
    stages = tuple(tuple(range(bounds[s] + 1, bounds[s + 1] + 1)) for s in range(len(bounds) - 1))
    stored = graph.stored_bytes_per_node()
    nodes = graph.nodes
    cw = [0] + [boundary[stage[-1]] for stage in stages]
    cw[-1] = sum(nodes[o].grad_bytes for o in graph.gradient_outputs)
    cbw = [0] + [sum(stored[v] for v in stage) + max(boundary[stage[-1]], nodes[stage[-1]].output_bytes)
                 + max((nodes[v].workspace_bytes for v in stage), default=0) for stage in stages]
    fixed = max((n.backward_workspace_bytes for n in nodes), default=0)
    return Chain(stages, tuple(sum(nodes[v].recomputation_cost for v in st) for st in stages),
                 tuple(sum(nodes[v].backward_cost for v in st) for st in stages), tuple(cw), tuple(cbw), fixed,
                 tuple(sum(nodes[v].param_grad_bytes for v in st) for st in stages))


def discretize(chain: Chain, budget: float, slots: int) -> tuple[list[int], list[int]] | None:
    """Sizes in memory slots (rounded up) when ``budget`` bytes are split into ``slots`` slots."""
    available = budget - chain.fixed_bytes
    if available <= 0:
        return None
    unit = available / slots
    return ([math.ceil(c / unit - 1e-9) for c in chain.cw], [math.ceil(c / unit - 1e-9) for c in chain.cbw])


def gradient_slots(chain: Chain, budget: float, slots: int) -> np.ndarray | None:
    """``P[a, b]``: the slots (rounded up) of the parameter gradients of stages ``a..b-1``, ``a <= b``
    (0 on and below the diagonal), for ``budget`` bytes split into ``slots`` slots."""
    available = budget - chain.fixed_bytes
    if available <= 0:
        return None
    length = len(chain.stages)
    total = np.concatenate(([0], np.cumsum(np.asarray(chain.pg or (0,) * length, dtype=np.float64))))
    spans = total[None, :] - total[:, None]
    return np.where(spans > 0, np.ceil(spans / (available / slots) - 1e-9), 0).astype(np.int64)


def solve_chain(chain: Chain, budget: float, slots: int = DEFAULT_SLOTS) -> list[tuple[str, int]] | None:
    """Rotor's DP for ``budget`` bytes; the stage-level operation sequence, or None when nothing fits."""
    table = _tables(chain, budget, slots)
    if table is None:
        return None
    opt, what, cw, cbw, grads = table
    length = len(chain.stages)
    if not np.isfinite(opt[0, length - 1][slots]):
        return None
    ops: list[tuple[str, int]] = []
    _rebuild(0, length - 1, slots, what, cw, cbw, grads, ops)
    return ops


def optimal_time(chain: Chain, budget: float, slots: int = DEFAULT_SLOTS) -> float:
    """The DP's optimal total time (forward, recomputation and backward) for ``budget``; ∞ if infeasible."""
    table = _tables(chain, budget, slots)
    return float(table[0][0, len(chain.stages) - 1][slots]) if table is not None else math.inf


def _tables(chain: Chain, budget: float, slots: int):
    """Rotor's tables: ``opt[i, l, m]``, the least time of stages ``i..l`` with ``m`` slots, and
    ``what[i, l, m]``, the first stage ``j`` run without tapes after a checkpoint (-1: stage ``i`` runs with
    its tape first). The candidates of a cell are compared at once over ``j`` and ``m``; ties go to the
    earliest, as in rotor's loop. The last item is :func:`gradient_slots`.

    ``opt`` is stored padded: each row ``opt[i, l]`` is ``2 * (slots + 1)`` long, its left half ∞, so that
    ``Opt[i][l](m - s)`` for every ``m`` is one slice of it starting at ``slots + 1 - s`` (∞ where
    ``m < s``), gathered for all cells of a span at once (:func:`_gather`)."""
    sizes = discretize(chain, budget, slots)
    if sizes is None:
        return None
    cw, cbw = sizes
    grads = gradient_slots(chain, budget, slots)
    length = len(chain.stages)
    size = slots + 1
    m = np.arange(size)
    padded = np.full((length, length, 2 * size), np.inf)
    opt = padded[:, :, size:]  # a view: opt[i, l, m]
    what = np.full((length, length, size), -1, dtype=np.int64)
    for i in range(length):
        need = max(cw[i + 1] + cbw[i + 1], cw[i] + cw[i + 1] + cbw[i + 1]) + grads[i, i + 1]
        opt[i, i] = np.where(m >= need, chain.fw[i] + chain.bw[i], np.inf)
    prefix = np.concatenate(([0.0], np.cumsum(chain.fw)))
    cw, cbw = np.asarray(cw, dtype=np.int64), np.asarray(cbw, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(padded.reshape(length * length, 2 * size), size, axis=1)
    for span in range(1, length):  # every cell (i, i + span) at once
        first = np.arange(length - span)
        last = first + span
        j = first[:, None] + np.arange(1, span + 1)[None, :]  # (cells, span): the candidate j of each cell
        # tape first: stage i keeps its tape, then i+1..l with cbw[i+1] fewer slots, then B(i) beside the
        # parameter gradients of i+1..l
        tape_first = _gather(windows, length, size, first + 1, last, cbw[first + 1])
        tape_first += _gather(windows, length, size, first, first, grads[first + 1, last + 1])
        # stage i..j-1 run without tapes, j..l with cw[j] fewer slots, then i..j-1 again beside the
        # parameter gradients of j..l
        last_j = np.broadcast_to(last[:, None], j.shape)
        leaves = _gather(windows, length, size, j, last_j, cw[j])
        leaves += (prefix[j] - prefix[first][:, None])[:, :, None]  # (rotor's order of the sums: equal ties)
        leaves += _gather(windows, length, size, np.broadcast_to(first[:, None], j.shape), j - 1, grads[j, last_j + 1])
        best_leaf = np.argmin(leaves, axis=1)  # the earliest of equal times, as rotor's loop
        leaf_time = np.take_along_axis(leaves, best_leaf[:, None, :], axis=1)[:, 0, :]
        tape = tape_first <= leaf_time  # the tape-first candidate comes first, so it wins ties
        opt[first, last] = np.where(tape, tape_first, leaf_time)
        what[first, last] = np.where(tape, -1, best_leaf + 1 + first[:, None])
    return opt, what, cw, cbw, grads


def _gather(windows: np.ndarray, length: int, size: int, rows: np.ndarray, columns: np.ndarray,
            shift: np.ndarray) -> np.ndarray:
    """``opt[rows, columns, m - shift]`` for every ``m`` (∞ where ``m < shift``), from ``windows``, the
    padded table's sliding windows (``windows[r, k]``: row ``r`` of the padded table from ``k`` on);
    ``rows``, ``columns`` and ``shift`` have one shape, the result that shape plus ``(size,)``. A shift
    beyond the table reads the padding only."""
    return windows[rows * length + columns, size - np.minimum(shift, size)]


def _rebuild(i: int, l: int, m: int, what: np.ndarray, cw: np.ndarray, cbw: np.ndarray, grads: np.ndarray,
             ops: list) -> None:
    if i == l:
        ops += [("Fe", i), ("B", i)]
        return
    j = int(what[i, l][m])
    if j < 0:
        ops.append(("Fe", i))
        _rebuild(i + 1, l, m - cbw[i + 1], what, cw, cbw, grads, ops)
        ops.append(("B", i))
    else:
        ops += [("Fn", k) for k in range(i, j)]
        _rebuild(j, l, m - cw[j], what, cw, cbw, grads, ops)
        _rebuild(i, j - 1, m - int(grads[j, l + 1]), what, cw, cbw, grads, ops)


def lower_chain_ops(graph: CostGraph, chain: Chain, stage_ops: list[tuple[str, int]]) -> Schedule:
    """Stage operations -> a schedule: forward ops up to the first backward, frees by liveness."""
    node_ops: list[Op] = []
    first_backward = None
    for kind, s in stage_ops:
        stage = chain.stages[s]
        if kind == "B":
            if first_backward is None:
                first_backward = len(node_ops)
            node_ops += [Backward(v) for v in reversed(stage) if graph.nodes[v].requires_grad]
        else:
            node_ops += [Forward(v, tape=kind == "Fe" and graph.nodes[v].requires_grad) for v in stage]
    split = first_backward if first_backward is not None else len(node_ops)
    return insert_frees(graph, node_ops[:split], node_ops[split:])


@register("chain_dp")
def chain_dp(graph: CostGraph, budget_bytes: int | None = None, *, max_stages: int = DEFAULT_MAX_STAGES,
             slots: int = DEFAULT_SLOTS, refine_above: float = DEFAULT_REFINE_ABOVE, name: str = "chain_dp"
             ) -> Solution:
    """Rotor's DP on the graph's chain of stages; the simulated plan (see the module docstring)."""
    if not graph.implicit_backward:
        raise SolverError(f"{name} needs a graph with implicit backward; {graph.name!r} has explicit "
                          "backward nodes (a Checkmate joint graph)")
    chain = chain_of(graph, max_stages, refine_above)

    def plan(model_budget: float) -> Solution | None:
        stage_ops = solve_chain(chain, model_budget, slots)
        if stage_ops is None:
            return None
        recomputed = sum(1 for kind, _ in stage_ops if kind != "B") - len(chain.stages)
        return Solution.of(name, graph, lower_chain_ops(graph, chain, stage_ops),
                           f"{len(chain.stages)} stages, {recomputed} stage recomputations")

    def minimal_model_budget() -> float:
        high = float(chain.fixed_bytes + sum(chain.pg) + sum(chain.cw) + sum(chain.cbw)) * 2 + 1
        while solve_chain(chain, high, slots) is None:
            high *= 2
        low = float(chain.fixed_bytes)
        while high - low > max(1.0, high * 1e-3):
            middle = (low + high) / 2
            if solve_chain(chain, middle, slots) is None:
                low = middle
            else:
                high = middle
        return high

    return simulator_checked(plan, budget_bytes, lambda: memoized(
        graph, ("chain_dp.minimal_budget", max_stages, slots, refine_above), minimal_model_budget), graph,
        loosen=True)


@register("chain_dp_fine")
def chain_dp_fine(graph: CostGraph, budget_bytes: int | None = None) -> Solution:
    """``chain_dp`` on a finer chain of a joint cost graph: every stage of more than ``FINE_REFINE_ABOVE``
    of its nodes cut further at narrow positions, up to ``FINE_MAX_STAGES`` stages. Its model over-prices
    the values open across several cuts more often, so neither chain dominates: on ResNet-50's joint graph
    (B=8, 224²) the finer chain's floor is 230.9 MiB (the default chain's 250.3) and it has a plan at
    256.6 MiB and +37.1 % where the default has none under 274.8 MiB at +36.7 %, while above 280 MiB the
    default's plans are cheaper. ``auto`` runs both where the two chains differ (``planner.auto_solvers``,
    docs/solvers/chain_dp.md)."""
    return chain_dp(graph, budget_bytes, max_stages=FINE_MAX_STAGES, refine_above=FINE_REFINE_ABOVE,
                    name="chain_dp_fine")
