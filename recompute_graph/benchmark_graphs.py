"""Loaders for the public benchmark graphs, each kept in its paper's own cost conventions.

* **Kusumoto et al. 2019** (``cg_*.txt``, dumped from Chainer): nodes are the intermediate forward tensors
  (model inputs, labels and parameters removed); edge ``a -> b`` for every input ``a`` and output ``b`` of
  a forward function; ``output_bytes = grad_bytes = M(v)``; ``forward_cost = T(v) = 10`` if the
  producing function's class name starts with ``Conv``, else 1 (the official experiment code);
  ``backward_cost = 0`` (the paper's model charges only recomputation). ``backward_needs`` comes from
  the matching backward function's ``input`` / ``output`` lines. Cost unit ``"kusumoto2019 units"``.
* **Checkmate 2020** (networkx node-link JSON, Moccasin's re-export): joint forward+backward training
  graphs; every node, forward or backward (``phase``), is one computation with ``forward_cost =
  cost_cpu`` and ``output_bytes = cost_ram``; ``implicit_backward=False`` because the backward nodes are
  explicit. Cost unit ``"checkmate2020 cost_cpu"``.
* **Random layered DAGs** (same JSON family): plain scheduling DAGs, ``output_bytes = out_cost``,
  ``forward_cost = duration``; ``param_cost`` summed into ``parameter_bytes``; no backward.

The directory of the files is ``$RECOMPUTE_GRAPH_BENCHMARKS`` or the first ``shared/benchmarks/graphs``
found beside the working directory or the package's checkout.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import GraphError
from .graph import CostGraph, CostNode

__all__ = ["load_graph", "load_kusumoto", "load_checkmate", "benchmark_dir", "benchmark_graph_paths"]

KUSUMOTO_UNIT = "kusumoto2019 units (Conv=10, other=1)"
CHECKMATE_UNIT = "checkmate2020 cost_cpu"
RANDOM_LAYERED_UNIT = "random-layered duration"


def benchmark_dir() -> Path:
    """The folder holding ``kusumoto2019/`` and ``checkmate2020/`` (raises GraphError if none is found)."""
    env = os.environ.get("RECOMPUTE_GRAPH_BENCHMARKS")
    candidates = [Path(env)] if env else []
    for start in (Path.cwd(), Path(__file__).resolve().parent):
        for folder in (start, *start.parents):
            candidates.append(folder / "shared" / "benchmarks" / "graphs")
            candidates.append(folder.parent / "shared" / "benchmarks" / "graphs")
    for candidate in candidates:
        if (candidate / "kusumoto2019").is_dir():
            return candidate
    raise GraphError("benchmark graphs not found: set RECOMPUTE_GRAPH_BENCHMARKS to the folder that holds "
                     "kusumoto2019/ and checkmate2020/ (normally ../shared/benchmarks/graphs)")


def benchmark_graph_paths(family: str) -> list[Path]:
    """Sorted paths of one family's files: ``"kusumoto2019"`` or ``"checkmate2020"``."""
    if family not in ("kusumoto2019", "checkmate2020"):
        raise ValueError(f"unknown benchmark family {family!r}; use 'kusumoto2019' or 'checkmate2020'")
    pattern = "*.txt" if family == "kusumoto2019" else "*.json"
    return sorted((benchmark_dir() / family).glob(pattern))


