"""Loaders of the published graphs keep each paper's conventions (numbers from algorithms.md §1.4)."""
import json

import networkx
import pytest

from recompute_graph import GraphError
from recompute_graph.benchmark_graphs import (CHECKMATE_UNIT, KUSUMOTO_UNIT, benchmark_dir,
                                              benchmark_graph_paths, load_graph)

# graph: (|V|, |E|, conv nodes, sum of M(v) bytes), counted on the official files
KUSUMOTO_TABLE = {
    "vgg19": (46, 45, 16, 4_004_508_676), "unet": (60, 63, 19, 11_781_604_356),
    "resnet50": (176, 191, 53, 4_605_604_868), "resnet152": (516, 565, 155, 9_974_838_276),
    "densenet": (568, 645, 160, 11_661_796_356), "googlenet": (134, 162, 59, 1_273_252_884),
    "pspnet": (385, 422, 114, 7_343_443_000),
}


@pytest.mark.parametrize("name", sorted(KUSUMOTO_TABLE))
def test_kusumoto_graphs_have_the_published_sizes(name):
    graph = load_graph(benchmark_dir() / "kusumoto2019" / f"cg_{name}.txt")
    nodes, edges, convs, total_bytes = KUSUMOTO_TABLE[name]
    assert (len(graph), len(graph.edges)) == (nodes, edges)
    assert sum(n.forward_cost == 10 for n in graph) == convs
    assert all(n.forward_cost == (10 if n.target.startswith("Conv") else 1) for n in graph)
    assert graph.total_output_bytes == total_bytes
    assert graph.cost_unit == KUSUMOTO_UNIT and graph.implicit_backward
    assert networkx.is_directed_acyclic_graph(graph.to_networkx())


def test_kusumoto_backward_dependencies_follow_the_backward_blocks():
    graph = load_graph(benchmark_dir() / "kusumoto2019" / "cg_vgg19.txt")
    relus = [n for n in graph if n.target == "ReLU"]
    convs = [n for n in graph if n.target.startswith("Conv")]
    assert relus and all(n.backward_needs == (n.index,) for n in relus)  # ReLU keeps its output
    assert all(n.saved_output_bytes == n.output_bytes for n in relus)
    later_convs = [n for n in convs if n.predecessors]
    assert later_convs and all(set(n.backward_needs) == set(n.predecessors) for n in later_convs)
    assert all(n.grad_bytes == n.output_bytes for n in graph)


def test_all_checkmate_graphs_load_as_joint_graphs():
    paths = benchmark_graph_paths("checkmate2020")
    assert len(paths) == 11
    for path in paths:
        raw = json.loads(path.read_text())
        graph = load_graph(path)
        assert len(graph) == len(raw["nodes"]) and len(graph.edges) == len(raw["links"])
        assert not graph.implicit_backward


def test_checkmate_vgg16_keeps_costs_and_phases():
    graph = load_graph(benchmark_dir() / "checkmate2020" / "VGG16_256_224x224_train.json")
    assert graph.cost_unit == CHECKMATE_UNIT
    conv = graph["block1_conv1"]
    assert (conv.forward_cost, conv.output_bytes, conv.phase) == (385, 3288334336, "forward")
    back = graph["block1_conv1_backward"]
    assert back.phase == "backward" and back.index == len(graph) - 1
    assert set(back.predecessors) == {graph["block1_conv1"].index, graph["block1_conv2"].index,
                                      graph["block1_conv2_backward"].index}
    assert sum(n.phase == "backward" for n in graph) == 23  # 22 gradients and the loss


def test_random_layered_graph_keeps_out_cost_duration_and_params():
    path = next(p for p in benchmark_graph_paths("checkmate2020") if "n100_" in p.name)
    raw = json.loads(path.read_text())
    graph = load_graph(path)
    assert len(graph) == 100 and graph.parameter_bytes == sum(n["param_cost"] for n in raw["nodes"])
    by_name = {f"n{n['name']}": n for n in raw["nodes"]}
    assert all(node.output_bytes == by_name[node.name]["out_cost"] for node in graph)
    assert all(node.forward_cost == by_name[node.name]["duration"] for node in graph)
    assert graph.sources == (graph.index_of(f"n{raw['graph']['source_node']}"),)


def test_saved_cost_graphs_load_too(tmp_path):
    graph = load_graph(benchmark_dir() / "kusumoto2019" / "cg_unet.txt")
    graph.save(str(tmp_path / "unet.json"))
    assert load_graph(tmp_path / "unet.json") == graph


def test_bad_graph_files_raise_graph_error(tmp_path, monkeypatch):
    with pytest.raises(GraphError, match="does not exist"):
        load_graph(tmp_path / "missing.txt")
    (tmp_path / "junk.txt").write_text("not a graph\n")
    with pytest.raises(GraphError, match="Kusumoto"):
        load_graph(tmp_path / "junk.txt")
    (tmp_path / "junk.json").write_text("{broken")
    with pytest.raises(GraphError, match="JSON"):
        load_graph(tmp_path / "junk.json")
    (tmp_path / "cycle.json").write_text(json.dumps(
        {"nodes": [{"id": 0, "cost_cpu": 1, "cost_ram": 1}, {"id": 1, "cost_cpu": 1, "cost_ram": 1}],
         "links": [{"source": 0, "target": 1}, {"source": 1, "target": 0}]}))
    with pytest.raises(GraphError, match="cycle"):
        load_graph(tmp_path / "cycle.json")
    monkeypatch.setenv("RECOMPUTE_GRAPH_BENCHMARKS", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert benchmark_dir() != tmp_path  # env var without kusumoto2019/ is skipped, fallback still found
    (tmp_path / "kusumoto2019").mkdir()
    assert benchmark_dir() == tmp_path


def test_a_graph_file_and_a_solver_have_one_smallest_budget_the_simulated_lowest_peak(capsys):
    """``solve --min-budget`` on a published graph prints the simulator's lowest peak of the solver's
    schedule, with no planning margin (that is for real allocators), the number docs/reproduction.md
    lists (its ``dp_exact`` column)."""
    import json
    from recompute_graph.cli import main
    from recompute_graph.planner import min_feasible_budget, planning_margin, run_solver
    path = str(next(p for p in benchmark_graph_paths("kusumoto2019") if str(p).endswith("cg_vgg19.txt")))
    graph = load_graph(path)
    assert planning_margin(graph) == 0.0
    lowest = run_solver("dp_exact", graph, None).peak_bytes
    assert min_feasible_budget(graph, "dp_exact") == lowest
    assert main(["solve", path, "--solver", "dp_exact", "--min-budget", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["min_budget_bytes"] == result["peak_bytes"] == lowest
    assert abs(lowest / (2 * graph.total_output_bytes) - 0.261) < 0.0005  # docs/reproduction.md: 26.1 %
