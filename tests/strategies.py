"""Shared hypothesis strategies: random cost graphs (acyclic by construction, integer costs)."""
from hypothesis import strategies as st

from recompute_graph import CostGraph, CostNode


@st.composite
def cost_graphs(draw, max_nodes: int = 12) -> CostGraph:
    """A random DAG with implicit backward: each node reads 1-2 earlier nodes (node 0 reads the input),
    saves a random subset of its inputs and maybe its output, and may own parameters or alias its
    first input (a view)."""
    count = draw(st.integers(1, max_nodes))
    nodes = []
    for i in range(count):
        predecessors = tuple(sorted(set(draw(st.lists(st.integers(0, i - 1), min_size=1, max_size=2))))) if i else ()
        view = bool(predecessors) and draw(st.booleans()) and draw(st.booleans())
        output = 0 if view else draw(st.integers(1, 1000))
        saves_output = draw(st.booleans())
        saved_inputs = tuple(p for p in predecessors if draw(st.booleans()))
        owner = None
        if view:
            owner = predecessors[0]
            while nodes[owner].alias_of is not None:
                owner = nodes[owner].alias_of
        needs = set(saved_inputs_owner(nodes, saved_inputs)) | ({owner if view else i} if saves_output else set())
        nodes.append(CostNode(
            index=i, name=f"n{i}", predecessors=predecessors, output_bytes=output, alias_of=owner,
            grad_bytes=draw(st.integers(1, 1000)), saved_buffer_bytes=draw(st.integers(0, 200)),
            backward_needs=tuple(sorted(needs)), workspace_bytes=draw(st.integers(0, 300)),
            backward_workspace_bytes=draw(st.integers(0, 300)), param_grad_bytes=draw(st.integers(0, 500)),
            forward_cost=float(draw(st.integers(1, 10))), backward_cost=float(draw(st.integers(1, 20))),
        ))
    return CostGraph("random", tuple(nodes))


def saved_inputs_owner(nodes, saved_inputs):
    for p in saved_inputs:
        while nodes[p].alias_of is not None:
            p = nodes[p].alias_of
        yield p
