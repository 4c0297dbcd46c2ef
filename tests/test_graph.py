import dataclasses
import subprocess
import sys

import networkx
import pytest

from recompute_graph import CostGraph, CostNode, GraphError


def diamond() -> CostGraph:
    """a -> (b, c) -> d; c is a view of a; d's backward needs b and c (so a's storage)."""
    return CostGraph("diamond", (
        CostNode(0, "a", output_bytes=100, grad_bytes=100, forward_cost=1.0, backward_cost=2.0),
        CostNode(1, "b", predecessors=(0,), output_bytes=50, backward_needs=(0,), saved_input_bytes=100,
                 saved_buffer_bytes=7, forward_cost=1.0),
        CostNode(2, "c", predecessors=(0,), alias_of=0, forward_cost=0.5),
        CostNode(3, "d", predecessors=(2, 1), output_bytes=10, backward_needs=(1, 2), forward_cost=3.0),
    ))


def test_graph_derives_successors_sorts_predecessors_and_answers_queries():
    g = diamond()
    assert g[3].predecessors == (1, 2)
    assert g[0].successors == (1, 2) and g["d"].index == 3
    assert g.edges == ((0, 1), (0, 2), (1, 3), (2, 3))
    assert g.sources == (0,) and g.sinks == (3,)
    assert g.storage_owner(2) == 0
    assert g.total_forward_cost == 5.5 and g.total_backward_cost == 2.0
    with pytest.raises(KeyError, match="no node named 'zz'"):
        g["zz"]


def test_store_all_saved_bytes_counts_each_needed_storage_once_plus_buffers():
    g = diamond()
    # a's storage (needed by b and, through the view c, by d) + b's output (needed by d) + b's buffer
    assert g.stored_bytes_per_node() == (100, 57, 0, 0)
    assert g.store_all_saved_bytes() == 157


def test_graph_and_nodes_are_immutable():
    g = diamond()
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.name = "other"
    with pytest.raises(dataclasses.FrozenInstanceError):
        g[0].output_bytes = 1
    assert isinstance(g.nodes, tuple)


@pytest.mark.parametrize("nodes, message", [
    ((CostNode(1, "a"),), "index is 1"),
    ((CostNode(0, "a"), CostNode(1, "a")), "duplicate"),
    ((CostNode(0, "a", predecessors=(1,)), CostNode(1, "b")), "does not precede"),
    ((CostNode(0, "a", output_bytes=-1),), "output_bytes is negative"),
    ((CostNode(0, "a", forward_cost=float("nan")),), "non-negative"),
    ((CostNode(0, "a", alias_of=0),), "earlier node"),
    ((CostNode(0, "a", backward_needs=(5,)),), "missing node 5"),
    ((CostNode(0, "a", kind="banana"),), "kind"),
])
def test_malformed_graphs_raise_graph_error(nodes, message):
    with pytest.raises(GraphError, match=message):
        CostGraph("bad", nodes)
    assert issubclass(GraphError, ValueError)


def test_networkx_view_has_edges_and_cost_attributes():
    view = diamond().to_networkx()
    assert isinstance(view, networkx.DiGraph) and networkx.is_directed_acyclic_graph(view)
    assert set(view.edges) == {(0, 1), (0, 2), (1, 3), (2, 3)}
    assert view.nodes[1]["output_bytes"] == 50 and view.nodes[3]["forward_cost"] == 3.0


def test_save_load_round_trip_preserves_everything_and_the_fingerprint(tmp_path):
    g = diamond()
    path = tmp_path / "g.json"
    g.save(str(path))
    loaded = CostGraph.load(str(path))
    assert loaded == g and loaded.fingerprint() == g.fingerprint()
    changed = CostGraph("diamond", tuple(dataclasses.replace(n, forward_cost=n.forward_cost + (n.index == 3))
                                         for n in g.nodes))
    assert changed.fingerprint() != g.fingerprint()
    with pytest.raises(GraphError, match="format"):
        CostGraph.from_dict({"nodes": []})


def test_repr_and_summary_are_readable():
    g = diamond()
    assert "4 nodes" in repr(g) and "store-all saved 157 B" in repr(g)
    table = g.summary()
    assert "diamond" in table and table.count("\n") == 5


def test_graph_module_and_package_import_without_torch():
    code = ("import sys, recompute_graph, recompute_graph.graph, recompute_graph.benchmark_graphs;"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gradient_outputs_are_the_scalar_loss_when_the_model_returns_one():
    """A model returning its own loss (transformers with labels) gets its gradient there only: the logits
    beside it get none, and no loss allowance is set aside for them; otherwise every output that
    requires grad gets a gradient and the outputs' bytes are set aside."""
    from recompute_graph.planner import loss_allowance_bytes
    from recompute_graph.simulate import simulate
    from recompute_graph.solvers import SOLVERS

    def head(loss_bytes: int) -> CostGraph:
        return CostGraph("head", (
            CostNode(0, "hidden", output_bytes=100, grad_bytes=100),
            CostNode(1, "logits", predecessors=(0,), output_bytes=1000, grad_bytes=1000, backward_needs=(0,)),
            CostNode(2, "loss", predecessors=(1,), output_bytes=loss_bytes, grad_bytes=loss_bytes,
                     saved_buffer_bytes=1000),
        ), output_indices=(1, 2), source="traced")
    with_loss, with_vector = head(4), head(400)
    assert with_loss.gradient_outputs == (2,) and with_vector.gradient_outputs == (1, 2)
    assert loss_allowance_bytes(with_loss) == 0 and loss_allowance_bytes(with_vector) == 1400
    peak_with_loss = SOLVERS["store_all"](with_loss, None).peak_bytes
    peak_with_vector = SOLVERS["store_all"](with_vector, None).peak_bytes
    assert peak_with_vector - peak_with_loss >= 1000  # the logits' gradient arrives only without a loss
    assert simulate(with_loss, SOLVERS["store_all"](with_loss, None).schedule).peak_bytes == peak_with_loss