def load_graph(path: str | os.PathLike[str]) -> CostGraph:
    """Load any supported graph file: Kusumoto ``.txt``, Checkmate / random layered ``.json``, or a
    :class:`CostGraph` saved with :meth:`CostGraph.save`."""
    path = Path(path)
    if not path.is_file():
        raise GraphError(f"graph file {str(path)!r} does not exist")
    if path.suffix == ".txt":
        return load_kusumoto(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise GraphError(f"{path}: not a Kusumoto .txt graph and not valid JSON ({error})") from None
    if isinstance(data, dict) and data.get("format") == "recompute_graph.CostGraph/1":
        return CostGraph.from_dict(data)
    return load_checkmate(path, data)


# ------------------------------------------------------------------------------------- Kusumoto 2019
def load_kusumoto(path: str | os.PathLike[str]) -> CostGraph:
    """Parse a Kusumoto 2019 ``cg_*.txt`` file (format in ``shared/benchmarks/README.md``)."""
    path = Path(path)
    lines = path.read_text().splitlines()
    try:
        variable_count, function_count = map(int, lines[0].split())
        variables: dict[int, tuple[int, str]] = {}
        for line in lines[1:1 + variable_count]:
            ident, nbytes, name = line.split(maxsplit=2)
            variables[int(ident)] = (int(nbytes), name)
        blocks = _kusumoto_blocks(lines, 1 + variable_count, function_count)
    except (ValueError, IndexError) as error:
        raise GraphError(f"{path}: not a Kusumoto 2019 graph file ({error})") from None
    forward, backward = blocks[: function_count // 2], blocks[function_count // 2:]
    if any(b["direction"] != "forward" for b in forward) or any(b["direction"] != "backward" for b in backward):
        raise GraphError(f"{path}: expected {function_count // 2} forward then as many backward blocks")

    def intermediate(ident: int) -> bool:
        return variables[ident][1] == "_"

    producer: dict[int, int] = {}  # tensor id -> forward function position
    for position, block in enumerate(forward):
        for out in block["outputs"]:
            producer[out] = position
    kept = [p for p, b in enumerate(forward) if any(intermediate(o) for o in b["outputs"])]
    order = _topological([(p, [producer[i] for i, _ in forward[p]["inputs"]
                                if intermediate(i) and i in producer]) for p in kept])
    index = {p: i for i, p in enumerate(order)}
    nodes = []
    for p in order:
        block = forward[p]
        out = block["outputs"][0]
        needs = set()
        for ident, kind in backward[p]["inputs"]:
            if kind in ("input", "output") and intermediate(ident) and ident in producer:
                needs.add(index[producer[ident]])
        saved_input = sum(variables[i][0] for i, k in backward[p]["inputs"]
                          if k == "input" and intermediate(i) and i in producer)
        saved_output = sum(variables[i][0] for i, k in backward[p]["inputs"] if k == "output")
        nbytes = sum(variables[o][0] for o in block["outputs"])
        nodes.append(CostNode(
            index=index[p], name=f"v{out}", kind="loaded", target=block["class"],
            predecessors=tuple(sorted({index[producer[i]] for i, _ in block["inputs"]
                                       if intermediate(i) and i in producer})),
            output_bytes=nbytes, grad_bytes=nbytes, saved_input_bytes=saved_input,
            saved_output_bytes=saved_output, backward_needs=tuple(sorted(needs)),
            forward_cost=10.0 if block["class"].startswith("Conv") else 1.0, backward_cost=0.0,
        ))
    parameters = sum(b for b, name in variables.values() if name.startswith("/"))
    inputs = sum(b for b, name in variables.values() if name.isdigit())
    return CostGraph(name=path.stem.removeprefix("cg_"), nodes=tuple(nodes), cost_unit=KUSUMOTO_UNIT,
                     cost_source="file", input_bytes=inputs, parameter_bytes=parameters,
                     implicit_backward=True, source=f"kusumoto2019:{path.name}")


def _kusumoto_blocks(lines: list[str], start: int, count: int) -> list[dict[str, Any]]:
    blocks = []
    i = start
    for _ in range(count):
        direction = lines[i].strip()
        k, p = map(int, lines[i + 1].split())
        inputs = []
        for line in lines[i + 2: i + 2 + k]:
            ident, kind = line.split()
            inputs.append((int(ident), kind))
        outputs = [int(line) for line in lines[i + 2 + k: i + 2 + k + p]]
        blocks.append({"direction": direction, "inputs": inputs, "outputs": outputs,
                       "class": lines[i + 2 + k + p].strip()})
        i += 2 + k + p + 2  # class name line, then one JSON attribute line
    return blocks


# ------------------------------------------------------------------------------------- Checkmate 2020
def load_checkmate(path: str | os.PathLike[str], data: dict[str, Any] | None = None) -> CostGraph:
    """Parse a Checkmate 2020 training graph or a random layered DAG (networkx node-link JSON)."""
    path = Path(path)
    if data is None:
        data = json.loads(path.read_text())
    try:
        raw_nodes = {int(n["id"] if "id" in n else n["name"]): n for n in data["nodes"]}
        edges = [(int(e["source"]), int(e["target"])) if "source" in e else (int(e["0"]), int(e["1"]))
                 for e in data["links"]]
    except (KeyError, TypeError, ValueError) as error:
        raise GraphError(f"{path}: not a Checkmate / random-layered node-link graph ({error})") from None
    layered = "out_cost" in next(iter(raw_nodes.values()))
    predecessors: dict[int, list[int]] = {n: [] for n in raw_nodes}
    for u, v in edges:
        if u not in raw_nodes or v not in raw_nodes:
            raise GraphError(f"{path}: edge {u}->{v} names a missing node")
        predecessors[v].append(u)
    order = _topological([(n, predecessors[n]) for n in sorted(raw_nodes)])
    index = {n: i for i, n in enumerate(order)}
    nodes = []
    for n in order:
        raw = raw_nodes[n]
        nodes.append(CostNode(
            index=index[n], name=str(raw.get("name", n)) if not layered else f"n{n}", kind="loaded",
            target=str(raw.get("name", n)),
            predecessors=tuple(sorted(index[u] for u in predecessors[n])),
            output_bytes=int(raw["out_cost"] if layered else raw["cost_ram"]),
            forward_cost=float(raw["duration"] if layered else raw["cost_cpu"]),
            requires_grad=False, phase="backward" if raw.get("backward") else "forward",
        ))
    parameters = sum(int(raw.get("param_cost", 0)) for raw in raw_nodes.values())
    return CostGraph(name=path.stem, nodes=tuple(nodes),
                     cost_unit=RANDOM_LAYERED_UNIT if layered else CHECKMATE_UNIT, cost_source="file",
                     parameter_bytes=parameters, implicit_backward=False, source=f"checkmate2020:{path.name}")


def _topological(items: list[tuple[int, list[int]]]) -> list[int]:
    """Kahn's algorithm, ties broken by original position (stable); raises GraphError on a cycle."""
    import heapq

    position = {key: i for i, (key, _) in enumerate(items)}
    successors: dict[int, list[int]] = {key: [] for key, _ in items}
    indegree = {key: 0 for key, _ in items}
    for key, preds in items:
        for p in set(preds):
            successors[p].append(key)
            indegree[key] += 1
    ready = [(position[k], k) for k, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, key = heapq.heappop(ready)
        order.append(key)
        for s in successors[key]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(ready, (position[s], s))
    if len(order) != len(items):
        raise GraphError("graph has a cycle")
    return order
