"""Print a Markdown table of the published benchmark graphs as loaded by recompute_graph.

    python scripts/benchmark_graph_sizes.py
"""
from __future__ import annotations

from recompute_graph import format_bytes
from recompute_graph.benchmark_graphs import benchmark_graph_paths, load_graph


def main() -> None:
    print("| family | graph | nodes | edges | backward nodes | sum of output bytes | total compute (file units) |")
    print("|---|---|---|---|---|---|---|")
    for family in ("kusumoto2019", "checkmate2020"):
        for path in benchmark_graph_paths(family):
            g = load_graph(path)
            backward = sum(n.phase == "backward" for n in g) if not g.implicit_backward else "implicit"
            print(f"| {family} | {g.name} | {len(g)} | {len(g.edges)} | {backward} | "
                  f"{g.total_output_bytes:,} ({format_bytes(g.total_output_bytes)}) | {g.total_forward_cost:.6g} |")


if __name__ == "__main__":
    main()
