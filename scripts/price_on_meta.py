"""Price a GPT-2-sized model on meta tensors (no weights allocated) and report how long it took.

    python scripts/price_on_meta.py [--layers 48] [--width 1600] [--heads 25] [--seq-len 1024] [--batch 8]
"""
from __future__ import annotations

import argparse
import time

import torch

import models_zoo
from recompute_graph import format_bytes
from recompute_graph.costs import profile_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--heads", type=int, default=25)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    start = time.perf_counter()
    with torch.device("meta"):
        model, inputs = models_zoo.get_model("gpt2", "paper", layers=args.layers, width=args.width,
                                             heads=args.heads, seq_len=args.seq_len, batch=args.batch)
    inputs = tuple(t.to("meta") for t in inputs)
    _, graph = profile_model(model, inputs, device_profile="h200")
    seconds = time.perf_counter() - start
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{parameters / 1e9:.2f} B parameters, {len(graph)} nodes, priced in {seconds:.1f} s")
    print(f"store-all activations {format_bytes(graph.store_all_saved_bytes())}, "
          f"parameters {format_bytes(graph.parameter_bytes)}, estimated step "
          f"{graph.total_forward_cost + graph.total_backward_cost:.3f} s on {graph.cost_source}")


if __name__ == "__main__":
    main()
