"""A store-all step of each path against eager PyTorch's, on third-party models, by the allocator.

For each conformance model: the peak of one eager training step (``torch.profiler`` memory events,
README loop's loss), and the measured peak of a store-all plan (budget 1.0) on the compiler path and on
the schedule executor, with each one's ratio to eager. A store-all plan recomputes nothing, so a ratio
above 1 is memory the path itself adds. Usage: ``python scripts/store_all_against_eager.py [NAME ...]
[--executor]`` (default: every conformance model, compiler path only).
"""
from __future__ import annotations

import sys
import warnings

import torch

import recompute_graph as rg
from models_zoo import third_party
from models_zoo.conformance import call_of
from recompute_graph.losses import default_training_loss
from recompute_graph.measure import allocator_peak_memory


def main(names: list[str], executor: bool) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    third_party.import_timm()
    print(f"{'model':28s} {'eager':>12s} {'compiler':>12s} ratio" + (f" {'executor':>12s} ratio" if executor else ""))
    for name in names or list(third_party.CONFORMANCE_MODELS):
        if not third_party.available(name):
            print(f"{name}: not installed")
            continue
        model, call = third_party.build(name)
        args, kwargs = call_of(call)
        torch.manual_seed(0)
        eager = allocator_peak_memory(lambda: default_training_loss(model(*args, **kwargs)).backward())
        model.zero_grad(set_to_none=True)
        row = f"{name:28s} {eager:12d}"
        for compiler in (True, False) if executor else (True,):
            torch._dynamo.reset()
            try:
                report = rg.verify(model, 1.0, example_inputs=args, example_kwargs=kwargs or None, compiler=compiler)
                row += f" {report.measured_peak_bytes:12d} {report.measured_peak_bytes / eager:5.3f}"
            except Exception as error:  # noqa: BLE001 - a row per model, whatever happens
                row += f" {type(error).__name__}"
        print(row, flush=True)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    main([a for a in arguments if not a.startswith("--")], "--executor" in arguments)
