"""What recomputing a training BatchNorm costs: from the batch, or normalized from its saved statistics.

For each BatchNorm of torchvision's ResNet-50 at a batch of 8 and 224² (the peer table's size), times the
training kernel (`_native_batch_norm_legit_functional`, what a recomputation from the batch costs) and
`batch_norm_recompute.normalize_from_statistics` (what the compiler path's recomputation costs now),
the least of `--repeats` runs each, and checks that the two outputs are equal bit for bit.

    python scripts/batch_norm_recompute.py [--batch 8] [--device cpu|cuda] [--dtype float32]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from recompute_graph.batch_norm_recompute import normalize_from_statistics  # noqa: E402

#: (channels, side) of ResNet-50's 53 BatchNorms at 224², with how many there are of each
RESNET50_NORMS = Counter({(64, 112): 1, (64, 56): 6, (256, 56): 4, (128, 56): 1, (128, 28): 7, (512, 28): 5,
                          (256, 28): 1, (256, 14): 11, (1024, 14): 7, (512, 14): 1, (512, 7): 5, (2048, 7): 4})


def least_seconds(run, repeats: int, device: torch.device) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"| channels x side | count | from the batch | from the statistics | ratio | bitwise equal |")
    print("|---|---|---|---|---|---|")
    totals = [0.0, 0.0]
    for (channels, side), count in sorted(RESNET50_NORMS.items(), key=lambda item: (-item[0][1], item[0][0])):
        x = torch.randn(args.batch, channels, side, side, device=device, dtype=dtype)
        weight, bias = (torch.randn(channels, device=device, dtype=dtype) for _ in range(2))
        mean_, var_ = torch.zeros(channels, device=device, dtype=dtype), torch.ones(channels, device=device, dtype=dtype)

        def training():
            return torch.ops.aten._native_batch_norm_legit_functional(x, weight, bias, mean_, var_, True, 0.1, 1e-5)
        out, mean, rstd, _, _ = training()
        batch = least_seconds(training, args.repeats, device)
        saved = least_seconds(lambda: normalize_from_statistics(x, weight, bias, mean, rstd), args.repeats, device)
        equal = torch.equal(normalize_from_statistics(x, weight, bias, mean, rstd), out)
        totals[0] += count * batch
        totals[1] += count * saved
        print(f"| {channels} x {side}² | {count} | {batch * 1e3:.2f} ms | {saved * 1e3:.2f} ms | "
              f"{saved / batch:.2f} | {equal} |")
    print(f"| all {sum(RESNET50_NORMS.values())} | | {totals[0] * 1e3:.1f} ms | {totals[1] * 1e3:.1f} ms | "
          f"{totals[1] / totals[0]:.2f} | |")


if __name__ == "__main__":
    main()
